"""`ZeroRedundancyOptimizer(..., overlap_with_forward=model)`: the updated slices land during
the next forward.

`step()` starts the exchange of the updated segments (`SliceGather.start`, one call per bucket)
and returns. A forward pre-hook on every module that holds some of the optimizer's parameters
(its own, `recurse=False`) waits for the calls carrying those parameters' buckets just before
that module runs, as FSDP and DeepSpeed's stage 3 prefetch; the model's forward post-hook waits
for whatever is left (parameters that no module ran with), so the backward pass and everything
after it start with nothing in flight. The model's `state_dict()` and `load_state_dict()` (pre-
hooks on the same modules), every entry point of the optimizer that reads or writes parameters
or state, and `dp.finalize()` (this is in the world's requests in flight) wait too.

The calls start in the order the model registers its modules (`model.modules()`: the same on
every rank, as the engines need), the first module's buckets first; buckets that no module
holds go last. A forward that runs its modules in another order is still right, it only waits
longer.

The limit: a parameter read outside its own module's forward and outside the waits above (a
norm logged right after `step()`, a parent's forward reading `self.child.weight` without calling
the child, `model.parameters()` read by hand) may see the values from before the step until the
next forward ends. Such a model should not use the overlap (docs/zero.md).
"""

from __future__ import annotations

import weakref
from collections.abc import Callable
from typing import TYPE_CHECKING, Any

import torch

from dataparallel import world
from dataparallel.torch._hooks import remove_hooks
from dataparallel.torch._zero_gather import SliceGather
from dataparallel.torch._zero_layout import Bucket

if TYPE_CHECKING:
    from torch.utils.hooks import RemovableHandle

__all__ = ["ForwardOverlap"]


class ForwardOverlap:
    """Where each bucket's exchange is waited for in the forward of `model`.

    Args:
        model: the module whose forward runs next (the bare model, or its wrapper).
        params: the optimizer's parameters, in its order (`Bucket.params` index them).
        buckets: the optimizer's buckets.

    Raises:
        ValueError: `model` holds none of `params`.
    """

    def __init__(
        self, model: torch.nn.Module, params: list[torch.Tensor], buckets: list[Bucket]
    ) -> None:
        if not isinstance(model, torch.nn.Module):
            raise TypeError(
                "ZeroRedundancyOptimizer: overlap_with_forward takes the model (a "
                f"torch.nn.Module) whose forward runs after step(), got {type(model).__name__}."
            )
        index = {id(p): k for k, p in enumerate(params)}
        bucket_of = {k: b for b, bucket in enumerate(buckets) for k in bucket.params}
        # Each module holding some of the parameters, with their buckets (registration order).
        self.modules: list[tuple[torch.nn.Module, list[int]]] = []
        for module in model.modules():
            held = sorted({bucket_of[index[id(p)]] for p in _own(module, index)})
            if held:
                self.modules.append((module, held))
        if not self.modules:
            raise ValueError(
                f"ZeroRedundancyOptimizer: overlap_with_forward={type(model).__name__} holds "
                "none of the optimizer's parameters, so its forward cannot wait for them. Give "
                "the model whose parameters the optimizer steps (or its wrapper)."
            )
        order: list[int] = []
        for _, held in self.modules:
            order += [b for b in held if b not in order]
        self.order = order + [b for b in range(len(buckets)) if b not in order]
        self._gather: SliceGather | None = None
        self._pending: list[Any] | None = None
        self._handles: list[RemovableHandle] = []
        self._cleanup = weakref.finalize(self, remove_hooks, self._handles)
        ref = weakref.ref(self)
        for module, held in self.modules:
            self._handles.append(module.register_forward_pre_hook(_waiter(ref, held)))
            self._handles.append(module.register_state_dict_pre_hook(_waiter(ref, None)))
            self._handles.append(module.register_load_state_dict_pre_hook(_waiter(ref, None)))
        self._handles.append(model.register_forward_hook(_waiter(ref, None), always_call=True))

    def start(self, gather: SliceGather) -> None:
        """Start `gather`'s calls, the first module's buckets first; they land in the hooks."""
        self.land()
        calls: list[int] = []
        for b in self.order:
            c = gather.call_of(b)
            if c not in calls:
                calls.append(c)
        gather.start(calls)
        self._gather = gather
        self._pending = world.current().pending
        self._pending.append(self)

    def land(self, buckets: list[int] | None = None) -> None:
        """Wait for the calls carrying `buckets` (default: every call in flight)."""
        gather = self._gather
        if gather is None:
            return
        gather.finish(None if buckets is None else [gather.call_of(b) for b in buckets])
        if not gather.in_flight:
            self._gather = None
            if self._pending is not None and self in self._pending:
                self._pending.remove(self)
            self._pending = None

    def wait(self) -> None:
        """What `dp.finalize()` and `dp.wait_all()` call on the requests in flight."""
        self.land()

    def close(self) -> None:
        """Land what is in flight and take the hooks off the model."""
        self.land()
        self._cleanup()


def _own(module: torch.nn.Module, index: dict[int, int]) -> list[torch.Tensor]:
    """`module`'s own parameters (not its children's) that the optimizer steps."""
    return [p for p in module.parameters(recurse=False) if id(p) in index]


def _waiter(ref: weakref.ref[ForwardOverlap], buckets: list[int] | None) -> Callable[..., None]:
    """A hook (any signature) that lands `buckets` (None: all) of the overlap `ref` holds."""

    def hook(*_: object, **__: object) -> None:
        overlap = ref()
        if overlap is not None:
            overlap.land(buckets)

    return hook

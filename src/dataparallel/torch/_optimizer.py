"""`DistributedOptimizer` for PyTorch: gradients reduced during `backward()`, then the inner step.

The wrapper is an instance of a subclass of the wrapped optimizer's class (as Horovod's), created
once per class, and it shares the wrapped optimizer's `__dict__`: `param_groups`, `state`,
`defaults` and step hooks are the same objects for both, so `isinstance`, `state_dict`,
`load_state_dict`, `param_groups` edits and learning-rate schedulers behave exactly as on the
wrapped optimizer. Only `step`, `zero_grad`, `add_param_group` and the new `synchronize` differ,
and, with error feedback, `state_dict`/`load_state_dict` (which also carry this rank's residuals).
The classes add no slots, so their instances keep the wrapped class's layout: a framework that
re-classes an optimizer (Lightning's `LightningOptimizer` becomes a subclass of the optimizer's
class, as Horovod's optimizer allows) can do so with this one too. What the wrapper adds lives
in the shared `__dict__` (`_dp_sync`), which is also how a plain optimizer wrapped once is told
from one never wrapped.
The reduction itself is `_gradsync.GradientSync`, shared with `DataParallelModel`.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import TYPE_CHECKING, Any, NoReturn, SupportsIndex, TypeVar, cast, overload

import torch

from dataparallel.backends.base import Backend
from dataparallel.groups import Group, backend_of
from dataparallel.torch._buckets import NamedParams
from dataparallel.torch._gradsync import GradientSync
from dataparallel.types import Op

if TYPE_CHECKING:
    from dataparallel.torch._buckets import Compressing

__all__ = ["FEEDBACK_KEY", "distributed_torch_optimizer"]

# The state-dict key of this rank's error-feedback residuals (beside torch's two).
FEEDBACK_KEY = "error_feedback"
# The state-dict key of PowerSGD's shared state (step count, bases), the same on every rank.
LOW_RANK_KEY = "powersgd"

_O = TypeVar("_O", bound=torch.optim.Optimizer)


class _DistributedOptimizer(torch.optim.Optimizer):
    """The methods every `DistributedOptimizer` subclass adds to its wrapped optimizer's class."""

    __slots__ = ()  # the wrapped class's layout (see the module's docstring)
    _dp_sync: GradientSync

    @overload
    def step(self, closure: None = None) -> None: ...

    @overload
    def step(self, closure: Callable[[], float]) -> float: ...

    def step(self, closure: Callable[[], float] | None = None) -> float | None:
        """Finish the gradient reduction (unless `synchronize()` did), then run the inner step.

        With a `closure` (LBFGS), the gradients of every evaluation are reduced before the inner
        optimizer reads them.
        """
        sync = self._dp_sync
        if closure is None:
            sync.wait()
            try:
                return super().step()
            finally:
                sync.reset()
        if sync.started:
            sync.wait()
        sync.reset()

        def reduced() -> float:
            loss = closure()
            sync.wait()
            sync.reset()
            return loss

        return super().step(reduced)

    step.hooked = True  # type: ignore[attr-defined]  # torch's step hooks run around the inner step

    def synchronize(self) -> None:
        """Finish reducing the gradients now, e.g. to clip them; `step()` then does not reduce.

        >>> import torch, dataparallel as dp
        >>> _ = dp.initialize()
        >>> model = torch.nn.Linear(2, 1)
        >>> opt = dp.DistributedOptimizer(torch.optim.SGD(model.parameters(), lr=0.1))
        >>> model(torch.ones(1, 2)).sum().backward()
        >>> opt.synchronize()
        >>> _ = torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        >>> opt.step()
        """
        self._dp_sync.wait()

    def zero_grad(self, set_to_none: bool = True) -> None:
        """Zero the gradients and start a new step.

        A reduction already in flight is completed first (every rank started it, so every rank
        must finish it); passes accumulated without one are discarded.
        """
        sync = self._dp_sync
        if sync.in_flight:
            sync.wait()
        super().zero_grad(set_to_none)
        sync.reset()

    def add_param_group(self, param_group: dict[str, object]) -> None:
        """Add a param group as the wrapped optimizer does; its parameters are reduced too."""
        super().add_param_group(param_group)
        sync = getattr(self, "_dp_sync", None)
        if sync is not None:
            sync.refresh()

    def state_dict(self) -> dict[str, Any]:
        """The wrapped optimizer's state dict; with error feedback (`compression=
        dp.Compression.fp16_feedback`, `.bf16_feedback`) also this rank's residuals under
        `"error_feedback"`, with the rank and world size they belong to (a plain optimizer's
        `load_state_dict` ignores the key). Save every rank's to resume exactly. With
        `dp.Compression.powersgd(...)`, also its step count and bases under `"powersgd"` (the
        same on every rank)."""
        state = super().state_dict()
        sync = self._dp_sync
        feedback = sync.feedback_state() if sync.feedback_in_state else None
        if feedback is not None:
            state[FEEDBACK_KEY] = feedback
        low_rank = sync.low_rank_state()
        if low_rank is not None:
            state[LOW_RANK_KEY] = low_rank
        return state

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        """Load a state dict as the wrapped optimizer does, and the error-feedback residuals it
        holds when they are this rank's (saved at this rank, in a world of this size); other
        ranks' residuals, or none, start this one's again from zero."""
        state_dict = dict(state_dict)
        feedback = state_dict.pop(FEEDBACK_KEY, None)
        low_rank = state_dict.pop(LOW_RANK_KEY, None)
        super().load_state_dict(state_dict)
        if self._dp_sync.feedback_in_state:
            self._dp_sync.load_feedback_state(feedback)
        self._dp_sync.load_low_rank_state(low_rank)

    @property
    def backward_passes_per_step(self) -> int:
        """Backward passes accumulated locally before the gradients are reduced."""
        return self._dp_sync.passes

    def rebind_world(self) -> None:
        """Reduce on the world made since this optimizer was (after an elastic run re-formed
        it: `dp.elastic.TorchState.sync` calls this, on every rank at the same point)."""
        self._dp_sync = self._dp_sync.remade()

    @property
    def gradient_sync(self) -> GradientSync:
        """The `GradientSync` that reduces this optimizer's gradients."""
        return self._dp_sync

    def __repr__(self) -> str:
        sync = self._dp_sync
        return (
            f"DistributedOptimizer({super().__repr__()}, op={sync.op!r}, "
            f"bucket_bytes={sync.bucket_bytes}, backward_passes_per_step={sync.passes})"
        )

    def __reduce_ex__(self, protocol: SupportsIndex) -> NoReturn:
        raise TypeError(
            "A DistributedOptimizer cannot be pickled (it holds gradient hooks); save "
            "optimizer.state_dict() instead, and load it into a new DistributedOptimizer."
        )


_CLASSES: dict[type, type[_DistributedOptimizer]] = {}


def _distributed_class(cls: type) -> type[_DistributedOptimizer]:
    made = _CLASSES.get(cls)
    if made is None:
        made = type(cls.__name__, (_DistributedOptimizer, cls), {"__slots__": ()})
        made.__qualname__ = cls.__qualname__
        made.__module__ = cls.__module__
        made.__doc__ = f"`{cls.__qualname__}` whose gradients are reduced across ranks."
        _CLASSES[cls] = made
    return made


def _named_params(state: dict[str, Any]) -> Callable[[], NamedParams]:
    """Return the optimizer's parameters as named in mismatch reports (reads the shared dict)."""

    def params() -> NamedParams:
        return [
            (f"param_groups[{g}]['params'][{i}]", p)
            for g, group in enumerate(state["param_groups"])
            for i, p in enumerate(group["params"])
        ]

    return params


def distributed_torch_optimizer(
    optimizer: _O,
    *,
    op: Op = "avg",
    bucket_bytes: int | None = None,
    backward_passes_per_step: int = 1,
    backend: Backend | None = None,
    group: Group | None = None,
    compression: Compressing = None,
    sparse_as_dense: bool = False,
) -> _O:
    """Wrap `optimizer` so that gradients are reduced across ranks before each step.

    Called by `dp.DistributedOptimizer(optimizer, ...)`. Each parameter gets a gradient hook;
    the hooks of a step's last backward pass start the reduction of full buckets while backward
    is still running (overlapping communication with computation), the remaining buckets are
    started when that pass ends, and `step()` waits for them, then runs the wrapped optimizer's
    step. Bucketing, unused parameters and mismatch detection are described in
    `dataparallel.torch`.

    The result is an instance of the wrapped optimizer's class (`isinstance` holds) that shares
    its state: `zero_grad`, `state_dict`, `load_state_dict`, `param_groups` and learning-rate
    schedulers work as on the wrapped optimizer. Create schedulers on the wrapper (or after
    wrapping): a scheduler patches the `step` of the object it is given.

    Args:
        optimizer: any `torch.optim.Optimizer`, identical in structure on every rank. Give every
            rank the same initial parameters (`dp.synchronize(model)`) and, when resuming, the
            same state (`dp.synchronize(optimizer)`).
        op: `"avg"` (default: Horovod, Lux, Flashlight) or `"sum"` (FluxMPI).
        bucket_bytes: fusion bucket size (default `DATAPARALLEL_BUCKET_BYTES`).
        backward_passes_per_step: backward passes whose gradients are accumulated (summed)
            locally before one reduction (default 1). Scale the loss by `1 / N` for the mean
            over passes, as with Horovod. `step()` after fewer passes reduces what there is.
        backend: the engine to use (default: the active one).
        group: reduce among the ranks of this `dp.new_group` group (default: the world).
        compression: `dp.Compression.fp16` or `.bf16`: floating gradients travel (and are
            reduced) as 16-bit floats, and come back in their dtype (default: none);
            `.fp16_feedback`/`.bf16_feedback` also carry each gradient's rounding residual
            to the next step (error feedback, docs/compression.md).
        sparse_as_dense: make sparse gradients (`nn.Embedding(sparse=True)`) dense and reduce
            them in the buckets (Horovod's option); by default they are gathered (indices and
            values from every rank, then coalesced) and stay sparse, averaged as dense ones.

    Returns:
        The distributed optimizer.

    Raises:
        TypeError: `optimizer` is already distributed, or was wrapped before.
        ValueError: a bad option, or an optimizer whose `step` was already patched by an LR
            scheduler.

    Note: unlike Horovod, `synchronize()` followed by `step()` needs no `skip_synchronize()`,
    and `zero_grad()` between a backward pass and `step()` completes the reduction in flight
    instead of raising.

    >>> import torch, dataparallel as dp
    >>> _ = dp.initialize()
    >>> model = torch.nn.Linear(3, 1)
    >>> opt = dp.DistributedOptimizer(torch.optim.SGD(model.parameters(), lr=0.1))
    >>> isinstance(opt, torch.optim.SGD)
    True
    >>> model(torch.ones(4, 3)).pow(2).mean().backward()   # averaged while backward runs
    >>> opt.step()
    """
    if isinstance(optimizer, _DistributedOptimizer):
        raise TypeError(
            "This optimizer is already a DistributedOptimizer; wrap the plain optimizer once."
        )
    if "_dp_sync" in vars(optimizer):
        raise TypeError(
            f"This {type(optimizer).__name__} was wrapped in a DistributedOptimizer already, which "
            "reduces its gradients: use that wrapper (a second one would reduce them twice). "
            "Wrap each plain optimizer once."
        )
    if not isinstance(optimizer, torch.optim.Optimizer):
        raise TypeError(
            "distributed_torch_optimizer wraps a torch.optim.Optimizer, got "
            f"{type(optimizer).__module__}.{type(optimizer).__qualname__}."
        )
    if "step" in vars(optimizer):
        raise ValueError(
            f"{type(optimizer).__name__}.step was patched on the instance (a learning-rate "
            "scheduler created before wrapping does this), so the wrapper's step would be "
            "bypassed. Create the DistributedOptimizer first, then the scheduler on it."
        )
    cls = _distributed_class(type(optimizer))
    wrapper = object.__new__(cls)
    wrapper.__dict__ = optimizer.__dict__  # the same dict: one state for both
    wrapper._dp_sync = GradientSync(
        _named_params(optimizer.__dict__),
        op=op,
        bucket_bytes=bucket_bytes,
        passes=backward_passes_per_step,
        owner="DistributedOptimizer",
        backend=backend_of(backend, group),
        compression=compression,
        sparse_as_dense=sparse_as_dense,
    )
    return cast(_O, wrapper)  # an instance of a subclass of the optimizer's class

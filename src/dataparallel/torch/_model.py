"""`DataParallelModel`: a module wrapper whose gradients are averaged during `backward()`."""

from __future__ import annotations

import contextlib
from collections import OrderedDict
from collections.abc import Callable, Iterator, Mapping
from typing import TYPE_CHECKING, Any

from torch import nn

from dataparallel.backends.base import Backend
from dataparallel.groups import Group, backend_of
from dataparallel.torch._buckets import NamedParams
from dataparallel.torch._gradsync import GradientSync
from dataparallel.torch._synchronize import synchronize_torch
from dataparallel.torch._zero.fully_shard import FullyShardedModule
from dataparallel.types import Op

if TYPE_CHECKING:
    from torch.nn.modules.module import _IncompatibleKeys

    from dataparallel.torch._buckets import Compressing

__all__ = ["FEEDBACK_KEY", "DataParallelModel"]

# The state-dict key of this rank's error-feedback residuals (torch's `_extra_state` habit).
FEEDBACK_KEY = "_error_feedback"
# The state-dict key of PowerSGD's shared state (step count, bases: the same on every rank).
LOW_RANK_KEY = "_powersgd"


def _named_trainable(module: nn.Module) -> Callable[[], NamedParams]:
    return lambda: list(module.named_parameters())


class DataParallelModel(nn.Module):
    """Wrap `module` for data-parallel training: gradients are averaged during `backward()`.

    FluxMPI's `DataParallelFluxModel`, PyTorch's `DistributedDataParallel`: at wrap time, rank
    0's parameters and buffers are broadcast to every rank; then every backward pass averages the
    gradients across ranks, in buckets started by gradient hooks while backward is still running
    (see `GradientSync`), and finished before `backward()` returns. Any optimizer works unchanged.

    - `no_sync()`: backward passes whose forward ran inside it only accumulate locally; the next
      backward outside it reduces the accumulated gradients (as with DDP, the forward decides).
    - Attribute access passes through to the wrapped module; `model.module` is the module itself.
    - `state_dict()` has no `module.` prefix (unlike DDP), so checkpoints load into the bare
      module and back; `load_state_dict` accepts keys with or without the prefix.
    - With error feedback (`compression=dp.Compression.fp16_feedback`, `.bf16_feedback`),
      `state_dict()` also holds this rank's residuals under `"_error_feedback"` (with the rank
      and world size they belong to), and `load_state_dict` takes them back when they are this
      rank's: save every rank's state dict to resume exactly. Pop the key to load the state
      into the bare module with `strict=True`.
    - Buffers (BatchNorm statistics) are broadcast at wrap time only; call `dp.synchronize(model)`
      to make them equal again (DDP broadcasts them at every forward).
    - A parameter used by no rank in a step keeps `grad=None`; one used on some ranks only gets
      the average with zeros from the others.

    Args:
        module: the model, identical in structure on every rank.
        op: `"avg"` (default) or `"sum"` (FluxMPI's reduction).
        bucket_bytes: fusion bucket size (default `DATAPARALLEL_BUCKET_BYTES`).
        root: the rank whose initial parameters win (default 0).
        backend: the engine to use (default: the active one).
        group: average among the ranks of this `dp.new_group` group (default: the world).
        compression: `dp.Compression.fp16` or `.bf16`: gradients travel as 16-bit floats
            (`.fp16_feedback`/`.bf16_feedback`: with error feedback).
        sparse_as_dense: reduce sparse gradients as dense ones (default: gathered, kept sparse).

    >>> import torch, dataparallel as dp
    >>> _ = dp.initialize()
    >>> model = dp.torch.DataParallelModel(torch.nn.Linear(3, 1))
    >>> model(torch.ones(2, 3)).sum().backward()   # gradients are averaged when this returns
    >>> sorted(model.state_dict())
    ['bias', 'weight']
    """

    def __init__(
        self,
        module: nn.Module,
        *,
        op: Op = "avg",
        bucket_bytes: int | None = None,
        root: int = 0,
        backend: Backend | None = None,
        group: Group | None = None,
        compression: Compressing = None,
        sparse_as_dense: bool = False,
    ) -> None:
        if not isinstance(module, nn.Module):
            raise TypeError(
                f"DataParallelModel wraps a torch.nn.Module, got {type(module).__module__}."
                f"{type(module).__qualname__}."
            )
        if any(isinstance(m, FullyShardedModule) for m in module.modules()):
            raise ValueError(
                "DataParallelModel cannot wrap a model with fully_shard modules: they gather "
                "their parameters and reduce-scatter their gradients themselves, and this "
                "wrapper would average them a second time. Use the fully sharded model as it is."
            )
        super().__init__()
        self.module = module
        backend = backend_of(backend, group)
        synchronize_torch(module, root=root, backend=backend)
        self._require_sync = True
        self._sync = GradientSync(
            _named_trainable(module),
            op=op,
            bucket_bytes=bucket_bytes,
            wait_after_backward=True,
            owner="DataParallelModel",
            backend=backend,
            compression=compression,
            sparse_as_dense=sparse_as_dense,
        )
        self.register_state_dict_post_hook(_drop_module_prefix)
        self.register_state_dict_post_hook(_add_feedback)
        self.register_load_state_dict_pre_hook(_add_module_prefix)

    def forward(self, *args: object, **kwargs: object) -> object:
        """Run the wrapped module; the backward of this forward reduces unless in `no_sync()`."""
        self._sync.enabled = self._require_sync
        return self.module(*args, **kwargs)

    @contextlib.contextmanager
    def no_sync(self) -> Iterator[None]:
        """Accumulate gradients locally for the forward/backward passes inside the block.

        >>> import torch, dataparallel as dp
        >>> _ = dp.initialize()
        >>> model = dp.torch.DataParallelModel(torch.nn.Linear(2, 1))
        >>> with model.no_sync():
        ...     model(torch.ones(1, 2)).sum().backward()    # local only
        >>> model(torch.ones(1, 2)).sum().backward()        # reduces both passes' sum
        """
        previous, self._require_sync = self._require_sync, False
        try:
            yield
        finally:
            self._require_sync = previous

    @property
    def gradient_sync(self) -> GradientSync:
        """The `GradientSync` that reduces this model's gradients."""
        return self._sync

    def rebind_world(self) -> None:
        """Reduce on the world made since this model was wrapped (after an elastic run
        re-formed it: `dp.elastic.TorchState.sync` calls this, on every rank at the same point).
        The parameters are not broadcast here: the state's sync does that next."""
        self._sync = self._sync.remade()

    def __getattr__(self, name: str) -> Any:
        try:
            return super().__getattr__(name)
        except AttributeError:
            inner = self.__dict__.get("_modules", {}).get("module")
            if inner is None:
                raise
            return getattr(inner, name)

    def load_state_dict(
        self, state_dict: Mapping[str, object], strict: bool = True, assign: bool = False
    ) -> _IncompatibleKeys:
        """Load a state dict of the wrapped module, with or without DDP's `module.` prefix
        (and this rank's error-feedback residuals, if it has them: see the class's notes)."""
        if self._sync.feedback_in_state:
            self._sync.load_feedback_state(state_dict.get(FEEDBACK_KEY))  # type: ignore[arg-type]
        self._sync.load_low_rank_state(state_dict.get(LOW_RANK_KEY))  # type: ignore[arg-type]
        for key in (FEEDBACK_KEY, LOW_RANK_KEY):
            if key in state_dict:
                state_dict = _without(state_dict, key)
        keys = list(state_dict)
        if keys and all(k.startswith("module.") for k in keys):
            state_dict = _renamed(state_dict, "", "module.", "")
        return self.module.load_state_dict(state_dict, strict=strict, assign=assign)


def _renamed(
    state_dict: Mapping[str, object], prefix: str, old: str, new: str
) -> OrderedDict[str, object]:
    """Return `state_dict` with keys `prefix + old + rest` renamed `prefix + new + rest`."""
    out: OrderedDict[str, object] = OrderedDict()
    for key, value in state_dict.items():
        if key.startswith(prefix + old):
            key = prefix + new + key[len(prefix + old) :]
        out[key] = value
    metadata = getattr(state_dict, "_metadata", None)
    if metadata is not None:
        meta: OrderedDict[str, object] = OrderedDict()
        inner = (prefix + old).rstrip(".")
        for key, value in metadata.items():
            if key == inner:
                key = (prefix + new).rstrip(".")
            elif key.startswith(prefix + old):
                key = prefix + new + key[len(prefix + old) :]
            meta[key] = value
        out._metadata = meta  # type: ignore[attr-defined]
    return out


def _without(state_dict: Mapping[str, object], key: str) -> OrderedDict[str, object]:
    """Return a copy of `state_dict` without `key` (its `_metadata` kept)."""
    out: OrderedDict[str, object] = OrderedDict((k, v) for k, v in state_dict.items() if k != key)
    metadata = getattr(state_dict, "_metadata", None)
    if metadata is not None:
        out._metadata = metadata  # type: ignore[attr-defined]
    return out


def _drop_module_prefix(
    module: nn.Module, state_dict: dict[str, object], prefix: str, local_metadata: object
) -> None:
    renamed = _renamed(state_dict, prefix, "module.", "")
    state_dict.clear()
    state_dict.update(renamed)
    if hasattr(renamed, "_metadata") and hasattr(state_dict, "_metadata"):
        state_dict._metadata.clear()
        state_dict._metadata.update(renamed._metadata)


def _add_module_prefix(
    module: nn.Module,
    state_dict: dict[str, object],
    prefix: str,
    local_metadata: object,
    strict: bool,
    missing_keys: list[str],
    unexpected_keys: list[str],
    error_msgs: list[str],
) -> None:
    """Accept unprefixed keys when a wrapper nested in a parent module is loaded (and take its
    error-feedback residuals out of them)."""
    feedback = state_dict.pop(prefix + FEEDBACK_KEY, None)
    low_rank = state_dict.pop(prefix + LOW_RANK_KEY, None)
    if isinstance(module, DataParallelModel):
        if module.gradient_sync.feedback_in_state:
            module.gradient_sync.load_feedback_state(feedback)  # type: ignore[arg-type]
        module.gradient_sync.load_low_rank_state(low_rank)  # type: ignore[arg-type]
    for key in list(state_dict):
        if key.startswith(prefix) and not key.startswith(prefix + "module."):
            state_dict[prefix + "module." + key[len(prefix) :]] = state_dict.pop(key)


def _add_feedback(
    module: nn.Module, state_dict: dict[str, object], prefix: str, local_metadata: object
) -> None:
    """Add this rank's error-feedback residuals, when it keeps them (`GradientSync`)."""
    if isinstance(module, DataParallelModel) and module.gradient_sync.feedback_in_state:
        feedback = module.gradient_sync.feedback_state()
        if feedback is not None:
            state_dict[prefix + FEEDBACK_KEY] = feedback
    if isinstance(module, DataParallelModel):
        low_rank = module.gradient_sync.low_rank_state()
        if low_rank is not None:
            state_dict[prefix + LOW_RANK_KEY] = low_rank

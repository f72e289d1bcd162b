"""Horovod's `DistributedOptimizer`, handed over to `dp.DistributedOptimizer`.

dataparallel's optimizer reduces gradients in fused buckets started by gradient hooks during
`backward()` (Horovod's tensor fusion and overlap). This layer adds Horovod's face: the checks of
`named_parameters`, `_parameter_names`, `skip_synchronize()` and the warning when `step()`
follows `synchronize()` without it, `set_backward_passes_per_step`, and process sets (a process
outside the set steps on its own gradients, as in Horovod).
"""

from __future__ import annotations

import contextlib
import warnings
from collections.abc import Callable, Iterable, Iterator
from typing import TYPE_CHECKING, TypeVar, cast, overload

import torch

from dataparallel import training
from dataparallel.backends.base import Backend
from dataparallel.backends.single import SingleBackend
from dataparallel.horovod.torch._basics import Adasum, Average, Sum
from dataparallel.horovod.torch._process_sets import ProcessSet, global_process_set, group_of

if TYPE_CHECKING:
    from dataparallel.arrays.compression import Compressing

__all__ = ["DistributedOptimizer"]

_O = TypeVar("_O", bound=torch.optim.Optimizer)

_STEP_WARNING = (
    "optimizer.step() called without optimizer.skip_synchronize() context after "
    "optimizer.synchronize(). This can cause training slowdown. You may want to consider using "
    "optimizer.skip_synchronize() context if you use optimizer.synchronize() in your code."
)


class _HorovodOptimizer(torch.optim.Optimizer):
    """What Horovod's optimizer adds to dataparallel's (mixed into its class)."""

    __slots__ = ()
    _hvd_inner_class: type
    _parameter_names: dict[torch.Tensor, str]
    _synchronized: bool
    _should_synchronize: bool

    def synchronize(self) -> None:
        """Finish reducing the gradients now (to clip them); use `skip_synchronize()` after."""
        super().synchronize()  # type: ignore[misc]
        self._synchronized = True

    @contextlib.contextmanager
    def skip_synchronize(self) -> Iterator[None]:
        """Say that the next `step()` follows `synchronize()`: it does not warn."""
        self._should_synchronize = False
        try:
            yield
        finally:
            self._should_synchronize = True

    @overload
    def step(self, closure: None = None) -> None: ...

    @overload
    def step(self, closure: Callable[[], float]) -> float: ...

    def step(self, closure: Callable[[], float] | None = None) -> float | None:
        """Reduce what is left (nothing after `synchronize()`), then run the inner step."""
        if self._should_synchronize and self._synchronized:
            warnings.warn(_STEP_WARNING, stacklevel=2)
        self._synchronized = False
        return super().step(closure)

    step.hooked = True  # type: ignore[attr-defined]

    def set_backward_passes_per_step(self, passes: int) -> None:
        """Change how many backward passes are accumulated locally before a reduction."""
        if isinstance(passes, bool) or not isinstance(passes, int) or passes < 1:
            raise ValueError("backward_passes_per_step must be > 0")
        self.gradient_sync.passes = passes  # type: ignore[attr-defined]


_CLASSES: dict[type, type] = {}


def _horovod_class(made: type, inner: type) -> type:
    cls = _CLASSES.get(made)
    if cls is None:
        cls = type(made.__name__, (_HorovodOptimizer, made), {"__slots__": ()})
        cls.__qualname__, cls.__module__ = made.__qualname__, made.__module__
        cls._hvd_inner_class = inner  # type: ignore[attr-defined]
        _CLASSES[made] = cls
    return cls


def _names(
    optimizer: torch.optim.Optimizer, named_parameters: Iterable[tuple[str, torch.Tensor]] | None
) -> dict[torch.Tensor, str]:
    """Check `named_parameters` as Horovod does; return {parameter: name}."""
    if named_parameters is not None:
        named = list(named_parameters)
    else:
        named = [
            (f"allreduce.noname.{i}.{j}", p)
            for i, group in enumerate(optimizer.param_groups)
            for j, p in enumerate(group["params"])
        ]
    if any(not isinstance(p, tuple) for p in named):
        raise ValueError(
            "named_parameters should be a sequence of tuples (name, parameter), usually produced "
            "by model.named_parameters()."
        )
    seen: set[str] = set()
    duplicates = sorted({k for k, _ in named if k in seen or seen.add(k)})  # type: ignore[func-returns-value]
    if duplicates:
        raise ValueError(
            "Parameter names in named_parameters must be unique. Found duplicates: "
            + ", ".join(duplicates)
        )
    every = {id(p) for group in optimizer.param_groups for p in group["params"]}
    unnamed = every - {id(p) for _, p in named}
    if unnamed:
        raise ValueError(
            "named_parameters was specified, but one or more model parameters were not named. "
            "Python object ids: " + ", ".join(str(i) for i in unnamed)
        )
    return {p: k for k, p in sorted(named, key=lambda kp: kp[0])}


def DistributedOptimizer(
    optimizer: _O,
    named_parameters: Iterable[tuple[str, torch.Tensor]] | None = None,
    compression: Compressing = None,
    backward_passes_per_step: int = 1,
    op: int = Average,
    gradient_predivide_factor: float = 1.0,
    num_groups: int = 0,
    groups: int | list[list[torch.Tensor]] | None = None,
    sparse_as_dense: bool = False,
    process_set: ProcessSet = global_process_set,
) -> _O:
    """Wrap `optimizer` so that gradients are averaged (or summed) across processes.

    `dp.DistributedOptimizer` does the work: gradients are reduced in fused buckets while
    `backward()` runs, and `step()` waits for them. `gradient_predivide_factor` and `groups` /
    `num_groups` are accepted and checked as in Horovod; dataparallel's buckets take the place of
    explicit groups, and the average is the same whatever the predivide factor. `op=Adasum`
    raises `NotImplementedError`.
    """
    if op == Adasum:
        raise NotImplementedError(
            "Adasum is not supported by dataparallel: use op=hvd.Average (or hvd.Sum)."
        )
    if op not in (Average, Sum):
        raise ValueError("DistributedOptimizer reduces gradients with op=hvd.Average or hvd.Sum.")
    if gradient_predivide_factor != 1.0 and op != Average:
        raise ValueError("gradient_predivide_factor not supported with op != Average")
    if backward_passes_per_step <= 0:
        raise ValueError("backward_passes_per_step must be > 0")
    if groups is None and num_groups:
        groups = num_groups
    if groups is not None and not (isinstance(groups, list) or groups > 0):
        raise ValueError(
            "groups should be a non-negative integer or a list of list of torch.Tensor."
        )
    names = _names(optimizer, named_parameters)
    if process_set.included() is False:  # outside the set: a world of one, as Horovod skips it
        backend: Backend | None = SingleBackend.create()
        group = None
    else:
        backend, group = None, group_of(process_set)
    inner = type(optimizer)
    wrapped = training.DistributedOptimizer(
        optimizer,
        op="avg" if op == Average else "sum",
        backward_passes_per_step=backward_passes_per_step,
        backend=backend,
        group=group,
        compression=compression,
        sparse_as_dense=sparse_as_dense,
    )
    wrapped.__class__ = _horovod_class(type(wrapped), inner)
    made = cast(_HorovodOptimizer, wrapped)  # the class just set
    made._parameter_names = names
    made._synchronized = False
    made._should_synchronize = True
    return wrapped

"""Horovod's `hvd.elastic` for PyTorch: `import dataparallel.horovod.torch as hvd`, then
`@hvd.elastic.run`, `hvd.elastic.TorchState`, `hvd.elastic.ElasticSampler`, as in Horovod.

These are `dataparallel.elastic`'s (docs/elastic.md); `run` re-forms the world with
`hvd.shutdown()` (waiting for nothing in flight) and `hvd.init()`, as Horovod's does. Errors:
`HorovodInternalError` is a `dp.RankFailedError`, what a collective raises when a rank died;
`HostsUpdatedInterrupt` is raised by `state.commit()` when the launcher added workers.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Concatenate, ParamSpec, TypeVar

from dataparallel.elastic.retry import reform_world, run_fn
from dataparallel.elastic.sampler import ElasticSampler
from dataparallel.elastic.state import (
    HostsUpdatedInterrupt,
    ObjectState,
    State,
    TorchState,
)
from dataparallel.horovod.torch._basics import HorovodInternalError
from dataparallel.horovod.torch._lifetime import abandon, init

__all__ = [
    "ElasticSampler",
    "HorovodInternalError",
    "HostsUpdatedInterrupt",
    "ObjectState",
    "State",
    "TorchState",
    "run",
]

P = ParamSpec("P")
R = TypeVar("R")
S = TypeVar("S", bound=State)


def _reset() -> None:
    reform_world(leave=abandon, enter=init)


def run(func: Callable[Concatenate[S, P], R]) -> Callable[Concatenate[S, P], R]:
    """Horovod's `hvd.elastic.run`: call `func(state, ...)` again after a lost or added worker."""
    return run_fn(func, _reset)

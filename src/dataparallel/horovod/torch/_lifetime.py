"""Horovod's `init()` and `shutdown()`: dataparallel's world, and what Horovod keeps beside it."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Literal

from dataparallel import world
from dataparallel.horovod.torch import _handles
from dataparallel.horovod.torch._basics import learn_nodes
from dataparallel.horovod.torch._process_sets import (
    ProcessSet,
    add_process_set,
    reset_process_sets,
)

__all__ = ["abandon", "init", "shutdown"]

_started: list[bool] = []  # [True] between this module's init() and shutdown()


def init(
    comm: Sequence[int] | None = None,
    process_sets: Sequence[ProcessSet] | Literal["dynamic"] | None = None,
) -> None:
    """Start dataparallel (`dp.initialize()`: MPI under an MPI launcher, Gloo under torchrun-
    style variables, else a world of one) and register `process_sets`.

    Args:
        comm: None (every process), or a list of all the world's ranks; a sub-communicator is not
            supported (make a process set instead).
        process_sets: process sets to register (`ProcessSet` objects), or `"dynamic"`.
    """
    if comm is not None and not isinstance(comm, (list, tuple)):
        raise ValueError("hvd.init(comm=...) takes a list of ranks here (not an MPI communicator).")
    first = not _started or not world.initialized()
    world.initialize()
    if comm is not None and sorted(comm) != list(range(world.size())):
        raise NotImplementedError(
            "hvd.init(comm=ranks) with a subset of the world is not supported: init every "
            "process and use hvd.add_process_set(ranks) for collectives among some of them."
        )
    _handles.reset()  # as Horovod's init: handles from before are forgotten
    if first:  # a second init keeps the process sets added since the first, as Horovod's
        reset_process_sets()
        _started.append(True)
    learn_nodes()
    if process_sets is not None and process_sets != "dynamic":
        for ps in process_sets:
            add_process_set(ps)


def shutdown() -> None:
    """Stop dataparallel (`dp.finalize()`); operations still queued are dropped."""
    if not world.initialized():
        return
    _forget()
    world.finalize()


def abandon() -> None:
    """`shutdown` for a world an elastic run re-forms: nothing in flight is waited for
    (`world.abandon`)."""
    if not world.initialized():
        return
    _forget()
    world.abandon()


def _forget() -> None:
    _handles.reset()
    reset_process_sets()
    _started.clear()

"""Collectives over picklable objects, and the barrier: `broadcast_object`, `allgather_object`."""

from __future__ import annotations

from typing import TypeVar

from dataparallel.arrays.replay import Replay
from dataparallel.backends.base import Backend
from dataparallel.collectives import traced
from dataparallel.collectives._call import check_root, context, prepared
from dataparallel.groups import Group, backend_of
from dataparallel.protocol import verify_same_call

__all__ = ["allgather_object", "barrier", "broadcast_object"]

T = TypeVar("T")  # what each rank passes: the same kind on every rank


def broadcast_object(
    obj: T, *, root: int = 0, backend: Backend | None = None, group: Group | None = None
) -> T:
    """Return `root`'s `obj` (anything picklable) on every rank."""
    ctx = context(backend_of(backend, group))
    rank = prepared(ctx, "broadcast_object", lambda: check_root(root, ctx.backend))
    verify_same_call(ctx.backend, {"collective": "broadcast_object", "root": rank})
    return ctx.backend.broadcast_object(obj, rank)


def allgather_object(
    obj: T, *, backend: Backend | None = None, group: Group | None = None
) -> list[T]:
    """Return the list of every rank's `obj` (anything picklable), in rank order."""
    ctx = context(backend_of(backend, group))
    verify_same_call(ctx.backend, {"collective": "allgather_object"})
    return ctx.backend.allgather_object(obj)


def barrier(*, backend: Backend | None = None, group: Group | None = None) -> None:
    """Block until every rank has reached the barrier (ranks that have joined, `dp.join`, too).

    Inside `jax.jit` the barrier is traced into the program: it runs each time the program runs.
    """
    if traced.tracing():
        traced.call("barrier", None, backend_of(backend, group))
        return
    ctx = context(backend_of(backend, group))
    verify_same_call(ctx.backend, {"collective": "barrier"}, replay=_barrier)
    ctx.backend.barrier()


def _barrier(_: bool) -> Replay:
    return Replay.barrier()

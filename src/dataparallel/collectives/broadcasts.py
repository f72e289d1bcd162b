"""Broadcasts: `broadcast`, `ibroadcast`."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from dataparallel.backends.base import Backend
from dataparallel.collectives._call import CallContext, check_root, context, leaves_of, run, verify
from dataparallel.collectives.requests import Request
from dataparallel.engine import tree
from dataparallel.engine.fusion import Broadcast, Fusion
from dataparallel.types import Tree

__all__ = ["broadcast", "ibroadcast"]


def _start_broadcast(
    x: Tree, root: int, backend: Backend | None, async_op: bool
) -> tuple[Fusion, Callable[[list[Any]], Any], CallContext]:
    ctx = context(backend)
    check_root(root, ctx.backend)
    flat = tree.flatten(x, "x")
    leaves = leaves_of(flat)
    collective = "ibroadcast" if async_op else "broadcast"
    verify(ctx, collective, flat, leaves, {"root": root})
    return (*run(ctx, collective, flat, leaves, Broadcast(root), async_op), ctx)


def broadcast(x: Tree, *, root: int = 0, backend: Backend | None = None) -> Tree:
    """Give every rank `root`'s values of `x` (an array, a number, or a pytree of them)."""
    fusion, finish, _ = _start_broadcast(x, root, backend, async_op=False)
    return finish(fusion.wait())


def ibroadcast(x: Tree, *, root: int = 0, backend: Backend | None = None) -> Request:
    """Start `broadcast` without blocking; `Request.wait()` returns its result."""
    fusion, finish, ctx = _start_broadcast(x, root, backend, async_op=True)
    return Request(fusion, finish, ctx.pending)

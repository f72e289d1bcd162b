"""Broadcasts: `broadcast`, `ibroadcast`."""

from __future__ import annotations

from collections.abc import Callable
from typing import cast

from dataparallel.arrays import tree
from dataparallel.arrays.actions import Broadcast
from dataparallel.backends.base import Backend, Handle
from dataparallel.collectives import traced
from dataparallel.collectives._agree import Call, agree, inline_fits
from dataparallel.collectives._call import (
    CallContext,
    Leaf,
    check_root,
    context,
    leaves_of,
    prepared,
    run,
    stage,
)
from dataparallel.collectives.requests import Request
from dataparallel.groups import Group, backend_of
from dataparallel.types import Tree, TreeT

__all__ = ["broadcast", "ibroadcast"]


def _start_broadcast(
    x: Tree, root: int, backend: Backend | None, async_op: bool
) -> tuple[Handle, Callable[[], object], CallContext]:
    ctx = context(backend)
    collective = "ibroadcast" if async_op else "broadcast"

    def prepare() -> tuple[int, tree.Flat, list[Leaf]]:
        rank = check_root(root, ctx.backend)
        flat = tree.flatten(x, "x")
        leaves = leaves_of(flat)
        stage(leaves)
        return rank, flat, leaves

    rank, flat, leaves = prepared(ctx, collective, prepare)
    inline = inline_fits(ctx, leaves)
    rows, _ = agree(Call(ctx, collective, flat, leaves, {"root": rank}, inline=inline))
    return (*run(ctx, collective, flat, leaves, Broadcast(rank), async_op, rows), ctx)


def broadcast(
    x: TreeT, *, root: int = 0, backend: Backend | None = None, group: Group | None = None
) -> TreeT:
    """Give every rank `root`'s values of `x` (an array, a number, or a pytree of them)."""
    if traced.is_traced(x):  # inside jax.jit: traced into the program
        return traced.call("broadcast", x, backend_of(backend, group), root=root)
    fusion, finish, _ = _start_broadcast(x, root, backend_of(backend, group), async_op=False)
    fusion.wait()
    return cast(TreeT, finish())


def ibroadcast(
    x: TreeT, *, root: int = 0, backend: Backend | None = None, group: Group | None = None
) -> Request[TreeT]:
    """Start `broadcast` without blocking; `Request.wait()` returns its result."""
    fusion, finish, ctx = _start_broadcast(x, root, backend_of(backend, group), async_op=True)
    return Request(fusion, finish, ctx.pending)

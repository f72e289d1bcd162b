"""`synchronize_tree`: every rank gets root's values of a pytree (the core of `dp.synchronize`)."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from dataparallel.arrays import tree
from dataparallel.arrays.actions import Broadcast
from dataparallel.backends.base import Backend
from dataparallel.collectives._agree import Call, agree, inline_fits
from dataparallel.collectives._call import (
    Leaf,
    check_root,
    context,
    leaf_of,
    log,
    prepared,
    results,
    run,
    stage,
)
from dataparallel.types import Tree

__all__ = ["synchronize_tree"]


_OBJECTS = ("keep", "broadcast")

# How a layer above syncs a leaf it owns (a torch module, an optimizer): None for other leaves.
Sync = Callable[[Any, int, Backend], Any]
LeafSync = Callable[[Any], Sync | None]


def synchronize_tree(
    x: Tree,
    *,
    root: int = 0,
    objects: str = "keep",
    backend: Backend | None = None,
    special: LeafSync | None = None,
) -> Tree:
    """Make every rank hold `root`'s values of the pytree `x`; see `dp.synchronize`.

    Array and number leaves are broadcast in fused buckets; `None` stays `None`; other leaves are
    kept, or broadcast by pickling with `objects="broadcast"`. Leaves for which `special` returns a
    function are synchronized by it, after the rest (`dp.synchronize` passes the torch layer's).
    """
    ctx = context(backend)

    def prepare() -> tuple[int, tree.Flat, list[Leaf], list[int], list[tuple[int, Sync]]]:
        if objects not in _OBJECTS:
            raise ValueError(f"objects={objects!r} is not one of {_OBJECTS}.")
        rank = check_root(root, ctx.backend)
        flat = tree.flatten(x, "x")
        arrays: list[Leaf] = []
        others: list[int] = []
        handled: list[tuple[int, Sync]] = []
        for i, value in enumerate(flat.leaves):
            sync = special(value) if special is not None else None
            if sync is not None:
                handled.append((i, sync))
                continue
            try:
                arrays.append(leaf_of(flat, i))
            except TypeError:
                others.append(i)
        stage(arrays)
        return rank, flat, arrays, others, handled

    rank, flat, arrays, others, handled = prepared(ctx, "synchronize", prepare)
    values: list[object] = list(flat.leaves)
    args = {"root": rank, "objects": objects, "object leaves": tuple(others)}
    inline = inline_fits(ctx, arrays)
    rows, _ = agree(Call(ctx, "synchronize", flat, arrays, args, inline=inline))
    log(ctx, f"synchronize root={rank} arrays={len(arrays)} objects={len(others)}")
    waitable, _ = run(ctx, "synchronize", flat, arrays, Broadcast(rank), False, rows)
    waitable.wait()
    for leaf, value in zip(arrays, results(arrays, ctx.backend.rank != rank), strict=True):
        values[leaf.index] = value
    if objects == "broadcast" and others:
        received = ctx.backend.broadcast_object([values[i] for i in others], rank)
        for i, value in zip(others, received, strict=True):
            values[i] = value
    for i, sync in handled:
        values[i] = sync(values[i], rank, ctx.backend)
    return tree.unflatten(flat.spec, values)

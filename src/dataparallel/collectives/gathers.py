"""Gathers: `allgather`, arrays concatenated along the first axis in rank order."""

from __future__ import annotations

import numpy as np

from dataparallel.arrays import tree
from dataparallel.arrays.dtypes import storage_dtype
from dataparallel.backends.base import Backend
from dataparallel.collectives import traced
from dataparallel.collectives._agree import Call, agree
from dataparallel.collectives._call import Leaf, context, leaves_of, log, prepared
from dataparallel.groups import Group, backend_of
from dataparallel.types import Tree

__all__ = ["allgather"]


def allgather(x: Tree, *, backend: Backend | None = None, group: Group | None = None) -> Tree:
    """Concatenate every rank's arrays along the first axis, in rank order.

    The first axis may differ between ranks; the other axes and the dtype must match. Numbers and
    0-d arrays count as one row each, so they gather into a 1-D array of `size()` items.
    Results are new arrays of each leaf's family (NumPy arrays for numbers).
    """
    if traced.is_traced(x):  # inside jax.jit: traced into the program
        return traced.call("allgather", x, backend_of(backend, group))
    ctx = context(backend_of(backend, group))
    b = ctx.backend

    def prepare() -> tuple[tree.Flat, list[Leaf], list[np.ndarray]]:
        flat = tree.flatten(x, "x")
        leaves = leaves_of(flat)
        hosts = [
            np.ascontiguousarray(leaf.family.work(leaf.value)[0]).reshape(-1) for leaf in leaves
        ]
        return flat, leaves, hosts

    flat, leaves, hosts = prepared(ctx, "allgather", prepare)
    rows = [leaf.shape[0] if leaf.shape else 1 for leaf in leaves]
    agree(Call(ctx, "allgather", flat, leaves, {}, first_axis=False))
    log(ctx, f"allgather leaves={len(leaves)}")
    gathered_rows = np.empty(b.size * len(leaves), np.int64)
    if leaves:
        b.allgatherv(np.array(rows, np.int64), gathered_rows, [len(leaves)] * b.size)
    every_rows = gathered_rows.reshape(b.size, len(leaves))
    out = []
    for i, (leaf, host) in enumerate(zip(leaves, hosts, strict=True)):
        rest = leaf.shape[1:]
        row_bytes = storage_dtype(leaf.dtype).itemsize * int(np.prod(rest, dtype=np.int64))
        counts = [int(every_rows[r, i]) * row_bytes for r in range(b.size)]
        received = np.empty(sum(counts), np.uint8)
        b.allgatherv(host.view(np.uint8), received, counts)
        gathered = received.view(storage_dtype(leaf.dtype)).reshape(-1, *rest)
        out.append(leaf.family.new(leaf.value, gathered))
    return tree.unflatten(flat.spec, out)

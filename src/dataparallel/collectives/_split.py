"""Reduce-scatter and all-to-all: the calls whose results change shape, run through the engine."""

from __future__ import annotations

import math
import sys

import numpy as np

from dataparallel.arrays import tree
from dataparallel.arrays.actions import Exchange, Scatter
from dataparallel.arrays.dtypes import storage_dtype
from dataparallel.arrays.fusion import Fusion
from dataparallel.arrays.nan import set_nan
from dataparallel.backends.base import ReduceOp
from dataparallel.collectives._call import CallContext, Leaf, log
from dataparallel.types import Tree

__all__ = ["check_rows", "host_work", "run_split", "scatter_masks"]


def check_rows(collective: str, flat: tree.Flat, leaves: list[Leaf]) -> None:
    """Raise `ValueError` for a leaf without a first axis (a number, a 0-d array)."""
    for leaf in leaves:
        if not leaf.shape:
            raise ValueError(
                f"{flat.path(leaf.index)}: {collective} splits arrays along their first axis, "
                "but this leaf is a number or a 0-d array; give it one (np.reshape(x, (1,)), "
                "x[None]) or leave it out of the tree."
            )


def host_work(leaf: Leaf) -> np.ndarray:
    """Return a host array of the leaf's values (a zero-copy view where its family allows)."""
    view = leaf.family.host_view(leaf.value)
    return view if view is not None else leaf.family.to_host(leaf.value)


def run_split(
    ctx: CallContext,
    collective: str,
    flat: tree.Flat,
    leaves: list[Leaf],
    action: Scatter | Exchange,
    nans: dict[int, np.ndarray] | None = None,
) -> Tree:
    """Run a reduce-scatter or an all-to-all of the leaves; return the rebuilt tree.

    Results change shape, so each comes back as a new array of its leaf's family; GPU leaves are
    staged through host memory. Every leaf is on the host here, so buckets are per dtype whatever
    the family. An all-to-all moves bytes, all leaves in one call: its bucketing must not depend
    on sizes, which differ between ranks. `nans`: a reduce-scatter's NaN masks, this rank's part
    of each (`scatter_masks`), by leaf index: NaN is written where they are set.
    """
    if ctx.settings.debug:
        log(ctx, f"{collective} {action} leaves={len(leaves)}")
    started = ctx.timeline.now() if ctx.timeline is not None else 0.0
    moves = isinstance(action, Exchange)
    fusion = Fusion(
        ctx.backend,
        action,
        bucket_bytes=sys.maxsize if moves else ctx.settings.bucket_bytes,
        async_op=False,
        pool=ctx.buffers,
        timeline=ctx.timeline,
    )
    out: list[object] = [None] * len(leaves)
    for i, leaf in enumerate(leaves):
        work, storage = host_work(leaf), storage_dtype(leaf.dtype)

        def deliver(
            host: np.ndarray, i: int = i, leaf: Leaf = leaf, kind: np.dtype = storage
        ) -> None:
            if moves:  # bytes, one row per row: back to the leaf's dtype and shape
                host = host.reshape(-1).view(kind).reshape(host.shape[0], *leaf.shape[1:])
            elif nans and leaf.index in nans:
                set_nan(host, leaf.dtype, nans[leaf.index])
            out[i] = leaf.family.adopt(leaf.value, host)  # host is the result's own memory

        if moves:
            row_bytes = storage.itemsize * math.prod(leaf.shape[1:])
            work = np.ascontiguousarray(work).reshape(-1).view(np.uint8)
            work = work.reshape(leaf.shape[0], row_bytes)
        fusion.add(work, "uint8" if moves else leaf.dtype, (), deliver)
    fusion.wait()
    if ctx.timeline is not None:
        ctx.timeline.complete(collective, started, leaves=len(leaves), calls=fusion.calls)
    return tree.unflatten(flat.spec, out)


def scatter_masks(
    ctx: CallContext, floating: list[Leaf], masks: list[np.ndarray]
) -> dict[int, np.ndarray]:
    """Reduce-scatter (MAX) the NaN masks of a min/max reduce-scatter's floating leaves (each
    shaped as its leaf, 1 where this rank has a NaN); return this rank's part of each, by leaf
    index (`run_split`'s `nans`)."""
    fusion = Fusion(
        ctx.backend,
        Scatter(ReduceOp.MAX),
        bucket_bytes=ctx.settings.bucket_bytes,
        async_op=False,
        pool=ctx.buffers,
    )
    parts: dict[int, np.ndarray] = {}
    for leaf, mask in zip(floating, masks, strict=True):

        def keep(part: np.ndarray, index: int = leaf.index) -> None:
            parts[index] = part

        fusion.add(mask, "uint8", (), keep)
    fusion.wait()
    return parts

"""What a collective sends after its handshake, described for ranks that have joined (`dp.join`).

Each function mirrors how a collective gives its leaves to `Fusion` (`_call.fuse`,
`_split.run_split`), as a `Replay` that a joined rank runs on zeros (`arrays/replay.py`).
"""

from __future__ import annotations

import numpy as np

from dataparallel.arrays.actions import Reduction, Scatter
from dataparallel.arrays.fusion import HOST_KEY
from dataparallel.arrays.replay import Add, Replay
from dataparallel.backends.base import ReduceOp
from dataparallel.collectives._call import CallContext, Leaf

__all__ = ["fused", "nan_masks", "nan_scatter", "split"]


def _add(leaf: Leaf) -> Add:
    work = leaf.work
    if type(work) is np.ndarray:
        return (HOST_KEY, leaf.dtype, work.shape)
    return ((leaf.family.name, leaf.device), leaf.dtype, leaf.shape)


def fused(
    ctx: CallContext,
    action: Reduction,
    leaves: list[Leaf],
    async_op: bool,
    inline: bool,
    then: Replay | None = None,
    compression: str | None = None,
) -> Replay:
    """The replay of `run`: the leaves through `fuse` (nothing more when they went `inline`),
    with the call's wire dtype (`compression`), so that zeros travel as the values do."""
    if inline:
        return Replay.nothing()
    return Replay.of(
        action,
        [[_add(leaf) for leaf in leaves]],
        bucket_bytes=ctx.settings.bucket_bytes,
        async_op=async_op,
        then=then,
        compression=compression,
    )


def nan_masks(ctx: CallContext, floating: list[Leaf], async_op: bool) -> Replay:
    """The replay of the NaN masks a min/max reduction sends when some rank has a NaN."""
    masks = [((), "uint8", leaf.shape) for leaf in floating]
    return Replay.of(
        Reduction(ReduceOp.MAX), [masks], bucket_bytes=ctx.settings.bucket_bytes, async_op=async_op
    )


def split(ctx: CallContext, action: Scatter, leaves: list[Leaf]) -> Replay:
    """The replay of `run_split` for a reduce-scatter (host arrays, one flush)."""
    return Replay.of(
        action,
        [[((), leaf.dtype, leaf.shape) for leaf in leaves]],
        bucket_bytes=ctx.settings.bucket_bytes,
    )


def nan_scatter(ctx: CallContext, floating: list[Leaf], then: Replay) -> Replay:
    """The replay of a min/max reduce-scatter when some rank has a NaN: the masks, then `then`."""
    return Replay.of(
        Scatter(ReduceOp.MAX),
        [[((), "uint8", leaf.shape) for leaf in floating]],
        bucket_bytes=ctx.settings.bucket_bytes,
        then=then,
    )

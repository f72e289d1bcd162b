"""Small payloads reduced where they land: every rank's values, reduced locally in rank order.

When a collective's payload fits in the handshake that precedes it (`protocol.handshake`), every
rank receives every rank's values with the handshake itself, and computes the result here with
NumPy, in rank order. Every rank computes from the same bytes in the same order, so every rank
gets the same result, bit for bit. The semantics are those of the engines' path
(`fusion.Fusion`): bool sums and products are logical or / and; bfloat16 and float16 are reduced
in float32 and rounded once; integer scales multiply as integers. NaN propagates under min and
max as NumPy's `minimum`/`maximum` propagate it.
"""

from __future__ import annotations

import numpy as np

from dataparallel.arrays.actions import Broadcast, Reduction
from dataparallel.arrays.dtypes import bf16_to_f32, f32_to_bf16, scale_in_place
from dataparallel.backends.base import ReduceOp

__all__ = ["ALIGN", "combine_rows", "land_inline", "pack_inline", "padded", "payload_of"]

ALIGN = 8  # each leaf's bytes start at a multiple of this in the record

_UFUNCS = {
    ReduceOp.SUM: np.add,
    ReduceOp.PROD: np.multiply,
    ReduceOp.MIN: np.minimum,
    ReduceOp.MAX: np.maximum,
}


def padded(nbytes: int) -> int:
    """Return the bytes a leaf of `nbytes` takes in a record."""
    return (nbytes + ALIGN - 1) & -ALIGN


def pack_inline(record: np.ndarray, start: int, works: list[np.ndarray]) -> None:
    """Copy `works` (host arrays in storage dtypes) into `record` from byte `start` on."""
    offset = start
    for work in works:
        nbytes = work.nbytes
        if work.flags.c_contiguous:
            record[offset : offset + nbytes] = work.reshape(-1).view(np.uint8)
        else:
            record[offset : offset + nbytes].view(work.dtype).reshape(work.shape)[...] = work
        offset += (nbytes + ALIGN - 1) & -ALIGN


def payload_of(works: list[np.ndarray]) -> bytes:
    """Return `works` laid out as `pack_inline` lays them out, as bytes."""
    if len(works) == 1:
        return works[0].tobytes()
    parts = []
    for work in works:
        raw = work.tobytes()
        parts.append(raw + bytes(-len(raw) % ALIGN))
    return b"".join(parts)


def land_inline(
    rows: np.ndarray,
    start: int,
    works: list[np.ndarray],
    dtypes: list[str],
    action: Reduction | Broadcast,
    rank: int,
) -> None:
    """Write the collective's result into `works` from every rank's record (`rows`, one per rank).

    Ranks that receive nothing (not the root of a reduce; the root of a broadcast) keep theirs.
    """
    offset = start
    for work, dtype in zip(works, dtypes, strict=True):
        nbytes = work.nbytes
        if nbytes:
            values = rows[:, offset : offset + nbytes].view(work.dtype)
            if isinstance(action, Broadcast):
                if rank != action.root:
                    work[...] = values[action.root].reshape(work.shape)
            elif action.root is None or action.root == rank:
                _combine(values, dtype, action, work)
        offset += (nbytes + ALIGN - 1) & -ALIGN


def combine_rows(ufunc: np.ufunc, values: np.ndarray, out: np.ndarray | None = None) -> np.ndarray:
    """Combine the rows of `values` (one per rank, two or more) with `ufunc`, in rank order.

    One row after the other, so that any caller, for any number of ranks, gets the same bits.
    """
    out = ufunc(values[0], values[1], out=out)
    for row in values[2:]:
        ufunc(out, row, out=out)
    return out


def _combine(values: np.ndarray, dtype: str, action: Reduction, work: np.ndarray) -> None:
    """Reduce `values` (one row per rank, storage dtype) along the ranks into `work`, scaled."""
    op, scale = action.op, action.scale
    if dtype == "bool":
        logical = np.logical_or if op in (ReduceOp.SUM, ReduceOp.MAX) else np.logical_and
        work[...] = combine_rows(logical, values).reshape(work.shape)
        return
    if dtype in ("bfloat16", "float16"):
        wide = bf16_to_f32(values) if dtype == "bfloat16" else values.astype(np.float32)
        out = combine_rows(_UFUNCS[op], wide)
        if scale is not None:
            scale_in_place(out, scale)
        if dtype == "float16":
            work[...] = out.astype(np.float16).reshape(work.shape)
        else:
            work[...] = f32_to_bf16(out, np.empty(out.shape, np.uint16)).reshape(work.shape)
        return
    contiguous = work.flags.c_contiguous  # then combined straight into it, through a 1-D view
    out = combine_rows(_UFUNCS[op], values, out=work.reshape(-1) if contiguous else None)
    if scale is not None:
        scale_in_place(out, scale)
    if not contiguous:
        work[...] = out.reshape(work.shape)

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

from dataclasses import dataclass

import numpy as np

from dataparallel.arrays.actions import Broadcast, Reduction
from dataparallel.arrays.dtypes import bf16_to_f32, f32_to_bf16, scale_in_place
from dataparallel.backends.base import ReduceOp

__all__ = [
    "ALIGN",
    "Slot",
    "combine_rows",
    "land_inline",
    "pack_inline",
    "pack_slots",
    "padded",
    "slots_of",
]

ALIGN = 8  # each leaf's bytes start at a multiple of this in the record


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


def pack_slots(slots: list[Slot], works: list[np.ndarray]) -> None:
    """Copy `works` into this rank's record through their kept `Slot`s (`slots_of(..., mine)`)."""
    for work, slot in zip(works, slots, strict=True):
        mine = slot.mine
        if mine is None:
            raise ValueError("pack_slots: these slots keep no place in this rank's record")
        mine[...] = work.reshape(-1)


@dataclass(slots=True, eq=False)
class Slot:
    """One leaf's place in a call's records: where this rank writes its values, and where every
    rank's values land (`slots_of`); a call plan keeps them, made once."""

    mine: np.ndarray | None  # this rank's values in the record it sends (1-D), if kept
    values: np.ndarray  # every rank's values, one row per rank, in the leaf's storage dtype
    rows: list[np.ndarray]  # the same rows, one array each (no view made per call)


def slots_of(
    payloads: np.ndarray, works: list[np.ndarray], mine: np.ndarray | None = None
) -> list[Slot]:
    """Lay `works` out as `pack_inline` does: each one's `Slot` in `payloads` (every rank's
    payload bytes, one row per rank) and in `mine` (this rank's record's payload), if given."""
    slots, offset = [], 0
    for work in works:
        nbytes = work.nbytes
        values = payloads[:, offset : offset + nbytes].view(work.dtype)
        own = None if mine is None else mine[offset : offset + nbytes].view(work.dtype)
        slots.append(Slot(own, values, list(values)))
        offset += (nbytes + ALIGN - 1) & -ALIGN
    return slots


def land_inline(
    payloads: np.ndarray,
    works: list[np.ndarray],
    dtypes: list[str],
    action: Reduction | Broadcast,
    rank: int,
    slots: list[Slot] | None = None,
) -> None:
    """Write the collective's result into `works` from every rank's payload (one row per rank;
    `slots`: their `slots_of`, when the caller keeps them).

    Ranks that receive nothing (not the root of a reduce; the root of a broadcast) keep theirs.
    """
    if slots is None:
        slots = slots_of(payloads, works)
    if isinstance(action, Broadcast):
        if rank != action.root:
            for work, slot in zip(works, slots, strict=True):
                work[...] = slot.values[action.root].reshape(work.shape)
        return
    if action.root is not None and action.root != rank:
        return
    ufunc, scale = _ufunc(action.op), action.scale
    for work, dtype, slot in zip(works, dtypes, slots, strict=True):
        if dtype in _WIDENED:
            _combine(slot.values, dtype, action, work)
            continue
        # The commonest: combined in rank order straight into the work, through a 1-D view.
        contiguous = work.flags.c_contiguous
        rows = slot.rows
        out = ufunc(rows[0], rows[1], out=work.reshape(-1) if contiguous else None)
        for row in rows[2:]:
            ufunc(out, row, out=out)
        if scale is not None:
            scale_in_place(out, scale)
        if not contiguous:
            work[...] = out.reshape(work.shape)


_WIDENED = frozenset({"bool", "bfloat16", "float16"})  # combined by `_combine`, not in place


def _ufunc(op: ReduceOp) -> np.ufunc:
    """The NumPy ufunc of `op` (compared by identity: an enum's hash is Python code)."""
    if op is ReduceOp.SUM:
        return np.add
    if op is ReduceOp.MAX:
        return np.maximum
    if op is ReduceOp.MIN:
        return np.minimum
    return np.multiply


def combine_rows(ufunc: np.ufunc, values: np.ndarray, out: np.ndarray | None = None) -> np.ndarray:
    """Combine the rows of `values` (one per rank, two or more) with `ufunc`, in rank order.

    One row after the other, so that any caller, for any number of ranks, gets the same bits.
    """
    out = ufunc(values[0], values[1], out=out)
    for row in values[2:]:
        ufunc(out, row, out=out)
    return out


def _combine(values: np.ndarray, dtype: str, action: Reduction, work: np.ndarray) -> None:
    """Reduce `values` (one row per rank, storage dtype) of a bool or 16-bit float leaf along
    the ranks into `work`, scaled: bools as logical or / and, 16-bit floats in float32."""
    op, scale = action.op, action.scale
    if dtype == "bool":
        logical = np.logical_or if op in (ReduceOp.SUM, ReduceOp.MAX) else np.logical_and
        work[...] = combine_rows(logical, values).reshape(work.shape)
        return
    wide = bf16_to_f32(values) if dtype == "bfloat16" else values.astype(np.float32)
    out = combine_rows(_ufunc(op), wide)
    if scale is not None:
        scale_in_place(out, scale)
    if dtype == "float16":
        work[...] = out.astype(np.float16).reshape(work.shape)
    else:
        work[...] = f32_to_bf16(out, np.empty(out.shape, np.uint16)).reshape(work.shape)

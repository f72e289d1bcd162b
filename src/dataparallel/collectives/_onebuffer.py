"""Which reductions go as one host buffer and one `Allreduce` ("packed", "whole"), and where a
"whole" plan puts each leaf (`_plans.py` decides and executes; this says what qualifies)."""

from __future__ import annotations

from typing import cast

import numpy as np

from dataparallel.arrays.actions import Reduction
from dataparallel.backends.base import ReduceOp
from dataparallel.collectives._call import CallContext, Leaf
from dataparallel.protocol import payload_capacity

__all__ = [
    "ALIGN",
    "ONE_MESSAGE",
    "PLAN_BYTES",
    "WHOLE_BYTES",
    "Layout",
    "is_packable",
    "is_whole",
    "one_sum",
    "whole_layout",
]

PLAN_BYTES = 1 << 20  # a bucket of several leaves up to this size is kept in its plan
WHOLE_BYTES = 256 << 20  # a "whole" plan's most bytes (its buffer is lent whole)
PACKED_DTYPES = frozenset({"float32", "float64", "int32", "int64"})
PACKED_OPS = frozenset({ReduceOp.SUM, ReduceOp.PROD})  # min and max: the NaN rules of "fused"
ALIGN = 64  # bytes: where a "whole" plan's large leaves start, for JAX to adopt them


def is_packable(
    ctx: CallContext,
    collective: str,
    action: Reduction,
    wire: str | None,
    leaves: list[Leaf],
    dtypes: list[str],
) -> bool:
    """Whether one `Allreduce` of one host bucket is what `Fusion` would make of these leaves."""
    if not one_sum(ctx, collective, action, wire, leaves, dtypes):
        return False
    works = [leaf.work for leaf in leaves]
    if len(works) == 1:
        return True  # a bucket of itself, whatever its size
    total = sum(cast(np.ndarray, w).nbytes for w in works)
    return total <= min(PLAN_BYTES, ctx.settings.bucket_bytes)


ONE_MESSAGE = "one message of the small leaves, each larger leaf from its own memory"


Layout = tuple[tuple[int, ...], tuple[int, ...], tuple[int, ...], int]


def whole_layout(works: list[np.ndarray], alone_over: int) -> Layout:
    """A "whole" plan's layout: each leaf's offset in the buffer, the leaves packed at its front
    (those of at most `alone_over` bytes, when there are several), the leaves reduced alone
    (each starting 64-byte aligned, so that JAX adopts it), and the buffer's length."""
    front = [i for i, w in enumerate(works) if w.nbytes <= alone_over]
    if len(front) < 2:  # nothing to pack with: reduced from its own memory too
        front = []
    chosen = set(front)
    alone = [i for i in range(len(works)) if i not in chosen]
    offsets = [0] * len(works)
    offset, align = 0, max(1, ALIGN // works[0].itemsize)
    for i in front + alone:
        if i not in chosen:
            offset = -(-offset // align) * align
        offsets[i] = offset
        offset += works[i].size
    return tuple(offsets), tuple(front), tuple(alone), offset


def is_whole(
    ctx: CallContext,
    collective: str,
    action: Reduction,
    wire: str | None,
    leaves: list[Leaf],
    dtypes: list[str],
) -> bool:
    """Whether these leaves make a "whole" plan: read-only host arrays (JAX's), several, of one
    dtype that `Fusion` reduces as it is, up to `WHOLE_BYTES`, summed or multiplied, every rank
    answering (records)."""
    if len(leaves) < 2 or not one_sum(ctx, collective, action, wire, leaves, dtypes):
        return False
    works = [cast(np.ndarray, leaf.work) for leaf in leaves]
    return not any(w.flags.writeable for w in works) and sum(w.nbytes for w in works) <= WHOLE_BYTES


def one_sum(
    ctx: CallContext,
    collective: str,
    action: Reduction,
    wire: str | None,
    leaves: list[Leaf],
    dtypes: list[str],
) -> bool:
    """Whether these leaves may be reduced as one host buffer with one `Allreduce` ("packed",
    "whole"): host arrays of one dtype that `Fusion` reduces as it is, summed or multiplied, no
    integer scale (`Fusion`'s rules), every rank answering in records as "inline" does."""
    if collective != "allreduce" or wire is not None or action.op not in PACKED_OPS:
        return False
    if len(set(dtypes)) != 1 or dtypes[0] not in PACKED_DTYPES:
        return False
    if dtypes[0] in ("int32", "int64") and action.scale is not None:
        return False
    if any(type(leaf.work) is not np.ndarray for leaf in leaves):
        return False
    return bool(payload_capacity(ctx.backend.size))

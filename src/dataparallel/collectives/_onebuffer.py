"""The reductions that go as one host buffer and one `Allreduce` (`Packed`, `Whole`): which
qualify, where a `Whole` plan puts each leaf, and how both run (`_plans.py` plans and picks)."""

from __future__ import annotations

from typing import cast

import numpy as np

from dataparallel.arrays.actions import Reduction
from dataparallel.arrays.fusion import allreduce_into_scaled, allreduce_scaled, pack_bucket
from dataparallel.arrays.pool import BufferPool
from dataparallel.backends.base import Backend, ReduceOp
from dataparallel.collectives._call import CallContext, Leaf, host_works
from dataparallel.collectives._callplan import Packed, Whole
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
    "run_packed",
    "run_whole",
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


def run_packed(
    backend: Backend, plan: Packed, works: list[np.ndarray], pool: BufferPool
) -> list[np.ndarray]:
    """The handshake, then one allreduce of the plan's bucket; return the leaves' results (read-only
    arrays come back new)."""
    buf = plan.bucket
    if buf is None:  # one leaf: its own bucket
        work = works[0]
        if not work.flags.writeable and work.flags.c_contiguous:  # a JAX array's memory
            return [into_new(backend, plan, work, pool)]
        mine = work.flags.c_contiguous and work.flags.writeable
        target = work if mine else np.array(work, order="C")
    else:
        pack_bucket(works, buf)  # as `Fusion` packs a bucket
        target = buf
    plan.records.exchange(backend, plan.agreement.describe, plan.agreement.replay_of)
    allreduce_scaled(backend, target.reshape(-1), plan.action)  # after the handshake
    if buf is None:
        if target is not work:
            if not work.flags.writeable:
                return [target]
            work[...] = target
        return works
    try:
        for work, view in zip(works, plan.views, strict=True):
            work[...] = view
    except ValueError:  # a read-only array (asked only then): a new one, as `Fusion` gives
        pairs = zip(works, plan.views, strict=True)
        out = [work if work.flags.writeable else view.copy() for work, view in pairs]
        for work, view in zip(out, plan.views, strict=True):
            work[...] = view
        return out
    return works


def into_new(backend: Backend, plan: Packed, work: np.ndarray, pool: BufferPool) -> np.ndarray:
    """The handshake, then one allreduce from read-only `work` into a buffer lent by `pool`
    (as `Fusion` reduces a read-only array that goes alone); return it."""
    result = pool.lend(work.dtype, work.shape)
    plan.records.exchange(backend, plan.agreement.describe, plan.agreement.replay_of)
    allreduce_into_scaled(backend, work.reshape(-1), result.reshape(-1), plan.action)
    return result


def run_whole(ctx: CallContext, plan: Whole, leaves: list[Leaf]) -> None:
    """The handshake, then the "whole" plan's calls into a buffer lent by the pool: the small
    leaves packed at its front (scaled as they are packed, where `prescale` may) and reduced in
    place, each larger leaf from its memory into its place; each leaf's work becomes its view of
    the result (adopted by JAX, not copied)."""
    works, backend, action = host_works(leaves), ctx.backend, plan.action
    started = ctx.timeline.now() if ctx.timeline is not None else 0.0
    buf = ctx.buffers.lend(works[0].dtype, (plan.items,))
    places = [buf[o : o + w.size] for o, w in zip(plan.offsets, works, strict=True)]
    front = buf[: sum(works[i].size for i in plan.front)]
    if plan.front:
        np.concatenate([works[i] for i in plan.front], axis=None, out=front)
    plan.records.exchange(backend, plan.agreement.describe, plan.agreement.replay_of)
    if plan.front:
        allreduce_scaled(backend, front, action)
    for i in plan.alone:
        allreduce_into_scaled(backend, works[i].reshape(-1), places[i], action)
    for leaf, work, place in zip(leaves, works, places, strict=True):
        leaf.work, leaf.is_view = place.reshape(work.shape), False
    if ctx.timeline is not None:
        calls = len(plan.alone) + bool(plan.front)
        ctx.timeline.complete("allreduce", started, leaves=len(leaves), calls=calls)

"""What the fast lanes of `dp.allreduce` share (`_fast.py`, `_plans.py`).

The handshake with less Python than `protocol.exchange`, the general path's description of a call
(from which every lane's record is made, so a rank on a lane meets a rank on the general path),
and the reductions made once per (op, scale, size).
"""

from __future__ import annotations

from collections.abc import Callable
from functools import lru_cache, partial
from typing import Any, NamedTuple

import numpy as np

from dataparallel import world
from dataparallel.arrays import tree
from dataparallel.arrays.actions import Reduction
from dataparallel.arrays.dtypes import prescale, scale_in_place
from dataparallel.arrays.replay import Replay
from dataparallel.backends.base import Backend
from dataparallel.collectives import _replays
from dataparallel.collectives._call import Leaf, describe, inline_fits, leaves_of, stage
from dataparallel.protocol import HEADER_BYTES, RECORD_BYTES, digest, disagree, reduction

__all__ = [
    "DTYPES",
    "FLOATS",
    "IN_PLACE_OPS",
    "NOT_FAST",
    "PAD",
    "UFUNCS",
    "General",
    "allreduce_scaled",
    "gather_records",
    "general",
    "integer_rules",
    "reduction_of",
]

NOT_FAST = object()  # what a lane returns for a call it leaves to the general path
UFUNCS = {"sum": np.add, "prod": np.multiply, "min": np.minimum, "max": np.maximum, "avg": np.add}
FLOATS = frozenset({np.dtype(np.float32), np.dtype(np.float64)})
DTYPES = FLOATS | {np.dtype(np.int32), np.dtype(np.int64)}
PAD = bytes(RECORD_BYTES)


@lru_cache(maxsize=64)
def reduction_of(op: str, scale: Any, size: int) -> Reduction:
    """`protocol.reduction`, made once per (op, scale, size): its checks cost a call 0.7 µs."""
    return reduction(op, scale, size)


def gather_records(
    backend: Backend, record: np.ndarray, x: Any, op: str, scale: Any, *, fused: bool
) -> tuple[np.ndarray, bytes]:
    """Gather every rank's record (as `protocol.exchange`, with less Python); return the rows.

    `fused`: an allreduce of `x` follows (a rank that has joined makes it on zeros); else the
    values travel in the records and nothing follows."""
    rows = np.empty(backend.size * RECORD_BYTES, np.uint8)
    backend.allgather(record, rows)
    raw = rows.tobytes()
    h = raw[:8]
    for start in range(RECORD_BYTES, len(raw), RECORD_BYTES):
        if raw[start : start + 8] != h:
            described = lambda: general(x, op, scale).details()  # noqa: E731 (only on a mismatch)
            replay = partial(_fused_replay, x, op, scale) if fused else _nothing
            disagree(backend, rows.reshape(-1, RECORD_BYTES), described, replay=replay)
            break
    return rows, raw


def _fused_replay(x: np.ndarray, op: str, scale: Any, _: bool) -> Replay:
    """What the in-place lane and planned trees send after the handshake, as the general path
    describes it."""
    ctx = world.current()
    leaves = leaves_of(tree.flatten(x, "x"))
    stage(leaves)
    return _replays.fused(ctx, reduction(op, scale, ctx.backend.size), leaves, False, False)


IN_PLACE_OPS = frozenset({"sum", "avg", "prod"})


def allreduce_scaled(backend: Backend, buf: np.ndarray, action: Reduction) -> None:
    """The one allreduce a lane makes after its handshake, in place, scaled as `action` says:
    before the sum where that is exact (`dtypes.prescale`), else after."""
    prescaled = prescale(buf, action.scale)
    backend.allreduce(buf, action.op)
    if action.scale is not None and not prescaled:
        scale_in_place(buf, action.scale)


def _nothing(_: bool) -> Replay:
    """A fast call's values travel in the handshake: a rank that has joined sends nothing more."""
    return Replay.nothing()


class General(NamedTuple):
    """The call as the general path sees it: what every lane's handshake is made from."""

    header: bytes  # the handshake header: the hash of the call's summary, no flags
    details: Callable[[], dict[str, Any]]  # the call field by field (for a mismatch's report)
    inline: bool  # whether its values travel in the handshake
    leaves: list[Leaf]
    spec: Any  # the tree's structure


def general(x: Any, op: str, scale: Any) -> General:
    """Describe `dp.allreduce(x, op, scale=scale)` as the general path does (`_call.describe`)."""
    ctx = world.current()
    flat = tree.flatten(x, "x")
    leaves = leaves_of(flat)
    stage(leaves)
    args = {"op": op, "scale": None if scale is None else float(scale)}
    inline = inline_fits(ctx, leaves)
    summary, details = describe(ctx, "allreduce", flat, leaves, args, True, inline)
    header = digest(summary).to_bytes(8, "little") + bytes(HEADER_BYTES - 8)
    return General(header, details, inline, leaves, flat.spec)


def integer_rules(dtype: np.dtype, op: str, scale: Any) -> bool:
    """Whether integer rules apply (an average or a scale of integers, and their errors): those
    are the general path's."""
    return dtype not in FLOATS and (op == "avg" or scale is not None)

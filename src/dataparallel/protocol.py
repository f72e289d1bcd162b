"""Input validation and collective mismatch detection.

Every collective begins with one small message, the *handshake*, and no rank sends anything
else for the call until every rank has agreed on it. Each rank contributes a 64-byte record: an
8-byte hash of its call (collective, op, root, tree structure, shapes, dtypes), 8 bytes of flags,
and up to 48 bytes of payload; one allgather gives every rank every record. Since every rank sees
the same records, every rank reaches the same verdict:

- all hashes equal: the call goes on. A payload that fits in the record (a loss, a few metrics)
  has then already travelled: the ranks reduce it locally, and the call costs one message.
- hashes differ: the ranks exchange pickled descriptions of their calls (only now), and every
  rank raises `CollectiveMismatchError` naming the ranks and what differs; the world stays usable.

A rank whose call fails before communicating (a `TypeError` for a bad leaf) still takes part in
the handshake, with its failure as its call (`fail_together`), so its next call can never be
paired with the other ranks' current one. In worlds over `GATHER_LIMIT` ranks the handshake is a
16-byte allreduce of `[h, -h]` with MAX instead (the largest and the smallest hash), without
payload.

A rank that has joined (`dp.join`: it ran out of data) takes part in every handshake with a
`joined` mark instead of a call. The others' calls must then agree among themselves; the lowest
of them sends what it is about to send (a `Replay`, `arrays/replay.py`), and the joined ranks
make the same engine calls on zeros. Calls that cannot be answered so (gathers, broadcasts, ...)
raise `RankJoinedError` on the ranks that made them. Without joined ranks, nothing of this costs
anything.

`DATAPARALLEL_CHECK=0` cannot turn the handshake off (without it a mismatch hangs or corrupts):
it makes the hash cover only what decides the messages that follow (collective, op, root, and
each leaf's dtype, size and device), so a mismatch of shapes of equal size or of tree
structure goes unnoticed, at a lower cost of describing the call.
"""

from __future__ import annotations

import hashlib
import numbers
from collections.abc import Callable
from typing import Any, NoReturn

import numpy as np

from dataparallel.arrays.actions import Reduction
from dataparallel.arrays.dtypes import INTEGER_DTYPES
from dataparallel.arrays.replay import Replay
from dataparallel.backends.base import Backend, ReduceOp
from dataparallel.errors import CollectiveMismatchError, RankJoinedError

__all__ = [
    "GATHER_LIMIT",
    "HEADER_BYTES",
    "INLINE_BYTES",
    "JOINED",
    "NEWCOMER",
    "RECORD_BYTES",
    "ReplayOf",
    "check_scale",
    "digest",
    "disagree",
    "exchange",
    "fail_together",
    "handshake",
    "inline_capacity",
    "new_record",
    "parse_op",
    "reduction",
    "reduction_error",
    "validate_reduction",
    "verify_same_call",
]

RECORD_BYTES = 64  # what each rank contributes to a handshake
HEADER_BYTES = 16  # the call's hash, then the flags
INLINE_BYTES = RECORD_BYTES - HEADER_BYTES  # payload carried by the handshake itself
GATHER_LIMIT = 64  # larger worlds check with an allreduce, whose cost grows slower with size
# Flag bytes of a record (byte 8 is "this rank has a NaN"): the rank has joined (`dp.join`), and
# this is its first handshake since it joined.
JOINED, NEWCOMER = 9, 10

# What a call will send after its handshake, for ranks that joined to answer (None: it cannot);
# given whether some rank raised the handshake's flag.
ReplayOf = Callable[[bool], Replay | None] | None

_OPS = ("sum", "prod", "min", "max", "avg")
_MAX_DIFFERENCES = 8


def parse_op(op: str) -> tuple[ReduceOp, bool]:
    """Return the engine op for `op` and whether it is `"avg"` (sum, then divide by size)."""
    if op == "avg":
        return ReduceOp.SUM, True
    try:
        return ReduceOp(op), False
    except ValueError:
        raise ValueError(f"op={op!r} is not a reduction: use one of {_OPS}.") from None


def reduction(op: str, scale: object, size: int, root: int | None = None) -> Reduction:
    """Return what the engine does for a public `op` and `scale` on a world of `size` ranks.

    The one place where `"avg"` becomes a sum scaled by `1 / size`, and `scale` multiplies it.

    >>> reduction("avg", 2.0, 4)
    Reduction(op=<ReduceOp.SUM: 'sum'>, scale=0.5, root=None)
    """
    engine_op, average = parse_op(op)
    check_scale(scale)
    total = 1.0 if scale is None else float(scale)  # type: ignore[arg-type]
    if average:
        total /= size
    return Reduction(engine_op, None if total == 1 else total, root)


def check_scale(scale: object) -> None:
    """Raise `TypeError` unless `scale` is None or a real number (a 0-d array or tensor too)."""
    if scale is None or isinstance(scale, numbers.Real):
        return
    if not isinstance(scale, (str, bytes, numbers.Complex)) and hasattr(type(scale), "__float__"):
        return
    raise TypeError(
        f"scale={scale!r} must be a real number (an int or a float), got {type(scale).__name__}."
    )


def reduction_error(dtype: str, op: str, scale: float | None) -> str | None:
    """Return why a reduction cannot be done on `dtype`, or None when it can."""
    if dtype in INTEGER_DTYPES or dtype == "bool":
        if op == "avg":
            return (
                f"op='avg' on {dtype} values would truncate; convert the leaf to a floating "
                "dtype, or use op='sum' and divide yourself."
            )
        if scale is not None and (dtype == "bool" or not float(scale).is_integer()):
            return (
                f"scale={scale} cannot be applied to {dtype} values; use a floating dtype, "
                "or an integral scale."
            )
    if dtype.startswith("complex") and op in ("min", "max"):
        return f"op={op!r} is not defined for complex values ({dtype})."
    return None


def validate_reduction(dtype: str, op: str, scale: float | None, path: str) -> None:
    """Raise `TypeError` for a reduction the dtype cannot hold, naming the leaf's `path`."""
    error = reduction_error(dtype, op, scale)
    if error is not None:
        raise TypeError(f"{path}: {error}")


def digest(description: str) -> int:
    """Return the 62-bit hash of a call's summary that the handshake compares."""
    raw = hashlib.blake2b(description.encode(), digest_size=8).digest()
    return int.from_bytes(raw, "little") >> 2  # so that -h fits in int64 too


def inline_capacity(size: int) -> int:
    """Return how many payload bytes a handshake carries in a world of `size` ranks (0: none)."""
    return INLINE_BYTES if 1 < size <= GATHER_LIMIT else 0


def new_record() -> np.ndarray:
    """Return an empty handshake record; a payload goes at `HEADER_BYTES` onwards."""
    return np.zeros(RECORD_BYTES, np.uint8)


def handshake(
    backend: Backend,
    summary: str | int,
    call: dict[str, Any] | Callable[[], dict[str, Any]],
    *,
    record: np.ndarray | None = None,
    flag: bool | None = None,
    replay: ReplayOf = None,
    on_joined: Callable[[], None] | None = None,
) -> tuple[np.ndarray | None, bool]:
    """Exchange this rank's call with every rank; raise `CollectiveMismatchError` unless all agree.

    Args:
        backend: the engine the collective runs on (a world of two or more).
        summary: a string equal on two ranks exactly when their calls are the same, or its
            `digest`.
        call: the call field by field (or a function that makes it), to explain a mismatch.
        record: this rank's record (`new_record()`) with a payload after the header, if any.
        flag: a bit every rank learns the OR of (whether some rank has a NaN), or None.
        replay: makes what the call sends next (given whether some rank raised `flag`), for
            ranks that have joined to answer with zeros (None: the call cannot be answered so,
            and raises `RankJoinedError` if some rank has joined).
        on_joined: called when some rank has joined (before the call goes on).

    Returns:
        Every rank's record, one row per rank (None in worlds over `GATHER_LIMIT` ranks), and
        whether any rank raised `flag`.
    """
    h = summary if isinstance(summary, int) else digest(summary)
    if backend.size > GATHER_LIMIT:
        bounds = np.array([h, -h, bool(flag), 0, 1, -1, -backend.rank], np.int64)
        backend.allreduce(bounds, ReduceOp.MAX)
        if bounds[0] != -bounds[1]:
            _mismatch(backend, call)
        if bounds[3]:
            _answer(backend, int(-bounds[6]), call, replay, on_joined, bool(bounds[2]))
        return None, bool(bounds[2])
    if record is None:
        record = np.zeros(RECORD_BYTES, np.uint8)
    head = record[:HEADER_BYTES].view(np.int64)
    head[0] = h
    if flag:
        head[1] = 1
    rows = exchange(backend, record, call, replay=replay, on_joined=on_joined)
    return rows, (flag is not None and bool(rows[:, 8].any()))


def exchange(
    backend: Backend,
    record: np.ndarray,
    call: dict[str, Any] | Callable[[], dict[str, Any]],
    *,
    replay: ReplayOf = None,
    on_joined: Callable[[], None] | None = None,
) -> np.ndarray:
    """Gather every rank's `record` (its header filled in); raise unless every hash is the same.

    The core of `handshake`, for callers that build their record themselves (a world of at most
    `GATHER_LIMIT` ranks). Returns the records, one row per rank.
    """
    size = backend.size
    rows = np.empty((size, RECORD_BYTES), np.uint8)
    backend.allgather(record, rows.reshape(-1))
    if rows[:, :8].tobytes() != record[:8].tobytes() * size:
        disagree(backend, rows, call, replay=replay, on_joined=on_joined)
    return rows


def disagree(
    backend: Backend,
    rows: np.ndarray,
    call: dict[str, Any] | Callable[[], dict[str, Any]],
    *,
    replay: ReplayOf = None,
    on_joined: Callable[[], None] | None = None,
) -> None:
    """The records' hashes differ: answer the ranks that have joined, or raise on every rank.

    Raises `CollectiveMismatchError` unless the ranks that have not joined agree among themselves.
    """
    joined = rows[:, JOINED] != 0
    hashes = rows[~joined, :8]
    if not joined.any() or (hashes != hashes[0]).any():
        _mismatch(backend, call)
    root = int(np.flatnonzero(~joined)[0])
    _answer(backend, root, call, replay, on_joined, bool(rows[:, 8].any()))


def _answer(
    backend: Backend,
    root: int,
    call: dict[str, Any] | Callable[[], dict[str, Any]],
    replay: ReplayOf,
    on_joined: Callable[[], None] | None,
    flagged: bool,
) -> None:
    """Some rank has joined: send it what this call sends next, or raise `RankJoinedError`.

    `root`, the lowest rank that has not joined, sends the replay; every rank receives it.
    """
    mine = replay(flagged) if replay is not None and backend.rank == root else None
    if backend.broadcast_object(mine, root) is None:
        collective = (call if isinstance(call, dict) else call()).get("collective")
        raise RankJoinedError(
            f"{collective} cannot run while some ranks have joined (dp.join: they ran out of "
            "data): a rank that has joined answers reductions (allreduce, reducescatter, "
            "gradient steps) and barriers with zeros, nothing else. Make this call before "
            "any rank joins, or after every rank has (when dp.join returns)."
        )
    if on_joined is not None:
        on_joined()


def _mismatch(backend: Backend, call: dict[str, Any] | Callable[[], dict[str, Any]]) -> NoReturn:
    """Exchange the calls' descriptions (every rank saw the mismatch) and raise on every rank.

    Ranks that have joined take part with None (`dp.join`), and are left out of the report.
    """
    calls = backend.allgather_object(call if isinstance(call, dict) else call())
    raise CollectiveMismatchError(_explain(calls))


def verify_same_call(
    backend: Backend,
    call: dict[str, Any] | Callable[[], dict[str, Any]],
    summary: str | None = None,
    replay: ReplayOf = None,
) -> None:
    """Raise `CollectiveMismatchError` on every rank unless all ranks make the same call.

    One handshake without payload (see the module's notes); for calls whose own communication
    follows, so that it never meets another rank's different call.

    Args:
        backend: the engine the collective will run on.
        call: a description of the call, field by field (`{"collective": "allreduce", "op":
            "sum", "x['w']": "float32[3]"}`), or a function that makes one: it is only needed to
            explain a mismatch, so a caller with a cheap `summary` can defer it.
        summary: a string equal on two ranks exactly when their calls are the same (default:
            derived from `call`).
        replay: what follows, for ranks that have joined (see `handshake`).
    """
    if backend.size == 1:
        return
    if summary is None:
        summary = repr(sorted((call if isinstance(call, dict) else call()).items()))
    handshake(backend, summary, call, replay=replay)


def fail_together(backend: Backend, collective: str, error: BaseException) -> None:
    """Make `collective` fail on every rank: this rank's call failed before communicating.

    This rank still takes part in the handshake, with its failure as its call, so the other
    ranks raise `CollectiveMismatchError` (naming this rank and `error`) instead of pairing their
    call with this rank's next one. The caller re-raises `error` afterwards.
    """
    if backend.size == 1:
        return
    reason = f"{type(error).__name__}: {error}"
    described = {"collective": collective, "failed": reason}
    try:
        handshake(backend, f"{collective}|failed|{reason}", described)
    except CollectiveMismatchError:
        error.add_note(
            f"dataparallel: {collective} raised CollectiveMismatchError on the other ranks, "
            "which did not fail alike: every rank's call failed, and the ranks stay in step."
        )


def _ranks(ranks: list[int]) -> str:
    return ("rank " if len(ranks) == 1 else "ranks ") + ", ".join(map(str, ranks))


def _explain(every: list[dict[str, Any] | None]) -> str:
    """Describe, field by field, how the ranks' calls differ (None: a rank that has joined)."""
    calls = {rank: call for rank, call in enumerate(every) if call is not None}
    failed: dict[str, list[int]] = {}
    for rank, call in calls.items():
        if "failed" in call:
            failed.setdefault(str(call["failed"]), []).append(rank)
    if failed:
        collective = calls[min(min(ranks) for ranks in failed.values())].get("collective")
        return (
            f"{collective} failed on some ranks before the ranks communicated, so it fails on "
            "every rank:\n"
            + "\n".join(f"  {_ranks(ranks)}: {reason}" for reason, ranks in failed.items())
            + "\nFix the call on the ranks named (their own traceback shows where); the next "
            "collective works as usual."
        )
    keys = sorted({k for c in calls.values() for k in c}, key=lambda k: (k != "collective", k))
    lines = []
    for key in keys:
        groups: dict[str, list[int]] = {}
        for rank, call in calls.items():
            value = call.get(key, "<absent>")
            groups.setdefault(value if isinstance(value, str) else repr(value), []).append(rank)
        if len(groups) > 1:
            parts = "; ".join(f"{value} on {_ranks(ranks)}" for value, ranks in groups.items())
            lines.append(f"  {key}: {parts}")
    shown = lines[:_MAX_DIFFERENCES]
    if len(lines) > len(shown):
        shown.append(f"  ... and {len(lines) - len(shown)} more differences")
    collectives = sorted({str(c.get("collective")) for c in calls.values()})
    head = (
        f"Ranks called different collectives ({', '.join(collectives)})"
        if len(collectives) > 1
        else f"Ranks called {collectives[0]} with different arguments"
    )
    return (
        head
        + ":\n"
        + "\n".join(shown)
        + (
            "\nEvery rank must make the same collective calls, in the same order, with the same "
            "tree structure, shapes (first axis excepted for allgather), dtypes, ops and roots."
        )
    )

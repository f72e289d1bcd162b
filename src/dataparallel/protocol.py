"""The handshake: the message every collective begins with, both sides of it.

Every collective begins with one small message, and no rank sends anything else for the call
until every rank has agreed on it. Each rank contributes a 64-byte `RECORD` (little-endian, named
fields): the `digest` of its call (collective, op, root, tree structure, shapes, dtypes), its
`flags` (`Flag`), and up to `PAYLOAD_BYTES` of payload; one allgather gives every rank every
record. Since every rank sees the same records, every rank reaches the same verdict:

- all digests equal: the call goes on. A payload that fits in the record (a loss, a few
  metrics) has then already travelled: the ranks reduce it locally, and the call costs one
  message.
- digests differ: the ranks exchange pickled descriptions of their calls (only now), and every
  rank raises `CollectiveMismatchError` naming the ranks and what differs (`protocol_report.py`);
  the world stays usable.

A rank whose call fails before communicating (a `TypeError` for a bad leaf) still takes part in
the handshake, with its failure as its call (`fail_together`), so its next call can never be
paired with the other ranks' current one. In worlds over `GATHER_LIMIT` ranks the handshake is an
allreduce with MAX of `BOUNDS` (the largest and the smallest digest, and what the flags say)
instead, without payload.

A rank that has joined (`dp.join`: it ran out of data) takes part in every handshake with the
`Flag.JOINED` mark instead of a call (`joined_round`). The others' calls must then agree among
themselves; the lowest of them sends what it is about to send (a `Replay`, `arrays/replay.py`),
and the joined ranks make the same engine calls on zeros. Calls that cannot be answered so
(gathers, broadcasts, ...) raise `RankJoinedError` on the ranks that made them. Without joined
ranks, nothing of this costs anything.

A gradient reduction whose ranks all promised, in the flags of a step's last bucket, that their
next call on the engine is the same step again (`torch/_gradsync.py`) makes that step without a
handshake: its layout was agreed, and nothing has been called since. A rank that is about to
make any other call first keeps its promise on zeros (`owe`: every handshake here settles what
its rank owes the engine first), marked so that the ranks that made the step learn at its end
that a rank did something else (they then raise `CollectiveMismatchError` with the rank's call,
as a handshake would have) or joined (`dp.join`: its zeros are what it would have answered).

`DATAPARALLEL_CHECK=0` cannot turn the handshake off (without it a mismatch hangs or corrupts):
the collectives then make the digest cover only what decides the messages that follow
(collective, op, root, and each leaf's dtype, size and device).
"""

from __future__ import annotations

import enum
import hashlib
from collections.abc import Callable, Mapping

import numpy as np

from dataparallel import caches
from dataparallel.arrays.replay import Replay
from dataparallel.backends.base import Backend, Handle, ReduceOp
from dataparallel.errors import CollectiveMismatchError, CollectiveTimeoutError, RankJoinedError
from dataparallel.protocol_report import Describe, mismatch, timed_out

__all__ = [
    "BOUNDS",
    "GATHER_LIMIT",
    "PAYLOAD_BYTES",
    "RECORD",
    "Describe",
    "Flag",
    "Records",
    "ReplayOf",
    "Started",
    "digest",
    "fail_together",
    "handshake",
    "handshakes",
    "joined_round",
    "new_record",
    "owe",
    "owed",
    "payload_capacity",
    "settle",
    "start_handshake",
    "verify_same_call",
]

GATHER_LIMIT = 64  # larger worlds check with an allreduce, whose cost grows slower with size
PAYLOAD_BYTES = 48  # what a record carries beside its header


class Flag(enum.IntFlag):
    """The bits of a record's `flags`, every rank's OR learnt by every rank."""

    NAN = 1  # this rank's floating leaves hold a NaN (min/max: `arrays/nan.py`)
    JOINED = 2  # this rank has joined (`dp.join`) and answers instead of calling
    NEWCOMER = 4  # ... and this is its first handshake since it joined


# What each rank contributes: little-endian whatever the host, so that ranks on machines of
# either byte order read each other's records alike.
RECORD = np.dtype([("digest", "<i8"), ("flags", "<i8"), ("payload", "u1", (PAYLOAD_BYTES,))])

# What a world over `GATHER_LIMIT` ranks reduces with MAX instead (native order: reduced as
# numbers, never read as bytes by another host). A rank that has joined contributes `NO_DIGEST`
# to the digests, below every digest and every negated one, so only working ranks count there.
BOUNDS = np.dtype(
    [
        ("high", "=i8"),  # the largest digest
        ("neg_low", "=i8"),  # minus the smallest: equal to -high exactly when all agree
        ("flagged", "=i8"),  # some rank raised Flag.NAN
        ("joined", "=i8"),  # some rank has joined
        ("working", "=i8"),  # some rank has not
        ("newcomer", "=i8"),  # the highest rank that joined in this round (-1: none)
        ("neg_first_working", "=i8"),  # minus the lowest rank that has not joined
    ]
)
NO_DIGEST = -(1 << 62)
_NAN = int(Flag.NAN)  # as a plain int: NumPy's `&` with an IntFlag goes through Python

# What a call will send after its handshake, for ranks that joined to answer (None: it cannot);
# given whether some rank raised `Flag.NAN`.
ReplayOf = Callable[[bool], Replay | None] | None
# A handshake begun early (`start_handshake`): its records and the gather in flight.
Started = tuple["Records", Handle]


# What each rank owes an engine before its next call (`owe`), by the engine's id: the engine
# (so that a reused id is not mistaken for it) and what keeps the promise on zeros, given
# whether this rank is joining. One at a time per engine, so that a rank that keeps them knows
# their order; and how many handshakes each engine has made (`settle`).
_owed: dict[int, tuple[Backend, Callable[[bool], None]]] = {}
_handshakes: dict[int, int] = {}
caches.register(_owed.clear)  # `dp.finalize()`: the world's engines are gone
caches.register(_handshakes.clear)


def owe(backend: Backend, answer: Callable[[bool], None] | None) -> None:
    """Record that this rank promised the other ranks that its next call on `backend` is a step
    they will make without a handshake (None: the promise was kept, or is taken back before it
    was made); `answer(joining)` makes that step on zeros, should this rank call something else
    first (`settle`). One promise per engine at a time (`owed` says whether one is held)."""
    if answer is None:
        _owed.pop(id(backend), None)
    else:
        _owed[id(backend)] = (backend, answer)


def owed(backend: Backend) -> Callable[[bool], None] | None:
    """The promise this rank holds on `backend` (`owe`), or None."""
    held = _owed.get(id(backend))
    return held[1] if held is not None and held[0] is backend else None


def settle(backend: Backend, joining: bool = False) -> int:
    """Before a handshake on `backend`: keep on zeros what this rank promised the others
    (`owe`); return how many handshakes `backend` has made, this one included."""
    answer = owed(backend)
    if answer is not None:
        del _owed[id(backend)]
        answer(joining)
    count = _handshakes.get(id(backend), 0) + 1
    _handshakes[id(backend)] = count
    return count


def handshakes(backend: Backend) -> int:
    """How many handshakes `backend` has made (`settle`)."""
    return _handshakes.get(id(backend), 0)


def digest(description: str) -> int:
    """Return the 62-bit hash of a call's summary that the handshake compares."""
    raw = hashlib.blake2b(description.encode(), digest_size=8).digest()
    return int.from_bytes(raw, "little") >> 2  # so that -h fits in int64 too


def payload_capacity(size: int) -> int:
    """Return how many payload bytes a handshake carries in a world of `size` ranks (0: none)."""
    return PAYLOAD_BYTES if 1 < size <= GATHER_LIMIT else 0


def new_record(call_digest: int = 0, flags: int = 0) -> np.ndarray:
    """Return a writable record (shape `(1,)`); its payload is `record["payload"][0]`."""
    record = np.zeros(1, RECORD)
    record["digest"], record["flags"] = call_digest, flags
    return record


def handshake(
    backend: Backend,
    summary: str | int,
    call: Describe,
    *,
    records: Records | None = None,
    flag: bool | None = None,
    replay: ReplayOf = None,
    on_joined: Callable[[], None] | None = None,
    started: Started | None = None,
) -> tuple[np.ndarray | None, bool]:
    """Exchange this rank's call with every rank; raise `CollectiveMismatchError` unless all agree.

    Args:
        backend: the engine the collective runs on (a world of two or more).
        summary: a string equal on two ranks exactly when their calls are the same, or its
            `digest`.
        call: the call field by field (or a function that makes it), to explain a mismatch.
        records: the call's `Records` with its digest (`summary`'s), and its payload if any: a
            call plan keeps them; made here when not given.
        flag: a bit every rank learns the OR of (whether some rank has a NaN), or None.
        replay: makes what the call sends next (given whether some rank raised `flag`), for
            ranks that have joined to answer with zeros (None: the call cannot be answered so,
            and raises `RankJoinedError` if some rank has joined).
        on_joined: called when some rank has joined (before the call goes on).
        started: the exchange `start_handshake` began for this call (`summary`'s); finished here.

    Returns:
        Every rank's record (`RECORD`, one per rank; None in worlds over `GATHER_LIMIT` ranks),
        and whether any rank raised `flag`.
    """
    if started is not None:
        records, gather = started
        return records.exchange(backend, call, replay, on_joined, gather), False
    h = summary if isinstance(summary, int) else digest(summary)
    if backend.size > GATHER_LIMIT:
        settle(backend)
        bounds = np.zeros(1, BOUNDS)
        bounds[0] = (h, -h, bool(flag), 0, 1, -1, -backend.rank)
        try:
            backend.allreduce(bounds.view(np.int64), ReduceOp.MAX)
        except CollectiveTimeoutError as error:
            raise timed_out(backend, call) from error
        seen = bounds[0]
        if seen["high"] != -seen["neg_low"]:
            mismatch(backend, call)
        if seen["joined"]:
            root = int(-seen["neg_first_working"])
            _answer(backend, root, call, replay, on_joined, bool(seen["flagged"]))
        return None, bool(seen["flagged"])
    if records is None:
        records = Records(backend.size, h)
    records.flags[0] = _NAN if flag else 0
    rows = records.exchange(backend, call, replay, on_joined)
    return rows, (flag is not None and bool((rows["flags"] & _NAN).any()))


def start_handshake(
    backend: Backend, summary: str | int, records: Records | None = None
) -> Started | None:
    """Begin the handshake of a call that comes later (`Backend.iallgather`, no flag), so that
    its rendezvous overlaps the caller's work; `handshake(started=...)` finishes it, and must,
    on every rank alike. None where it cannot begin early (a world of one or over `GATHER_LIMIT`).

    `records`: the call's `Records` (a call plan keeps them), given `summary`'s digest here.
    """
    if not 1 < backend.size <= GATHER_LIMIT:
        return None
    settle(backend)
    h = summary if isinstance(summary, int) else digest(summary)
    if records is None:
        records = Records(backend.size, h)
    else:
        records.record["digest"], records.flags[0] = h, 0
    return records, backend.iallgather(records.sent, records.received)


class Records:
    """One call's records, allocated once (a call plan keeps them): this rank's, its digest
    filled in, and every rank's, with views of their fields."""

    def __init__(self, size: int, call_digest: int) -> None:
        self.record = new_record(call_digest)
        self.sent = self.record.view(np.uint8)
        self.payload: np.ndarray = self.record["payload"][0]  # this rank's values go here
        self.flags: np.ndarray = self.record["flags"]  # ... and its flags
        self.rows = np.empty(size, RECORD)
        self.received = self.rows.view(np.uint8)
        self.payloads: np.ndarray = self.rows["payload"]  # every rank's, one row per rank

    def exchange(
        self,
        backend: Backend,
        call: Describe,
        replay: ReplayOf = None,
        on_joined: Callable[[], None] | None = None,
        started: Handle | None = None,
    ) -> np.ndarray:
        """Gather every rank's record (this one's payload and flags filled in); return them,
        unless the digests differ: then answer the ranks that have joined, or raise on every
        rank (`CollectiveMismatchError`). The one exchange of records (`started`: the gather
        began already, `start_handshake`)."""
        try:
            if started is None:
                settle(backend)
                backend.allgather(self.sent, self.received)
            else:
                started.wait()
        except CollectiveTimeoutError as error:  # zero cost unless raised (Python 3.11+)
            raise timed_out(backend, call) from error
        rows = self.rows
        digests = rows["digest"].tobytes()
        if digests != digests[:8] * backend.size:
            _disagree(backend, rows, call, replay, on_joined)
        return rows


def _disagree(
    backend: Backend,
    rows: np.ndarray,
    call: Describe,
    replay: ReplayOf,
    on_joined: Callable[[], None] | None,
) -> None:
    """The records' digests differ: answer the ranks that have joined, or raise on every rank.

    Raises `CollectiveMismatchError` unless the ranks that have not joined agree among themselves.
    """
    flags = rows["flags"]
    joined = (flags & Flag.JOINED) != 0
    digests = rows["digest"][~joined]
    if not joined.any() or (digests != digests[0]).any():
        mismatch(backend, call)
    root = int(np.flatnonzero(~joined)[0])
    _answer(backend, root, call, replay, on_joined, bool((flags & Flag.NAN).any()))


def _answer(
    backend: Backend,
    root: int,
    call: Describe,
    replay: ReplayOf,
    on_joined: Callable[[], None] | None,
    flagged: bool,
) -> None:
    """Some rank has joined: send it what this call sends next, or raise `RankJoinedError`.

    `root`, the lowest rank that has not joined, sends the replay (given whether some rank
    raised `Flag.NAN`); every rank receives it.
    """
    mine = replay(flagged) if replay is not None and backend.rank == root else None
    if backend.broadcast_object(mine, root) is None:
        collective = (call if isinstance(call, Mapping) else call()).get("collective")
        raise RankJoinedError(
            f"{collective} cannot run while some ranks have joined (dp.join: they ran out of "
            "data): a rank that has joined answers reductions (allreduce, reducescatter, "
            "gradient steps) and barriers with zeros, nothing else. Make this call before "
            "any rank joins, or after every rank has (when dp.join returns)."
        )
    if on_joined is not None:
        on_joined()


def joined_round(backend: Backend, newcomer: bool) -> tuple[bool, int, Replay | None]:
    """Take part in the next handshake as a rank that has joined (`dp.join`).

    Returns whether every rank has joined, the rank that joined last (then; -1 otherwise), and
    what the working ranks send next, to be made on zeros (None: nothing, or a mismatch among
    them, which they raise).
    """
    b = backend
    settle(b, joining=True)
    if b.size > GATHER_LIMIT:
        bounds = np.zeros(1, BOUNDS)
        bounds[0] = (NO_DIGEST, NO_DIGEST, 0, 1, 0, b.rank if newcomer else -1, NO_DIGEST)
        b.allreduce(bounds.view(np.int64), ReduceOp.MAX)
        seen = bounds[0]
        if not seen["working"]:
            return True, int(seen["newcomer"]), None
        if seen["high"] != -seen["neg_low"]:  # the others disagree: they exchange, then raise
            b.allgather_object(None)
            return False, -1, None
        return False, -1, b.broadcast_object(None, int(-seen["neg_first_working"]))
    records = Records(b.size, 0)  # no call: its digest is none of theirs
    records.flags[0] = Flag.JOINED | (Flag.NEWCOMER if newcomer else 0)
    b.allgather(records.sent, records.received)
    rows = records.rows
    flags = rows["flags"]
    joined = (flags & Flag.JOINED) != 0
    if joined.all():
        return True, int(np.flatnonzero(flags & Flag.NEWCOMER)[-1]), None
    digests = rows["digest"][~joined]
    if (digests != digests[0]).any():
        b.allgather_object(None)
        return False, -1, None
    return False, -1, b.broadcast_object(None, int(np.flatnonzero(~joined)[0]))


def verify_same_call(
    backend: Backend,
    call: Describe,
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
        summary = repr(sorted((call if isinstance(call, Mapping) else call()).items()))
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

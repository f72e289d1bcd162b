"""Input validation and collective mismatch detection (`dataparallel.protocol`).

The mismatch tests make the ranks call collectives differently on purpose: every rank must raise
`CollectiveMismatchError` naming the ranks and what differs, and the next collective must work.
They need two ranks or more; the message itself is also tested on a simulated world of three.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from typing import Any

import numpy as np
import pytest

import dataparallel as dp
import dataparallel.world as world_module
from dataparallel.arrays.actions import parse_op, reduction_error, validate_reduction
from dataparallel.backends.base import Backend, DoneHandle, Handle, ReduceOp
from dataparallel.protocol import (
    BOUNDS,
    RECORD,
    Flag,
    Records,
    new_record,
    verify_same_call,
)


def test_parse_op() -> None:
    assert parse_op("sum") == (ReduceOp.SUM, False)
    assert parse_op("avg") == (ReduceOp.SUM, True)
    assert parse_op("prod") == (ReduceOp.PROD, False)
    assert parse_op("min") == (ReduceOp.MIN, False)
    assert parse_op("max") == (ReduceOp.MAX, False)
    with pytest.raises(ValueError, match=r"op='SUM' is not a reduction: use one of \('sum', "):
        parse_op("SUM")


@pytest.mark.parametrize("dtype", ["int8", "uint64", "bool"])
def test_integers_reject_avg_and_fractional_scale(dtype: str) -> None:
    assert "op='avg'" in (reduction_error(dtype, "avg", None) or "")
    assert "scale=0.5 cannot be applied" in (reduction_error(dtype, "sum", 0.5) or "")
    assert reduction_error(dtype, "sum", None) is None
    assert reduction_error(dtype, "max", None) is None
    with pytest.raises(TypeError, match=r"^grads\['w'\]: op='avg' on \w+ values would truncate"):
        validate_reduction(dtype, "avg", None, "grads['w']")


def test_integral_scale_is_accepted_on_integers_but_not_on_bool() -> None:
    assert reduction_error("int32", "sum", 2.0) is None
    assert reduction_error("int32", "sum", 3) is None
    assert "scale=2 cannot be applied to bool values" in (reduction_error("bool", "sum", 2) or "")


@pytest.mark.parametrize("op", ["min", "max"])
def test_complex_rejects_min_and_max(op: str) -> None:
    assert f"op={op!r} is not defined for complex values" in (
        reduction_error("complex64", op, None) or ""
    )
    assert reduction_error("complex128", "avg", 0.5) is None


@pytest.mark.parametrize("dtype", ["float16", "bfloat16", "float32", "float64", "complex64"])
def test_floats_accept_every_op_and_scale(dtype: str) -> None:
    for op in ("sum", "prod", "avg") + (("min", "max") if "complex" not in dtype else ()):
        assert reduction_error(dtype, op, 0.25) is None


# --- verify_same_call on a simulated world of three -----------------------------------------


class Simulated(Backend):
    """Rank 0 of a world of three whose peers made the calls in `peers`."""

    name = "simulated"

    def __init__(self, peers: list[dict[str, Any]]) -> None:
        self.rank, self.size, self.local_rank, self.local_size = 0, 3, 0, 3
        self.peers = peers
        self.log: list[str] = []

    @classmethod
    def create(cls, **kwargs: Any) -> Simulated:
        raise NotImplementedError

    def allreduce(self, buf: Any, op: ReduceOp) -> None:
        self.log.append(f"allreduce {op.value} {buf.dtype}[{buf.size}]")
        if any(peer != self.peers[0] for peer in self.peers):
            buf[0] += 1  # the largest hash differs from the smallest

    def allgather(self, send: Any, recv: Any) -> None:
        self.log.append(f"allgather {send.dtype}[{send.size}]")
        rows = recv.reshape(self.size, -1)
        rows[...] = send
        for rank, peer in enumerate(self.peers):
            if peer != self.peers[0]:
                rows[rank, 0] ^= 1  # another call: another hash

    def allgather_object(self, obj: Any) -> list[Any]:
        self.log.append("allgather_object")
        return [obj, *self.peers[1:]]

    def iallreduce(self, buf: Any, op: ReduceOp) -> Handle:
        raise NotImplementedError

    def reduce(self, buf: Any, op: ReduceOp, root: int) -> None:
        raise NotImplementedError

    def broadcast(self, buf: Any, root: int) -> None:
        raise NotImplementedError

    def ibroadcast(self, buf: Any, root: int) -> Handle:
        return DoneHandle()

    def allgatherv(self, send: Any, recv: Any, counts: list[int]) -> None:
        raise NotImplementedError

    def broadcast_object(self, obj: Any, root: int) -> Any:
        raise NotImplementedError

    def barrier(self) -> None:
        raise NotImplementedError

    def abort(self, code: int = 1) -> None:
        raise NotImplementedError


CALL = {"collective": "allreduce", "op": "sum", "x['w']": "float32[3]"}


def test_a_record_is_named_fields_in_little_endian_order() -> None:
    """What ranks exchange is laid out the same on every host: the digest, the flags, the payload,
    each in its place, little-endian, whatever writes it (`new_record`, `Records`)."""
    assert RECORD.itemsize == 64 and RECORD.names == ("digest", "flags", "payload")
    digest, flags = 0x0102030405060708, Flag.JOINED | Flag.NEWCOMER
    made = new_record(digest, flags)
    made["payload"][0][:2] = [0xAA, 0xBB]
    raw = made.view(np.uint8).tobytes()
    assert raw[:8] == digest.to_bytes(8, "little") and raw[8:16] == int(flags).to_bytes(8, "little")
    assert raw[16:18] == b"\xaa\xbb" and raw[18:] == bytes(46)
    records = Records(3, digest)
    records.flags[0] = flags
    records.payload[:2] = [0xAA, 0xBB]
    assert records.sent.tobytes() == raw and records.received.nbytes == 3 * 64
    assert int(made["flags"][0]) & Flag.NAN == 0 and Flag(int(made["flags"][0])) == flags


def test_bounds_are_named_int64_slots() -> None:
    """Worlds over 64 ranks reduce `BOUNDS` with MAX: seven named int64 slots, one vector."""
    assert BOUNDS.itemsize == 7 * 8 and all(BOUNDS[name] == np.int64 for name in BOUNDS.names)
    bounds = np.zeros(1, BOUNDS)
    bounds["neg_first_working"] = -3
    assert bounds.view(np.int64)[BOUNDS.names.index("neg_first_working")] == -3


def test_matching_calls_cost_one_small_allgather() -> None:
    backend = Simulated([CALL, CALL, CALL])
    verify_same_call(backend, CALL)
    assert backend.log == ["allgather uint8[64]"]


def test_a_lazy_description_is_only_built_on_a_mismatch() -> None:
    built = []

    def describe() -> dict[str, Any]:
        built.append(1)
        return CALL

    verify_same_call(Simulated([CALL] * 3), describe, summary="same")
    assert built == []
    with pytest.raises(dp.CollectiveMismatchError):
        verify_same_call(Simulated([CALL, CALL, {**CALL, "op": "max"}]), describe, summary="x")
    assert built == [1]


def test_mismatch_message_names_ranks_and_fields() -> None:
    peers = [CALL, {**CALL, "x['w']": "float32[4]"}, {**CALL, "x['w']": "float32[4]"}]
    with pytest.raises(dp.CollectiveMismatchError) as info:
        verify_same_call(Simulated(peers), CALL)
    assert str(info.value).startswith("Ranks called allreduce with different arguments:\n")
    assert "  x['w']: float32[3] on rank 0; float32[4] on ranks 1, 2\n" in str(info.value)
    assert "op:" not in str(info.value)  # fields that agree are not listed


def test_mismatch_message_for_different_collectives_and_absent_fields() -> None:
    other = {"collective": "broadcast", "root": 0, "x['w']": "float32[3]"}
    with pytest.raises(dp.CollectiveMismatchError) as info:
        verify_same_call(Simulated([CALL, other, CALL]), CALL)
    message = str(info.value)
    assert message.startswith("Ranks called different collectives (allreduce, broadcast):")
    assert "  collective: allreduce on ranks 0, 2; broadcast on rank 1" in message
    assert "  op: sum on ranks 0, 2; <absent> on rank 1" in message
    assert "  root: <absent> on ranks 0, 2; 0 on rank 1" in message


def test_many_differences_are_summarized() -> None:
    mine = {"collective": "allreduce", **{f"x[{i}]": "float32[1]" for i in range(20)}}
    theirs = {"collective": "allreduce", **{f"x[{i}]": "float32[2]" for i in range(20)}}
    with pytest.raises(dp.CollectiveMismatchError, match=r"\.\.\. and 12 more differences"):
        verify_same_call(Simulated([mine, theirs, theirs]), mine)


# --- real mismatches (two ranks or more) ----------------------------------------------------


@pytest.fixture
def others(size: int) -> str:
    """Return how a message names every rank but 0."""
    if size == 1:
        pytest.skip("a mismatch needs two ranks or more")
    listed = ", ".join(map(str, range(1, size))) if size <= 3 else f"1-{size - 1}"  # a range
    return ("rank " if size == 2 else "ranks ") + listed


def expect_mismatch(call: Callable[[], Any], *fragments: str) -> str:
    """Check that `call` raises CollectiveMismatchError with `fragments`, then that dp works."""
    with pytest.raises(dp.CollectiveMismatchError) as info:
        call()
    message = str(info.value)
    for fragment in fragments:
        assert fragment in message, f"{fragment!r} not in:\n{message}"
    assert "Every rank must make the same collective calls" in message
    size = dp.size()
    assert dp.allreduce(np.ones(2))[0] == size  # the world stays usable
    return message


def test_different_shapes(rank: int, others: str) -> None:
    x = {"w": np.zeros(2 if rank == 0 else 3)}
    expect_mismatch(
        lambda: dp.allreduce(x),
        "Ranks called allreduce with different arguments",
        f"x['w']: float64[2] on rank 0; float64[3] on {others}",
    )


def test_different_dtypes(rank: int, others: str) -> None:
    x = [np.zeros(2, np.float32 if rank == 0 else np.float64)]
    expect_mismatch(lambda: dp.broadcast(x), f"x[0]: float32[2] on rank 0; float64[2] on {others}")


def test_different_tree_structures(rank: int, others: str) -> None:
    x = {"a": 1.0} if rank == 0 else {"b": 1.0}
    expect_mismatch(
        lambda: dp.allreduce(x),
        "tree structure:",
        f"x['a']: float64[] on rank 0; <absent> on {others}",
        f"x['b']: <absent> on rank 0; float64[] on {others}",
    )


def test_different_ops(rank: int, others: str) -> None:
    op = "sum" if rank == 0 else "max"
    expect_mismatch(lambda: dp.allreduce(np.ones(2), op=op), f"op: sum on rank 0; max on {others}")


def test_different_scales(rank: int, others: str) -> None:
    scale = None if rank == 0 else 2.0
    expect_mismatch(
        lambda: dp.allreduce(1.0, scale=scale), f"scale: None on rank 0; 2.0 on {others}"
    )


def test_different_roots(rank: int, others: str) -> None:
    root = 0 if rank == 0 else 1
    expect_mismatch(lambda: dp.reduce(np.ones(2), root=root), f"root: 0 on rank 0; 1 on {others}")
    expect_mismatch(
        lambda: dp.broadcast(np.ones(2), root=root), f"root: 0 on rank 0; 1 on {others}"
    )
    expect_mismatch(lambda: dp.broadcast_object("o", root=root), "broadcast_object")


def test_different_collectives(rank: int, others: str) -> None:
    def call() -> Any:
        return dp.allreduce(np.ones(2)) if rank == 0 else dp.broadcast(np.ones(2))

    expect_mismatch(
        call,
        "Ranks called different collectives (allreduce, broadcast)",
        f"collective: allreduce on rank 0; broadcast on {others}",
    )
    expect_mismatch(
        lambda: dp.barrier() if rank == 0 else dp.allgather_object(1),
        "Ranks called different collectives (allgather_object, barrier)",
    )
    expect_mismatch(
        lambda: dp.allreduce(1.0) if rank == 0 else dp.iallreduce(1.0).wait(),
        "Ranks called different collectives (allreduce, iallreduce)",
    )


def test_allgather_allows_a_different_first_axis_only(rank: int, size: int, others: str) -> None:
    out = dp.allgather(np.zeros((rank + 1, 2)))
    assert out.shape == (size * (size + 1) // 2, 2)
    expect_mismatch(
        lambda: dp.allgather(np.zeros((1, 2 + (rank > 0)))),
        f"x: float64['*', 2] on rank 0; float64['*', 3] on {others}",
    )


def counted(monkeypatch: pytest.MonkeyPatch) -> list[str]:
    """Record every allgather and allreduce the active backend makes from now on."""
    backend = world_module.current().backend
    calls: list[str] = []
    for name in ("allgather", "allreduce"):
        real = getattr(backend, name)

        def counting(*args: Any, real: Callable[..., None] = real, name: str = name) -> None:
            calls.append(name)
            real(*args)

        monkeypatch.setattr(backend, name, counting)
    return calls


def test_small_payloads_travel_with_the_check(size: int, monkeypatch: pytest.MonkeyPatch) -> None:
    calls = counted(monkeypatch)
    out = dp.allreduce({"loss": np.float32(1.5), "n": np.ones(3, np.int64)})
    assert out["loss"] == 1.5 * size and out["n"].tolist() == [size] * 3
    assert calls == (["allgather"] if size > 1 else ["allreduce"] * 2)
    calls.clear()
    dp.allreduce(np.ones(100))  # 800 bytes: the handshake, then the payload
    assert calls == (["allgather", "allreduce"] if size > 1 else ["allreduce"])


def test_check_off_keeps_the_guard(rank: int, others: str, monkeypatch: pytest.MonkeyPatch) -> None:
    active = world_module.current()
    monkeypatch.setattr(active, "settings", dataclasses.replace(active.settings, check=False))
    calls = counted(monkeypatch)
    out = dp.allreduce(np.ones(3))
    assert calls == ["allgather"]
    np.testing.assert_array_equal(out, np.full(3, float(dp.size())))
    # What decides the messages is still compared: dtypes, sizes (the explanation is complete).
    x = np.ones(200, np.float32 if rank == 0 else np.float64)
    expect_mismatch(lambda: dp.allreduce(x), f"x: float32[200] on rank 0; float64[200] on {others}")
    expect_mismatch(lambda: dp.allreduce(np.ones(200 + (rank > 0))), "x: float64[200] on rank 0")
    # Shapes of equal size are not compared with the checks off.
    out = dp.allreduce(np.ones((2, 3) if rank == 0 else (3, 2)))
    assert out.sum() == 6 * dp.size()

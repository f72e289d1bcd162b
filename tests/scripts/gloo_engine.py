"""Checks of the Gloo engine itself, over flat buffers, at any world size.

`check_engine(backend)` exercises what the Gloo backend does beyond plain `torch.distributed`
calls: integer dtypes Gloo lacks (int16, uint16 widened; uint32, uint64 viewed as signed, with the
sign bit flipped for min/max), complex products, `reduce` leaving non-root buffers untouched,
`allgatherv` with uneven and zero counts, 0-d and empty buffers, non-blocking requests, objects.
Every rank computes what every other rank sent, so each result is checked exactly.

Used by `tests/test_gloo.py`, on the active world when it is Gloo.
"""

from __future__ import annotations

from typing import Any

import numpy as np

from dataparallel.backends.base import Backend, ReduceOp

INTEGERS = ("int8", "int16", "int32", "int64", "uint8", "uint16", "uint32", "uint64")
FLOATS = ("float16", "float32", "float64")
COMPLEX = ("complex64", "complex128")


def rank_values(dtype: str, rank: int) -> np.ndarray:
    """Return rank `rank`'s 6 values of `dtype`, chosen to wrap, hit sign bits and stay exact."""
    dt = np.dtype(dtype)
    if dt.kind in "iu":
        info = np.iinfo(dt)
        # near the top (sums wrap; unsigned values have their top bit set), small, and zero
        values = [info.max - rank, info.max // 2 + rank, rank + 2, 3, 0, info.min + rank]
        return np.array(values, dtype=object).astype(dt)
    if dt.kind == "c":
        return np.array([1 + 1j, rank - 2j, 0.5, -rank, 2j, 1], dtype=dt)
    return np.array([rank + 1, -rank, 0.5 * rank, 2.0, -1.5, 4 - rank], dtype=dt)


def expected(dtype: str, op: ReduceOp, size: int) -> np.ndarray:
    """Return the reduction of every rank's `rank_values`, in the dtype's own arithmetic."""
    every = np.stack([rank_values(dtype, r) for r in range(size)])
    with np.errstate(over="ignore"):
        if op is ReduceOp.SUM:
            return every.sum(axis=0, dtype=dtype)
        if op is ReduceOp.PROD:
            return every.prod(axis=0, dtype=dtype)
        if op is ReduceOp.MIN:
            return every.min(axis=0)
        return every.max(axis=0)


def _same(got: np.ndarray, want: np.ndarray, what: str) -> None:
    assert got.dtype == want.dtype, f"{what}: dtype {got.dtype}, expected {want.dtype}"
    if got.dtype.kind in "iub":
        assert np.array_equal(got, want), f"{what}: {got} != {want}"
    else:
        np.testing.assert_allclose(got, want, rtol=1e-3, err_msg=what)


def check_reductions(b: Backend) -> None:
    """Check allreduce, iallreduce and reduce for every dtype and op, against NumPy."""
    for dtype in INTEGERS + FLOATS + COMPLEX:
        ops = [ReduceOp.SUM, ReduceOp.PROD]
        if not dtype.startswith("complex"):
            ops += [ReduceOp.MIN, ReduceOp.MAX]
        for op in ops:
            want = expected(dtype, op, b.size)
            what = f"{dtype} {op.value}"
            buf = rank_values(dtype, b.rank)
            b.allreduce(buf, op)
            _same(buf, want, f"allreduce {what}")
            buf = rank_values(dtype, b.rank)
            request = b.iallreduce(buf, op)
            request.wait()
            assert request.test(), f"iallreduce {what}: test() after wait() must be True"
            _same(buf, want, f"iallreduce {what}")
            for root in {0, b.size - 1}:
                buf = rank_values(dtype, b.rank)
                b.reduce(buf, op, root)
                mine = want if b.rank == root else rank_values(dtype, b.rank)
                _same(buf, mine, f"reduce {what} root={root} on rank {b.rank}")


def check_bool_as_uint8(b: Backend) -> None:
    """Check `Fusion`'s bool encoding: uint8 with MAX (or) and MIN (and)."""
    mine = np.array([b.rank == 0, True, False], dtype=bool).view(np.uint8).copy()
    b.allreduce(mine, ReduceOp.MAX)
    assert mine.tolist() == [1, 1, 0]
    mine = np.array([b.rank == 0, True, False], dtype=bool).view(np.uint8).copy()
    b.allreduce(mine, ReduceOp.MIN)
    assert mine.tolist() == [int(b.size == 1), 1, 0]


def check_shapes(b: Backend) -> None:
    """Check 0-d and empty buffers, and the errors for read-only and strided ones."""
    zero_d = np.array(b.rank + 1.0)
    b.allreduce(zero_d, ReduceOp.SUM)
    assert float(zero_d) == b.size * (b.size + 1) / 2
    empty = np.empty(0, np.float32)
    b.allreduce(empty, ReduceOp.SUM)
    b.broadcast(empty, 0)
    b.iallreduce(empty, ReduceOp.MAX).wait()
    scalar = np.array(b.rank, np.uint16)
    b.broadcast(scalar, b.size - 1)
    assert int(scalar) == b.size - 1
    read_only = np.ones(3)
    read_only.flags.writeable = False
    for call in (lambda: b.allreduce(read_only, ReduceOp.SUM), lambda: b.broadcast(read_only, 0)):
        try:
            call()
        except ValueError as exc:
            assert "read-only" in str(exc), exc
        else:
            raise AssertionError("a read-only buffer must raise ValueError")
    try:
        b.allreduce(np.ones((4, 4))[:, 0], ReduceOp.SUM)
    except ValueError as exc:
        assert "contiguous" in str(exc), exc
    else:
        raise AssertionError("a strided buffer must raise ValueError")


def check_movement(b: Backend) -> None:
    """Check broadcast, ibroadcast and allgatherv of raw data in several dtypes."""
    for root in range(b.size):
        for dtype in ("uint16", "float64", "complex64", "int8"):
            buf = np.full(5, b.rank, dtype=dtype)
            b.broadcast(buf, root)
            assert np.array_equal(buf, np.full(5, root, dtype=dtype)), (dtype, root, buf)
        buf = np.arange(7, dtype=np.float32) * (b.rank + 1)
        request = b.ibroadcast(buf, root)
        request.wait()
        assert request.test()
        assert np.array_equal(buf, np.arange(7, dtype=np.float32) * (root + 1))
    patterns: list[list[int]] = [
        [3] * b.size,  # equal: gathered in place
        [r + 1 for r in range(b.size)],  # uneven: padded
        [0 if r % 2 else 2 for r in range(b.size)],  # some ranks send nothing
        [0] * b.size,
    ]
    for counts in patterns:
        send = np.arange(counts[b.rank], dtype=np.float64) + 100 * b.rank
        send.flags.writeable = False  # a send buffer may be read-only
        recv = np.full(sum(counts), -1.0)
        b.allgatherv(send, recv, counts)
        want = np.concatenate(
            [np.arange(c, dtype=np.float64) + 100 * r for r, c in enumerate(counts)]
        )
        assert np.array_equal(recv, want), (counts, recv, want)


def check_objects(b: Backend) -> None:
    """Check object broadcast and gather, and the barrier."""
    for root in range(b.size):
        got = b.broadcast_object({"from": b.rank, "data": [b.rank] * 3}, root)
        assert got == {"from": root, "data": [root] * 3}
    everyone: list[Any] = b.allgather_object(("rank", b.rank))
    assert everyone == [("rank", r) for r in range(b.size)]
    b.barrier()


def check_engine(b: Backend) -> None:
    """Run every check above on backend `b`; raises AssertionError on the first failure."""
    assert b.name == "gloo", b
    assert 0 <= b.local_rank < b.local_size <= b.size
    check_reductions(b)
    check_bool_as_uint8(b)
    check_shapes(b)
    check_movement(b)
    check_objects(b)


if __name__ == "__main__":
    import dataparallel as dp

    backend = dp.initialize("gloo")
    check_engine(backend)
    print(f"ENGINE OK rank={backend.rank} size={backend.size}", flush=True)
    dp.finalize()

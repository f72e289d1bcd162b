"""Flashlight's reducers over `Fusion`: when they communicate, and what they leave behind.

Communication calls are observed by wrapping the active backend's `allreduce`/`iallreduce`, so
the tests see the number, order and size of the buffers the engine actually sends.
"""

from __future__ import annotations

from typing import Any

import numpy as np
import pytest
import torch

import dataparallel as dp
import dataparallel.world as world_module
from dataparallel.backends.base import Handle, ReduceOp

jnp = pytest.importorskip("jax.numpy")


class Sent:
    """The buffers handed to the engine, in order."""

    def __init__(self) -> None:
        self.buffers: list[np.ndarray] = []

    @property
    def sizes(self) -> list[int]:
        return [b.size for b in self.buffers]


@pytest.fixture
def sent(world: Any, monkeypatch: pytest.MonkeyPatch) -> Sent:
    """Record every buffer the engine reduces from now on (mismatch checks excluded)."""
    record = Sent()
    backend = world_module.current().backend
    blocking, nonblocking = backend.allreduce, backend.iallreduce

    def allreduce(buf: Any, op: ReduceOp) -> None:
        record.buffers.append(buf)
        blocking(buf, op)

    def iallreduce(buf: Any, op: ReduceOp) -> Handle:
        record.buffers.append(buf)
        return nonblocking(buf, op)

    monkeypatch.setattr(backend, "allreduce", allreduce)
    monkeypatch.setattr(backend, "iallreduce", iallreduce)
    return record


def full(n: int, rank: int, dtype: Any = np.float64) -> np.ndarray:
    return np.full(n, rank + 1, dtype)


def test_inline_reducer_reduces_at_once(rank: int, size: int, sent: Sent) -> None:
    reducer = dp.InlineReducer(scale=0.5)
    a, t = full(3, rank), torch.full((2, 2), float(rank + 1))
    reducer.add(a)
    assert sent.sizes == [3] and reducer.calls == 1
    np.testing.assert_array_equal(a, np.full(3, 0.5 * size * (size + 1) / 2))
    reducer.add(t)
    assert sent.sizes == [3, 4]
    assert torch.equal(t, torch.full((2, 2), 0.5 * size * (size + 1) / 2))
    reducer.finalize()
    assert reducer.calls == 2  # finalize has nothing left to do


def test_inline_reducer_default_scale_is_a_plain_sum(rank: int, size: int) -> None:
    x = np.full(2, rank + 1, np.int32)
    dp.InlineReducer().add(x)
    np.testing.assert_array_equal(x, np.full(2, size * (size + 1) // 2, np.int32))
    with pytest.raises(TypeError, match=r"scale=0\.5 cannot be applied to int32 values"):
        dp.InlineReducer(scale=0.5).add(x)


@pytest.mark.parametrize("scale", ["0.5", 1j])
def test_reducers_reject_a_scale_that_is_not_a_real_number(scale: Any, rank: int) -> None:
    with pytest.raises(TypeError, match=r"scale=.* must be a real number"):
        dp.InlineReducer(scale)
    with pytest.raises(TypeError, match=r"scale=.* must be a real number"):
        dp.CoalescingReducer(scale)


def test_coalescing_flush_rules_are_flashlight_s(rank: int, size: int, sent: Sent) -> None:
    arrays = [full(3, rank), full(3, rank), full(3, rank), full(10, rank), full(2, rank)]
    reducer = dp.CoalescingReducer(scale=1.0, bucket_bytes=64)  # 8 float64
    reducer.add(arrays[0])
    reducer.add(arrays[1])  # 48 bytes cached
    assert sent.sizes == [] and reducer.calls == 0
    reducer.add(arrays[2])  # 48 + 24 > 64: the cache is flushed first, then this one is cached
    assert sent.sizes == [6]
    reducer.add(arrays[3])  # 80 > 64: the cache (24 bytes) is flushed, then this one goes alone
    assert sent.sizes == [6, 3, 10]
    reducer.add(arrays[4])
    reducer.finalize()
    assert sent.sizes == [6, 3, 10, 2] and reducer.calls == 4
    for a in arrays:
        np.testing.assert_array_equal(a, np.full(a.size, size * (size + 1) / 2))


def test_a_bucket_filled_exactly_is_not_flushed_early(rank: int, sent: Sent) -> None:
    reducer = dp.CoalescingReducer(bucket_bytes=64)
    reducer.add(full(4, rank))
    reducer.add(full(4, rank))  # 32 + 32 == 64: still fits
    assert sent.sizes == []
    reducer.add(full(1, rank))
    assert sent.sizes == [8]
    reducer.finalize()
    assert sent.sizes == [8, 1]


def test_an_oversize_contiguous_array_is_reduced_in_place(rank: int, size: int, sent: Sent) -> None:
    big = full(100, rank)
    with dp.CoalescingReducer(bucket_bytes=64) as reducer:
        reducer.add(big)
    assert reducer.calls == 1 and np.shares_memory(sent.buffers[0], big)
    np.testing.assert_array_equal(big, np.full(100, size * (size + 1) / 2))


def test_contiguous_false_makes_one_call_per_array(rank: int, size: int, sent: Sent) -> None:
    arrays = [full(2, rank), full(3, rank), torch.full((4,), float(rank + 1))]
    reducer = dp.CoalescingReducer(scale=2.0, contiguous=False)
    for a in arrays:
        reducer.add(a)
    assert sent.sizes == []
    reducer.finalize()
    assert sorted(sent.sizes) == [2, 3, 4] and reducer.calls == 3
    want = 2.0 * size * (size + 1) / 2
    for a in arrays:
        assert np.all(np.asarray(a) == want)


def test_one_call_per_dtype_bucket_whatever_the_family(rank: int, size: int, sent: Sent) -> None:
    arrays: list[Any] = [
        full(2, rank, np.float32),
        full(3, rank, np.float64),
        full(4, rank, np.float32),
        torch.full((5,), float(rank + 1)),
        np.full(2, rank == 0),
    ]
    with dp.CoalescingReducer() as reducer:
        for a in arrays:
            reducer.add(a)
    assert sorted(sent.sizes) == [2, 3, 11] and reducer.calls == 3  # torch and NumPy alike
    total = size * (size + 1) / 2
    for a in arrays[:4]:
        assert np.all(np.asarray(a) == total)
    assert arrays[4].all()  # bool sum is a logical or


@pytest.mark.parametrize("async_op", [True, False])
def test_finalize_completes_everything(async_op: bool, rank: int, size: int) -> None:
    arrays = [full(n, rank, np.float32) for n in (5, 50, 500, 5)]
    reducer = dp.CoalescingReducer(scale=1 / size, async_op=async_op, bucket_bytes=256)
    for a in arrays:
        reducer.add(a)
    reducer.flush()
    reducer.finalize()
    for a in arrays:
        np.testing.assert_allclose(a, np.full(a.size, (size + 1) / 2), rtol=1e-6)
    reducer.finalize()  # a second finalize is harmless
    np.testing.assert_allclose(arrays[0], np.full(5, (size + 1) / 2), rtol=1e-6)


def test_context_manager_finalizes_on_exit(rank: int, size: int) -> None:
    a, t = full(3, rank), torch.full((2, 3), float(rank + 1)).T  # a transposed view
    with dp.CoalescingReducer(scale=3.0) as reducer:
        reducer.add(a)
        reducer.add(t)
    assert isinstance(reducer, dp.CoalescingReducer)
    want = 3.0 * size * (size + 1) / 2
    np.testing.assert_array_equal(a, np.full(3, want))
    assert torch.equal(t, torch.full((3, 2), want))


def test_coalescing_reducer_ops(rank: int, size: int) -> None:
    a, b = full(3, rank, np.float32), full(3, rank, np.int16)
    with dp.CoalescingReducer(op="avg") as reducer:
        reducer.add(a)
    np.testing.assert_allclose(a, np.full(3, (size + 1) / 2), rtol=1e-6)
    with dp.CoalescingReducer(op="max") as reducer:
        reducer.add(b)
    np.testing.assert_array_equal(b, np.full(3, size, np.int16))
    with pytest.raises(TypeError, match=r"op='avg' on int16 values"):
        dp.CoalescingReducer(op="avg").add(b)
    with pytest.raises(ValueError, match=r"op='mean' is not a reduction"):
        dp.CoalescingReducer(op="mean")


def test_bfloat16_and_float16_tensors(rank: int, size: int) -> None:
    bf, half = torch.full((4,), rank + 1.0, dtype=torch.bfloat16), full(4, rank, np.float16)
    with dp.CoalescingReducer(scale=0.5) as reducer:
        reducer.add(bf)
        reducer.add(half)
    want = 0.5 * size * (size + 1) / 2
    assert bf.dtype == torch.bfloat16 and torch.equal(bf.float(), torch.full((4,), want))
    np.testing.assert_array_equal(half, np.full(4, want, np.float16))


@pytest.mark.parametrize("reducer_type", [dp.InlineReducer, dp.CoalescingReducer])
def test_immutable_values_are_refused(reducer_type: type[dp.Reducer]) -> None:
    reducer = reducer_type()
    for value in (jnp.ones(2), 1.0, np.float32(2)):
        with pytest.raises(
            TypeError, match=r"takes mutable arrays .* `x = dp\.allreduce\(x\)` for JAX"
        ):
            reducer.add(value)
    with pytest.raises(TypeError, match=r"^x: expected an array"):
        reducer.add("text")


def test_buffers_are_reused_across_flushes(rank: int, sent: Sent) -> None:
    reducer = dp.CoalescingReducer(async_op=False, bucket_bytes=64)
    arrays = [full(3, rank) for _ in range(6)]
    for a in arrays:
        reducer.add(a)
    reducer.finalize()
    assert sent.sizes == [6, 6, 6]
    first, second, third = sent.buffers
    assert np.shares_memory(first, second) and np.shares_memory(second, third)
    # ...and across reducers: the pool belongs to the world.
    with dp.CoalescingReducer(bucket_bytes=64) as again:
        again.add(full(3, rank))
        again.add(full(3, rank))
    assert np.shares_memory(sent.buffers[3], first)


def test_bucket_bytes_defaults_to_the_setting(world: Any) -> None:
    assert dp.CoalescingReducer().bucket_bytes == world_module.current().settings.bucket_bytes
    assert dp.CoalescingReducer(bucket_bytes=1000).bucket_bytes == 1000


def test_read_only_arrays_are_refused(rank: int) -> None:
    frozen = full(3, rank)
    frozen.flags.writeable = False
    with pytest.raises(TypeError, match=r"takes writable arrays, .* got a read-only NumPy array"):
        dp.CoalescingReducer().add(frozen)


def test_bucket_bytes_must_be_positive() -> None:
    with pytest.raises(ValueError, match=r"bucket_bytes=0 must be positive"):
        dp.CoalescingReducer(bucket_bytes=0)


def test_byte_swapped_arrays_are_staged_and_written_back(rank: int, size: int) -> None:
    swapped = np.full(3, 1000 + rank, ">i4")
    with dp.CoalescingReducer() as reducer:
        reducer.add(swapped)
    assert swapped.dtype == np.dtype(">i4")
    np.testing.assert_array_equal(swapped, np.full(3, 1000 * size + size * (size - 1) // 2))

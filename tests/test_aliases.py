"""Leaves of one call over the same memory are each reduced once (`arrays/aliases.py`).

`[a, a]`, `{"x": a, "y": a, "z": a[:]}`, overlapping views, torch tensors and their views, the
non-blocking form and Horovod's grouped in-place allreduce: every alias ends with the value
reduced once from what the ranks held when the call began, at sizes below, at and above the
bucket size (where a leaf is reduced in place on its own). Rank r holds `r + 1.5` everywhere.
"""

from __future__ import annotations

import numpy as np
import pytest

import dataparallel as dp
from dataparallel.arrays.aliases import overlapping
from dataparallel.config import DEFAULT_BUCKET_BYTES

torch = pytest.importorskip("torch")

# Float64 items: inline, one bucket, at the bucket size, one past it, well past it.
SIZES = [3, 10_000, DEFAULT_BUCKET_BYTES // 8, DEFAULT_BUCKET_BYTES // 8 + 1, 100_000]


def _expected(size: int, op: str = "sum") -> float:
    values = [r + 1.5 for r in range(size)]
    if op == "avg":
        return sum(values) / size
    return {"sum": sum, "max": max, "min": min, "prod": np.prod}[op](values)


def test_overlapping_finds_every_alias_but_the_first() -> None:
    a, b = np.zeros(100), np.zeros(100)
    assert overlapping([a, b, a]) == [2]
    assert overlapping([a[50:], a[:60], b, a[60:]]) == [1, 3]  # one group, the earliest kept
    assert overlapping([a[:50], a[50:], b[::2], b[1::2][:1]]) == [3]  # bounds: conservative
    assert overlapping([a, np.zeros(0), a[:0]]) == []  # empty arrays hold no memory
    assert overlapping([torch.zeros(3), a, 1.0]) == []  # host arrays only


@pytest.mark.parametrize("n", SIZES)
@pytest.mark.parametrize("op", ["sum", "avg", "max"])
def test_the_same_array_twice_is_reduced_once(rank: int, size: int, n: int, op: str) -> None:
    a = np.full(n, rank + 1.5)
    out = dp.allreduce([a, a], op=op)
    assert out[0] is a and out[1] is a
    np.testing.assert_allclose(a, _expected(size, op))
    a = np.full(n, rank + 1.5)
    out = dp.allreduce({"x": a, "y": a, "z": a[:]})
    assert out["x"] is a and out["y"] is a
    np.testing.assert_allclose(a, _expected(size))


@pytest.mark.parametrize("n", SIZES)
def test_overlapping_views_reduce_their_union_once(rank: int, size: int, n: int) -> None:
    a = np.full(2 * n, rank + 1.5)
    dp.allreduce([a[: n + n // 5 + 1], a[n - n // 5 :]])
    np.testing.assert_allclose(a, _expected(size))
    b = np.full(2 * n, rank + 1.5)  # small before large: the small one is packed after
    dp.allreduce({"a": b[:2], "b": b, "c": np.full(n, rank + 1.5)})
    np.testing.assert_allclose(b, _expected(size))
    c = np.full((n, 2), rank + 1.5)  # strided views of the same rows
    dp.allreduce([c[:, 0], c, c.T])
    np.testing.assert_allclose(c, _expected(size))


@pytest.mark.parametrize("n", SIZES)
def test_in_flight_and_gradients_and_reduce(rank: int, size: int, n: int) -> None:
    a = np.full(n, rank + 1.5)
    request = dp.iallreduce([a, a, a[: n // 2]])
    request.wait()
    np.testing.assert_allclose(a, _expected(size))
    g = np.full(n, rank + 1.5)
    dp.allreduce_gradients([g, g], op="sum")
    np.testing.assert_allclose(g, _expected(size))
    r = np.full(n, rank + 1.5)
    dp.reduce([r, r], root=size - 1)
    np.testing.assert_allclose(r, _expected(size) if rank == size - 1 else rank + 1.5)


@pytest.mark.parametrize("n", SIZES)
def test_torch_tensors_and_their_views(rank: int, size: int, n: int) -> None:
    t = torch.full((n,), rank + 1.5)
    out = dp.allreduce([t, t])
    assert out[0] is t and out[1] is t
    torch.testing.assert_close(t, torch.full((n,), _expected(size)))
    t = torch.full((n, 1), rank + 1.5, dtype=torch.float64)
    dp.allreduce([t, t.view(-1), {"n": np.ones(3)}])
    torch.testing.assert_close(t, torch.full((n, 1), _expected(size), dtype=torch.float64))
    u = torch.full((n,), rank + 1.5)
    dp.iallreduce((u, u[1:]), op="avg").wait()
    torch.testing.assert_close(u, torch.full((n,), _expected(size, "avg")))


@pytest.mark.parametrize("n", SIZES)
def test_horovod_grouped_in_place(rank: int, size: int, n: int) -> None:
    hvd = pytest.importorskip("dataparallel.horovod.torch")
    hvd.init()
    t = torch.full((n,), rank + 1.5)
    hvd.grouped_allreduce_([t, t], op=hvd.Sum)
    torch.testing.assert_close(t, torch.full((n,), _expected(size)))
    handle = hvd.grouped_allreduce_async_([t, t], op=hvd.Average)
    hvd.synchronize(handle)
    torch.testing.assert_close(t, torch.full((n,), _expected(size)))


@pytest.mark.parametrize("n", SIZES)
def test_horovod_factors_scale_shared_memory_once(rank: int, size: int, n: int) -> None:
    """Horovod's prescale and postscale factors of an in-place call apply once to each element,
    however many of the call's tensors hold it."""
    hvd = pytest.importorskip("dataparallel.horovod.torch")
    hvd.init()
    t = torch.full((n,), rank + 1.5)
    hvd.grouped_allreduce_([t, t], op=hvd.Sum, prescale_factor=0.5, postscale_factor=3.0)
    torch.testing.assert_close(t, torch.full((n,), _expected(size) * 1.5))
    u = torch.full((2 * n,), rank + 1.5, dtype=torch.float64)
    hvd.grouped_allreduce_([u[: n + 1], u[n - 1 :], u], op=hvd.Max, prescale_factor=2.0)
    torch.testing.assert_close(u, torch.full((2 * n,), 2 * _expected(size, "max"), dtype=u.dtype))
    ints = torch.full((n,), rank + 1, dtype=torch.int64)
    hvd.grouped_allreduce_([ints, ints.view(-1)], op=hvd.Sum, postscale_factor=2.0)
    assert ints.tolist() == [2 * sum(r + 1 for r in range(size))] * n


@pytest.mark.parametrize("n", SIZES)
def test_a_reducer_given_the_same_array_twice_reduces_it_once(rank: int, size: int, n: int) -> None:
    a, b = np.full(n, rank + 1.5), torch.full((n,), rank + 1.5)
    with dp.CoalescingReducer(op="sum") as reducer:
        for x in (a, b, a, b.view(-1), np.full(3, 1.0), a[:]):
            reducer.add(x)
    np.testing.assert_allclose(a, _expected(size))
    torch.testing.assert_close(b, torch.full((n,), _expected(size)))
    c = np.full(n + 1, rank + 1.5)
    reducer = dp.CoalescingReducer()
    reducer.add(c[1:])
    with pytest.raises(ValueError, match="shares memory with an array added since the last"):
        reducer.add(c[:-1])  # every rank refuses it, before anything of it is sent
    reducer.finalize()
    np.testing.assert_allclose(c[1:], _expected(size))
    assert c[0] == rank + 1.5


def test_a_reducer_takes_interleaved_views_and_refuses_strided_overlaps(
    rank: int, size: int
) -> None:
    a = np.full((4, 6), rank + 1.5)
    with dp.CoalescingReducer() as reducer:
        reducer.add(a[:, ::2])  # interleaved columns: their byte ranges overlap, not their memory
        reducer.add(a[:, 1::2])
        reducer.add(a[:, ::2])  # the same view again: once
    np.testing.assert_allclose(a, _expected(size))
    b = np.full((4, 6), rank + 1.5)
    reducer = dp.CoalescingReducer()
    reducer.add(b[:, ::2])
    with pytest.raises(ValueError, match="shares memory"):
        reducer.add(b[:2])
    with pytest.raises(ValueError, match="shares memory"):
        reducer.add(b[:, ::4])
    reducer.finalize()
    np.testing.assert_allclose(b[:, ::2], _expected(size))
    np.testing.assert_allclose(b[:, 1::2], rank + 1.5)

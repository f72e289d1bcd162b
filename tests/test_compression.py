"""Compression (`dp.Compression.fp16`, `.bf16`): values travel in 16 bits, come back in their dtype.

Each rank draws its values from a seed, so every rank can compute the exact float64 reduction of
every rank's values; a compressed result must stay within the rounding bound of its wire dtype
(`(size + 2) * eps * sum |x_r|`: the rounding of each input, of each step of the reduction, and of
the result), and differ from the exact result somewhere (it really went through 16 bits). What
the engine is handed is recorded too: 16-bit buffers only.
"""

from __future__ import annotations

import copy
import sys
from collections.abc import Iterator
from typing import Any

import numpy as np
import pytest
import torch
from _families import ARRAY_FAMILIES, FLOATING, Family, as_float, usable
from _torch_common import OPTIMIZERS, global_batch, loss_of, make_model, share, step_pair

import dataparallel as dp
from dataparallel.backends.base import Backend, ReduceOp
from dataparallel.backends.half import add16, narrow, widen
from dataparallel.errors import CollectiveMismatchError

COMPRESSIONS = {"fp16": dp.Compression.fp16, "bf16": dp.Compression.bf16}
EPS = {"float16": 2.0**-11, "bfloat16": 2.0**-8, "float32": 2.0**-24, "float64": 2.0**-53}
N = 3000  # more than the handshake carries inline, and enough values for rounding to show


def draw(rank: int, salt: int = 0, n: int = N) -> np.ndarray:
    return np.random.default_rng(100 * salt + rank).standard_normal(n)


def bound(size: int, dtype: str, wire: str, salt: int = 0, n: int = N) -> np.ndarray:
    eps = max(EPS[dtype], EPS[wire])
    return (size + 2) * eps * sum(np.abs(draw(r, salt, n)) for r in range(size))


@pytest.fixture
def wires(world: Backend, monkeypatch: pytest.MonkeyPatch) -> Iterator[list[tuple[str, int]]]:
    """Record (dtype, items) of every floating buffer the engines are asked to allreduce (the
    world's, and its private duplicate, where gradient buckets travel: `arrays/comm_thread.py`)."""
    seen: list[tuple[str, int]] = []
    inside = []  # an engine's iallreduce_half may call its own iallreduce: count the call once
    for engine in {world, dp.world.current().private(world)}:
        for name in ("allreduce", "iallreduce"):
            original = getattr(engine, name)

            def recording(buf: Any, op: Any, _original: Any = original) -> Any:
                if not inside and str(buf.dtype).startswith("float"):
                    seen.append((str(buf.dtype), buf.size))
                return _original(buf, op)

            monkeypatch.setattr(engine, name, recording)

        def recording_half(
            buf: Any, op: Any, dtype: str, _half: Any = engine.iallreduce_half
        ) -> Any:
            seen.append((dtype, buf.size))
            inside.append(True)
            try:
                return _half(buf, op, dtype)
            finally:
                inside.pop()

        monkeypatch.setattr(engine, "iallreduce_half", recording_half)
    yield seen


# -- the collectives ----------------------------------------------------------------------------


@pytest.mark.matrix
@pytest.mark.parametrize("family", ARRAY_FAMILIES, ids=repr)
@pytest.mark.parametrize("dtype", FLOATING)
@pytest.mark.parametrize("name", sorted(COMPRESSIONS))
@pytest.mark.parametrize("op", ["sum", "avg"])
def test_values_come_back_in_their_dtype_within_the_wires_rounding(
    family: Family, dtype: str, name: str, op: str, size: int, rank: int
) -> None:
    usable(family)
    if dtype not in family.dtypes:
        pytest.skip(f"{family} has no {dtype}")
    wire = {"fp16": "float16", "bf16": "bfloat16"}[name]
    with family.context():
        x = family.make(draw(rank), dtype)
        out = dp.allreduce(x, op, compression=COMPRESSIONS[name])
        got = as_float(np.asarray(family.read(out))).astype(np.float64)
        assert str(out.dtype).removeprefix("torch.") == dtype
    exact = sum(draw(r) for r in range(size)) / (size if op == "avg" else 1)
    limit = bound(size, dtype, wire) / (size if op == "avg" else 1)
    assert np.all(np.abs(got - exact) <= limit), np.max(np.abs(got - exact) - limit)
    if dtype in ("float32", "float64") and size > 1:
        assert np.any(got != exact)


@pytest.mark.parametrize("name", sorted(COMPRESSIONS))
def test_what_the_engine_is_handed_is_16_bits(
    name: str, wires: list[tuple[str, int]], rank: int
) -> None:
    tree = {
        "a": np.ones(N, np.float32),
        "b": torch.ones(N, dtype=torch.float64),
        "c": np.arange(10),  # integers travel as they are
    }
    out = dp.allreduce(tree, compression=COMPRESSIONS[name])
    wire = {"fp16": "float16", "bf16": "bfloat16"}[name]
    assert wires and all(dtype == wire for dtype, _ in wires), wires
    assert sum(items for _, items in wires) == 2 * N  # one bucket (or a few) of both leaves
    assert out["a"].dtype == np.float32 and out["b"].dtype == torch.float64
    size = dp.size()
    np.testing.assert_array_equal(out["a"], np.full(N, size, np.float32))  # exact in 16 bits
    np.testing.assert_array_equal(out["c"], np.arange(10) * size)


def test_without_compression_float32_travels_as_float32(wires: list[tuple[str, int]]) -> None:
    dp.allreduce(np.ones(N, np.float32), compression=dp.Compression.none)
    assert wires == [("float32", N)]


@pytest.mark.parametrize("name", sorted(COMPRESSIONS))
@pytest.mark.parametrize("op", ["min", "max", "prod"])
def test_every_op_reduces_in_16_bits(name: str, op: str, rank: int, size: int) -> None:
    x = 1 + 0.1 * np.abs(draw(rank, 1))  # positive, so that products stay in range
    got = dp.allreduce(x.copy(), op, compression=COMPRESSIONS[name])
    stack = np.stack([1 + 0.1 * np.abs(draw(r, 1)) for r in range(size)])
    exact = {"min": np.min, "max": np.max, "prod": np.prod}[op](stack, axis=0)
    eps = EPS["float16" if name == "fp16" else "bfloat16"]
    np.testing.assert_allclose(got, exact, rtol=(size + 2) * eps * 2)


def test_a_nan_still_wins_under_max(rank: int, size: int) -> None:
    x = np.zeros(N, np.float32)
    if rank == size - 1:
        x[7] = np.nan
    got = dp.allreduce(x, "max", compression=dp.Compression.bf16)
    assert np.isnan(got[7]) and np.count_nonzero(np.isnan(got)) == 1


def test_float16_overflows_where_bfloat16_keeps_the_range(size: int) -> None:
    big = np.full(N, 1e6, np.float32)
    assert np.all(np.isinf(dp.allreduce(big.copy(), compression=dp.Compression.fp16)))
    kept = dp.allreduce(big.copy(), compression=dp.Compression.bf16)
    np.testing.assert_allclose(kept, 1e6 * size, rtol=2**-7)


def test_iallreduce_and_allreduce_gradients_take_compression(rank: int, size: int) -> None:
    request = dp.iallreduce(draw(rank).astype(np.float32), compression=dp.Compression.fp16)
    grads = dp.allreduce_gradients(
        {"w": torch.from_numpy(draw(rank, 2))}, compression=dp.Compression.bf16
    )
    exact = sum(draw(r) for r in range(size))
    assert np.all(np.abs(request.wait() - exact) <= bound(size, "float32", "float16"))
    mean = sum(draw(r, 2) for r in range(size)) / size
    assert np.all(np.abs(grads["w"].numpy() - mean) <= bound(size, "float64", "bfloat16", 2) / size)


def test_a_group_compresses_among_its_ranks(rank: int, size: int) -> None:
    members = [0] if size == 1 else [0, size - 1]
    group = dp.new_group(members)
    if group.member:
        got = dp.allreduce(draw(rank), "avg", group=group, compression=dp.Compression.fp16)
        exact = sum(draw(r) for r in members) / len(members)
        np.testing.assert_allclose(
            got, exact, atol=float(np.max(bound(size, "float64", "float16")))
        )


# -- errors -------------------------------------------------------------------------------------


def test_ranks_that_disagree_on_compression_raise_a_mismatch(rank: int, size: int) -> None:
    if size == 1:
        pytest.skip("a mismatch needs two ranks")
    compression = dp.Compression.fp16 if rank == 0 else None
    with pytest.raises(CollectiveMismatchError, match="compression"):
        dp.allreduce(np.ones(N, np.float32), compression=compression)
    assert dp.allreduce(1.0) == size  # the world is still usable


def test_optimizers_that_disagree_on_compression_raise_a_mismatch(rank: int, size: int) -> None:
    if size == 1:
        pytest.skip("a mismatch needs two ranks")
    model = make_model()
    compression = dp.Compression.bf16 if rank == size - 1 else None
    opt = dp.DistributedOptimizer(
        torch.optim.SGD(model.parameters(), lr=0.1), compression=compression
    )
    x, y = global_batch(0)
    with pytest.raises(CollectiveMismatchError, match="compression"):
        loss_of(model, share(x), share(y)).backward()
    del opt
    assert dp.allreduce(1.0) == size


def test_a_compression_that_is_not_one_raises_type_error() -> None:
    with pytest.raises(TypeError, match="not a compressor"):
        dp.allreduce(np.ones(3), compression="fp16")


# -- Horovod's compressor interface -------------------------------------------------------------


def test_compress_and_decompress_round_trip_like_horovods() -> None:
    x = torch.linspace(-2, 2, 9)
    for compressor, wire in ((dp.Compression.fp16, torch.float16), (dp.Compression.bf16, None)):
        packed, ctx = compressor.compress(x)
        assert packed.dtype == (wire or torch.bfloat16) and ctx == torch.float32
        back = compressor.decompress(packed, ctx)
        assert back.dtype == torch.float32
        torch.testing.assert_close(back, x, rtol=1e-2, atol=1e-2)
    ints = torch.arange(4)
    assert dp.Compression.fp16.compress(ints)[0] is ints
    assert dp.Compression.none.compress(x)[0] is x
    packed_np, ctx_np = dp.Compression.fp16.compress(np.ones(3))
    assert (
        packed_np.dtype == np.float16
        and dp.Compression.fp16.decompress(packed_np, ctx_np).dtype == np.float64
    )


# -- training -----------------------------------------------------------------------------------


@pytest.mark.parametrize("name", sorted(COMPRESSIONS))
def test_distributed_optimizer_with_compression_trains_as_one_process(
    name: str, world: Backend
) -> None:
    model = make_model()
    reference = copy.deepcopy(model)
    opt = dp.DistributedOptimizer(
        OPTIMIZERS["sgd-momentum"](model.parameters()), compression=COMPRESSIONS[name]
    )
    ref_opt = OPTIMIZERS["sgd-momentum"](reference.parameters())
    tol = 2e-3 if name == "fp16" else 2e-2
    for step in range(3):
        x, y = global_batch(step)
        step_pair(model, opt, reference, ref_opt, x, y)
        for got, want in zip(model.parameters(), reference.parameters(), strict=True):
            assert got.grad is not None and got.grad.dtype == torch.float32
            torch.testing.assert_close(got.grad, want.grad, rtol=tol, atol=tol)
    for got, want in zip(model.parameters(), reference.parameters(), strict=True):
        torch.testing.assert_close(got, want, rtol=tol, atol=tol)


def test_data_parallel_model_with_compression_averages_in_16_bits(
    world: Backend, wires: list[tuple[str, int]]
) -> None:
    bare = make_model()
    reference = copy.deepcopy(bare)
    model = dp.torch.DataParallelModel(bare, compression=dp.Compression.fp16)
    x, y = global_batch(0)
    loss_of(model, share(x), share(y)).backward()
    loss_of(reference, x, y).backward()
    for got, want in zip(model.parameters(), reference.parameters(), strict=True):
        torch.testing.assert_close(got.grad, want.grad, rtol=2e-3, atol=2e-3)
    assert wires and all(dtype == "float16" for dtype, _ in wires)


def test_optax_distributed_optimizer_compresses_eagerly_and_under_jit(rank: int, size: int) -> None:
    optax = pytest.importorskip("optax")
    jax = pytest.importorskip("jax")
    opt = dp.DistributedOptimizer(optax.sgd(1.0), compression=dp.Compression.bf16)
    params = {"w": jax.numpy.zeros(N, jax.numpy.float32)}
    state = opt.init(params)
    grads = {"w": jax.numpy.asarray(draw(rank, 3).astype(np.float32))}
    mean = sum(draw(r, 3) for r in range(size)) / size
    limit = bound(size, "float32", "bfloat16", 3) / size
    for update in (opt.update, jax.jit(opt.update)):
        updates, _ = update(grads, state, params)
        assert updates["w"].dtype == jax.numpy.float32
        assert np.all(np.abs(-np.asarray(updates["w"], np.float64) - mean) <= limit)


@pytest.mark.matrix(strength=1)
@pytest.mark.parametrize("dtype", ["float32", "float16", "bfloat16"])
@pytest.mark.parametrize("name", sorted(COMPRESSIONS))
def test_optax_compresses_under_jit_in_packed_16_bit_buffers_as_eagerly(
    name: str, dtype: str, rank: int, size: int
) -> None:
    """A jitted compressed update (packed 16-bit buffers, cast inside the step) gives the eager
    update's results: equal up to two ranks, at three within the rounding of the 16-bit sums
    (their order may differ with the buffers' sizes)."""
    optax = pytest.importorskip("optax")
    jax = pytest.importorskip("jax")
    grads = {  # a large leaf (a buffer of its own), two small ones packed, and integers
        "big": jax.numpy.asarray(draw(rank, 5, 70_000), dtype),
        "small": jax.numpy.asarray(draw(rank, 6, 300), dtype),
        "tiny": jax.numpy.asarray(draw(rank, 7, 3).reshape(3, 1), dtype),
        "count": jax.numpy.arange(4, dtype=jax.numpy.int32),
    }
    opt = dp.DistributedOptimizer(optax.sgd(1.0), compression=COMPRESSIONS[name], op="sum")
    params = jax.tree_util.tree_map(jax.numpy.zeros_like, grads)
    state = opt.init(params)
    eager, _ = opt.update(grads, state, params)
    jitted, _ = jax.jit(opt.update)(grads, state, params)
    wire = {"fp16": "float16", "bf16": "bfloat16"}[name]
    for key, leaf in grads.items():
        assert jitted[key].dtype == eager[key].dtype  # sgd's update of integers is floating
        assert key == "count" or jitted[key].dtype == leaf.dtype
        got, want = (np.asarray(x[key], np.float64) for x in (jitted, eager))
        if size <= 2 or key == "count":
            np.testing.assert_array_equal(got, want, err_msg=key)
        else:
            salt = {"big": 5, "small": 6, "tiny": 7}[key]
            limit = bound(size, dtype, wire, salt, leaf.size).reshape(leaf.shape)
            assert np.all(np.abs(got - want) <= limit), key
    if dtype == "float32":  # it went through 16 bits
        exact = sum(draw(r, 5, 70_000).astype(np.float32).astype(np.float64) for r in range(size))
        assert np.any(-np.asarray(jitted["big"], np.float64) != exact)


def test_optax_ranks_that_disagree_on_compression_under_jit_raise_a_mismatch(
    rank: int, size: int
) -> None:
    if size == 1:
        pytest.skip("a mismatch needs two ranks")
    optax = pytest.importorskip("optax")
    jax = pytest.importorskip("jax")
    compression = dp.Compression.fp16 if rank == 0 else dp.Compression.bf16
    opt = dp.DistributedOptimizer(optax.sgd(1.0), compression=compression)
    params = {"w": jax.numpy.zeros(N, jax.numpy.float32)}
    with pytest.raises(CollectiveMismatchError, match="compress"):
        jax.jit(opt.update)(params, opt.init(params), params)
    assert dp.allreduce(1.0) == size


def test_optax_compression_refuses_the_mpi4jax_route_by_name(rank: int, size: int) -> None:
    if size == 1:
        pytest.skip("one rank reduces nothing: no route is taken")
    optax = pytest.importorskip("optax")
    jax = pytest.importorskip("jax")
    opt = dp.DistributedOptimizer(optax.sgd(1.0), compression=dp.Compression.fp16, route="mpi4jax")
    params = {"w": jax.numpy.zeros(N, jax.numpy.float32)}
    with pytest.raises(RuntimeError, match="16-bit"):
        jax.jit(opt.update)(params, opt.init(params), params)


# -- the engines' 16-bit reduction --------------------------------------------------------------


def rounded_sums(values: list[np.ndarray], dtype: str) -> list[np.ndarray]:
    """Every result a reduction of `values` (16-bit, as float32) that rounds each addition to
    `dtype` can give: for 3 ranks one per pairing, for fewer the one sum (more: empty)."""

    def add(a: np.ndarray, b: np.ndarray) -> np.ndarray:  # exact in float64, rounded to 16 bits
        return round16(a.astype(np.float64) + b, dtype)

    if len(values) == 1:
        return [values[0]]
    if len(values) == 2:
        return [add(values[0], values[1])]
    if len(values) == 3:
        a, b, c = values
        return [add(add(a, b), c), add(add(a, c), b), add(add(b, c), a)]
    return []


def round16(wide: np.ndarray, dtype: str) -> np.ndarray:
    """Round float64 `wide` to `dtype` (nearest even), returned as float32: NumPy's casts."""
    if dtype == "float16":
        return wide.astype(np.float16).astype(np.float32)
    bits = np.empty(wide.size, np.uint16)  # float64 -> float32 -> bfloat16 rounds as directly
    narrow(wide.astype(np.float32), "bfloat16", bits)
    out = np.empty(wide.size, np.float32)
    widen(bits, "bfloat16", out)
    return out


# Sizes around the NumPy path's block (`half._BLOCK`) and MPICH's 64 KiB eager/rendezvous split.
BOUNDARY_ITEMS = [1, 2, 7, N + 1, (1 << 14) - 1, (1 << 14) + 1, (1 << 15) + 3, 3 * (1 << 14)]


@pytest.mark.matrix
@pytest.mark.parametrize("torch_loaded", [True, False], ids=["torch", "numpy"])
@pytest.mark.parametrize("items", BOUNDARY_ITEMS, ids=lambda n: f"{n}-items")
@pytest.mark.parametrize("dtype", ["float16", "bfloat16"])
def test_the_16_bit_sum_rounds_each_addition_once(
    dtype: str, items: int, torch_loaded: bool, monkeypatch: pytest.MonkeyPatch
) -> None:
    """`add16` (MPI's 16-bit sum op) gives the correctly rounded 16-bit sum, with torch or not."""
    if not torch_loaded:
        monkeypatch.delitem(sys.modules, "torch")
    rng = np.random.default_rng(items)
    scale = np.exp2(rng.integers(-30, 16, items)) if dtype == "bfloat16" else 1.0
    wide = [(rng.standard_normal(items) * scale).astype(np.float32) for _ in range(2)]
    wide[0][:3] = [np.inf, np.nan, 65504.0][:items]  # specials and float16's overflow
    bufs = [np.empty(items, np.float16 if dtype == "float16" else np.uint16) for _ in wide]
    exact = []
    for w, buf in zip(wide, bufs, strict=True):
        narrow(w, dtype, buf)
        exact.append(np.empty(items, np.float32))
        widen(buf, dtype, exact[-1])
    add16(bufs[0], bufs[1], dtype)
    got = np.empty(items, np.float32)
    widen(bufs[1], dtype, got)
    np.testing.assert_array_equal(got, rounded_sums(exact, dtype)[0])


@pytest.mark.parametrize("items", BOUNDARY_ITEMS, ids=lambda n: f"{n}-items")
@pytest.mark.parametrize("dtype", ["float16", "bfloat16"])
def test_engines_reduce_16_bits_as_a_native_16_bit_sum(
    items: int, dtype: str, world: Backend, rank: int, size: int
) -> None:
    """Every rank ends with the same bits, each addition rounded once to 16 bits (the native
    half sum of Gloo, NCCL, and MPI's `half_sum` op): at 3 ranks one of the pairings."""
    values = [np.float32(0.1) * (1 + draw(r, 4, items)).astype(np.float32) for r in range(size)]
    buf = np.empty(items, np.float16 if dtype == "float16" else np.uint16)
    inputs = []
    for r in range(size):  # the inputs as rounded to 16 bits
        mine = np.empty(items, buf.dtype)
        narrow(values[r], dtype, mine)
        inputs.append(np.empty(items, np.float32))
        widen(mine, dtype, inputs[-1])
        if r == rank:
            buf[...] = mine
    world.iallreduce_half(buf, ReduceOp.SUM, dtype).wait()
    got = np.empty(items, np.float32)
    widen(buf, dtype, got)
    every = dp.allgather_object(buf.copy())
    assert all(np.array_equal(theirs, every[0]) for theirs in every)
    total = np.sum(inputs, axis=0, dtype=np.float64)
    possible = rounded_sums(inputs, dtype)
    if possible:
        assert np.all(np.any([got == p for p in possible], axis=0)), np.max(np.abs(got - total))
    magnitude = np.sum(np.abs(inputs), axis=0, dtype=np.float64)
    assert np.all(np.abs(got - total) <= size * EPS[dtype] * magnitude)

"""`dp.reducescatter` and the engines' `reduce_scatter`, at any world size.

Rank r's values are computed from r (`_families.rank_values`), so each rank knows every rank's
input and checks its own part of the reduction against NumPy. First axes are chosen so that
`size()` does not divide them, and so that some ranks get no rows at all.
"""

from __future__ import annotations

import dataclasses
from typing import Any

import numpy as np
import pytest
import torch
from _families import (
    ARRAY_FAMILIES,
    OPS,
    Family,
    assert_values,
    expected,
    invalid,
    np_dtype,
    rank_values,
    usable,
)

import dataparallel as dp
import dataparallel.world as world_module
from dataparallel.arrays.families import family_of
from dataparallel.arrays.segments import row_parts
from dataparallel.backends.base import Backend, ReduceOp
from dataparallel.backends.single import SingleBackend

jnp = pytest.importorskip("jax.numpy")
ml_dtypes = pytest.importorskip("ml_dtypes")

MATRIX = [
    pytest.param(family, dtype, op, id=f"{family.name}-{dtype}-{op}")
    for family in ARRAY_FAMILIES
    for dtype in family.dtypes
    for op in OPS
]


def part(values: np.ndarray, rank: int, size: int) -> np.ndarray:
    """Return rank `rank`'s rows of `values` (Horovod's split: the first n % size get one more)."""
    parts = row_parts(values.shape[0], size)
    start = sum(parts[:rank])
    return values[start : start + parts[rank]]


def check(family: Family, x: Any, out: Any, want: np.ndarray, dtype: str) -> None:
    """Check a result: a new array of `x`'s family and dtype holding `want`."""
    assert out is not x
    assert family_of(out).name == family_of(x).name and family_of(out).dtype(out) == dtype
    if family.name.startswith("torch"):
        assert out.device == x.device
    assert_values(family, out, want, dtype)


@pytest.mark.matrix
@pytest.mark.parametrize(("family", "dtype", "op"), MATRIX)
def test_every_op_dtype_and_family(
    family: Family, dtype: str, op: str, rank: int, size: int
) -> None:
    usable(family)
    shape = (2 * size + 1, 3)  # size does not divide it (but at one rank)
    with family.context():
        x = family.make(rank_values(rank, dtype, shape), dtype)
        if invalid(op, dtype):
            with pytest.raises(TypeError, match=rf"^x\['w'\]: op='{op}' "):
                dp.reducescatter({"w": x}, op=op)
            return
        out = dp.reducescatter({"w": x}, op=op)
        want = part(expected(op, dtype, size, shape), rank, size)
        check(family, x, out["w"], want, dtype)


@pytest.mark.parametrize("rows", [0, 1, 2, 5])
def test_parts_of_every_size_some_empty(rows: int, rank: int, size: int) -> None:
    x = np.arange(rows * 2, dtype=np.float64).reshape(rows, 2) * (rank + 1)
    out = dp.reducescatter(x)
    whole = np.arange(rows * 2, dtype=np.float64).reshape(rows, 2) * (size * (size + 1) / 2)
    want = part(whole, rank, size)
    assert out.shape == want.shape == (row_parts(rows, size)[rank], 2)
    np.testing.assert_array_equal(out, want)


def test_a_tree_of_families_and_dtypes_in_few_calls(
    rank: int, size: int, monkeypatch: pytest.MonkeyPatch
) -> None:
    backend = world_module.current().backend
    calls: list[str] = []
    real = backend.reduce_scatter

    def counting(send: Any, recv: Any, counts: list[int], op: ReduceOp) -> None:
        calls.append(str(send.dtype))
        real(send, recv, counts, op)

    monkeypatch.setattr(backend, "reduce_scatter", counting)
    shapes = {"a": (7, 2), "b": (3,), "c": (size - 1, 4), "d": (1, 2, 2), "e": (0, 3), "f": (4,)}
    x = {
        "a": np.asarray(rank_values(rank, "float32", shapes["a"]), np.float32),
        "b": torch.tensor(rank_values(rank, "float32", shapes["b"]), dtype=torch.float32),
        "c": jnp.asarray(rank_values(rank, "float32", shapes["c"]), dtype=jnp.float32),
        "d": np.asarray(rank_values(rank, "int64", shapes["d"]), np.int64),
        "e": torch.zeros(shapes["e"], dtype=torch.bfloat16),
        "f": torch.tensor(rank_values(rank, "float32", shapes["f"])).to(torch.bfloat16),
    }
    out = dp.reducescatter(x, op="max")
    assert list(out) == list(x)
    for key, shape in shapes.items():
        dtype = "int64" if key == "d" else "float32"
        want = part(expected("max", dtype, size, shape), rank, size)
        got = (
            out[key].float().numpy() if isinstance(out[key], torch.Tensor) else np.asarray(out[key])
        )
        assert got.shape == want.shape, key
        np.testing.assert_array_equal(got, want)
    assert isinstance(out["b"], torch.Tensor) and out["f"].dtype == torch.bfloat16
    assert type(out["c"]) is type(x["c"]) and out["d"].dtype == np.int64
    # One call per dtype on the wire: float32 (NumPy, torch, JAX together), int64, and bfloat16
    # (which MPI and Gloo lack: widened to float32).
    assert sorted(calls) == ["float32", "float32", "int64"]


def test_small_buckets_split_the_calls_and_keep_the_values(
    rank: int, size: int, monkeypatch: pytest.MonkeyPatch
) -> None:
    active = world_module.current()
    monkeypatch.setattr(active, "settings", dataclasses.replace(active.settings, bucket_bytes=64))
    leaves = [np.full((i + 1, 3), float(rank + i)) for i in range(6)]  # 24 to 144 bytes
    out = dp.reducescatter(leaves, op="sum", scale=0.5)
    for i, leaf in enumerate(out):
        whole = np.full((i + 1, 3), 0.5 * sum(r + i for r in range(size)))
        np.testing.assert_array_equal(leaf, part(whole, rank, size))


def test_avg_and_scale(rank: int, size: int) -> None:
    x = {"f": np.full((size + 1, 2), float(rank + 1)), "i": np.full((size,), rank + 1, np.int32)}
    out = dp.reducescatter({"f": x["f"]}, op="avg", scale=4.0)
    mean = (size + 1) / 2
    np.testing.assert_allclose(out["f"], part(np.full((size + 1, 2), 4 * mean), rank, size))
    out = dp.reducescatter({"i": x["i"]}, op="sum", scale=3)
    np.testing.assert_array_equal(out["i"], np.full(1, 3 * size * (size + 1) // 2, np.int32))
    assert out["i"].dtype == np.int32


def test_inputs_are_left_alone_and_odd_layouts_work(rank: int, size: int) -> None:
    base = np.arange(4 * (size + 1) * 2, dtype=np.float64).reshape(-1, 2)
    strided = base[::2]  # a non-contiguous view, (2 * (size + 1), 2) rows
    readonly = np.full((size + 2,), float(rank))
    readonly.flags.writeable = False
    big_endian = np.full((3, 2), rank + 1, dtype=">i4")
    transposed = torch.arange(6.0).reshape(2, 3).t()  # (3, 2), not contiguous
    bf16 = np.full((size + 1,), rank + 1, dtype=ml_dtypes.bfloat16)
    before = strided.copy()
    out = dp.reducescatter(
        {"s": strided, "r": readonly, "b": big_endian, "t": transposed, "h": bf16}
    )
    np.testing.assert_array_equal(strided, before)  # the input is not written
    np.testing.assert_array_equal(out["s"], part(before * size, rank, size))
    np.testing.assert_array_equal(
        out["r"], part(np.full((size + 2,), size * (size - 1) / 2), rank, size)
    )
    np.testing.assert_array_equal(
        out["b"], part(np.full((3, 2), size * (size + 1) // 2), rank, size)
    )
    assert out["b"].dtype == np.int32
    np.testing.assert_array_equal(out["t"].numpy(), part(transposed.numpy() * size, rank, size))
    assert out["h"].dtype == bf16.dtype
    np.testing.assert_array_equal(
        out["h"].astype(np.float32),
        part(np.full((size + 1,), size * (size + 1) / 2, np.float32), rank, size),
    )


def test_an_explicit_backend_of_one_keeps_every_row(rank: int, size: int) -> None:
    x = np.arange(5.0) + rank
    out = dp.reducescatter(x, backend=SingleBackend())
    np.testing.assert_array_equal(out, x)
    assert out is not x
    out = dp.reducescatter(x, backend=dp.get_backend())
    np.testing.assert_array_equal(
        out, part((np.arange(5.0) * size + size * (size - 1) / 2), rank, size)
    )


def test_empty_trees_and_none(rank: int) -> None:
    assert dp.reducescatter({}) == {}
    assert dp.reducescatter({"a": None, "b": []}) == {"a": None, "b": []}


def test_debug_log(
    rank: int, size: int, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    active = world_module.current()
    monkeypatch.setattr(active, "settings", dataclasses.replace(active.settings, debug=True))
    dp.reducescatter({"a": np.ones((2, 2)), "b": np.ones(3)}, op="avg")
    err = capsys.readouterr().err
    assert f"[dataparallel {rank}/{size}] reducescatter op=sum" in err and "leaves=2" in err


# --- errors ---------------------------------------------------------------------------------


@pytest.mark.parametrize("leaf", [1.0, np.float32(2), np.array(3.0), torch.tensor(1.0)], ids=repr)
def test_leaves_without_a_first_axis_are_a_value_error(leaf: Any, rank: int) -> None:
    with pytest.raises(ValueError, match=r"^x\['s'\]: reducescatter splits arrays along their"):
        dp.reducescatter({"a": np.ones(2), "s": leaf})


def test_bad_ops_dtypes_and_scales(rank: int) -> None:
    with pytest.raises(TypeError, match=r"^x\['i'\]: op='avg' on int32 values would truncate"):
        dp.reducescatter({"i": np.ones(3, np.int32)}, op="avg")
    with pytest.raises(TypeError, match=r"^x: op='avg' on bool values"):
        dp.reducescatter(np.ones(3, bool), op="avg")
    with pytest.raises(TypeError, match=r"^x: scale=0.5 cannot be applied to int64 values"):
        dp.reducescatter(np.ones(3, np.int64), scale=0.5)
    with pytest.raises(TypeError, match=r"^x: op='max' is not defined for complex values"):
        dp.reducescatter(np.ones(3, np.complex64), op="max")
    with pytest.raises(ValueError, match=r"op='mean' is not a reduction"):
        dp.reducescatter(np.ones(3), op="mean")  # type: ignore[arg-type]
    with pytest.raises(TypeError, match=r"scale='2' must be a real number"):
        dp.reducescatter(np.ones(3), scale="2")  # type: ignore[arg-type]
    with pytest.raises(TypeError, match=r"^x\[0\]: expected an array"):
        dp.reducescatter(["text"])


def _mismatch(call: Any, *fragments: str) -> None:
    with pytest.raises(dp.CollectiveMismatchError) as info:
        call()
    for fragment in fragments:
        assert fragment in str(info.value), str(info.value)
    assert dp.allreduce(np.ones(2))[0] == dp.size()  # the world stays usable


def _others(size: int) -> str:
    if size == 1:
        pytest.skip("a mismatch needs two ranks or more")
    listed = ", ".join(map(str, range(1, size))) if size <= 3 else f"1-{size - 1}"  # a range
    return ("rank " if size == 2 else "ranks ") + listed


def test_a_first_axis_that_differs_across_ranks_is_a_mismatch(rank: int, size: int) -> None:
    others = _others(size)
    _mismatch(
        lambda: dp.reducescatter({"w": np.ones((4 + (rank > 0), 2))}),
        "Ranks called reducescatter with different arguments",
        f"x['w']: float64[4, 2] on rank 0; float64[5, 2] on {others}",
    )


def test_other_differences_across_ranks_are_mismatches(rank: int, size: int) -> None:
    others = _others(size)
    _mismatch(
        lambda: dp.reducescatter(np.ones(4, np.float32 if rank == 0 else np.float64)),
        f"x: float32[4] on rank 0; float64[4] on {others}",
    )
    _mismatch(
        lambda: dp.reducescatter(np.ones(4), op="sum" if rank == 0 else "max"),
        f"op: sum on rank 0; max on {others}",
    )
    _mismatch(
        lambda: dp.reducescatter(np.ones(4)) if rank == 0 else dp.allreduce(np.ones(4)),
        "Ranks called different collectives (allreduce, reducescatter)",
    )


# --- the engines' reduce_scatter, directly ---------------------------------------------------

ENGINE_DTYPES = ["float64", "float32", "float16", "int8", "int16", "int32", "int64", "uint8"]
ENGINE_DTYPES += ["uint16", "uint32", "uint64", "complex64"]


@pytest.mark.parametrize("dtype", ENGINE_DTYPES)
def test_engine_reduce_scatter_uneven_counts(
    dtype: str, world: Backend, rank: int, size: int
) -> None:
    counts = [r % 3 + 1 for r in range(size)]
    counts[-1] = 0 if size > 1 else counts[-1]  # a rank may receive nothing
    ops = [ReduceOp.SUM, ReduceOp.PROD] + (
        [] if "complex" in dtype else [ReduceOp.MIN, ReduceOp.MAX]
    )
    for op in ops:
        values = np.arange(sum(counts)) % 2 + rank + 1
        send = values.astype(np_dtype(dtype))
        recv = np.zeros(counts[rank], np_dtype(dtype))
        world.reduce_scatter(send, recv, counts, op)
        every = np.stack([(np.arange(sum(counts)) % 2 + r + 1) for r in range(size)])
        reduce = {ReduceOp.SUM: np.sum, ReduceOp.PROD: np.prod}.get(op)
        reduce = reduce or (np.min if op is ReduceOp.MIN else np.max)
        want = reduce(every.astype(np_dtype(dtype)), axis=0).astype(np_dtype(dtype))
        start = sum(counts[:rank])
        np.testing.assert_array_equal(recv, want[start : start + counts[rank]], err_msg=str(op))


def test_engine_reduce_scatter_defaults(world: Backend, rank: int, size: int) -> None:
    counts = list(range(1, size + 1))
    send = np.arange(sum(counts), dtype=np.float64) + rank
    recv = np.empty(counts[rank])
    # The non-blocking form, then the protocol's default (an allreduce), which any engine has.
    world.ireduce_scatter(send, recv, counts, ReduceOp.SUM).wait()
    start = sum(counts[:rank])
    want = (np.arange(sum(counts)) * size + size * (size - 1) / 2)[start : start + counts[rank]]
    np.testing.assert_array_equal(recv, want)
    recv[...] = 0
    Backend.reduce_scatter(world, send, recv, counts, ReduceOp.SUM)
    np.testing.assert_array_equal(recv, want)
    assert Backend.ireduce_scatter(world, send, recv, counts, ReduceOp.MAX).test()
    np.testing.assert_array_equal(recv, np.arange(start, start + counts[rank]) + size - 1.0)


# --- NCCL's calls (no GPU needed: the calls are recorded, not made) ---------------------------


class Recorder:
    """Stands for CuPy's NCCL module and communicator: records the calls made on it."""

    def __init__(self) -> None:
        self.calls: list[tuple[Any, ...]] = []

    def __getattr__(self, name: str) -> Any:
        return lambda *args: self.calls.append((name, *args))


def device(ptr: int, items: int, itemsize: int = 4, dtype: str = "float32") -> Any:
    from dataparallel.backends.base import DeviceBuffer

    return DeviceBuffer(ptr, items, itemsize, dtype, 0, 0, None)


def test_nccl_reduce_scatter_calls() -> None:
    from dataparallel.backends.nccl.backend import device_pair, scatter_call

    nccl = Recorder()
    send, recv = device(1000, 6), device(5000, 2)
    scatter_call(send, recv, [2, 2, 2], (7, 1), 0, 1, nccl)(nccl, 42)
    assert nccl.calls == [("reduceScatter", 1000, 5000, 2, 7, 0, 42)]
    nccl.calls.clear()
    complex_send, complex_recv = device(1000, 5, 8, "complex64"), device(5000, 2, 8, "complex64")
    scatter_call(complex_send, complex_recv, [2, 2, 1], (7, 2), 0, 1, nccl)(nccl, 42)
    assert nccl.calls == [
        ("groupStart",),
        ("reduce", 1000, 1000, 4, 7, 0, 0, 42),  # rank 1 is not root: recvbuff unused
        ("reduce", 1016, 5000, 4, 7, 0, 1, 42),  # its own part lands in recv
        ("reduce", 1032, 1032, 2, 7, 0, 2, 42),
        ("groupEnd",),
    ]
    assert device_pair(np.ones(2), np.ones(1), "x") is None
    with pytest.raises(TypeError, match=r"both be host arrays or both CUDA buffers"):
        device_pair(np.ones(2), recv, "reduce_scatter")


def test_fusion_reduce_scatters_by_the_counts_its_caller_gives(rank: int, size: int) -> None:
    """A bucket its caller packs and splits (ZeRO's padded segments, not rows): each rank gets
    the sum of its count of items, handed to the caller's landing, and the flights are held to
    `Fusion`'s bound (on MPI one at a time)."""
    from dataparallel.arrays.actions import Scatter
    from dataparallel.arrays.fusion import Fusion, ShardFlight

    backend = world_module.current().backend
    fusion = Fusion(backend, Scatter(ReduceOp.SUM), bucket_bytes=1)
    landed: list[tuple[int, np.ndarray]] = []
    most = 0
    for b in range(5):
        counts = [(b + r) % 3 for r in range(size)]  # some ranks get nothing
        send = np.arange(sum(counts), dtype=np.float32) * (rank + 1) + b
        recv = np.full(counts[rank], -1.0, np.float32)
        land = lambda got, b=b: landed.append((b, got.copy()))  # noqa: E731
        flight = ShardFlight("float32", send, recv, tuple(counts), land)
        fusion.reduce_scatter(lambda flight=flight: flight)
        most = max(most, len(fusion._flights))
    fusion.land()
    assert not fusion.in_flight and most <= fusion.backend.calls_in_flight
    assert [b for b, _ in landed] == list(range(5))  # landed in order
    ranks = size * (size + 1) / 2  # the sum of (r + 1) over the ranks
    for b, got in landed:
        counts = [(b + r) % 3 for r in range(size)]
        start = sum(counts[:rank])
        mine = np.arange(start, start + counts[rank], dtype=np.float32)
        np.testing.assert_array_equal(got, mine * ranks + b * size)

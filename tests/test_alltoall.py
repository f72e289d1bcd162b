"""`dp.alltoall` and the engines' `alltoallv`, at any world size.

Rank r's rows and splits are computed from r (`source`, `splits_of`), so each rank knows what every
rank sends it and checks the rows it gets against NumPy. Splits include zeros (ranks that send or
receive nothing) and first axes differ between ranks.
"""

from __future__ import annotations

import dataclasses
from typing import Any

import numpy as np
import pytest
import torch
from _families import ARRAY_FAMILIES, Family, as_float, np_dtype, usable

import dataparallel as dp
import dataparallel.world as world_module
from dataparallel.arrays.families import family_of
from dataparallel.backends.base import Backend
from dataparallel.backends.single import SingleBackend

jnp = pytest.importorskip("jax.numpy")

BY_DTYPE = [
    pytest.param(family, dtype, id=f"{family.name}-{dtype}")
    for family in ARRAY_FAMILIES
    for dtype in family.dtypes
]


def splits_of(rank: int, size: int) -> list[int]:
    """Rank `rank`'s rows for each rank: 1, 2, 0, 1, 2, ... shifted by the rank."""
    return [(rank + i + 1) % 3 for i in range(size)]


def source(rank: int, size: int, dtype: str, rest: tuple[int, ...] = (2,)) -> np.ndarray:
    """Rank `rank`'s rows: row k, column c holds 10 * rank + k + 30 * c (exact in every dtype)."""
    rows = sum(splits_of(rank, size))
    k = np.arange(rows).reshape(rows, *[1] * len(rest))
    c = np.arange(int(np.prod(rest))).reshape(1, *rest) if rest else np.zeros(())
    values = (10 * rank + k + 30 * c).astype(np.float64)
    if dtype == "bool":
        return values % 2 == 0
    if dtype.startswith("complex"):
        return values + 1j * rank
    return values


def received_by(rank: int, size: int, dtype: str, rest: tuple[int, ...] = (2,)) -> np.ndarray:
    """The rows `rank` gets: from each rank in turn, the rows that rank meant for it."""
    parts = []
    for r in range(size):
        splits = splits_of(r, size)
        start = sum(splits[:rank])
        parts.append(source(r, size, dtype, rest)[start : start + splits[rank]])
    return np.concatenate(parts)


@pytest.mark.matrix(strength=1)
@pytest.mark.parametrize(("family", "dtype"), BY_DTYPE)
def test_every_dtype_and_family(family: Family, dtype: str, rank: int, size: int) -> None:
    usable(family)
    with family.context():
        x = family.make(source(rank, size, dtype), dtype)
        out, got = dp.alltoall(x, splits_of(rank, size))
        assert got == [splits_of(r, size)[rank] for r in range(size)]
        assert out is not x and family_of(out).name == family_of(x).name
        assert family_of(out).dtype(out) == dtype
        if family.name.startswith("torch"):
            assert out.device == x.device
        want = received_by(rank, size, dtype).astype(np_dtype(dtype))
        result = np.asarray(family.read(out))
        assert result.shape == want.shape
        np.testing.assert_array_equal(as_float(result), as_float(want))


def test_default_splits_are_equal_parts(rank: int, size: int) -> None:
    x = np.arange(2 * size * 3).reshape(2 * size, 3) + 100 * rank
    out, got = dp.alltoall(x)
    assert got == [2] * size
    want = np.concatenate(
        [
            (np.arange(2 * size * 3).reshape(2 * size, 3) + 100 * r)[2 * rank : 2 * rank + 2]
            for r in range(size)
        ]
    )
    np.testing.assert_array_equal(out, want)
    out, got = dp.alltoall(torch.arange(size) + 10 * rank)
    assert got == [1] * size
    assert torch.equal(out, torch.tensor([10 * r + rank for r in range(size)]))


@pytest.mark.parametrize(
    "kind", ["list", "tuple", "numpy-int32", "numpy-uint8", "torch", "jax", "numpy-ints"]
)
def test_splits_as_sequences_arrays_and_tensors(kind: str, rank: int, size: int) -> None:
    plain = splits_of(rank, size)
    splits: Any = {
        "list": plain,
        "tuple": tuple(plain),
        "numpy-int32": np.array(plain, np.int32),
        "numpy-uint8": np.array(plain, np.uint8),
        "torch": torch.tensor(plain, dtype=torch.int32),
        "jax": jnp.asarray(plain),
        "numpy-ints": [np.int64(n) for n in plain],
    }[kind]
    out, got = dp.alltoall(source(rank, size, "float64"), splits)
    assert got == [splits_of(r, size)[rank] for r in range(size)]
    assert all(type(n) is int for n in got)
    np.testing.assert_array_equal(out, received_by(rank, size, "float64"))


def test_a_tree_travels_as_records_in_one_call(
    rank: int, size: int, monkeypatch: pytest.MonkeyPatch
) -> None:
    backend = world_module.current().backend
    calls: list[int] = []
    real = backend.alltoallv

    def counting(send: Any, send_counts: list[int], recv: Any, recv_counts: list[int]) -> None:
        calls.append(len(send_counts))
        real(send, send_counts, recv, recv_counts)

    monkeypatch.setattr(backend, "alltoallv", counting)
    rests = {"f": (2,), "h": (), "i": (3, 1), "b": (), "z": (0,)}
    x = {
        "f": source(rank, size, "float64", rests["f"]),
        "h": torch.tensor(source(rank, size, "float32", ())).to(torch.bfloat16),
        "i": jnp.asarray(source(rank, size, "int32", rests["i"]).astype(np.int32)),
        "b": source(rank, size, "bool", ()),
        "z": np.empty((sum(splits_of(rank, size)), 0), np.float32),
    }
    out, got = dp.alltoall(x, splits=splits_of(rank, size))
    assert calls == [size, size]  # the splits, then every leaf at once
    assert got == [splits_of(r, size)[rank] for r in range(size)]
    np.testing.assert_array_equal(out["f"], received_by(rank, size, "float64", rests["f"]))
    assert out["h"].dtype == torch.bfloat16
    np.testing.assert_array_equal(out["h"].float().numpy(), received_by(rank, size, "float32", ()))
    assert out["i"].dtype == jnp.int32 and out["i"].shape[1:] == (3, 1)
    np.testing.assert_array_equal(np.asarray(out["i"]), received_by(rank, size, "int32", (3, 1)))
    np.testing.assert_array_equal(out["b"], received_by(rank, size, "bool", ()))
    assert out["z"].shape == (sum(got), 0) and out["z"].dtype == np.float32


def test_the_way_back_with_the_received_splits_restores_the_input(rank: int, size: int) -> None:
    x = {"a": source(rank, size, "float32"), "t": torch.tensor(source(rank, size, "int64", ()))}
    there, got = dp.alltoall(x, splits_of(rank, size))
    back, sent = dp.alltoall(there, got)
    assert sent == splits_of(rank, size)
    np.testing.assert_array_equal(back["a"], x["a"])
    assert torch.equal(back["t"], x["t"])


def test_ranks_that_send_or_receive_nothing(rank: int, size: int) -> None:
    rows = 0 if rank == size - 1 and size > 1 else rank + 2  # the last rank has no rows
    x = np.full((rows, 2), float(rank))
    out, got = dp.alltoall(x, [rows] + [0] * (size - 1))  # everything to rank 0
    counts = [0 if r == size - 1 and size > 1 else r + 2 for r in range(size)]
    if rank == 0:
        assert got == counts
        want = np.concatenate([np.full((n, 2), float(r)) for r, n in enumerate(counts)])
        np.testing.assert_array_equal(out, want)
    else:
        assert got == [0] * size and out.shape == (0, 2)
    out, got = dp.alltoall(np.empty((0, 4), np.int16))  # nobody sends anything
    assert got == [0] * size and out.shape == (0, 4) and out.dtype == np.int16


def test_an_explicit_backend_of_one_returns_every_row(rank: int) -> None:
    x = {"a": np.arange(4.0) + rank}
    out, got = dp.alltoall(x, backend=SingleBackend())
    assert got == [4] and out["a"] is not x["a"]
    np.testing.assert_array_equal(out["a"], x["a"])


def test_empty_trees(rank: int, size: int) -> None:
    assert dp.alltoall({}) == ({}, [0] * size)
    assert dp.alltoall([None], splits=[0] * size) == ([None], [0] * size)


def test_debug_log(
    rank: int, size: int, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    active = world_module.current()
    monkeypatch.setattr(active, "settings", dataclasses.replace(active.settings, debug=True))
    dp.alltoall({"a": np.ones((size, 2)), "b": np.ones(size)})
    err = capsys.readouterr().err
    assert f"[dataparallel {rank}/{size}] alltoall splits={[1] * size}" in err
    assert "leaves=2" in err


# --- errors (every rank makes the same mistake) ---------------------------------------------


def test_bad_splits_are_value_errors(rank: int, size: int) -> None:
    x = np.ones((size + 1, 2))
    with pytest.raises(ValueError, match=rf"has {size + 1} entries, but the world has {size} "):
        dp.alltoall(x, [1] * (size + 1))
    with pytest.raises(ValueError, match=r"has a negative count"):
        dp.alltoall(x, [size + 2] + [0] * (size - 2) + [-1] if size > 1 else [-1])
    with pytest.raises(ValueError, match=rf"sums to {size}, but the first axis has {size + 1}"):
        dp.alltoall(x, [1] * size)
    if size > 1:
        with pytest.raises(ValueError, match=rf"first axis \({size + 1} rows\) does not divide"):
            dp.alltoall(x)


NOT_INTEGERS = {
    "floats": lambda n: [1.0] * n,
    "numpy-floats": lambda n: np.ones(n, np.float32),
    "torch-floats": lambda n: torch.ones(n),
    "bools": lambda n: [True] * n,
    "int": lambda n: n,
    "str": lambda n: "1" * n,
    "nested": lambda n: [[1]] * n,
    "2-d": lambda n: np.ones((n, 1), int),
}


@pytest.mark.parametrize("kind", list(NOT_INTEGERS))
def test_splits_that_are_not_integers_are_type_errors(kind: str, rank: int, size: int) -> None:
    with pytest.raises(TypeError, match=r"^alltoall: splits must "):
        dp.alltoall(np.ones((size, 2)), NOT_INTEGERS[kind](size))


def test_leaves_without_a_first_axis_or_with_different_ones(rank: int, size: int) -> None:
    with pytest.raises(ValueError, match=r"^x\['n'\]: alltoall splits arrays along their first"):
        dp.alltoall({"a": np.ones(size), "n": 1.0})
    with pytest.raises(ValueError, match=r"^x\[0\]: alltoall splits arrays"):
        dp.alltoall([np.array(1.0)])
    with pytest.raises(ValueError, match=r"x\['a'\] has 2 rows, x\['b'\] has 3"):
        dp.alltoall({"a": np.ones((2, 1)), "b": np.ones(3)}, splits=[2] + [0] * (size - 1))
    with pytest.raises(TypeError, match=r"^x\['s'\]: expected an array"):
        dp.alltoall({"s": "text"})


def _others(size: int) -> str:
    if size == 1:
        pytest.skip("a mismatch needs two ranks or more")
    listed = ", ".join(map(str, range(1, size))) if size <= 3 else f"1-{size - 1}"  # a range
    return ("rank " if size == 2 else "ranks ") + listed


def test_differences_past_the_first_axis_are_mismatches(rank: int, size: int) -> None:
    others = _others(size)
    for call, fragment in [
        (
            lambda: dp.alltoall(np.ones((size, 2 + (rank > 0)))),
            f"x: float64['*', 2] on rank 0; float64['*', 3] on {others}",
        ),
        (
            lambda: dp.alltoall({"w": np.ones(size, np.float32 if rank == 0 else np.int32)}),
            f"x['w']: float32['*'] on rank 0; int32['*'] on {others}",
        ),
        (
            lambda: dp.alltoall(np.ones(size)) if rank == 0 else dp.allgather(np.ones(size)),
            "Ranks called different collectives (allgather, alltoall)",
        ),
    ]:
        with pytest.raises(dp.CollectiveMismatchError) as info:
            call()
        assert fragment in str(info.value), str(info.value)
        assert dp.allreduce(np.ones(2))[0] == size  # the world stays usable


# --- the engines' alltoallv, directly --------------------------------------------------------


@pytest.mark.parametrize("dtype", ["float64", "uint8", "bool", "int16", "complex128"])
def test_engine_alltoallv_uneven_counts(dtype: str, world: Backend, rank: int, size: int) -> None:
    sends = splits_of(rank, size)
    send = source(rank, size, dtype, ()).astype(np_dtype(dtype))
    receives = [splits_of(r, size)[rank] for r in range(size)]
    recv = np.zeros(sum(receives), np_dtype(dtype))
    world.alltoallv(send, sends, recv, receives)
    want = received_by(rank, size, dtype, ()).astype(np_dtype(dtype))
    np.testing.assert_array_equal(recv, want)
    recv[...] = 0
    world.ialltoallv(send, sends, recv, receives).wait()
    np.testing.assert_array_equal(recv, want)
    recv[...] = 0
    Backend.alltoallv(world, send, sends, recv, receives)  # the protocol's default: gathers
    np.testing.assert_array_equal(recv, want)
    assert Backend.ialltoallv(world, send, sends, recv, receives).test()


# --- NCCL's calls (no GPU needed: the calls are recorded, not made) ---------------------------


def test_nccl_alltoall_calls() -> None:
    from dataparallel.backends.base import DeviceBuffer
    from dataparallel.backends.nccl.backend import alltoall_call

    calls: list[tuple[Any, ...]] = []

    class Recorder:
        def __getattr__(self, name: str) -> Any:
            return lambda *args: calls.append((name, *args))

    send = DeviceBuffer(1000, 3, 2, "bfloat16", 0, 0, None)
    recv = DeviceBuffer(5000, 4, 2, "bfloat16", 0, 0, None)
    alltoall_call(send, recv, [1, 0, 2], [2, 2, 0], Recorder(), 1)(Recorder(), 42)
    assert calls == [
        ("groupStart",),
        ("send", 1000, 2, 1, 0, 42),
        ("recv", 5000, 4, 1, 0, 42),
        ("send", 1002, 0, 1, 1, 42),
        ("recv", 5004, 4, 1, 1, 42),
        ("send", 1002, 4, 1, 2, 42),
        ("recv", 5008, 0, 1, 2, 42),
        ("groupEnd",),
    ]

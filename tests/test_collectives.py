"""The collectives on single leaves, at any world size: every op, dtype and family, and every call.

Rank r's values are computed from r (see `_families.rank_values`), so each rank knows what every
other rank sent and checks the exact result. Trees, `synchronize` and the property-based tests are
in `test_collectives_trees.py`; mismatch detection is in `test_protocol.py`.
"""

from __future__ import annotations

import copy
import dataclasses
import re
import socket
import time
from collections.abc import Callable
from typing import Any

import numpy as np
import pytest
import torch
from _families import (
    ARRAY_FAMILIES,
    DTYPES,
    FAMILIES,
    FAMILY,
    OPS,
    Family,
    as_float,
    assert_values,
    expected,
    invalid,
    np_dtype,
    rank_values,
    usable,
)

import dataparallel as dp
import dataparallel.world as world_module
from dataparallel.arrays.dtypes import scale_in_place
from dataparallel.arrays.families import family_of

jnp = pytest.importorskip("jax.numpy")

MATRIX = [
    pytest.param(family, dtype, op, id=f"{family.name}-{dtype}-{op}")
    for family in FAMILIES
    for dtype in family.dtypes
    for op in OPS
]
BY_DTYPE = [
    pytest.param(family, dtype, id=f"{family.name}-{dtype}")
    for family in FAMILIES
    for dtype in family.dtypes
]


def check_leaf(family: Family, before: Any, out: Any, want: np.ndarray, dtype: str) -> None:
    """Check a returned leaf: in place for mutable families, same type and dtype, values `want`."""
    if family.mutable:
        assert out is before, "a mutable array must be written in place and returned"
    else:
        assert type(out) is type(before)
    assert family_of(out).dtype(out) == dtype
    assert_values(family, out, want, dtype)


@pytest.mark.matrix
@pytest.mark.parametrize(("family", "dtype", "op"), MATRIX)
def test_allreduce_every_op_dtype_and_family(
    family: Family, dtype: str, op: str, rank: int, size: int
) -> None:
    usable(family)
    shape = () if family.scalar else (2, 3)
    with family.context():
        x = family.make(rank_values(rank, dtype, shape), dtype)
        if invalid(op, dtype):
            with pytest.raises(TypeError, match=rf"^x\['w'\]: op='{op}' "):
                dp.allreduce({"w": x}, op=op)
            return
        out = dp.allreduce({"w": x}, op=op)
        assert list(out) == ["w"]
        check_leaf(family, x, out["w"], expected(op, dtype, size, shape), dtype)


@pytest.mark.parametrize("family", FAMILIES, ids=repr)
def test_allreduce_of_a_bare_leaf(family: Family, rank: int, size: int) -> None:
    usable(family)
    shape = () if family.scalar else (2, 3)
    with family.context():
        x = family.make(rank_values(rank, "float64", shape), "float64")
        out = dp.allreduce(x, op="max")
        check_leaf(family, x, out, expected("max", "float64", size, shape), "float64")


@pytest.mark.parametrize("family", FAMILIES, ids=repr)
def test_scale_multiplies_the_result(family: Family, rank: int, size: int) -> None:
    usable(family)
    shape = () if family.scalar else (2, 3)
    with family.context():
        x = family.make(rank_values(rank, "float64", shape), "float64")
        out = dp.allreduce(x, scale=0.5)
        check_leaf(family, x, out, 0.5 * expected("sum", "float64", size, shape), "float64")
        y = family.make(rank_values(rank, "float64", shape), "float64")
        out = dp.allreduce(y, op="avg", scale=4.0)
        check_leaf(family, y, out, 4.0 * expected("avg", "float64", size, shape), "float64")
        z = family.make(rank_values(rank, "int64", shape), "int64")
        out = dp.allreduce(z, scale=3)
        check_leaf(family, z, out, 3 * expected("sum", "int64", size, shape), "int64")
        with pytest.raises(TypeError, match=r"^x: scale=0.5 cannot be applied to int64 values"):
            dp.allreduce(z, scale=0.5)
        with pytest.raises(TypeError, match=r"^x: op='avg' on int64 values would truncate"):
            dp.allreduce(z, op="avg")


def test_integral_float_scale_is_accepted_on_integers(rank: int, size: int) -> None:
    out = dp.allreduce(np.full(3, rank + 1, np.int32), scale=2.0)
    np.testing.assert_array_equal(out, np.full(3, size * (size + 1), np.int32))


def test_bool_rejects_scale_and_avg(rank: int) -> None:
    flags = np.array([True, False])
    with pytest.raises(TypeError, match=r"^x\['f'\]: scale=2 cannot be applied to bool values"):
        dp.allreduce({"f": flags}, scale=2)
    with pytest.raises(TypeError, match=r"^x\['f'\]: op='avg'"):
        dp.allreduce({"f": flags}, op="avg")


@pytest.mark.parametrize("scale", ["2", 1j, np.complex64(2)])
def test_a_scale_that_is_not_a_real_number_is_a_type_error(scale: Any, rank: int) -> None:
    with pytest.raises(TypeError, match=r"scale=.* must be a real number"):
        dp.allreduce(np.ones(2), scale=scale)
    with pytest.raises(TypeError, match=r"scale=.* must be a real number"):
        dp.reduce(np.ones(2), scale=scale)
    np.testing.assert_array_equal(
        dp.allreduce(np.ones(2), scale=np.float32(0.5)), [0.5 * dp.size()] * 2
    )


def test_unknown_op_is_a_value_error(rank: int) -> None:
    with pytest.raises(ValueError, match=r"op='mean' is not a reduction: use one of"):
        dp.allreduce(np.ones(2), op="mean")


def host(value: Any) -> np.ndarray:
    """Return a NumPy copy of a leaf of any family."""
    if isinstance(value, torch.Tensor):
        return value.detach().cpu().numpy().copy()
    return np.array(value)


def _tree(rank: int) -> dict[str, Any]:
    return {
        "np": np.full(3, rank + 1.0),
        "torch": torch.full((2, 2), float(rank + 1)),
        "jax": jnp.full((2,), rank + 1.0),
        "int": rank + 1,
        "np_scalar": np.float32(rank + 1),
    }


def test_reduce_gives_the_result_to_root_only(rank: int, size: int) -> None:
    total = size * (size + 1) / 2
    for root in range(size):
        x = _tree(rank)
        before = {k: host(v) for k, v in x.items()}
        out = dp.reduce(x, root=root)
        assert out["np"] is x["np"] and out["torch"] is x["torch"]
        for key, value in out.items():
            want = total if rank == root else before[key]
            np.testing.assert_array_equal(host(value), np.broadcast_to(want, before[key].shape))
        assert type(out["int"]) is int and type(out["np_scalar"]) is np.float32


@pytest.mark.parametrize("op", ["prod", "min", "max", "avg"])
def test_reduce_ops_and_scale(op: str, rank: int, size: int) -> None:
    root = size - 1
    x = rank_values(rank, "float64")
    out = dp.reduce(x, op=op, root=root, scale=2.0)
    assert out is x
    if rank == root:
        np.testing.assert_allclose(out, 2.0 * expected(op, "float64", size))
    else:
        np.testing.assert_array_equal(out, rank_values(rank, "float64"))


@pytest.mark.matrix(strength=1)
@pytest.mark.parametrize(("family", "dtype"), BY_DTYPE)
def test_broadcast_from_every_root(family: Family, dtype: str, rank: int, size: int) -> None:
    usable(family)
    shape = () if family.scalar else (2, 3)
    with family.context():
        for root in range(size):
            x = family.make(rank_values(rank, dtype, shape), dtype)
            out = dp.broadcast({"w": [x]}, root=root)["w"][0]
            want = rank_values(root, dtype, shape).astype(np_dtype(dtype))
            check_leaf(family, x, out, as_float(want), dtype)


def test_broadcast_of_a_tree_in_place(rank: int, size: int) -> None:
    x = _tree(rank)
    out = dp.broadcast(x, root=0)
    assert out["np"] is x["np"] and out["torch"] is x["torch"]
    for value in out.values():
        assert np.all(host(value) == 1)
    assert type(out["int"]) is int and out["int"] == 1


@pytest.mark.matrix(strength=1)
@pytest.mark.parametrize(
    ("family", "dtype"), [p for p in BY_DTYPE if p.values[0] in ARRAY_FAMILIES]
)
def test_allgather_concatenates_uneven_first_axes(
    family: Family, dtype: str, rank: int, size: int
) -> None:
    usable(family)
    with family.context():
        x = family.make(rank_values(rank, dtype, (rank, 2)), dtype)  # rank 0 sends no rows
        out = dp.allgather(x)
        every = [rank_values(r, dtype, (r, 2)) for r in range(size)]
        want = np.concatenate(every).astype(np_dtype(dtype))
        assert type(out) is type(x)
        assert family_of(out).dtype(out) == dtype
        got = np.asarray(family.read(out))
        assert got.shape == (size * (size - 1) // 2, 2)
        np.testing.assert_array_equal(as_float(got), as_float(want))


def test_allgather_of_trees_and_scalars(rank: int, size: int) -> None:
    x = {
        "rows": np.full((rank + 1, 2), rank, np.int16),
        "t": torch.full((1, 3), float(rank)),
        "j": jnp.full((2,), rank, dtype=jnp.int32),
        "n": rank,
        "zero_d": np.array(rank + 0.5),
    }
    out = dp.allgather(x)
    want_rows = np.concatenate([np.full((r + 1, 2), r, np.int16) for r in range(size)])
    np.testing.assert_array_equal(out["rows"], want_rows)
    assert out["rows"].dtype == np.int16
    assert isinstance(out["t"], torch.Tensor) and tuple(out["t"].shape) == (size, 3)
    np.testing.assert_array_equal(out["t"][:, 0].numpy(), np.arange(size, dtype=np.float32))
    np.testing.assert_array_equal(np.asarray(out["j"]), np.repeat(np.arange(size), 2))
    np.testing.assert_array_equal(out["n"], np.arange(size))
    np.testing.assert_array_equal(out["zero_d"], np.arange(size) + 0.5)


def test_broadcast_object_from_every_root(rank: int, size: int) -> None:
    for root in range(size):
        obj = {"rank": rank, "name": "r" * (rank + 1), "set": {rank}}
        assert dp.broadcast_object(obj, root=root) == {
            "rank": root,
            "name": "r" * (root + 1),
            "set": {root},
        }


def test_allgather_object_lists_every_rank(rank: int, size: int) -> None:
    got = dp.allgather_object(("rank", rank, [None] * rank))
    assert got == [("rank", r, [None] * r) for r in range(size)]


def _poll(request: dp.Request, seconds: float = 60.0) -> None:
    deadline = time.monotonic() + seconds
    while not request.test():
        assert time.monotonic() < deadline, "Request.test() never became True"
        time.sleep(0.001)


def test_iallreduce_request_test_and_wait(rank: int, size: int) -> None:
    x = {"a": np.full(5, rank + 1.0), "j": jnp.full(3, rank + 1.0), "n": rank + 1.0}
    request = dp.iallreduce(x, op="avg")
    assert isinstance(request, dp.Request)
    _poll(request)
    out = request.wait()
    assert out["a"] is x["a"]
    mean = (size + 1) / 2
    np.testing.assert_array_equal(out["a"], np.full(5, mean))
    np.testing.assert_array_equal(np.asarray(out["j"]), np.full(3, mean))
    assert out["n"] == mean
    assert request.test() and request.wait() is out  # waiting again returns the same result


def test_iallreduce_scale_and_wait_without_test(rank: int, size: int) -> None:
    x = torch.full((4,), float(rank + 1))
    out = dp.iallreduce(x, op="sum", scale=2.0).wait()
    assert out is x
    assert torch.equal(x, torch.full((4,), float(size * (size + 1))))


def test_ibroadcast_from_every_root(rank: int, size: int) -> None:
    for root in range(size):
        x = {"a": np.full(3, rank, np.int64), "j": jnp.full(2, rank + 0.5), "s": np.int8(rank)}
        request = dp.ibroadcast(x, root=root)
        _poll(request)
        out = request.wait()
        assert out["a"] is x["a"]
        np.testing.assert_array_equal(out["a"], np.full(3, root))
        np.testing.assert_array_equal(np.asarray(out["j"]), np.full(2, root + 0.5))
        assert out["s"] == root and type(out["s"]) is np.int8


def test_wait_all_with_a_list(rank: int, size: int) -> None:
    a, b = np.full(2, rank + 1.0), np.full(3, float(rank))
    requests = [dp.iallreduce(a, op="max"), dp.ibroadcast(b, root=size - 1)]
    results = dp.wait_all(requests)
    assert results[0] is a and results[1] is b
    np.testing.assert_array_equal(a, np.full(2, float(size)))
    np.testing.assert_array_equal(b, np.full(3, float(size - 1)))
    assert all(r.test() for r in requests)


def test_wait_all_without_a_list_waits_for_everything_in_flight(rank: int, size: int) -> None:
    assert dp.wait_all() == []  # nothing in flight
    leaves = [np.full(4, float(rank + i)) for i in range(3)]
    for leaf in leaves:
        dp.iallreduce(leaf)
    results = dp.wait_all()
    assert len(results) == 3 and all(r is leaf for r, leaf in zip(results, leaves, strict=True))
    for i, leaf in enumerate(leaves):
        np.testing.assert_array_equal(leaf, np.full(4, size * (size - 1) / 2 + size * i))
    assert dp.wait_all() == []


def test_barrier_waits_for_the_slowest_rank(rank: int, size: int) -> None:
    # No rank leaves before every rank came: an order, read on the one CLOCK_MONOTONIC that the
    # processes of a machine share. Rank 0 comes last (it sleeps while the others wait for it).
    hosts = dp.allgather_object(socket.gethostname())
    dp.barrier()
    if rank == 0:
        time.sleep(0.3)
    came = time.monotonic()
    dp.barrier()
    left = time.monotonic()
    arrivals = dp.allgather_object(came)
    here = [r for r in range(size) if hosts[r] == hosts[rank]]
    assert left >= max(arrivals[r] for r in here), (left, arrivals)


# --- errors ---------------------------------------------------------------------------------


def test_object_arrays_and_strings_raise_naming_the_path(rank: int) -> None:
    bad = {"a": [np.zeros(2), np.array(["s", 1], dtype=object)]}
    with pytest.raises(TypeError, match=r"^x\['a'\]\[1\]: dtype object is not supported"):
        dp.allreduce(bad)
    with pytest.raises(TypeError, match=r"^x\['b'\]: expected an array .* got builtins.str"):
        dp.allreduce({"b": "text"})
    with pytest.raises(TypeError, match=r"^grads\['fc1'\]\['weight'\]: expected an array"):
        dp.allreduce_gradients({"fc1": {"weight": object()}})
    with pytest.raises(TypeError, match=r"^x\[0\]: dtype str"):
        dp.broadcast([np.array(["a"])])
    with pytest.raises(TypeError, match=r"^x: the integer 36893488147419103232 does not fit"):
        dp.allreduce(2**65)


def test_bad_root_raises_value_error(size: int) -> None:
    for root in (-1, size):
        message = rf"root={root} is not a rank of this world of {size}"
        with pytest.raises(ValueError, match=message):
            dp.broadcast(np.ones(2), root=root)
        with pytest.raises(ValueError, match=message):
            dp.reduce(np.ones(2), root=root)
        with pytest.raises(ValueError, match=message):
            dp.ibroadcast(np.ones(2), root=root)
        with pytest.raises(ValueError, match=message):
            dp.broadcast_object(1, root=root)
        with pytest.raises(ValueError, match=message):
            dp.synchronize({"a": 1.0}, root=root)


@pytest.mark.parametrize("root", [0.0, 1.0, True, "0"], ids=repr)
def test_a_root_that_is_not_an_int_raises_type_error(root: Any) -> None:
    message = rf"root={re.escape(repr(root))} is not a rank: give an int from 0 to"
    for call in (
        lambda: dp.broadcast(np.ones(2), root=root),
        lambda: dp.reduce(np.ones(2), root=root),
        lambda: dp.ibroadcast(np.ones(2), root=root),
        lambda: dp.broadcast_object(1, root=root),
        lambda: dp.synchronize({"a": 1.0}, root=root),
    ):
        with pytest.raises(TypeError, match=message):
            call()


def test_numpy_integer_roots_are_ranks(rank: int, size: int) -> None:
    root = np.int64(size - 1)
    assert dp.broadcast(np.full(2, float(rank)), root=root).tolist() == [size - 1.0] * 2


@pytest.mark.filterwarnings("ignore:.*(nested|Sparse CSR) tensor:UserWarning")
@pytest.mark.parametrize(
    ("make", "message"),
    [
        (lambda: torch.nested.nested_tensor([torch.ones(2), torch.ones(3)]), "a nested torch"),
        (lambda: torch.ones(3).to_sparse(), r"a torch tensor of layout torch\.sparse_coo cannot"),
        (
            lambda: torch.eye(3).to_sparse_csr(),
            r"a torch tensor of layout torch\.sparse_csr cannot",
        ),
        (lambda: torch.ones(3, device="meta"), "a torch tensor on the 'meta' device has no data"),
    ],
    ids=["nested", "sparse_coo", "sparse_csr", "meta"],
)
def test_torch_tensors_without_dense_data_are_refused_by_path(
    make: Callable[[], Any], message: str
) -> None:
    tree = {"a": [make()]}
    with pytest.raises(TypeError, match=rf"^x\['a'\]\[0\]: {message}"):
        dp.allreduce(tree)
    with pytest.raises(TypeError, match=rf"^x\['a'\]\[0\]: {message}"):
        dp.broadcast(tree)


def test_calls_before_initialize_raise_not_initialized(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(world_module, "_world", None)
    assert not dp.initialized()
    calls: list[Callable[[], Any]] = [
        dp.rank,
        dp.size,
        dp.local_rank,
        dp.local_size,
        dp.is_main,
        dp.device,
        dp.get_backend,
        dp.barrier,
        dp.wait_all,
        lambda: dp.allreduce(np.ones(2)),
        lambda: dp.broadcast(1.0),
        lambda: dp.CoalescingReducer(),
    ]
    for call in calls:
        with pytest.raises(dp.NotInitializedError, match=r"call dp\.initialize\(\) first"):
            call()


def test_family_matrix_covers_the_contract() -> None:
    assert set(DTYPES) == {
        "bool",
        "int8",
        "int16",
        "int32",
        "int64",
        "uint8",
        "uint16",
        "uint32",
        "uint64",
        "float16",
        "bfloat16",
        "float32",
        "float64",
        "complex64",
        "complex128",
    }
    assert {"numpy", "torch", "jax", "numpy-scalar", "python-scalar", "cupy"} <= set(FAMILY)


def test_debug_logs_every_collective_with_its_rank(
    rank: int, size: int, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    active = world_module.current()
    monkeypatch.setattr(active, "settings", dataclasses.replace(active.settings, debug=True))
    dp.allreduce({"a": np.ones(2), "b": 1.0})
    dp.allgather(np.ones(1))
    err = capsys.readouterr().err
    assert f"[dataparallel {rank}/{size}] allreduce" in err and "leaves=2" in err
    assert f"[dataparallel {rank}/{size}] allgather leaves=1" in err
    monkeypatch.setattr(active, "settings", dataclasses.replace(active.settings, debug=False))
    dp.allreduce(1.0)
    assert capsys.readouterr().err == ""


def test_an_average_is_the_sum_scaled_bit_for_bit_on_every_path(rank: int, size: int) -> None:
    """Over 2, 4... ranks the shares are scaled before the sum (`dtypes.prescale`), over 3 the
    sum after: either way `avg` gives the same call's `sum` divided by the world's size, bit for
    bit, for one array (a "packed" plan, in place), a packed list, a tree, and torch
    gradients. (The same call: the engine's order of adding depends on the buffers' layout.)"""
    rng = np.random.default_rng(rank)

    def draw(*shape: int) -> np.ndarray:
        return (rng.standard_normal(shape) * 10.0 ** rng.integers(-20, 20, shape)).astype(
            np.float32
        )

    def scaled(leaves: list[Any]) -> list[np.ndarray]:
        for leaf in leaves:
            scale_in_place(leaf, 1 / size)
        return leaves

    one, pair, tree = draw(5000), [draw(100), draw(7, 3)], {"w": draw(70_000), "b": draw(9)}
    want = scaled([dp.allreduce(one.copy(), op="sum"), *dp.allreduce(copy.deepcopy(pair))])
    summed = dp.allreduce(copy.deepcopy(tree))
    want += scaled([summed["w"], summed["b"]])
    got = [dp.allreduce(one, op="avg"), *dp.allreduce(pair, op="avg")]
    averaged = dp.allreduce(tree, op="avg")
    got += [averaged["w"], averaged["b"]]
    inputs, base = torch.from_numpy(draw(4, 300)), torch.nn.Linear(300, 200)
    for op in ("sum", "avg"):
        model = copy.deepcopy(base)
        opt = dp.DistributedOptimizer(torch.optim.SGD(model.parameters(), lr=0.0), op=op)
        model(inputs).square().sum().backward()
        opt.step()
        grads = [p.grad.numpy() for p in model.parameters()]
        (got if op == "avg" else want).extend(grads if op == "avg" else scaled(grads))
    for w, g in zip(want, got, strict=True):
        np.testing.assert_array_equal(g.view(np.uint32), w.view(np.uint32))

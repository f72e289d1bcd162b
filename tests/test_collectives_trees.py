"""Collectives on pytrees, `synchronize`, `allreduce_gradients`, and property-based tests.

Every test passes at any world size; rank r's leaves are computed from r.
"""

from __future__ import annotations

import dataclasses
from collections import namedtuple
from typing import Any

import numpy as np
import optree
import pytest
import torch
from _engine_calls import count_engine_calls
from hypothesis import given, settings
from hypothesis import strategies as st
from hypothesis.extra import numpy as hnp

import dataparallel as dp
from dataparallel.collectives._callplan import CallPlan

jax = pytest.importorskip("jax")
jnp = pytest.importorskip("jax.numpy")

Point = namedtuple("Point", ["x", "y"])


@dataclasses.dataclass
class Layer:
    weight: Any
    bias: Any


@dataclasses.dataclass(frozen=True)
class Frozen:
    a: Any
    b: Any


def host(value: Any) -> np.ndarray:
    """Return a NumPy copy of a leaf of any family."""
    if isinstance(value, torch.Tensor):
        return value.detach().cpu().float().numpy().copy()
    a = np.array(value)
    return a.astype(np.float64) if a.dtype.kind != "c" else a


def assert_same_tree(a: Any, b: Any, path: str = "x") -> None:
    """Assert that `a` and `b` have the same containers (types, keys, fields) all the way down."""
    assert type(a) is type(b), f"{path}: {type(a)} != {type(b)}"
    if isinstance(a, dict):
        assert list(a) == list(b), path
        for key in a:
            assert_same_tree(a[key], b[key], f"{path}[{key!r}]")
    elif isinstance(a, (list, tuple)):
        assert len(a) == len(b), path
        for i, (u, v) in enumerate(zip(a, b, strict=True)):
            assert_same_tree(u, v, f"{path}[{i}]")
    elif dataclasses.is_dataclass(a):
        for f in dataclasses.fields(a):
            assert_same_tree(getattr(a, f.name), getattr(b, f.name), f"{path}.{f.name}")


def rich_tree(rank: int) -> dict[str, Any]:
    """Return a tree with every container and family; float leaves hold rank + 1."""
    v = float(rank + 1)
    return {
        "dict": {"np": np.full((2, 2), v, np.float32), "none": None},
        "list": [torch.full((3,), v), np.full(1, rank + 1, np.int64), rank + 1],
        "tuple": (jnp.full((2,), v), np.float16(v)),
        "point": Point(x=torch.full((2,), v, dtype=torch.float64), y=v),
        "layer": Layer(weight=np.full(2, v), bias=jnp.full(1, v, dtype=jnp.bfloat16)),
        "frozen": Frozen(a=np.full(2, v, np.complex64), b=(rank == 0)),
        "nested": [{"deep": [(np.full(2, v),)]}],
        "empty": {},
        "param": torch.nn.Parameter(torch.full((2,), v)),
    }


def test_tree_structure_types_and_in_place_writes(rank: int, size: int) -> None:
    x = rich_tree(rank)
    out = dp.allreduce(x)
    assert_same_tree(out, x)
    total = size * (size + 1) / 2
    # Mutable leaves are the very objects passed in; JAX arrays and numbers are new.
    assert out["dict"]["np"] is x["dict"]["np"]
    assert out["list"][0] is x["list"][0] and out["param"] is x["param"]
    assert out["point"].x is x["point"].x and out["layer"].weight is x["layer"].weight
    assert out["nested"][0]["deep"][0][0] is x["nested"][0]["deep"][0][0]
    assert out["tuple"][0] is not x["tuple"][0] and out["layer"].bias is not x["layer"].bias
    assert out["dict"]["none"] is None and out["empty"] == {}
    for leaf in optree.tree_leaves(out, namespace="dataparallel"):
        if isinstance(leaf, (bool, np.bool_)):
            assert leaf is True  # bool sum is a logical or: rank 0 holds True
        else:
            np.testing.assert_array_equal(host(leaf), np.broadcast_to(total, host(leaf).shape))
    assert type(out["list"][2]) is int and type(out["tuple"][1]) is np.float16
    assert out["layer"].bias.dtype == jnp.bfloat16
    assert out["param"].requires_grad


def test_three_hundred_leaves_of_mixed_dtypes_and_families(rank: int, size: int) -> None:
    dtypes = (np.float32, np.float64, np.int32, np.int8, np.uint16, np.complex128)
    x: dict[str, Any] = {}
    for i in range(320):
        kind = i % 4
        if kind == 0:
            x[f"n{i:03d}"] = np.full(i % 5, rank + i, dtypes[i % len(dtypes)])
        elif kind == 1:
            x[f"t{i:03d}"] = torch.full((i % 3 + 1,), float(rank + i))
        elif kind == 2:
            x[f"j{i:03d}"] = jnp.full((2,), float(rank + i))
        else:
            x[f"s{i:03d}"] = rank + i
    out = dp.allreduce(x, op="max")
    assert list(out) == list(x)
    for key, leaf in out.items():
        i = int(key[1:])
        assert np.all(host(leaf) == size - 1 + i), key
        if key[0] in "nt":
            assert leaf is x[key]


@pytest.mark.matrix
@pytest.mark.parametrize("op", ["sum", "avg", "prod"])
@pytest.mark.parametrize("dtype", [np.float32, np.float64, np.int32, np.int64])
@pytest.mark.parametrize("kind", ["list", "tuple", "dict"])
def test_trees_of_numpy_arrays_reduce_as_the_general_path(
    rank: int, size: int, op: str, dtype: Any, kind: str
) -> None:
    """Lists, tuples and dicts of one dtype take a "packed" plan (`_plans.py`): same results,
    written in place (non-contiguous arrays too), new arrays for read-only ones, called again
    safely."""
    if op == "avg" and np.dtype(dtype).kind == "i":
        return  # an integer average is refused (tested with the errors)
    from dataparallel import world

    def arrays(step: int) -> list[np.ndarray]:
        wide = np.full((4, 6), rank + step + 1, dtype)
        strided = wide[:, ::2]  # every other column: written back through its strides
        frozen = np.full(5, 2 - rank % 2, dtype)
        frozen.flags.writeable = False
        return [np.full(40, rank + 1, dtype), strided, np.full((2, 3), step + 1, dtype), frozen]

    def tree_of(xs: list[np.ndarray]) -> Any:
        return (
            {"a": xs[0], "b": {"s": xs[1], "c": xs[2]}, "z": xs[3]}
            if kind == "dict"
            else (list(xs) if kind == "list" else tuple(xs))
        )

    def leaves(tree: Any) -> list[Any]:
        return [tree["a"], tree["b"]["s"], tree["b"]["c"], tree["z"]] if kind == "dict" else tree

    for step in range(3):  # the first call makes the plan, the next ones use it
        xs = arrays(step)
        general = dp.allreduce(tree_of([torch.from_numpy(x.copy()) for x in xs]), op=op)
        out = dp.allreduce(tree_of(xs), op=op)
        assert type(out) is type(tree_of(xs)) and (kind != "dict" or list(out) == ["a", "b", "z"])
        for got, x, want in zip(leaves(out), xs, leaves(general), strict=True):
            np.testing.assert_array_equal(got, want.numpy(), strict=True)
            assert (got is x) == x.flags.writeable  # in place, or new when read-only
    plans = [plan for _, plan in world.current().plans.items() if isinstance(plan, CallPlan)]
    assert any(plan.kind == "packed" for plan in plans) or size == 1
    plan_buffers = [plan.buf for plan in plans if plan.buf is not None]
    assert not any(np.shares_memory(leaf, buf) for leaf in leaves(out) for buf in plan_buffers)


@pytest.mark.parametrize("op", ["sum", "avg", "prod", "min", "max"])
@pytest.mark.parametrize("kind", [list, tuple, dict])
def test_a_few_floats_reduce_in_the_handshake_as_the_general_path(
    rank: int, size: int, op: str, kind: type
) -> None:
    """Metrics: Python floats in a container are keyed as they are (`_plans._host_form`); NumPy
    scalars are flattened and staged. Both give Python floats back, with the same values."""
    values = [rank + 0.5, -1.0 / (rank + 3), float("nan") if rank == size - 1 else 2.0]

    def tree_of(xs: list[Any]) -> Any:
        return {"c": xs[0], "a": xs[1], "b": xs[2]} if kind is dict else kind(xs)

    for scale in (None, 0.5):
        out = dp.allreduce(tree_of(values), op=op, scale=scale)
        general = dp.allreduce(tree_of([np.float64(v) for v in values]), op=op, scale=scale)
        assert type(out) is kind and all(type(v) is float for v in optree.tree_leaves(out))
        got, want = optree.tree_leaves(out), optree.tree_leaves(general)
        np.testing.assert_array_equal(np.array(got), np.array(want, np.float64), strict=True)
    if kind is dict:
        assert list(out) == ["c", "a", "b"]


@pytest.mark.parametrize("op", ["sum", "avg"])
def test_a_jax_tree_past_the_plan_limit_makes_one_buffer(
    rank: int, size: int, op: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    """JAX leaves of one dtype over `PLAN_BYTES` ("whole"): the small leaves packed and reduced
    by one engine call, each large leaf by one call from JAX's memory (no copy of ours; an
    average over 2, 4, ... ranks writes its scaled shares into place first), all into one lent
    buffer whose views JAX adopts without a copy (each large leaf 64-byte aligned); a later call
    does not overwrite an earlier call's results."""
    from dataparallel import world

    counts = count_engine_calls(monkeypatch, world.current().backend)
    packed, alone = counts.in_place, counts.into

    def grads(step: int) -> dict[str, Any]:  # "b" (64 bytes), "c" (20), then "v", then "w"
        v = float(rank + 1 + step)
        return {
            "w": jnp.full((300, 1000), v),
            "b": jnp.full(16, -v),
            "c": jnp.full(5, 2 * v),
            "v": jnp.ones((1000, 300)),
        }

    total = sum(float(r + 1) for r in range(size))
    divide = size if op == "avg" else 1
    first = dp.allreduce(grads(0), op=op)
    second = dp.allreduce(grads(10), op=op)
    for out, step in ((first, 0), (second, 10)):
        assert all(isinstance(leaf, jax.Array) for leaf in out.values())
        want = (total + step * size) / divide
        np.testing.assert_allclose(out["w"], np.full((300, 1000), want), rtol=1e-6)
        np.testing.assert_allclose(out["b"], np.full(16, -want), rtol=1e-6)
        np.testing.assert_allclose(out["c"], np.full(5, 2 * want), rtol=1e-6)
        np.testing.assert_allclose(out["v"], np.full((1000, 300), size / divide), rtol=1e-6)
    if size > 1 and op == "avg" and size & (size - 1) == 0:  # shares scaled exactly, first:
        assert packed == [16 + 5, 300_000, 300_000] * 2  # each large leaf's written scaled
        assert alone == []  # into its place, then reduced there in place
    elif size > 1:
        assert packed == [16 + 5] * 2
        assert alone == [300_000, 300_000] * 2
        assert not any(counts.into_writable)  # JAX's own memory, read where it lies
    if size > 1:
        b, c, v, w = (first[k].unsafe_buffer_pointer() for k in ("b", "c", "v", "w"))
        assert c == b + 64 and v == b + 128 and w == v + 1_200_000  # one buffer, adopted


def test_a_whole_plan_with_one_small_leaf_packs_nothing(
    rank: int, size: int, monkeypatch: pytest.MonkeyPatch
) -> None:
    """One small leaf has nothing to be packed with: every leaf is reduced from JAX's memory
    into its place, each starting 64-byte aligned (JAX adopts it) though the first is 12 bytes."""
    from dataparallel import world

    alone = count_engine_calls(monkeypatch, world.current().backend).into
    tree = [jnp.full(3, rank + 1, jnp.int32)]
    big = [jnp.full((700, 300), rank + 1, jnp.int32), jnp.ones((300, 500), jnp.int32)]
    out = dp.allreduce(tree + big)
    total = size * (size + 1) // 2
    np.testing.assert_array_equal(out[0], np.full(3, total))
    np.testing.assert_array_equal(out[1], np.full((700, 300), total))
    np.testing.assert_array_equal(out[2], np.full((300, 500), size))
    if size > 1:
        assert alone == [3, 210_000, 150_000]
        assert all(leaf.unsafe_buffer_pointer() % 64 == 0 for leaf in out)


def test_a_jax_tree_past_the_whole_limit_goes_leaf_by_leaf(
    rank: int, size: int, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Over `WHOLE_BYTES` (256 MiB; 2 MiB here), `Fusion`: each leaf over the bucket size is
    reduced from JAX's memory into its own lent buffer."""
    from dataparallel import world
    from dataparallel.collectives import _onebuffer

    monkeypatch.setattr(_onebuffer, "WHOLE_BYTES", 2 << 20)
    calls = count_engine_calls(monkeypatch, world.current().backend).into
    tree = [jnp.full((1000, 300), rank + 1.0), jnp.ones((300, 1000))]  # 2.4 MB in all
    out = dp.allreduce(tree)
    np.testing.assert_array_equal(out[0], np.full((1000, 300), size * (size + 1) / 2))
    np.testing.assert_array_equal(out[1], np.full((300, 1000), float(size)))
    if size > 1:  # one call per leaf
        assert calls == [300_000, 300_000]


def test_ranks_mixing_jax_and_numpy_past_the_plan_limit_are_told(rank: int, size: int) -> None:
    """A JAX tree past the plan limit goes as one message, a NumPy tree in buckets: ranks that
    mix them raise `CollectiveMismatchError` naming how each rank's values travel."""
    if size == 1:
        pytest.skip("needs peers")
    shapes = [(600, 600), (16,)]
    if rank == 0:
        tree = [np.ones(shape, np.float32) for shape in shapes]
    else:
        tree = [jnp.ones(shape, jnp.float32) for shape in shapes]
    with pytest.raises(dp.CollectiveMismatchError, match=r"messages: .*one message of the small"):
        dp.allreduce(tree)
    np.testing.assert_array_equal(dp.allreduce(np.ones(3)), np.full(3, size))  # the world goes on


@pytest.mark.parametrize("bucket", ["bucket-larger", "bucket-smaller"])
def test_a_tree_past_the_plan_limit_takes_the_general_path(
    rank: int, size: int, bucket: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A "packed" plan is one bucket of at most `PLAN_BYTES`: larger trees go through `Fusion`."""
    from dataparallel import world
    from dataparallel.collectives._onebuffer import PLAN_BYTES

    active = world.current()
    limit = 4 * PLAN_BYTES if bucket == "bucket-larger" else PLAN_BYTES // 4
    monkeypatch.setattr(
        active, "settings", dataclasses.replace(active.settings, bucket_bytes=limit)
    )
    big = [np.full(min(limit, PLAN_BYTES) // 8, rank + 1.0), np.ones(3)]
    out = dp.allreduce(big)
    assert out[0] is big[0] and out[0][-1] == size * (size + 1) / 2 and out[1][0] == size
    shapes = [big[0].shape, big[1].shape]
    packed = [
        plan
        for _, plan in active.plans.items()
        if isinstance(plan, CallPlan) and [view.shape for view in plan.views] == shapes
    ]
    assert packed == []


def test_non_contiguous_inputs_are_reduced_and_written_back_in_place(rank: int, size: int) -> None:
    base = np.arange(24, dtype=np.float64).reshape(4, 6) + 100 * rank
    strided = base[:, ::2]  # every other column: not contiguous
    t_base = torch.arange(6, dtype=torch.float32).reshape(2, 3) + 100 * rank
    transposed = t_base.T
    assert not strided.flags.c_contiguous and not transposed.is_contiguous()
    want_strided = sum(np.arange(24.0).reshape(4, 6)[:, ::2] + 100 * r for r in range(size))
    want_t = sum(np.arange(6.0).reshape(2, 3).T + 100 * r for r in range(size))
    out = dp.allreduce({"s": strided, "t": transposed})
    assert out["s"] is strided and out["t"] is transposed
    np.testing.assert_array_equal(strided, want_strided)
    np.testing.assert_array_equal(transposed.numpy(), want_t)
    # The columns between the strided ones are untouched.
    np.testing.assert_array_equal(
        base[:, 1::2], np.arange(24.0).reshape(4, 6)[:, 1::2] + 100 * rank
    )
    # Alone (not packed with other leaves), a strided leaf too.
    column = np.full((3, 2), float(rank))[:, 1]
    np.testing.assert_array_equal(dp.allreduce(column), np.full(3, size * (size - 1) / 2))


def test_read_only_numpy_array_comes_back_new(rank: int, size: int) -> None:
    x = np.full(3, rank + 1.0)
    x.flags.writeable = False
    out = dp.allreduce(x)
    assert out is not x
    np.testing.assert_array_equal(out, np.full(3, size * (size + 1) / 2))
    np.testing.assert_array_equal(x, np.full(3, rank + 1.0))


def test_a_string_field_of_a_dataclass_is_named_in_the_error() -> None:
    @dataclasses.dataclass
    class Named:
        weight: Any
        name: str

    with pytest.raises(TypeError, match=r"^x\['layer'\]\.name: expected an array"):
        dp.allreduce({"layer": Named(np.ones(2), "fc")})


def test_empty_tree_and_empty_leaves(size: int) -> None:
    assert dp.allreduce({}) == {}
    assert dp.allreduce([]) == []
    assert dp.allreduce(None) is None
    out = dp.allreduce({"e": np.zeros((0, 3)), "f": np.ones(2)})
    assert out["e"].shape == (0, 3)
    np.testing.assert_array_equal(out["f"], np.full(2, float(size)))


# --- synchronize ----------------------------------------------------------------------------


class Tag:
    """An object that is not a container: a leaf that synchronize keeps or pickles."""

    def __init__(self, rank: int) -> None:
        self.rank = rank

    def __eq__(self, other: object) -> bool:
        return isinstance(other, Tag) and other.rank == self.rank

    __hash__ = None  # type: ignore[assignment]


def state(rank: int) -> dict[str, Any]:
    return {
        "w": np.full(3, float(rank)),
        "t": torch.full((2,), float(rank)),
        "j": jnp.full((2,), float(rank)),
        "step": rank,
        "flag": rank == 0,
        "np_bool": np.bool_(rank == 0),
        "np_scalar": np.int16(rank),
        "none": None,
        "name": f"rank{rank}",
        "obj": Tag(rank),
    }


def test_synchronize_broadcasts_arrays_and_numbers_keeps_objects(rank: int, size: int) -> None:
    for root in range(size):
        x = state(rank)
        out = dp.synchronize(x, root=root)
        assert out["w"] is x["w"] and out["t"] is x["t"]
        np.testing.assert_array_equal(out["w"], np.full(3, float(root)))
        assert torch.equal(out["t"], torch.full((2,), float(root)))
        np.testing.assert_array_equal(np.asarray(out["j"]), np.full(2, float(root)))
        assert out["step"] == root and type(out["step"]) is int
        assert out["flag"] is (root == 0)
        assert out["np_bool"] == (root == 0) and type(out["np_bool"]) is np.bool_
        assert out["np_scalar"] == root and type(out["np_scalar"]) is np.int16
        assert out["none"] is None
        assert out["name"] == f"rank{rank}" and out["obj"] == Tag(rank)


def test_synchronize_objects_broadcast(rank: int, size: int) -> None:
    root = size - 1
    out = dp.synchronize(state(rank), root=root, objects="broadcast")
    assert out["name"] == f"rank{root}" and out["obj"] == Tag(root)
    assert out["step"] == root and out["none"] is None


def test_synchronize_rejects_bad_objects_value() -> None:
    with pytest.raises(ValueError, match=r"objects='all' is not one of \('keep', 'broadcast'\)"):
        dp.synchronize({"a": 1.0}, objects="all")


# --- allreduce_gradients --------------------------------------------------------------------


def test_allreduce_gradients_averages_by_default(rank: int, size: int) -> None:
    grads: dict[str, Any] = {
        "fc1": {"weight": torch.full((2, 2), float(rank + 1))},
        "b": np.full(2, rank + 1.0),
    }
    out = dp.allreduce_gradients(grads)
    assert out["fc1"]["weight"] is grads["fc1"]["weight"]
    mean = (size + 1) / 2
    assert torch.allclose(out["fc1"]["weight"], torch.full((2, 2), mean))
    np.testing.assert_allclose(out["b"], np.full(2, mean))


def test_allreduce_gradients_sum(rank: int, size: int) -> None:
    out = dp.allreduce_gradients({"g": jnp.full(3, rank + 1.0)}, op="sum")
    np.testing.assert_array_equal(np.asarray(out["g"]), np.full(3, size * (size + 1) / 2))


def test_allreduce_gradients_names_integer_leaves(rank: int) -> None:
    with pytest.raises(TypeError, match=r"^grads\['steps'\]: op='avg' on int32 values"):
        dp.allreduce_gradients({"steps": np.zeros(2, np.int32)})


# --- property-based -------------------------------------------------------------------------

_DTYPES = st.sampled_from([np.float64, np.float32, np.int32, np.int64, np.int16])
_ARRAYS = hnp.arrays(
    _DTYPES,
    hnp.array_shapes(min_dims=0, max_dims=2, min_side=0, max_side=3),
    elements=st.integers(-20, 20),
)
_LEAVES = _ARRAYS | st.integers(-20, 20) | st.integers(-20, 20).map(float)
_TREES = st.recursive(
    _LEAVES,
    lambda children: (
        st.lists(children, max_size=3)
        | st.dictionaries(st.text("abc", min_size=1, max_size=2), children, max_size=3)
        | st.tuples(children, children)
        | st.builds(Point, children, children)
    ),
    max_leaves=12,
)


def _shift(tree: Any, by: int) -> Any:
    def shift(a: Any) -> Any:
        return np.array(a + by, dtype=a.dtype) if isinstance(a, np.ndarray) else a + by

    return optree.tree_map(shift, tree)


def _agree(ok: bool, why: str) -> None:
    """Fail on every rank if the check failed on any, so the ranks stay in lockstep."""
    verdicts = dp.allgather_object((ok, why))
    failed = [f"rank {r}: {w}" for r, (good, w) in enumerate(verdicts) if not good]
    assert not failed, "\n".join(failed)


@settings(max_examples=25)
@given(_TREES, st.sampled_from(["sum", "max", "min"]))
def test_random_trees_come_back_with_their_structure_and_values(tree: Any, op: str) -> None:
    rank, size = dp.rank(), dp.size()
    x = _shift(tree, rank)
    out = dp.allreduce(x, op=op)
    shifts = {"sum": size * (size - 1) // 2, "max": size - 1, "min": 0}[op]
    scale = size if op == "sum" else 1
    ok, why = True, ""
    try:
        assert optree.tree_structure(out) == optree.tree_structure(tree)
        for got, base, sent in zip(
            optree.tree_leaves(out), optree.tree_leaves(tree), optree.tree_leaves(x), strict=True
        ):
            assert type(got) is type(base)
            if isinstance(base, np.ndarray):
                assert got is sent and got.dtype == base.dtype and got.shape == base.shape
            np.testing.assert_array_equal(got, base * scale + shifts)
    except AssertionError as exc:
        ok, why = False, str(exc)
    _agree(ok, why)


@settings(max_examples=15)
@given(_TREES, st.integers(0, 7))
def test_random_trees_broadcast_from_any_root(tree: Any, pick: int) -> None:
    rank, size = dp.rank(), dp.size()
    root = pick % size
    out = dp.broadcast(_shift(tree, rank), root=root)
    ok, why = True, ""
    try:
        assert optree.tree_structure(out) == optree.tree_structure(tree)
        for got, base in zip(optree.tree_leaves(out), optree.tree_leaves(tree), strict=True):
            np.testing.assert_array_equal(got, base + root)
    except AssertionError as exc:
        ok, why = False, str(exc)
    _agree(ok, why)


@pytest.mark.parametrize("bucket_bytes", [1, 100, 4096])
def test_trees_larger_than_a_bucket(
    bucket_bytes: int, rank: int, size: int, monkeypatch: pytest.MonkeyPatch
) -> None:
    active = dp.world.current()
    monkeypatch.setattr(
        active, "settings", dataclasses.replace(active.settings, bucket_bytes=bucket_bytes)
    )
    dtypes = (np.float32, np.float64, np.int32, np.float16, np.complex64)
    x: dict[str, Any] = {
        f"a{i:02d}": np.full(i % 7 + 1, rank + 1, dtypes[i % len(dtypes)]) for i in range(40)
    }
    x["bf16"] = torch.full((300,), float(rank + 1), dtype=torch.bfloat16)
    x["big"] = np.full(2000, float(rank + 1))
    x["jax"] = jnp.full((5,), float(rank + 1), dtype=jnp.bfloat16)
    total = size * (size + 1) / 2
    out = dp.iallreduce(x, scale=2.0).wait()
    for key, leaf in out.items():
        assert np.all(host(leaf) == 2.0 * total), key
    out = dp.broadcast(out, root=size - 1)
    for key, leaf in out.items():
        assert np.all(host(leaf) == 2.0 * total), key  # every rank now holds the same values
    y = {k: v for k, v in x.items() if k != "jax" and "complex" not in str(v.dtype)}
    for leaf in y.values():
        leaf[...] = rank + 1
    out = dp.reduce(y, op="max", root=size - 1)
    for key, leaf in out.items():
        assert np.all(host(leaf) == (size if rank == size - 1 else rank + 1)), key


@pytest.mark.parametrize("joined", [False, True], ids=["all-ranks", "rank-0-joined"])
def test_an_oversize_leaf_goes_at_once_and_the_open_bucket_keeps_filling(
    joined: bool, rank: int, size: int, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Small, large, small: two calls (the large one, then both small ones), not three; a rank
    that has joined (`dp.join`) makes the same calls on zeros."""
    if joined and size == 1:
        pytest.skip("a joined rank needs another rank to answer")
    active = dp.world.current()
    monkeypatch.setattr(active, "settings", dataclasses.replace(active.settings, bucket_bytes=256))
    backend = active.backend
    sent: list[int] = []
    blocking = backend.allreduce

    def allreduce(buf: Any, op: Any) -> None:
        sent.append(buf.size)
        blocking(buf, op)

    monkeypatch.setattr(backend, "allreduce", allreduce)
    if joined and rank == 0:
        dp.join()
        assert sent == [2000, 16]  # the replay's calls: the same as the others'
        return
    tree = [np.full(8, rank + 1.0), np.full(2000, rank + 1.0), np.full(8, 1.0)]
    out = dp.allreduce(tree)
    live = [r for r in range(size) if not (joined and r == 0)]
    np.testing.assert_array_equal(out[1], np.full(2000, sum(r + 1.0 for r in live)))
    np.testing.assert_array_equal(out[0], np.full(8, sum(r + 1.0 for r in live)))
    np.testing.assert_array_equal(out[2], np.full(8, float(len(live))))
    assert sent == [2000, 16]
    if joined:
        dp.join()

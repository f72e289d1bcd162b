"""Flattening pytrees (`dataparallel.arrays.tree`): leaves, readable paths, round trips."""

from __future__ import annotations

import collections
import dataclasses
from typing import Any, NamedTuple

import numpy as np
import optree
import pytest

from dataparallel.arrays import tree


class Pair(NamedTuple):
    first: Any
    second: Any


@dataclasses.dataclass
class Linear:
    weight: Any
    bias: Any = None


@dataclasses.dataclass(frozen=True)
class Frozen:
    a: Any
    b: Any


@dataclasses.dataclass
class WithPostInit:
    x: Any
    calls: list[int] = dataclasses.field(default_factory=list)

    def __post_init__(self) -> None:
        if isinstance(self.calls, list):
            self.calls.append(1)


class Opaque:
    """Not a container: a leaf."""


def sample() -> dict[str, Any]:
    return {
        "b": [np.zeros(2), (1.0, None)],
        "a": Pair(first=np.ones(1), second={"z": 3}),
        "fc": Linear(weight=np.ones((2, 2)), bias=None),
        "frozen": Frozen(a=1, b=[2]),
        "none": None,
        "empty": [],
    }


def test_paths_name_every_container() -> None:
    flat = tree.flatten(sample(), "grads")
    assert flat.paths == [
        "grads['a'].first",
        "grads['a'].second['z']",
        "grads['b'][0]",
        "grads['b'][1][0]",
        "grads['fc'].weight",
        "grads['frozen'].a",
        "grads['frozen'].b[0]",
    ]
    assert [flat.path(i) for i in range(len(flat.leaves))] == flat.paths
    assert len(flat.leaves) == 7


def test_default_name_is_x() -> None:
    assert tree.flatten([1, {"k": 2}]).paths == ["x[0]", "x[1]['k']"]
    assert tree.flatten(np.ones(2)).paths == ["x"]


def test_none_is_an_empty_node_not_a_leaf() -> None:
    flat = tree.flatten({"a": None, "b": 1})
    assert flat.leaves == [1]
    assert tree.unflatten(flat.spec, [5]) == {"a": None, "b": 5}
    assert tree.flatten(None).leaves == []
    assert tree.unflatten(tree.flatten(None).spec, []) is None


def test_unflatten_restores_types_and_key_order() -> None:
    original = sample()
    flat = tree.flatten(original)
    rebuilt = tree.unflatten(flat.spec, [f"leaf{i}" for i in range(len(flat.leaves))])
    assert list(rebuilt) == list(original)  # insertion order, though leaves are sorted by key
    assert type(rebuilt["a"]) is Pair and rebuilt["a"].first == "leaf0"
    assert type(rebuilt["fc"]) is Linear and rebuilt["fc"].weight == "leaf4"
    assert rebuilt["fc"].bias is None
    assert type(rebuilt["frozen"]) is Frozen and rebuilt["frozen"].b == ["leaf6"]
    assert rebuilt["b"][1] == ("leaf3", None) and rebuilt["none"] is None and rebuilt["empty"] == []


def test_dataclasses_are_rebuilt_without_running_init() -> None:
    obj = WithPostInit(x=np.zeros(1))
    assert obj.calls == [1]
    flat = tree.flatten(obj)
    assert flat.paths == ["x.x", "x.calls[0]"]
    rebuilt = tree.unflatten(flat.spec, ["new", 7])
    assert type(rebuilt) is WithPostInit and rebuilt.x == "new" and rebuilt.calls == [7]


def test_dataclasses_are_registered_in_dataparallel_s_namespace_only() -> None:
    @dataclasses.dataclass
    class Local:
        w: Any

    obj = Local(w=np.ones(1))
    assert tree.flatten({"m": obj}).paths == ["x['m'].w"]
    # The user's optree registry is left alone: there the dataclass is still a leaf.
    assert optree.tree_leaves({"m": obj}) == [obj]  # type: ignore[arg-type]


def test_mapping_and_sequence_types_are_kept() -> None:
    ordered = collections.OrderedDict([("z", 1), ("a", 2)])
    default = collections.defaultdict(list, {"k": [3]})
    for container in (ordered, default, (4, 5), [6]):
        flat = tree.flatten(container)
        rebuilt = tree.unflatten(flat.spec, flat.leaves)
        assert type(rebuilt) is type(container) and rebuilt == container
    assert list(tree.unflatten(tree.flatten(ordered).spec, [1, 2])) == ["z", "a"]


def test_unknown_objects_and_strings_are_leaves() -> None:
    opaque = Opaque()
    flat = tree.flatten({"o": opaque, "s": "text", "n": 3})
    assert flat.leaves == [3, opaque, "text"] and flat.paths == ["x['n']", "x['o']", "x['s']"]


def test_structure_ignores_values_and_sees_containers() -> None:
    a = tree.flatten({"w": np.zeros(2), "b": [1, 2]}).structure()
    b = tree.flatten({"w": np.ones(5), "b": [3.0, "x"]}).structure()
    assert a == b
    assert tree.flatten({"w": 1, "c": [1, 2]}).structure() != a
    assert tree.flatten({"w": 1, "b": (1, 2)}).structure() != a
    assert tree.flatten({"w": 1, "b": [1, 2, 3]}).structure() != a
    assert tree.flatten(Pair(1, 2)).structure() != tree.flatten((1, 2)).structure()


def test_three_hundred_leaves() -> None:
    big = {f"layer{i:03d}": {"w": i, "b": [i, i]} for i in range(110)}
    flat = tree.flatten(big)
    assert len(flat.leaves) == 330
    assert flat.path(0) == "x['layer000']['b'][0]"
    assert tree.unflatten(flat.spec, flat.leaves) == big


@pytest.mark.parametrize("leaf", [np.zeros(3), 1.5, "s", Opaque()])
def test_a_bare_leaf_is_its_own_tree(leaf: Any) -> None:
    flat = tree.flatten(leaf)
    assert flat.leaves == [leaf] and flat.paths == ["x"]
    assert tree.unflatten(flat.spec, [leaf]) is leaf


# -- nodes registered with JAX only (flax's FrozenDict, register_pytree_node_class) -------------


def _jax_box() -> type:
    jax = pytest.importorskip("jax")

    @jax.tree_util.register_pytree_node_class
    class Box:
        def __init__(self, a: Any, b: Any) -> None:
            self.a, self.b = a, b

        def tree_flatten(self) -> tuple[tuple[Any, Any], str]:
            return (self.a, self.b), "meta"

        @classmethod
        def tree_unflatten(cls, aux: str, children: Any) -> Any:
            assert aux == "meta"
            return cls(*children)

    return Box


def test_jax_registered_nodes_flatten_through_jax() -> None:
    box = _jax_box()
    flat = tree.flatten({"box": box(np.ones(2), [3.0, None])}, "params")
    assert [type(leaf) for leaf in flat.leaves] == [np.ndarray, float]
    rebuilt = tree.unflatten(flat.spec, [np.zeros(2), 4.0])
    assert type(rebuilt["box"]) is box
    np.testing.assert_array_equal(rebuilt["box"].a, np.zeros(2))
    assert rebuilt["box"].b == [4.0, None]


def test_jax_registered_nodes_are_reduced_across_ranks(world: Any, rank: int, size: int) -> None:
    import dataparallel as dp

    box = _jax_box()
    jnp = pytest.importorskip("jax.numpy")
    out = dp.allreduce(box(jnp.full(3, rank + 1.0), {"n": float(rank)}))
    assert type(out) is box
    np.testing.assert_allclose(np.asarray(out.a), np.full(3, size * (size + 1) / 2))
    assert out.b == {"n": float(size * (size - 1) / 2)}
    synced = dp.synchronize(box(jnp.full(1, float(rank)), "kept"))
    np.testing.assert_array_equal(np.asarray(synced.a), [0.0])
    assert synced.b == "kept"

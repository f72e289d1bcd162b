"""Flatten and unflatten pytrees (on optree), with readable leaf paths for error messages.

Containers are dict, list, tuple, namedtuple, `None` (an empty node, so it stays `None`), anything
registered with optree, dataclasses, and nodes registered with JAX only (flax's `FrozenDict`,
`register_pytree_node_class` classes). The last two are registered on first sight in
dataparallel's own optree namespace (so user registrations elsewhere are left alone); JAX nodes
flatten and unflatten through JAX's own registry.
"""

from __future__ import annotations

import dataclasses
import functools
import sys
from collections.abc import Hashable, Iterable
from typing import TYPE_CHECKING, Any, NamedTuple

import numpy as np
import optree

from dataparallel import caches
from dataparallel.types import Tree

if TYPE_CHECKING:
    from jax.tree_util import PyTreeDef

__all__ = ["Flat", "flatten", "unflatten"]

NAMESPACE = "dataparallel"


class Flat(NamedTuple):
    """A flattened tree: its leaves, its structure, and the leaves' paths (`x['fc1'].weight`).

    Paths are spelled out on demand (`path(i)`, `paths`): they are for error messages, and
    spelling them for every call would cost more than a small allreduce.
    """

    leaves: list[Any]  # arrays and numbers of any family: callers look at them as they are
    spec: optree.PyTreeSpec
    name: str

    def path(self, i: int) -> str:
        """Return the path of leaf `i`, rooted at the tree's name."""
        return str(optree.treespec_accessors(self.spec)[i].codify(self.name))

    @property
    def paths(self) -> list[str]:
        """Return the paths of every leaf."""
        return [self.path(i) for i in range(len(self.leaves))]

    def structure(self) -> str:
        """Return a description of the structure that is equal on every rank for equal trees."""
        return _structure(self.spec)


# Dataclass types registered in NAMESPACE, mirroring optree's registry: kept for the process's life
# (unregistering would break the specs of trees still held), unlike the caches below, which
# `dp.finalize()` clears (`_clear`).
_registered: set[type] = set()
# Leaves that are certainly not dataclasses, checked in C before any Python-level test.
_PLAIN = (np.ndarray, np.generic, bool, int, float, complex, str, bytes)


def _is_unregistered_dataclass(x: object) -> bool:
    return (
        not isinstance(x, _PLAIN)
        and dataclasses.is_dataclass(x)
        and not isinstance(x, type)
        and type(x) not in _registered
    )


def _register_dataclass(cls: type) -> None:
    names = tuple(f.name for f in dataclasses.fields(cls))

    def flatten(obj: object) -> tuple[tuple[object, ...], None, tuple[str, ...]]:
        return tuple(getattr(obj, n) for n in names), None, names

    def unflatten(_: Hashable | None, children: Iterable[object]) -> object:
        obj: object = object.__new__(cls)
        for name, child in zip(names, children, strict=True):
            object.__setattr__(obj, name, child)
        return obj

    optree.register_pytree_node(
        cls,
        flatten,
        unflatten,  # type: ignore[arg-type]  # optree's stub wants a Collection; any class works
        path_entry_type=optree.GetAttrEntry,
        namespace=NAMESPACE,
    )
    _registered.add(cls)


def _is_jax_node(x: object) -> bool:
    """Return whether JAX (loaded) sees `x` as a container that optree does not know."""
    kind = type(x)
    if kind in _leaf_types or isinstance(x, _PLAIN):
        return False
    jax = sys.modules.get("jax")
    if jax is None or isinstance(x, jax.Array) or jax.tree_util.all_leaves([x]):
        _leaf_types.add(kind)  # a leaf to JAX too: never asked again
        return False
    return kind not in _registered


def _register_jax_node(cls: type) -> None:
    jax = sys.modules["jax"]

    def flatten(obj: object) -> tuple[list[object], PyTreeDef]:
        def one_level(y: object) -> bool:
            return y is not obj

        children = jax.tree_util.tree_leaves(obj, is_leaf=one_level)
        return children, jax.tree_util.tree_structure(obj, is_leaf=one_level)

    def unflatten(treedef: PyTreeDef, children: Iterable[object]) -> object:
        return treedef.unflatten(list(children))

    optree.register_pytree_node(
        cls,
        flatten,
        unflatten,  # type: ignore[arg-type]  # as above: any container JAX knows
        namespace=NAMESPACE,
    )
    _registered.add(cls)


_leaf_types: set[type] = set()  # types JAX sees as leaves (asked once per type)


@dataclasses.dataclass
class _KnownLeaves:
    """Types found to be leaves (neither kind of node above), and whether JAX was loaded then."""

    jax_loaded: bool = False
    types: set[type] = dataclasses.field(default_factory=set)


_known = _KnownLeaves()


def flatten(tree: Tree, name: str = "x") -> Flat:
    """Flatten `tree` into leaves, their paths (rooted at `name`) and its structure."""
    jax_loaded = "jax" in sys.modules
    if _known.jax_loaded != jax_loaded:  # JAX just came: its containers must be asked again
        _known.jax_loaded = jax_loaded
        _known.types.clear()
    while True:  # an unregistered dataclass is a leaf to optree: register it and flatten again
        leaves, spec = optree.tree_flatten(tree, none_is_leaf=False, namespace=NAMESPACE)
        kinds = set(map(type, leaves))
        if kinds <= _known.types:  # the usual case: every leaf's type was asked before
            break
        dataclass_types = {type(leaf) for leaf in leaves if _is_unregistered_dataclass(leaf)}
        jax_types = {type(leaf) for leaf in leaves if _is_jax_node(leaf)} - dataclass_types
        if not dataclass_types and not jax_types:
            _known.types.update(kinds - {type})  # a class's answer is its own, not its type's
            break
        for cls in dataclass_types:
            _register_dataclass(cls)
        for cls in jax_types:
            _register_jax_node(cls)
    return Flat(leaves, spec, name)


@functools.lru_cache(maxsize=256)
def _structure(spec: optree.PyTreeSpec) -> str:
    return str(spec)


@caches.register
def _clear() -> None:
    """Forget the types asked about and the structures spelt (they are asked again)."""
    _leaf_types.clear()
    _known.jax_loaded = False
    _known.types.clear()
    _structure.cache_clear()


def unflatten(spec: optree.PyTreeSpec, leaves: list[object]) -> Tree:
    """Rebuild a tree of `spec`'s structure from `leaves`."""
    return optree.tree_unflatten(spec, leaves)

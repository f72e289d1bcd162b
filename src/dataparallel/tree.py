"""Flatten and unflatten pytrees (on optree), with readable leaf paths for error messages.

Containers are dict, list, tuple, namedtuple, `None` (an empty node, so it stays `None`), anything
registered with optree, and dataclasses, which are registered on first sight in dataparallel's own
optree namespace (so user registrations elsewhere are left alone).
"""

from __future__ import annotations

import dataclasses
from typing import Any, NamedTuple

import optree

__all__ = ["Flat", "flatten", "unflatten"]

NAMESPACE = "dataparallel"


class Flat(NamedTuple):
    """A flattened tree: its leaves, their paths (`x['fc1'].weight`) and the structure."""

    leaves: list[Any]
    paths: list[str]
    spec: optree.PyTreeSpec


def _is_unregistered_dataclass(x: Any) -> bool:
    return (
        dataclasses.is_dataclass(x)
        and not isinstance(x, type)
        and type(x) not in optree.register_pytree_node.get(namespace=NAMESPACE)  # type: ignore[attr-defined]
    )


def _register_dataclass(cls: type) -> None:
    names = tuple(f.name for f in dataclasses.fields(cls))

    def flatten(obj: Any) -> tuple[tuple[Any, ...], None, tuple[str, ...]]:
        return tuple(getattr(obj, n) for n in names), None, names

    def unflatten(_: None, children: Any) -> Any:
        obj = object.__new__(cls)
        for name, child in zip(names, children, strict=True):
            object.__setattr__(obj, name, child)
        return obj

    optree.register_pytree_node(
        cls,
        flatten,  # type: ignore[arg-type]
        unflatten,
        path_entry_type=optree.GetAttrEntry,
        namespace=NAMESPACE,
    )


def flatten(tree: Any, name: str = "x") -> Flat:
    """Flatten `tree` into leaves, their paths (rooted at `name`) and its structure."""
    while True:
        accessors, leaves, spec = optree.tree_flatten_with_accessor(
            tree, is_leaf=_is_unregistered_dataclass, none_is_leaf=False, namespace=NAMESPACE
        )
        fresh = {type(leaf) for leaf in leaves if _is_unregistered_dataclass(leaf)}
        if not fresh:
            break
        for cls in fresh:
            _register_dataclass(cls)
    paths = [accessor.codify(name) for accessor in accessors]
    return Flat(leaves, paths, spec)


def unflatten(spec: optree.PyTreeSpec, leaves: list[Any]) -> Any:
    """Rebuild a tree of `spec`'s structure from `leaves`."""
    return optree.tree_unflatten(spec, leaves)

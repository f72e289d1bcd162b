"""Typed names for what the public calls take: trees of arrays, and reduction ops."""

from __future__ import annotations

from typing import Any, Literal, TypeAlias, TypeVar

__all__ = ["Op", "Tree", "TreeT", "WireDtype"]

# A pytree: an array (NumPy, PyTorch, JAX, CuPy), a number, None, or a dict, list, tuple,
# namedtuple or dataclass of them (the tree library is optree). Its structure is not checked
# statically: the calls check it at run time and name the leaf's path in their errors.
Tree: TypeAlias = Any
# A tree that a call gives back with its own structure and leaf types (reduced or broadcast values:
# arrays written in place, numbers and JAX arrays new ones of the same type).
TreeT = TypeVar("TreeT")

# An element-wise reduction: "avg" is a sum divided by the world's size.
Op: TypeAlias = Literal["sum", "prod", "min", "max", "avg"]

# A 16-bit float dtype that floating values may travel as (compression's wire dtype; bfloat16 is
# held on the host as its raw bits, `uint16`).
WireDtype: TypeAlias = Literal["float16", "bfloat16"]

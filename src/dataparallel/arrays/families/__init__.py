"""Array families: which family a leaf is of (`family_of`, `array_family`), one adapter per family.

A family says what a leaf is and how to see or stage its memory on the host (`base.Family`); the
families are `host.py` (NumPy, numbers), `torch.py`, `jax.py` and `cupy.py`. Callers ask this
package which family a leaf is of and import the families' names from here, so that no caller
needs to know which frameworks exist: a framework is never imported here, only recognized once
the program has imported it.
"""

from __future__ import annotations

import sys
from typing import TYPE_CHECKING, cast

import numpy as np

from dataparallel.arrays.dtypes import check_dtype
from dataparallel.arrays.families.base import Family, Staged, Work, stage, write_back
from dataparallel.arrays.families.cupy import CupyFamily
from dataparallel.arrays.families.host import NumpyFamily, Scalar, ScalarFamily
from dataparallel.arrays.families.jax import JaxFamily
from dataparallel.arrays.families.torch import TorchFamily

if TYPE_CHECKING:
    import torch

__all__ = [
    "Family",
    "Scalar",
    "Staged",
    "Work",
    "array_family",
    "family_of",
    "stage",
    "write_back",
]

_NUMPY, _SCALAR = NumpyFamily(), ScalarFamily()
_TORCH, _JAX, _CUPY = TorchFamily(), JaxFamily(), CupyFamily()
_ARRAY_FAMILIES: dict[str, Family] = {"numpy": _NUMPY, "torch": _TORCH, "jax": _JAX, "cupy": _CUPY}


def array_family(x: object) -> str | None:
    """Return `"numpy"`, `"torch"`, `"jax"` or `"cupy"` for an array of that family, else None.

    No framework is imported: an object of a framework's type means it is imported already.
    torch.Tensor subclasses (`nn.Parameter`, ...) count as torch.

    >>> array_family(np.zeros(2)), array_family(1.0)
    ('numpy', None)
    """
    if isinstance(x, np.ndarray):
        return "numpy"
    root = type(x).__module__.partition(".")[0]
    torch = sys.modules.get("torch")
    if torch is not None and isinstance(x, torch.Tensor):
        return "torch"
    if root in ("jax", "jaxlib"):
        jax = sys.modules.get("jax")
        return "jax" if jax is not None and isinstance(x, jax.Array) else None
    if root == "cupy":
        cupy = sys.modules.get("cupy")
        return "cupy" if cupy is not None and isinstance(x, cupy.ndarray) else None
    return None


def family_of(x: object, path: str = "x") -> Family:
    """Return the family of leaf `x`, checking that its dtype is supported.

    Raises:
        TypeError: `x` is not an array of a supported family and dtype, nor a number; the message
            starts with the leaf's `path`.
    """
    if isinstance(x, (bool, int, float, complex, np.generic)):
        if isinstance(x, int) and not isinstance(x, bool) and not -(2**63) <= x < 2**63:
            raise TypeError(f"{path}: the integer {x} does not fit in int64.")
        family: Family = _SCALAR
    else:
        name = array_family(x)
        if name is None:
            raise TypeError(
                f"{path}: expected an array (NumPy, PyTorch, JAX, CuPy) or a number, "
                f"got {type(x).__module__}.{type(x).__qualname__}."
            )
        if name == "jax" and "Tracer" in type(x).__name__:
            raise TypeError(
                f"{path}: got a traced JAX value, which this call cannot take: inside jax.jit "
                "use dp.allreduce, dp.reduce, dp.reducescatter, dp.broadcast, dp.allgather, "
                "dp.alltoall (equal splits) or dp.DistributedOptimizer for optax; call the others "
                "outside jax.jit."
            )
        if name == "torch":
            problem = _TORCH.problem(cast("torch.Tensor", x))  # array_family checked
            if problem is not None:
                raise TypeError(f"{path}: {problem}")
        family = _ARRAY_FAMILIES[name]
    check_dtype(family.dtype(x), path)
    return family

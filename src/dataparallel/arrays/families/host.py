"""The host families: NumPy arrays (seen through zero-copy views where writable) and numbers
(Python numbers and NumPy scalars: immutable, returned as the same type)."""

from __future__ import annotations

from typing import TypeAlias

import numpy as np

from dataparallel.arrays.dtypes import BF16_BITS, dtype_name, storage_dtype
from dataparallel.arrays.families.base import Family

__all__ = ["NumpyFamily", "Scalar", "ScalarFamily"]

# The leaves of `ScalarFamily`: Python numbers and NumPy scalars.
Scalar: TypeAlias = bool | int | float | complex | np.generic


class NumpyFamily(Family[np.ndarray]):
    name = "numpy"

    def dtype(self, x: np.ndarray) -> str:
        return dtype_name(x.dtype)

    def shape(self, x: np.ndarray) -> tuple[int, ...]:
        return tuple(x.shape)

    def host_view(self, x: np.ndarray) -> np.ndarray | None:
        if not x.flags.writeable or not x.dtype.isnative:  # byte-swapped: staged, converted
            return None
        return x.view(BF16_BITS) if x.dtype.kind == "V" else x  # "V": ml_dtypes' bfloat16

    def to_host(self, x: np.ndarray) -> np.ndarray:
        native = np.array(x, dtype=x.dtype.newbyteorder("="))
        return native.view(storage_dtype(self.dtype(x)))

    def from_host(self, x: np.ndarray, host: np.ndarray) -> np.ndarray:
        if x.flags.writeable:
            if x.dtype.isnative:
                x.view(host.dtype)[...] = host
            else:
                x[...] = host.view(x.dtype.newbyteorder("="))
            return x
        return self.new(x, host)

    def new(self, like: np.ndarray, host: np.ndarray) -> np.ndarray:
        return np.array(host).view(like.dtype.newbyteorder("="))

    def adopt(self, like: np.ndarray, host: np.ndarray) -> np.ndarray:
        return host.view(like.dtype.newbyteorder("="))


_PYTHON_DTYPES = {bool: "bool", int: "int64", float: "float64", complex: "complex128"}


class ScalarFamily(Family[Scalar]):
    """Python numbers and NumPy scalars: immutable, returned as the same type."""

    name = "scalar"
    mutable = False

    def dtype(self, x: Scalar) -> str:
        if isinstance(x, np.generic):
            return dtype_name(x.dtype)
        return _PYTHON_DTYPES.get(type(x)) or dtype_name(np.asarray(x).dtype)

    def shape(self, x: Scalar) -> tuple[int, ...]:
        return ()

    def to_host(self, x: Scalar) -> np.ndarray:
        return np.array(x).view(storage_dtype(self.dtype(x)))  # bfloat16 as its bits

    def from_host(self, x: Scalar, host: np.ndarray) -> Scalar:
        if isinstance(x, np.generic):
            return host.reshape(-1).view(x.dtype)[0]  # a NumPy scalar of x's type
        return type(x)(host.reshape(()).item())

    def new(self, like: Scalar, host: np.ndarray) -> np.ndarray:
        return np.array(host).view(np.asarray(like).dtype)

"""Array families and dtypes for the core tests: make a leaf of a family and dtype, read it back.

Every test that runs a collective on "every family" draws its leaves from `FAMILIES`. A family
that is not installed (CuPy, CUDA) stays in the parametrization and is skipped with the reason.
JAX has 64-bit dtypes only with `jax_enable_x64`: its `context()` turns it on for the test.
"""

from __future__ import annotations

import contextlib
import functools
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from typing import Any

import numpy as np

try:
    import torch
except ImportError:  # pragma: no cover - torch is part of the test environment
    torch = None  # type: ignore[assignment]
try:
    import jax
    import jax.numpy as jnp
except ImportError:  # pragma: no cover
    jax = jnp = None  # type: ignore[assignment]
try:
    import ml_dtypes
except ImportError:  # pragma: no cover
    ml_dtypes = None  # type: ignore[assignment]

INTEGER = ("int8", "int16", "int32", "int64", "uint8", "uint16", "uint32", "uint64")
FLOATING = ("float16", "bfloat16", "float32", "float64")
COMPLEX = ("complex64", "complex128")
DTYPES = ("bool", *INTEGER, *FLOATING, *COMPLEX)
OPS = ("sum", "prod", "min", "max", "avg")


def np_dtype(name: str) -> np.dtype:
    """Return the NumPy dtype of `name` (bfloat16 from ml_dtypes)."""
    if name == "bfloat16":
        assert ml_dtypes is not None
        return np.dtype(ml_dtypes.bfloat16)
    return np.dtype(name)


def as_float(a: np.ndarray) -> np.ndarray:
    """Return `a` with 16-bit floats widened to float32, for comparisons."""
    if a.dtype.name in ("bfloat16", "float16"):
        return a.astype(np.float32)
    return a


@functools.cache  # asked for each case of every matrix test as it is collected
def _cupy_reason() -> str | None:
    try:
        import cupy
    except ImportError:
        return "CuPy is not installed"
    try:
        if cupy.cuda.runtime.getDeviceCount() < 1:
            return "CuPy sees no CUDA device"
    except Exception as exc:  # any CUDA failure means: not here
        return f"CuPy cannot reach CUDA ({exc})"
    return None


@functools.cache
def _torch_cuda_reason() -> str | None:
    if torch is None:
        return "torch is not installed"
    return None if torch.cuda.is_available() else "torch sees no CUDA device"


@dataclass(frozen=True)
class Family:
    """How to make leaves of one array family, and read them back as NumPy."""

    name: str
    make: Callable[[np.ndarray, str], Any]
    read: Callable[[Any], np.ndarray]
    dtypes: tuple[str, ...]
    mutable: bool = True
    scalar: bool = False
    missing: Callable[[], str | None] = lambda: None

    def skip_reason(self) -> str | None:
        """Return why this family cannot be tested here, or None."""
        return self.missing()

    @contextlib.contextmanager
    def context(self) -> Iterator[None]:
        """Enable what the family needs for every dtype (64-bit JAX)."""
        if self.name == "jax":
            with jax.enable_x64(True):
                yield
        else:
            yield

    def __repr__(self) -> str:
        return self.name


def _numpy_make(values: np.ndarray, dtype: str) -> np.ndarray:
    return values.astype(np_dtype(dtype))


def _torch_make(values: np.ndarray, dtype: str, device: str = "cpu") -> Any:
    if dtype == "bfloat16":
        return torch.from_numpy(values.astype(np.float32)).to(torch.bfloat16).to(device)
    return torch.from_numpy(values.astype(np_dtype(dtype))).to(device)


def _torch_read(x: Any) -> np.ndarray:
    x = x.detach().cpu()
    if x.dtype == torch.bfloat16:
        x = x.float()
    return x.numpy()


def _jax_make(values: np.ndarray, dtype: str) -> Any:
    return jnp.asarray(values.astype(np_dtype(dtype)))


def _cupy_make(values: np.ndarray, dtype: str) -> Any:
    import cupy

    return cupy.asarray(values.astype(np_dtype(dtype)))


def _python_make(values: np.ndarray, dtype: str) -> Any:
    kind = {"bool": bool, "int64": int, "float64": float, "complex128": complex}[dtype]
    return kind(values.reshape(()).item())


def _scalar_make(values: np.ndarray, dtype: str) -> Any:
    return values.reshape(()).astype(np_dtype(dtype))[()]


_NO_BF16 = tuple(d for d in DTYPES if d != "bfloat16")

FAMILIES = (
    Family("numpy", _numpy_make, np.asarray, DTYPES),
    Family(
        "torch",
        _torch_make,
        _torch_read,
        DTYPES,
        missing=lambda: None if torch is not None else "torch is not installed",
    ),
    Family(
        "jax",
        _jax_make,
        np.asarray,
        DTYPES,
        mutable=False,
        missing=lambda: None if jax is not None else "jax is not installed",
    ),
    Family("numpy-scalar", _scalar_make, np.asarray, DTYPES, mutable=False, scalar=True),
    Family(
        "python-scalar",
        _python_make,
        np.asarray,
        ("bool", "int64", "float64", "complex128"),
        mutable=False,
        scalar=True,
    ),
    Family(
        "torch-cuda",
        lambda v, d: _torch_make(v, d, "cuda"),
        _torch_read,
        DTYPES,
        missing=_torch_cuda_reason,
    ),
    Family("cupy", _cupy_make, lambda x: x.get(), _NO_BF16, missing=_cupy_reason),
)
FAMILY = {f.name: f for f in FAMILIES}
ARRAY_FAMILIES = tuple(f for f in FAMILIES if not f.scalar)


def usable(family: Family) -> Family:
    """Return `family`, or skip the test with the reason it cannot be used here."""
    import pytest

    reason = family.skip_reason()
    if reason is not None:
        pytest.skip(reason)
    return family


def rank_values(rank: int, dtype: str, shape: tuple[int, ...] = (2, 3)) -> np.ndarray:
    """Return rank `rank`'s values for a reduction test, as float64/complex128/bool NumPy.

    Element e of rank r holds `r + 1 + e % 2` (small integers, exact in every dtype); bool holds
    `(r + e) % 2 == 0`; complex adds an imaginary part `r - e % 3`.
    """
    e = np.arange(int(np.prod(shape))).reshape(shape) if shape else np.array(1)
    if dtype == "bool":
        return (rank + e) % 2 == 0
    values = (rank + 1 + e % 2).astype(np.float64)
    if dtype.startswith("complex"):
        return values + 1j * (rank - e % 3)
    return values


def expected(op: str, dtype: str, size: int, shape: tuple[int, ...] = (2, 3)) -> np.ndarray:
    """Return the reduction of `rank_values` over `size` ranks, as the engine computes it."""
    stack = np.stack([rank_values(r, dtype, shape) for r in range(size)])
    if dtype == "bool":
        logical = {"sum": np.any, "max": np.any, "min": np.all, "prod": np.all}[op]
        return logical(stack, axis=0)
    if dtype in INTEGER:
        stack = stack.astype(dtype)  # integers wrap as the engine's do
        if op in ("min", "max"):
            return np.min(stack, axis=0) if op == "min" else np.max(stack, axis=0)
        reduce = np.sum if op == "sum" else np.prod
        return reduce(stack, axis=0, dtype=stack.dtype)
    floating: dict[str, Callable[..., Any]] = {
        "sum": np.sum,
        "prod": np.prod,
        "min": np.min,
        "max": np.max,
        "avg": np.mean,
    }
    return np.asarray(floating[op](stack, axis=0))


def tolerance(dtype: str) -> float:
    """Return the relative tolerance for comparing a reduced `dtype` with float64 arithmetic."""
    return {"float16": 2e-3, "bfloat16": 1e-2, "float32": 1e-6, "complex64": 1e-6}.get(dtype, 1e-12)


def invalid(op: str, dtype: str) -> bool:
    """Return whether the contract rejects `op` on `dtype` with a TypeError."""
    return (op == "avg" and (dtype in INTEGER or dtype == "bool")) or (
        op in ("min", "max") and dtype in COMPLEX
    )


def assert_values(family: Family, out: Any, want: np.ndarray, dtype: str) -> None:
    """Check that leaf `out` of `family` holds `want`: exactly for integers and bool."""
    got = np.asarray(family.read(out))
    assert got.shape == want.shape
    if dtype == "bool":
        np.testing.assert_array_equal(got.astype(bool), want)
    elif dtype in INTEGER:
        np.testing.assert_array_equal(got, want)
    else:
        np.testing.assert_allclose(as_float(got), want, rtol=tolerance(dtype))

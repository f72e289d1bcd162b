"""Dtype names and host storage: what collectives support, how bfloat16 lives on the host, and
how values are scaled in their dtype (an average's `1 / size`).

NumPy has no bfloat16: on the host its values are carried as their raw 16 bits (`uint16`), widened
exactly to float32 for a reduction and rounded back to nearest even.
"""

from __future__ import annotations

from collections.abc import Hashable
from typing import Any

import numpy as np

from dataparallel import caches

__all__ = [
    "BF16_BITS",
    "INTEGER_DTYPES",
    "SUPPORTED_DTYPES",
    "bf16_to_f32",
    "check_dtype",
    "dtype_name",
    "f32_to_bf16",
    "prescale",
    "prescaled_copy",
    "scale_in_place",
    "storage_dtype",
]

SUPPORTED_DTYPES = frozenset(
    {"bool", "int8", "int16", "int32", "int64", "uint8", "uint16", "uint32", "uint64"}
    | {"float16", "bfloat16", "float32", "float64", "complex64", "complex128"}
)
INTEGER_DTYPES = frozenset(
    {"int8", "int16", "int32", "int64", "uint8", "uint16", "uint32", "uint64"}
)
BF16_BITS = np.dtype(np.uint16)  # how bfloat16 values are held on the host


_DTYPE_NAMES: dict[Hashable, str] = {}  # a pure function of the dtype; cleared by dp.finalize()
caches.register(_DTYPE_NAMES.clear)


def dtype_name(dtype: Any) -> str:
    """Return the name of a NumPy or torch dtype (`"float32"`, `"bfloat16"`), cached.

    >>> dtype_name(np.dtype(np.float32))
    'float32'
    """
    name = _DTYPE_NAMES.get(dtype)
    if name is None:
        text = str(dtype)
        name = text.removeprefix("torch.") if text.startswith("torch.") else np.dtype(dtype).name
        _DTYPE_NAMES[dtype] = name = str(name)
    return name


def storage_dtype(dtype: str) -> np.dtype:
    """Return the NumPy dtype that holds values of `dtype` on the host (bfloat16 as raw bits)."""
    return BF16_BITS if dtype == "bfloat16" else np.dtype(dtype)


def bf16_to_f32(bits: np.ndarray, out: np.ndarray | None = None) -> np.ndarray:
    """Widen bfloat16 bits to float32 exactly (in place in `out`: no temporaries)."""
    if out is None:
        out = np.empty(bits.shape, np.float32)
    wide = out.view(np.uint32)
    wide[...] = bits
    wide <<= 16
    return out


def f32_to_bf16(values: np.ndarray, out: np.ndarray) -> np.ndarray:
    """Narrow float32 to bfloat16 bits, rounding to nearest even (NaN stays NaN)."""
    bits = values.view(np.uint32)
    rounded = bits >> 16  # the one temporary: (bits + 0x7FFF + lowest kept bit) >> 16
    rounded &= 1
    rounded += 0x7FFF
    rounded += bits
    rounded >>= 16
    out[...] = rounded
    nan = np.isnan(values)
    if nan.any():
        out[nan] = 0x7FC0
    return out


def check_dtype(dtype: str, path: str) -> str:
    if dtype not in SUPPORTED_DTYPES:
        raise TypeError(
            f"{path}: dtype {dtype} is not supported by collectives; use one of "
            f"{', '.join(sorted(SUPPORTED_DTYPES))} (convert the leaf, or keep it out of the tree)."
        )
    return dtype


def prescale(values: np.ndarray, scale: float | None) -> bool:
    """Multiply `values` (about to be summed) by `scale` when that gives the sum's scaled result:
    a power of two below one (an average over 2, 4, 8... ranks) on float32 or float64. Return
    whether it did.

    Scaling then is exact, so every rank's share scaled and summed is the sum scaled, rounded once
    (down to the smallest normal number: terms below 2^-125 in float32, 2^-1021 in float64, may
    differ in the last place; an overflow of the sum alone is avoided). Scaling before the call
    writes lines this process owns, just written by its producer; after the call the engine has
    shared them with the other ranks, and writing them again costs many times as much
    (benchmarks/NOTES.md, "Scaling before the sum").
    """
    return prescaled_copy(values, values, scale)


def prescaled_copy(values: np.ndarray, out: np.ndarray, scale: float | None) -> bool:
    """`prescale` of `values` written into `out` (read-only memory's shares: one pass, where a
    copy then a scaling after the call make two). Return whether it did; if not, `out` is left
    as it was."""
    if scale is None or not prescalable(values.dtype, scale):
        return False
    np.multiply(values, scale, out=out)
    return True


def prescalable(dtype: np.dtype[np.generic], scale: float | None) -> bool:
    """Whether shares of `dtype` about to be summed are scaled by `scale` first (`prescale`)."""
    if scale is None or not 0 < scale < 1 or dtype not in _PRESCALED:
        return False
    power = _POWERS.get(scale)
    if power is None:  # asked for every bucket of a step with the same few scales: kept
        power = _POWERS[scale] = bool(np.frexp(scale)[0] == 0.5)  # a power of two
    return power


_PRESCALED = (np.dtype(np.float32), np.dtype(np.float64))
_POWERS: dict[float, bool] = {}  # whether each scale asked about is a power of two


def scale_in_place(values: np.ndarray, scale: float, out: np.ndarray | None = None) -> None:
    """Multiply `values` by `scale` in place, or into `out` (integers by `int(scale)`).

    The reciprocal of an integer n (an average's `1 / size`) divides by n instead, so an average
    is the exact mean rounded to the dtype (as `x / n` is); for n a power of two multiplying gives
    the same result for less (benchmarks/NOTES.md, "Scaling before the sum"). Half precision is
    in float32.
    """
    out = values if out is None else out
    if values.dtype.kind in "iu":
        np.multiply(values, int(scale), out=out, casting="unsafe")
        return
    wide = np.float32 if values.dtype == np.float16 else None
    divisor = 1.0 / scale if scale else 0.0
    if divisor == round(divisor) and divisor * scale == 1.0 and int(divisor) & int(divisor - 1):
        np.divide(values, int(divisor), out=out, dtype=wide, casting="unsafe")
    else:
        np.multiply(values, scale, out=out, dtype=wide, casting="unsafe")

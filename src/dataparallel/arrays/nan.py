"""NaN under min and max: every rank gets the same result, and NaN wins, as in NumPy.

Engines compare with `a > b ? a : b`, so a NaN survives or vanishes depending on the order in
which each rank combines the values: under MPI two ranks can get different results for the same
call, and Gloo drops NaN. The collectives therefore ask, in the handshake, whether any rank has a
NaN (`has_nan`: one pass over the values, only for floating leaves under min/max). Only when one
has, each rank also reduces a mask of where its NaNs are (`nan_mask`, reduced with MAX), and
writes NaN wherever any rank had one (`set_nan`) after the reduction.
"""

from __future__ import annotations

import numpy as np

__all__ = ["FLOATING", "has_nan", "nan_mask", "set_nan"]

FLOATING = frozenset({"float16", "bfloat16", "float32", "float64"})
_BF16_NAN = 0x7FC0


def _is_nan(values: np.ndarray, dtype: str) -> np.ndarray:
    if dtype == "bfloat16":  # raw bits: exponent all ones and a non-zero mantissa
        return (values & np.uint16(0x7FFF)) > np.uint16(0x7F80)
    return np.isnan(values)


def has_nan(values: np.ndarray, dtype: str) -> bool:
    """Return whether `values` (storage dtype) hold a NaN; cheap when they hold none."""
    if values.size == 0:
        return False
    if dtype == "bfloat16":
        return bool(_is_nan(values, dtype).any())
    return bool(np.isnan(values.max()))  # max propagates NaN: no temporary array


def nan_mask(values: np.ndarray, dtype: str) -> np.ndarray:
    """Return a flat uint8 mask, 1 where `values` hold NaN."""
    return _is_nan(values, dtype).reshape(-1).view(np.uint8)


def set_nan(values: np.ndarray, dtype: str, mask: np.ndarray) -> None:
    """Write NaN into `values` (storage dtype, any shape) where the flat `mask` is set."""
    where = mask.view(np.bool_).reshape(values.shape)
    values[where] = _BF16_NAN if dtype == "bfloat16" else np.nan

"""What Gloo is handed for a host buffer: dtypes it lacks carried exactly, buffers checked.

Gloo reduces int8/32/64, uint8, float16/32/64, bool and complex (sum only). int16 and uint16 are
reduced as int32 copies (wrapping like native integers); uint32 and uint64 as int32 / int64 views
(two's complement sums and products are bit-identical; min/max flip the sign bit in place first,
which maps unsigned order onto signed order).
"""

from __future__ import annotations

from collections.abc import Callable

import numpy as np

from dataparallel.backends.base import Buffer, ReduceOp

__all__ = ["flat", "wire_for", "writable"]

# Unsigned integers travel as the signed type of the same width (wrapping sums and products are
# bit-identical); for min/max their sign bit is flipped first, which keeps their order.
_SIGNED_VIEW: dict[str, np.dtype[np.signedinteger]] = {
    "uint32": np.dtype(np.int32),
    "uint64": np.dtype(np.int64),
}
_SIGN_BIT: dict[str, np.unsignedinteger] = {
    "uint32": np.uint32(1 << 31),
    "uint64": np.uint64(1 << 63),
}
_WIDENED: dict[str, np.dtype[np.int32]] = {
    "int16": np.dtype(np.int32),
    "uint16": np.dtype(np.int32),
}


def wire_for(buf: np.ndarray, op: ReduceOp) -> tuple[np.ndarray, Callable[[], None] | None]:
    """Return what Gloo reduces for `buf`, and what to do once it has (None: nothing)."""
    name = buf.dtype.name
    if name in _SIGNED_VIEW:
        if op in (ReduceOp.MIN, ReduceOp.MAX):
            sign = _SIGN_BIT[name]
            np.bitwise_xor(buf, sign, out=buf)
            return buf.view(_SIGNED_VIEW[name]), lambda: np.bitwise_xor(buf, sign, out=buf)
        return buf.view(_SIGNED_VIEW[name]), None
    if name in _WIDENED:
        wide = buf.astype(_WIDENED[name])
        return wide, lambda: np.copyto(buf, wide, casting="unsafe")
    if buf.dtype.kind == "c" and op is not ReduceOp.SUM:
        raise TypeError(f"op={op.value!r} is not defined here for complex values ({name}).")
    return buf, None


def flat(buf: Buffer, where: str) -> np.ndarray:
    array = np.asarray(buf)
    if not array.flags.c_contiguous:
        raise ValueError(f"GlooBackend.{where}: the buffer must be contiguous (got strides).")
    return array.reshape(-1)


def writable(array: np.ndarray, where: str) -> np.ndarray:
    if not array.flags.writeable:
        raise ValueError(
            f"GlooBackend.{where}: the buffer is read-only, but the result is written into it; "
            "pass a writable array (e.g. a copy)."
        )
    return array

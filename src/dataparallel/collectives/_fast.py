"""The fast path of the commonest small call: `dp.allreduce` of one number or one small array.

A loss, a count, a flag: one Python float, or one contiguous NumPy array of a few items, reduced
in a world of two to `checks.GATHER_LIMIT` ranks. Such a call costs one message (its values
travel in the handshake, see `checks.py`), so what is left to save is Python: this path skips
flattening, leaf records and the description of the call, whose hash it keeps per (dtype, shape,
op, scale). The hash is made by the general path on first sight (`_call.describe`), so both paths
send the same hash for the same call, and a rank on either path meets a rank on the other. The
result is computed as `engine.inline` computes it: NumPy, in rank order, the same on every rank.

Anything else (trees, other dtypes, GPU arrays, a timeline, debug logs, a world of one or of
many) takes the general path, which also raises the errors.
"""

from __future__ import annotations

import struct
from typing import Any

import numpy as np

from dataparallel import world
from dataparallel.checks import (
    HEADER_BYTES,
    INLINE_BYTES,
    RECORD_BYTES,
    digest,
    disagree,
    inline_capacity,
)
from dataparallel.collectives._call import describe, inline_fits, leaves_of, stage
from dataparallel.engine import tree
from dataparallel.engine.fusion import scale_in_place
from dataparallel.engine.inline import combine_rows
from dataparallel.engine.shadow import Shadow

__all__ = ["NOT_FAST", "small_allreduce"]

NOT_FAST = object()  # what `small_allreduce` returns for a call it leaves to the general path

_UFUNCS = {"sum": np.add, "prod": np.multiply, "min": np.minimum, "max": np.maximum, "avg": np.add}
_FLOATS = frozenset({np.dtype(np.float32), np.dtype(np.float64)})
_DTYPES = _FLOATS | {np.dtype(np.int32), np.dtype(np.int64)}
_F64 = struct.Struct("<d")
_PAD = bytes(RECORD_BYTES)
# (type, dtype, shape, op, scale, check) -> the record's header: the call's hash, no flags
_HEADERS: dict[tuple[Any, ...], bytes] = {}


def small_allreduce(x: Any, op: str, scale: Any) -> Any:
    """Return `dp.allreduce(x, op, scale=scale)` on the active world, or `NOT_FAST`."""
    kind = type(x)
    if kind is float:
        dtype, payload = _F64_DTYPE, _F64.pack(x)
    elif kind is np.ndarray:
        dtype = x.dtype
        if (
            dtype not in _DTYPES
            or x.nbytes > INLINE_BYTES
            or not x.flags.c_contiguous
            or not x.flags.writeable
        ):
            return NOT_FAST
        payload = x.tobytes()
    else:
        return NOT_FAST
    active = world.current()
    if active.timeline is not None or active.settings.debug:
        return NOT_FAST
    backend = active.backend
    size = backend.size
    ufunc = _UFUNCS.get(op)
    if not inline_capacity(size) or ufunc is None or type(scale) not in _SCALES:
        return NOT_FAST
    if dtype not in _FLOATS and (op == "avg" or scale is not None):
        return NOT_FAST  # integer rules (and their errors) are the general path's
    key = (kind, dtype, x.shape if kind is np.ndarray else (), op, scale, active.settings.check)
    header = _HEADERS.get(key)
    if header is None:
        summary, _ = _describe(x, op, scale)
        header = _HEADERS[key] = digest(summary).to_bytes(8, "little") + bytes(HEADER_BYTES - 8)
    record = np.frombuffer(header + payload + _PAD[: INLINE_BYTES - len(payload)], np.uint8)
    rows = np.empty(size * RECORD_BYTES, np.uint8)
    backend.allgather(record, rows)
    raw, h = rows.tobytes(), header[:8]
    for start in range(0, len(raw), RECORD_BYTES):  # as `checks.exchange`
        if raw[start : start + 8] != h:
            described = lambda: _describe(x, op, scale)[1]()  # noqa: E731 (only on a mismatch)
            disagree(backend, rows.reshape(size, RECORD_BYTES), described, shadow=_nothing)
            break
    total = 1.0 if scale is None else scale
    if op == "avg":
        total /= size
    if kind is float:  # Python's float arithmetic is NumPy's float64's, bit for bit
        values = [
            _F64.unpack_from(raw, start + HEADER_BYTES)[0]
            for start in range(0, len(raw), RECORD_BYTES)
        ]
        acc = values[0]
        for value in values[1:]:
            if op in ("sum", "avg"):
                acc += value
            elif op == "prod":
                acc *= value
            else:
                acc = float(ufunc(acc, value))  # NaN wins, as in NumPy
        return acc * total if total != 1 else acc
    rows2 = rows.reshape(size, RECORD_BYTES)
    out = combine_rows(ufunc, rows2[:, HEADER_BYTES : HEADER_BYTES + len(payload)].view(dtype))
    if total != 1:
        scale_in_place(out, total)
    x.reshape(-1)[...] = out
    return x


_F64_DTYPE = np.dtype(np.float64)


def _nothing(_: bool) -> Shadow:
    """A fast call's values travel in the handshake: a rank that has joined sends nothing more."""
    return Shadow.nothing()


_SCALES = (type(None), int, float)


def _describe(x: Any, op: str, scale: Any) -> tuple[str, Any]:
    """Describe the call as the general path does (`_call.describe`), inline."""
    ctx = world.current()
    flat = tree.flatten(x, "x")
    leaves = leaves_of(flat)
    stage(leaves)
    if not inline_fits(ctx, leaves):
        raise AssertionError("a fast call always travels in the handshake")
    args = {"op": op, "scale": None if scale is None else float(scale)}
    return describe(ctx, "allreduce", flat, leaves, args, True, True)

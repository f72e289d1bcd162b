"""The fast path of the commonest calls: `dp.allreduce` of one number or of one NumPy array.

A loss, a count, a flag: one Python float, or one contiguous NumPy array of a few items, reduced
in a world of two to `protocol.GATHER_LIMIT` ranks. Such a call costs one message (its values
travel in the handshake, see `protocol.py`), so what is left to save is Python: this path skips
flattening, leaf records and the description of the call, whose hash it keeps per (dtype, shape,
op, scale). The hash is made by the general path on first sight (`_call.describe`), so both paths
send the same hash for the same call, and a rank on either path meets a rank on the other. The
result is computed as `arrays.inline` computes it: NumPy, in rank order, the same on every rank.

One larger contiguous float32/float64 array under `sum`, `avg` or `prod` takes a second lane
(`_in_place`): the handshake without payload, then the one in-place allreduce the general path
would make for it, skipping the same Python (about 25 µs a call).

A list, tuple or dict of NumPy arrays of one dtype (or of a few Python floats) takes a third
lane: a plan per tree structure (`_plans.py`).

Anything else (nested trees, mixed dtypes, min/max of large arrays, GPU arrays, a timeline,
debug logs, a world of one or of many) takes the general path, which also raises the errors.
"""

from __future__ import annotations

import struct
from typing import Any

import numpy as np

from dataparallel import world
from dataparallel.arrays.actions import Reduction
from dataparallel.arrays.dtypes import scale_in_place
from dataparallel.collectives._lane import (
    DTYPES,
    FLOATS,
    IN_PLACE_OPS,
    NOT_FAST,
    PAD,
    UFUNCS,
    allreduce_scaled,
    gather_records,
    general,
    integer_rules,
    reduction_of,
)
from dataparallel.collectives._plans import tree_allreduce
from dataparallel.protocol import HEADER_BYTES, INLINE_BYTES, RECORD_BYTES, inline_capacity

__all__ = ["NOT_FAST", "fast_allreduce"]

_F64 = struct.Struct("<d")
# (type, dtype, shape, op, scale, check) -> the record's header: the call's hash, no flags
_HEADERS: dict[tuple[Any, ...], bytes] = {}
# (dtype, shape, op, scale, check, size) -> `_in_place`'s record (as an array) and reduction
_LANES: dict[tuple[Any, ...], tuple[np.ndarray, Reduction]] = {}


def fast_allreduce(x: Any, op: str, scale: Any) -> Any:
    """Return `dp.allreduce(x, op, scale=scale)` on the active world, or `NOT_FAST`."""
    kind = type(x)
    if kind is float:
        dtype = _F64_DTYPE
    elif kind is np.ndarray:
        dtype = x.dtype
        if dtype not in DTYPES or not x.flags.c_contiguous or not x.flags.writeable:
            return NOT_FAST
    elif kind is list or kind is tuple or kind is dict:
        dtype = None
    else:
        return NOT_FAST
    active = world.current()
    if active.timeline is not None or active.settings.debug:
        return NOT_FAST
    backend = active.backend
    size = backend.size
    ufunc = UFUNCS.get(op)
    if not inline_capacity(size) or ufunc is None or type(scale) not in _SCALES:
        return NOT_FAST
    if dtype is None:
        return tree_allreduce(x, kind, op, scale, active)
    if integer_rules(dtype, op, scale):
        return NOT_FAST
    if kind is np.ndarray and x.nbytes > INLINE_BYTES:
        return _in_place(x, op, scale, active)
    payload = _F64.pack(x) if kind is float else x.tobytes()
    header = _header(kind, x, op, scale, active.settings.check)
    record = header + payload + PAD[: INLINE_BYTES - len(payload)]
    rows, raw = gather_records(backend, np.frombuffer(record, np.uint8), x, op, scale, fused=False)
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
        return _scaled(acc, total) if total != 1 else acc
    # Combined into `x` as `combine_rows` combines, rank after rank (views of 1-D slices: about
    # 1 us less than rows of a 2-D view, a new array and a copy back).
    columns, out = rows.view(dtype), x.reshape(-1)
    per, first, n = RECORD_BYTES // dtype.itemsize, HEADER_BYTES // dtype.itemsize, x.size
    ufunc(columns[first : first + n], columns[per + first : per + first + n], out=out)
    for start in range(2 * per + first, size * per, per):
        ufunc(out, columns[start : start + n], out=out)
    if total != 1:
        scale_in_place(out, total)
    return x


def _scaled(value: float, scale: float) -> float:
    """`value` scaled as `scale_in_place` scales an array: by the reciprocal of an integer n (an
    average's 1 / size), a division by n; else a product. Bit for bit the general path's."""
    divisor = 1.0 / scale if scale else 0.0
    if divisor == round(divisor) and divisor * scale == 1.0:
        return value / int(divisor)
    return value * scale


def _in_place(x: np.ndarray, op: str, scale: Any, active: world.World) -> Any:
    """Reduce one larger float array in place, as the general path would: one `Allreduce`."""
    if op not in IN_PLACE_OPS or x.dtype not in FLOATS:  # min/max: the general NaN rules
        return NOT_FAST
    backend = active.backend
    key = (x.dtype, x.shape, op, scale, active.settings.check, backend.size)
    lane = _LANES.get(key)
    if lane is None:
        lane = _in_place_lane(key, x, op, scale)
        if lane is None:
            return NOT_FAST
    record, action = lane
    # A rank that has joined (dp.join) makes the same allreduce on zeros (`fused=True`).
    gather_records(backend, record, x, op, scale, fused=True)
    allreduce_scaled(backend, x.reshape(-1), action)  # after the handshake: a mismatch leaves x
    return x


def _in_place_lane(
    key: tuple[Any, ...], x: np.ndarray, op: str, scale: Any
) -> tuple[np.ndarray, Reduction] | None:
    """Make and keep what `_in_place` sends for calls like this one: its record and reduction
    (None: the general path's, which raises the error on every rank)."""
    try:
        action = reduction_of(op, scale, key[5])
    except Exception:
        return None
    if len(_LANES) > 4096:
        _LANES.clear()
    record = general(x, op, scale).header + PAD[:INLINE_BYTES]
    lane = _LANES[key] = (np.frombuffer(record, np.uint8), action)
    return lane


def _header(kind: type, x: Any, op: str, scale: Any, check: bool) -> bytes:
    """Return the handshake header of the call: its hash (made once per signature), no flags."""
    key = (kind, x.dtype if kind is np.ndarray else None, getattr(x, "shape", ()), op, scale, check)
    header = _HEADERS.get(key)
    if header is None:
        if len(_HEADERS) > 4096:
            _HEADERS.clear()
        header = _HEADERS[key] = general(x, op, scale).header
    return header


_F64_DTYPE = np.dtype(np.float64)
_SCALES = (type(None), int, float)

"""The fast path of the commonest calls: `dp.allreduce` of one number or of one NumPy array.

A loss, a count, a flag: one Python float, or one contiguous NumPy array of a few items, reduced
in a world of two to `checks.GATHER_LIMIT` ranks. Such a call costs one message (its values
travel in the handshake, see `checks.py`), so what is left to save is Python: this path skips
flattening, leaf records and the description of the call, whose hash it keeps per (dtype, shape,
op, scale). The hash is made by the general path on first sight (`_call.describe`), so both paths
send the same hash for the same call, and a rank on either path meets a rank on the other. The
result is computed as `engine.inline` computes it: NumPy, in rank order, the same on every rank.

One larger contiguous float32/float64 array under `sum`, `avg` or `prod` takes a second lane
(`_in_place`): the handshake without payload, then the one in-place allreduce the general path
would make for it, skipping the same Python (about 25 µs a call).

A list, tuple or dict of plain NumPy arrays of one dtype under `sum`, `avg` or `prod`, too large
to travel in the handshake and at most `PLAN_BYTES` in all, takes a third lane (`_tree`): a plan
per tree structure, made once by the general path and kept by the world (`World.plans`), holds
the call's hash, a buffer and each leaf's view of it, so a call is one `np.concatenate` into the
buffer, the handshake, the one `Allreduce` the general path's single bucket would make, and one
copy back per leaf (200 arrays of 64 floats: 0.11 us a leaf, against about 2 us a leaf of
records, fusion and write-back on the general path).

Anything else (nested trees, mixed dtypes, min/max of large arrays, GPU arrays, a timeline,
debug logs, a world of one or of many) takes the general path, which also raises the errors.
"""

from __future__ import annotations

import struct
from collections.abc import Callable
from dataclasses import dataclass
from functools import lru_cache, partial
from typing import Any, NamedTuple, TypeVar

import numpy as np

from dataparallel import world
from dataparallel.backends.base import Backend
from dataparallel.checks import (
    HEADER_BYTES,
    INLINE_BYTES,
    RECORD_BYTES,
    digest,
    disagree,
    inline_capacity,
    reduction,
)
from dataparallel.collectives import _shadows
from dataparallel.collectives._call import Leaf, describe, inline_fits, leaves_of, stage
from dataparallel.engine import tree
from dataparallel.engine.actions import Reduction
from dataparallel.engine.dtypes import scale_in_place
from dataparallel.engine.inline import combine_rows
from dataparallel.engine.shadow import Shadow

__all__ = ["NOT_FAST", "PLAN_BYTES", "fast_allreduce"]

NOT_FAST = object()  # what `fast_allreduce` returns for a call it leaves to the general path
PLAN_BYTES = 1 << 20  # trees up to this size get a plan, and keep its buffer
_PLANS_KEPT = 32  # plans a world keeps (the oldest goes first)

_UFUNCS = {"sum": np.add, "prod": np.multiply, "min": np.minimum, "max": np.maximum, "avg": np.add}
_FLOATS = frozenset({np.dtype(np.float32), np.dtype(np.float64)})
_DTYPES = _FLOATS | {np.dtype(np.int32), np.dtype(np.int64)}
_F64 = struct.Struct("<d")
_PAD = bytes(RECORD_BYTES)
# (type, dtype, shape, op, scale, check) -> the record's header: the call's hash, no flags
_HEADERS: dict[tuple[Any, ...], bytes] = {}


def fast_allreduce(x: Any, op: str, scale: Any) -> Any:
    """Return `dp.allreduce(x, op, scale=scale)` on the active world, or `NOT_FAST`."""
    kind = type(x)
    if kind is float:
        dtype = _F64_DTYPE
    elif kind is np.ndarray:
        dtype = x.dtype
        if dtype not in _DTYPES or not x.flags.c_contiguous or not x.flags.writeable:
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
    ufunc = _UFUNCS.get(op)
    if not inline_capacity(size) or ufunc is None or type(scale) not in _SCALES:
        return NOT_FAST
    if dtype is None:
        return _tree(x, kind, op, scale, active)
    if _integer_rules(dtype, op, scale):
        return NOT_FAST
    if kind is np.ndarray and x.nbytes > INLINE_BYTES:
        return _in_place(x, op, scale, active)
    payload = _F64.pack(x) if kind is float else x.tobytes()
    header = _header(kind, x, op, scale, active.settings.check)
    record = header + payload + _PAD[: INLINE_BYTES - len(payload)]
    rows, raw = _handshake(backend, record, x, op, scale, _nothing)
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
    if op not in _IN_PLACE_OPS or x.dtype not in _FLOATS:  # min/max: the general NaN rules
        return NOT_FAST
    backend = active.backend
    action = _reduction(op, scale, backend.size)
    header = _header(np.ndarray, x, op, scale, active.settings.check)
    # A rank that has joined (dp.join) makes the same allreduce on zeros: `_fused_shadow`.
    _handshake(
        backend, header + _PAD[:INLINE_BYTES], x, op, scale, partial(_fused_shadow, x, op, scale)
    )
    backend.allreduce(x.reshape(-1), action.op)
    if action.scale is not None:
        scale_in_place(x.reshape(-1), action.scale)
    return x


@dataclass(slots=True)
class _Plan:
    """How a tree of one structure is reduced: made once (`_plan`), used by every call."""

    record: bytes  # the handshake record: the call's hash, no payload
    action: Reduction
    buf: np.ndarray  # the tree's values, packed in leaf order (as the general path's bucket)
    views: list[np.ndarray]  # each leaf's place in `buf`, in its shape
    spec: Any  # the structure of a dict (None for a list or a tuple)


def _tree(x: Any, kind: type, op: str, scale: Any, active: world.World) -> Any:
    """Reduce a list, tuple or dict of NumPy arrays of one dtype with its plan (`_Plan`)."""
    if kind is dict:
        if type(_some_leaf(x)) not in _PLANNED_LEAVES:
            return NOT_FAST  # a dict of tensors, say: not flattened twice
        flat = tree.flatten(x, "x")
        leaves, spec = flat.leaves, flat.spec
    else:
        leaves, spec = x, None
    if len(leaves) < 2:
        return NOT_FAST
    if type(leaves[0]) is float:
        return _numbers(x, kind, leaves, spec, op, scale, active)
    if type(leaves[0]) is not np.ndarray or op not in _IN_PLACE_OPS:
        return NOT_FAST
    dtype = leaves[0].dtype
    for leaf in leaves:
        if type(leaf) is not np.ndarray or leaf.dtype is not dtype:
            return NOT_FAST
    settings = active.settings
    shapes = tuple([leaf.shape for leaf in leaves])
    key = (kind, spec, dtype, shapes, op, scale, settings.check, settings.bucket_bytes)
    plan = _planned(active, key, lambda: _plan(x, leaves, op, scale, active))
    if plan is None:
        return NOT_FAST
    buf, backend = plan.buf, active.backend
    np.concatenate(leaves, axis=None, out=buf)
    _handshake(backend, plan.record, x, op, scale, partial(_fused_shadow, x, op, scale))
    backend.allreduce(buf, plan.action.op)
    if plan.action.scale is not None:
        scale_in_place(buf, plan.action.scale)
    results = leaves
    try:
        for leaf, view in zip(leaves, plan.views, strict=True):
            leaf[...] = view
    except ValueError:  # a read-only array: a new one instead, as the general path gives
        results = [
            leaf if leaf.flags.writeable else view.copy()
            for leaf, view in zip(leaves, plan.views, strict=True)
        ]
        for leaf, view in zip(results, plan.views, strict=True):
            if leaf is not view:
                leaf[...] = view
    return tree.unflatten(spec, results) if spec is not None else kind(results)


_PLANNED_LEAVES = (np.ndarray, float)


def _some_leaf(x: Any) -> Any:
    """Return one leaf of a tree of dicts, lists and tuples (every leaf of a planned tree has
    the same type, so one that has another rules the tree out)."""
    while type(x) is dict or type(x) is list or type(x) is tuple:
        if not x:
            return None
        x = next(iter(x.values())) if type(x) is dict else x[0]
    return x


def _numbers(
    x: Any, kind: type, leaves: list[Any], spec: Any, op: str, scale: Any, active: world.World
) -> Any:
    """Reduce a few Python floats (metrics) in the handshake: the general path's inline call."""
    n = len(leaves)
    if n * 8 > INLINE_BYTES:
        return NOT_FAST
    for leaf in leaves:
        if type(leaf) is not float:
            return NOT_FAST
    settings = active.settings
    key = ("numbers", kind, spec, n, op, scale, settings.check, settings.bucket_bytes)
    plan = _planned(active, key, lambda: _numbers_plan(x, op, scale, active))
    if plan is None:
        return NOT_FAST
    header, action = plan
    payload = struct.pack(f"<{n}d", *leaves)
    rows, _ = _handshake(
        active.backend, header + payload + _PAD[: INLINE_BYTES - 8 * n], x, op, scale, _nothing
    )
    size = active.backend.size
    values = rows.reshape(size, RECORD_BYTES)[:, HEADER_BYTES : HEADER_BYTES + 8 * n]
    out = combine_rows(_UFUNCS[op], values.view(np.float64))  # as `engine.inline`, leaf by leaf
    if action.scale is not None:
        scale_in_place(out, action.scale)
    results = out.tolist()
    return tree.unflatten(spec, results) if spec is not None else kind(results)


def _numbers_plan(x: Any, op: str, scale: Any, active: world.World) -> tuple[bytes, Any] | None:
    """Return the header and reduction of `_numbers`' calls, or None for the general path's."""
    try:
        action = _reduction(op, scale, active.backend.size)
    except Exception:
        return None  # the general path raises the error, on every rank
    general = _general(x, op, scale)
    if not general.inline or any(leaf.dtype != "float64" for leaf in general.leaves):
        return None
    return general.header, action


def _plan(x: Any, leaves: list[Any], op: str, scale: Any, active: world.World) -> _Plan | None:
    """Make the plan of `x`'s calls (`leaves`: its arrays), or None for the general path's."""
    dtype = leaves[0].dtype
    if dtype not in _DTYPES or _integer_rules(dtype, op, scale):
        return None
    total = sum(leaf.nbytes for leaf in leaves)
    if total > min(PLAN_BYTES, active.settings.bucket_bytes):
        return None  # the general path would make more than one bucket
    try:
        action = _reduction(op, scale, active.backend.size)
    except Exception:
        return None  # the general path raises the error, on every rank
    general = _general(x, op, scale)
    if general.inline:
        return None  # the values travel in the handshake, as small calls
    buf = np.empty(total // dtype.itemsize, dtype)
    views, offset = [], 0
    for leaf in leaves:
        views.append(buf[offset : offset + leaf.size].reshape(leaf.shape))
        offset += leaf.size
    spec = general.spec if type(x) is dict else None
    return _Plan(general.header + _PAD[:INLINE_BYTES], action, buf, views, spec)


@lru_cache(maxsize=64)
def _reduction(op: str, scale: Any, size: int) -> Reduction:
    """`checks.reduction`, made once per (op, scale, size): its checks cost a call 0.7 µs."""
    return reduction(op, scale, size)


def _handshake(
    backend: Backend, record: bytes, x: Any, op: str, scale: Any, shadow: Callable[[bool], Shadow]
) -> tuple[np.ndarray, bytes]:
    """Gather every rank's record (as `checks.exchange`, with less Python); return the rows."""
    size = backend.size
    rows = np.empty(size * RECORD_BYTES, np.uint8)
    backend.allgather(np.frombuffer(record, np.uint8), rows)
    raw, h = rows.tobytes(), record[:8]
    for start in range(0, len(raw), RECORD_BYTES):
        if raw[start : start + 8] != h:
            described = lambda: _general(x, op, scale).details()  # noqa: E731 (only on a mismatch)
            disagree(backend, rows.reshape(size, RECORD_BYTES), described, shadow=shadow)
            break
    return rows, raw


def _fused_shadow(x: np.ndarray, op: str, scale: Any, _: bool) -> Shadow:
    """What `_in_place` and `_tree` send after the handshake, as the general path describes it."""
    ctx = world.current()
    leaves = leaves_of(tree.flatten(x, "x"))
    stage(leaves)
    return _shadows.fused(ctx, reduction(op, scale, ctx.backend.size), leaves, False, False)


def _header(kind: type, x: Any, op: str, scale: Any, check: bool) -> bytes:
    """Return the handshake header of the call: its hash (made once per signature), no flags."""
    key = (kind, x.dtype if kind is np.ndarray else None, getattr(x, "shape", ()), op, scale, check)
    header = _HEADERS.get(key)
    if header is None:
        if len(_HEADERS) > 4096:
            _HEADERS.clear()
        header = _HEADERS[key] = _general(x, op, scale).header
    return header


_IN_PLACE_OPS = frozenset({"sum", "avg", "prod"})
_F64_DTYPE = np.dtype(np.float64)


def _nothing(_: bool) -> Shadow:
    """A fast call's values travel in the handshake: a rank that has joined sends nothing more."""
    return Shadow.nothing()


_SCALES = (type(None), int, float)


class _General(NamedTuple):
    """The call as the general path sees it: what every lane's handshake is made from."""

    header: bytes  # the handshake header: the hash of the call's summary, no flags
    details: Callable[[], dict[str, Any]]  # the call field by field (for a mismatch's report)
    inline: bool  # whether its values travel in the handshake
    leaves: list[Leaf]
    spec: Any  # the tree's structure


def _general(x: Any, op: str, scale: Any) -> _General:
    """Describe `dp.allreduce(x, op, scale=scale)` as the general path does (`_call.describe`)."""
    ctx = world.current()
    flat = tree.flatten(x, "x")
    leaves = leaves_of(flat)
    stage(leaves)
    args = {"op": op, "scale": None if scale is None else float(scale)}
    inline = inline_fits(ctx, leaves)
    summary, details = describe(ctx, "allreduce", flat, leaves, args, True, inline)
    header = digest(summary).to_bytes(8, "little") + bytes(HEADER_BYTES - 8)
    return _General(header, details, inline, leaves, flat.spec)


def _integer_rules(dtype: np.dtype, op: str, scale: Any) -> bool:
    """Whether integer rules apply (an average or a scale of integers, and their errors): those
    are the general path's."""
    return dtype not in _FLOATS and (op == "avg" or scale is not None)


_T = TypeVar("_T")


def _planned(active: world.World, key: tuple[Any, ...], make: Callable[[], _T]) -> _T:
    """Return the world's plan for `key`, made by `make` on first sight (None: no plan)."""
    plans = active.plans
    plan = plans.get(key, NOT_FAST)  # one lookup: this is every planned call's path
    if plan is not NOT_FAST:
        return plan
    if len(plans) >= _PLANS_KEPT:
        del plans[next(iter(plans))]  # the oldest
    plans[key] = plan = make()
    return plan

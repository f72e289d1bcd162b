"""Call plans: what a reduction decides, decided once per signature, then one execution.

A reduction's signature is what its decisions depend on: the collective and its arguments, the
tree's structure, each leaf's dtype, shape and device, the world's size and the settings. The first
call of a signature is planned (`_plan`): validated, described and hashed for the handshake, its
`Reduction` and its join replay made, and its kind chosen, a `CallPlan` of one of four types:
`Inline` (the values travel in the handshake and every rank combines them, `arrays/inline.py`),
`Packed` (the handshake, then one engine call of the one host bucket `Fusion` would send, laid
out by `fusion.pack_bucket`), `Whole` (read-only host leaves of one dtype reduced into one lent
buffer whose views they become, without copying the large ones) or `Fused` (the leaves through
`Fusion`, with the NaN masks of min and max). The world keeps the plan (`World.plans`, dropped by
`dp.finalize()`), and every call, the first included, runs `execute`, which dispatches on its type.

`Packed` sends exactly what `Fused` sends for the same call, so ranks may differ in which they
execute: a rank that records a timeline or logs each call goes through `Fusion`, whose steps those
record.

What is left per call is finding the plan. A number, a writable NumPy array, or a list, tuple or
dict of numbers or of arrays of one dtype (`_host_form`) is keyed as it is, before any flattening:
the decision to skip `tree.flatten` is cached with the plan, and the plan runs through the same
`execute`. Any other tree is flattened and its leaves staged first (`_call.leaves_of`, `stage`).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Hashable, Sequence
from typing import Any, NamedTuple, cast

import numpy as np
import optree

from dataparallel.arrays import tree
from dataparallel.arrays.actions import Reduction, reduction, reduction_error
from dataparallel.arrays.aliases import overlapping
from dataparallel.arrays.compression import wire_dtype
from dataparallel.arrays.fusion import HOST_KEY, bucket_views
from dataparallel.arrays.inline import land_inline, pack_slots, slots_of
from dataparallel.arrays.nan import FLOATING
from dataparallel.arrays.replay import Replay
from dataparallel.backends.base import DoneHandle, Handle, ReduceOp
from dataparallel.collectives import _replays
from dataparallel.collectives._agree import Call, describe, inline_fits
from dataparallel.collectives._call import (
    CallContext,
    Leaf,
    check_root,
    host_works,
    leaves_of,
    log,
    prepared,
    results,
    run,
    stage,
    writable,
)
from dataparallel.collectives._callplan import Agreement, CallPlan, Fused, Inline, Packed, Whole
from dataparallel.collectives._nans import local_nans, nan_preserving
from dataparallel.collectives._onebuffer import (
    ONE_MESSAGE,
    is_packable,
    is_whole,
    run_packed,
    run_whole,
    whole_layout,
)
from dataparallel.protocol import PAYLOAD_BYTES, Records, digest, handshake, payload_capacity

__all__ = ["start"]

Finish = Callable[[], Any]  # builds the call's result: the type of the tree it was given

_DONE = DoneHandle()


def start(
    ctx: CallContext,
    collective: str,
    x: object,
    name: str,
    op: str,
    scale: float | None,
    *,
    root: int | None = None,
    compression: object = None,
    async_op: bool = False,
) -> tuple[Handle, Finish]:
    """Start the reduction `collective` of `x` through its plan.

    Returns what to wait for and the function that builds the result.
    """
    settings = ctx.settings
    plain = ctx.timeline is None and not settings.debug and root is None and compression is None
    if plain and type(scale) in _SCALES and type(op) is str:
        form = _host_form(x)
        if form is not None:
            size, check, bucket_bytes = ctx.backend.size, settings.check, settings.bucket_bytes
            key = (collective, name, op, scale, size, check, bucket_bytes, form.key)
            plan: CallPlan | None = ctx.plans.get(key)
            if type(plan) is Inline or (type(plan) is Packed and not form.numbers):
                return _DONE, _run_form(ctx, plan, form)
            return _general(ctx, collective, x, name, op, scale, root, compression, async_op, key)
    return _general(ctx, collective, x, name, op, scale, root, compression, async_op, None)


class _Form(NamedTuple):
    """A call's tree as it is: a number, a NumPy array, or a flat container of either."""

    key: tuple[Hashable, ...]  # what of the tree its plan depends on
    works: list[np.ndarray]  # its values as the plan's leaves (numbers: one float64 array)
    kind: type  # float, np.ndarray, list, tuple or dict
    spec: optree.PyTreeSpec | None  # a dict's structure
    numbers: bool  # the leaves are Python floats


_SCALES = (type(None), int, float)
_NUMERIC = frozenset("biufc")


def _host_form(x: object) -> _Form | None:
    """Return `x` as a `_Form`, or None for a tree that is flattened (`_general`)."""
    kind = type(x)
    if kind is float:
        return _Form(_FLOAT_KEY, [np.array(x)], kind, None, True)
    if kind is np.ndarray and isinstance(x, np.ndarray):
        flags = x.flags
        if not (flags.c_contiguous and flags.writeable) or x.dtype.kind not in _NUMERIC:
            return None
        return _Form((kind, x.dtype, x.shape), [x], kind, None, False)
    spec = None
    leaves: Sequence[object]
    if (kind is list or kind is tuple) and isinstance(x, (list, tuple)):
        leaves = x
    elif kind is dict and isinstance(x, dict):
        first = next(iter(x.values()), None)
        if type(first) is not float and type(first) is not np.ndarray:
            return None  # a dict of tensors, of dicts, ...: flattened once, by `_general`
        flat = tree.flatten(x, "x")
        leaves, spec = flat.leaves, flat.spec
    else:
        return None
    if not leaves:
        return None
    first = leaves[0]
    if type(first) is float:
        if len(leaves) * 8 > PAYLOAD_BYTES:
            return None
        for leaf in leaves:
            if type(leaf) is not float:
                return None
        return _Form((kind, spec, len(leaves)), [np.array(leaves)], kind, spec, True)
    if type(first) is not np.ndarray:
        return None
    dtype = first.dtype
    if dtype.kind not in _NUMERIC:
        return None
    for leaf in leaves:
        if type(leaf) is not np.ndarray or leaf.dtype is not dtype:
            return None
    arrays: list[np.ndarray] = list(leaves)  # every one checked above
    return _Form((kind, spec, dtype, tuple([a.shape for a in arrays])), arrays, kind, spec, False)


_FLOAT_KEY: tuple[Hashable, ...] = (float,)
_ONE_FLOAT64 = ["float64"]  # a form's numbers, one float64 array: laid out as n float64 leaves


def _run_form(ctx: CallContext, plan: Inline | Packed, form: _Form) -> Finish:
    """Execute `plan` on a `_Form`'s values; return what builds the result."""
    works = execute_host(ctx, plan, form.works, form.numbers)
    if form.numbers:
        values = works[0].tolist()
        if form.kind is float:
            return lambda: values
        return lambda: _rebuilt(form, values)
    if form.kind is np.ndarray:
        result = works[0]
        return lambda: result
    return lambda: _rebuilt(form, works)


def execute_host(
    ctx: CallContext, plan: Inline | Packed, works: list[np.ndarray], numbers: bool = False
) -> list[np.ndarray]:
    """Execute an `Inline` or `Packed` plan on host arrays (`numbers`: Python floats given as
    one float64 array); return the results' arrays (read-only ones come back new)."""
    backend = ctx.backend
    if type(plan) is Inline:
        slots = plan.numbers if numbers and plan.numbers is not None else plan.slots
        pack_slots(slots, works)
        records, agreed = plan.records, plan.agreement
        records.exchange(backend, agreed.describe, agreed.replay_of)
        dtypes = _ONE_FLOAT64 if numbers else plan.dtypes
        land_inline(records.payloads, works, dtypes, plan.action, backend.rank, slots)
        return works
    assert type(plan) is Packed
    return run_packed(backend, plan, works, ctx.buffers)


def _rebuilt(form: _Form, leaves: Sequence[object]) -> object:
    if form.spec is not None:
        return tree.unflatten(form.spec, list(leaves))
    return form.kind(leaves)


def _general(
    ctx: CallContext,
    collective: str,
    x: object,
    name: str,
    op: str,
    scale: float | None,
    root: int | None,
    compression: object,
    async_op: bool,
    key: tuple[Hashable, ...] | None,
) -> tuple[Handle, Finish]:
    """Flatten and stage `x`, find (or make) its plan, and execute it. `key`: the plan's key,
    when the caller made it from the tree as it is (`_host_form`)."""
    size = ctx.backend.size

    def prepare() -> tuple[tree.Flat, list[Leaf], Reduction, dict[str, object]]:
        wire = wire_dtype(compression)
        rank = None if root is None else check_root(root, ctx.backend)
        action = reduction(op, scale, size, rank)  # every call: it validates op and scale
        flat = tree.flatten(x, name)
        leaves = leaves_of(flat)
        stage(leaves, read_only=True)
        scale_arg = None if scale is None else float(scale)  # 2 and 2.0 are the same call
        args: dict[str, object] = {"op": op, "scale": scale_arg}
        if rank is not None:
            args["root"] = rank
        if wire is not None:
            args["compression"] = wire
        return flat, leaves, action, args

    flat, leaves, action, args = prepared(ctx, collective, prepare)
    if key is None:
        settings = ctx.settings
        signature = tuple([(leaf.dtype, leaf.shape, leaf.device) for leaf in leaves])
        key = (collective, name, *args.values(), size, settings.check, settings.bucket_bytes)
        key += (flat.spec, signature)
    plan: CallPlan | None = ctx.plans.get(key)
    if plan is None:
        plan = prepared(
            ctx,
            collective,
            lambda: _plan(ctx, collective, flat, leaves, args, action, scale, async_op),
        )
        ctx.plans.put(key, plan)
    return _execute(ctx, collective, plan, flat, leaves, async_op)


def _plan(
    ctx: CallContext,
    collective: str,
    flat: tree.Flat,
    leaves: list[Leaf],
    args: dict[str, object],
    action: Reduction,
    scale: float | None,
    async_op: bool,
) -> CallPlan:
    """Decide how calls like this one run (see the module's notes); raise for a bad leaf."""
    op = cast(str, args["op"])
    wire = cast(str | None, args.get("compression"))
    for leaf in leaves:
        error = reduction_error(leaf.dtype, op, scale)
        if error is not None:
            raise TypeError(f"{flat.path(leaf.index)}: {error}")
    size = ctx.backend.size
    inline = wire is None and inline_fits(ctx, leaves)  # compressed values never go inline
    dtypes = [leaf.dtype for leaf in leaves]
    packable = not inline and is_packable(ctx, collective, action, wire, leaves, dtypes)
    whole = not inline and not packable and is_whole(ctx, collective, action, wire, leaves, dtypes)
    messages = ONE_MESSAGE if whole else None
    summary, details = describe(Call(ctx, collective, flat, leaves, args, inline=inline), messages)
    call_digest = digest(summary)
    replay = _replays.fused(ctx, action, leaves, async_op, inline, compression=wire)
    agreement = Agreement(call_digest, details, replay, replay)
    # The handshake's buffers, where the world's size allows them: every plan but `Fused` is
    # chosen only then (`inline_fits`, `one_sum`).
    records = Records(size, call_digest) if payload_capacity(size) else None
    if (inline or packable or whole) and records is None:
        raise AssertionError("inline, packed and whole plans are chosen only with records")
    if inline and records is not None:
        works = host_works(leaves)
        slots = slots_of(records.payloads, works, records.payload)
        numbers = None
        if all(w.ndim == 0 and w.dtype == np.float64 for w in works):  # a form's: one array
            numbers = slots_of(records.payloads, [np.empty(len(works))], records.payload)
        return Inline(agreement, action, records, dtypes, slots, numbers)
    if packable and records is not None:
        works = host_works(leaves)
        bucket, views = None, []
        if len(works) > 1:  # the bucket `Fusion` packs these leaves into, kept
            bucket = np.empty(sum(w.size for w in works), works[0].dtype)
            views = bucket_views(bucket, [w.shape for w in works])
        return Packed(agreement, action, records, bucket, views)
    if whole and records is not None:  # one call of the packed front, then one per larger leaf
        offsets, front, alone, items = whole_layout(host_works(leaves), ctx.settings.bucket_bytes)
        sizes = [w.size for w in host_works(leaves)]
        calls = ([sum(sizes[i] for i in front)] if front else []) + [sizes[i] for i in alone]
        flushes = [[(HOST_KEY, dtypes[0], (n,))] for n in calls]
        replay = Replay.of(action, flushes, bucket_bytes=ctx.settings.bucket_bytes)
        agreement = Agreement(call_digest, details, replay, replay)
        return Whole(agreement, action, records, offsets, front, alone, items)
    nans = action.op in (ReduceOp.MIN, ReduceOp.MAX) and size > 1
    if nans:
        floating = [leaf for leaf in leaves if leaf.dtype in FLOATING]
        masks = _replays.nan_masks(ctx, floating, async_op)
        agreement = Agreement(call_digest, details, replay, dataclasses.replace(replay, then=masks))
    apart = len(leaves) > 1 and not _one_flight(ctx, leaves)
    return Fused(agreement, action, records, wire, nans, apart)


def _one_flight(ctx: CallContext, leaves: list[Leaf]) -> bool:
    """Whether `Fusion` sends these leaves as one packed bucket: all copied in before any lands,
    so leaves that share memory are each reduced once, whatever their memory (`aliases`)."""
    works = [leaf.work for leaf in leaves]
    if any(type(w) is not np.ndarray for w in works) or len(set(leaf.dtype for leaf in leaves)) > 1:
        return False
    return sum(cast(np.ndarray, w).nbytes for w in works) <= ctx.settings.bucket_bytes


def _execute(
    ctx: CallContext,
    collective: str,
    plan: CallPlan,
    flat: tree.Flat,
    leaves: list[Leaf],
    async_op: bool,
) -> tuple[Handle, Finish]:
    """Execute `plan` on staged leaves."""
    match plan:
        case Packed() if ctx.timeline is None and not ctx.settings.debug:
            works = execute_host(ctx, plan, host_works(leaves))
            for leaf, work in zip(leaves, works, strict=True):
                if work is not leaf.work:
                    leaf.work, leaf.is_view = work, False
            return _DONE, lambda: tree.unflatten(flat.spec, results(leaves, True))
        case Packed():  # through `Fusion`, whose steps a timeline and the log record
            fused = Fused(plan.agreement, plan.action, plan.records, None, False, False)
            return _fused(ctx, collective, fused, flat, leaves, async_op, None)
        case Whole():  # every rank executes it, with a timeline or not
            run_whole(ctx, plan, leaves)
            return _DONE, lambda: tree.unflatten(flat.spec, results(leaves, True))
        case Inline():
            return _inline(ctx, collective, plan, flat, leaves)
        case Fused():
            if plan.apart:  # leaves over the same memory: each reduced once, from its values now
                for i in overlapping([leaf.work for leaf in leaves]):
                    leaf = leaves[i]
                    leaf.work, leaf.is_view = np.array(leaf.work), False
            nans = prepared(ctx, collective, lambda: local_nans(leaves)) if plan.nans else None
            return _fused(ctx, collective, plan, flat, leaves, async_op, nans)


def _inline(
    ctx: CallContext, collective: str, plan: Inline, flat: tree.Flat, leaves: list[Leaf]
) -> tuple[Handle, Finish]:
    """`execute_host` on staged leaves (read-only ones copied first), logged and timed as
    `_call.run` logs and times a call."""
    action, timeline = plan.action, ctx.timeline
    if ctx.settings.debug:
        log(ctx, f"{collective} {action} leaves={len(leaves)} inline")
    started = timeline.now() if timeline is not None else 0.0
    writable(leaves)
    execute_host(ctx, plan, host_works(leaves))
    receives = action.root is None or action.root == ctx.backend.rank

    def finish() -> object:
        result = tree.unflatten(flat.spec, results(leaves, receives))
        if timeline is not None:
            timeline.complete(collective, started, leaves=len(leaves), calls=0)
        return result

    return _DONE, finish


def _fused(
    ctx: CallContext,
    collective: str,
    plan: Fused,
    flat: tree.Flat,
    leaves: list[Leaf],
    async_op: bool,
    nans: list[Leaf] | None,
) -> tuple[Handle, Finish]:
    """The handshake, then the leaves through `Fusion` (with the NaN masks where some rank
    flagged a NaN: `nan_preserving`)."""
    backend, agreed = ctx.backend, plan.agreement
    any_nan = False
    if backend.size > 1:
        _, any_nan = handshake(
            backend,
            agreed.digest,
            agreed.describe,
            records=plan.records,
            flag=None if nans is None else bool(nans),
            replay=agreed.replay_of,
        )
    if any_nan:  # some rank has a NaN: every rank also reduces where its NaNs are
        return nan_preserving(ctx, collective, flat, leaves, plan.action, async_op, plan.wire)
    return run(ctx, collective, flat, leaves, plan.action, async_op, None, plan.wire)

"""Call plans: what the general path decides about a reduction, decided once per signature.

A reduction's signature is what its decisions depend on: the collective and its arguments, the
tree's structure, each leaf's dtype, shape and device, the world's size and the settings. The first
call of a signature is planned (`_plan`): validated, described and hashed for the handshake, its
values placed in the handshake or not, its `Reduction` and its join replay made, and, for host
arrays of one dtype that make one bucket, that bucket allocated with each leaf's view of it. The
world keeps the plan (`World.plans`, which `dp.finalize()` drops with the world), and every call,
the first included, executes its plan (`start`) in one of three ways:

- "inline": the values travel in the handshake's payload, and every rank combines every rank's
  values locally, in rank order (`arrays/inline.py`): one message.
- "packed": the handshake, then one `Allreduce` of the bucket (the one leaf itself, in place; else
  the plan's buffer, packed and unpacked), scaled as `Fusion` scales a bucket.
- "fused": the leaves through `Fusion` (`_call.run`), with the NaN masks of min and max.
- "whole": a sum or product of read-only host leaves of one dtype (JAX's CPU arrays) over the
  "packed" limit and up to `_onebuffer.WHOLE_BYTES`, into one buffer lent by the pool: the leaves of
  at most `bucket_bytes` packed at its front and reduced by one `Allreduce` in place, each larger
  leaf reduced from JAX's memory straight into its place (`allreduce_into`: MPI reads the leaf,
  nothing copies it; an exact average's shares are written scaled into place and reduced there,
  `allreduce_into_scaled`); each leaf's result is a view of the buffer, which JAX adopts without a
  copy where it is 64-byte aligned. One handshake per call; ranks must all execute it (the summary
  says how the values travel). Packing the large leaves too (one call of everything) was measured
  slower: writing 7 MB just before the `Allreduce` that reads it made the call 1.6-1.9x a raw one,
  where reading the leaves where they lie costs 1.3-1.5x (2 ranks, 1.86 M float32 parameters). With
  the large leaves unpacked a "whole" plan makes `Fusion`'s calls for less Python: 32 MiB (8.40 M
  parameters) took 0.71-0.80x a raw in-place `Allreduce`, `Fusion` 0.92-1.06x, hence the limit of
  256 MiB (once 16 MiB, when everything was packed).

"packed" sends exactly what "fused" sends for the same call (`Fusion` makes one bucket of those
leaves), so ranks may differ in which they execute: a rank that records a timeline or logs each
call goes through `Fusion`, whose steps those record.

What is left per call is finding the plan. A number, a writable NumPy array, or a list, tuple or
dict of numbers or of arrays of one dtype (`_host_form`) is keyed as it is; any other tree is
flattened and its leaves staged first (`_call.leaves_of`, `stage`), as every call was before.
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
from dataparallel.arrays.fusion import HOST_KEY, allreduce_scaled
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
    prepared,
    results,
    run,
    stage,
)
from dataparallel.collectives._callplan import CallPlan, Kind
from dataparallel.collectives._nans import local_nans, nan_preserving
from dataparallel.collectives._onebuffer import (
    ONE_MESSAGE,
    Layout,
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
            if plan is not None and (
                plan.kind == "inline" or (plan.kind == "packed" and not form.numbers)
            ):
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


def _run_form(ctx: CallContext, plan: CallPlan, form: _Form) -> Finish:
    """Execute an "inline" or "packed" plan on a `_Form`; return what builds the result."""
    works, backend, records = form.works, ctx.backend, plan.records
    assert records is not None  # "inline" and "packed" plans have their records
    if plan.kind == "inline":  # the values travel in the handshake; each rank combines them all
        pack_slots(plan.form_slots, works)
        records.exchange(backend, plan.describe, plan.replay_of)
        dtypes = _ONE_FLOAT64 if form.numbers else plan.dtypes
        land_inline(records.payloads, works, dtypes, plan.action, backend.rank, plan.form_slots)
    elif plan.buf is None and form.kind is np.ndarray:  # contiguous and writable: in place
        records.exchange(backend, plan.describe, plan.replay_of)
        allreduce_scaled(backend, works[0].reshape(-1), plan.action)
    else:
        works = run_packed(backend, plan, works, ctx.buffers)
    if form.numbers:
        values = works[0].tolist()
        if form.kind is float:
            return lambda: values
        return lambda: _rebuilt(form, values)
    if form.kind is np.ndarray:
        result = works[0]
        return lambda: result
    return lambda: _rebuilt(form, works)


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
            ctx, collective, lambda: _plan(ctx, collective, flat, leaves, args, action, scale)
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
    kind: Kind = "inline" if inline else "whole" if whole else "fused"
    buf, views = None, []
    if packable:
        kind = "packed"
        works = host_works(leaves)
        if len(works) > 1:
            buf = np.empty(sum(w.size for w in works), works[0].dtype)
            offset = 0
            for w in works:
                views.append(buf[offset : offset + w.size].reshape(w.shape))
                offset += w.size
    nans = kind == "fused" and action.op in (ReduceOp.MIN, ReduceOp.MAX) and size > 1
    replay = _replays.fused(
        ctx, action, leaves, collective.startswith("i"), inline, compression=wire
    )
    layout: Layout = ((), (), (), 0)
    if whole:  # one call of the packed front, then one per larger leaf
        layout = whole_layout(host_works(leaves), ctx.settings.bucket_bytes)
        _, front, alone, _ = layout
        sizes = [w.size for w in host_works(leaves)]
        calls = ([sum(sizes[i] for i in front)] if front else []) + [sizes[i] for i in alone]
        flushes = [[(HOST_KEY, dtypes[0], (n,))] for n in calls]
        replay = Replay.of(action, flushes, bucket_bytes=ctx.settings.bucket_bytes)
    replay_nan = replay
    if nans:
        floating = [leaf for leaf in leaves if leaf.dtype in FLOATING]
        masks = _replays.nan_masks(ctx, floating, collective.startswith("i"))
        replay_nan = dataclasses.replace(replay, then=masks)
    apart = kind == "fused" and len(leaves) > 1 and not _one_flight(ctx, leaves)
    plan = CallPlan(
        kind,
        call_digest,
        details,
        action,
        dtypes,
        wire,
        nans,
        apart,
        replay,
        replay_nan,
        buf,
        views,
    )
    plan.offsets, plan.front, plan.alone, plan.items = layout
    if payload_capacity(size):  # the handshake's buffers, and where each leaf's values land
        records = plan.records = Records(size, call_digest)
        if inline:
            works = host_works(leaves)
            plan.slots = plan.form_slots = slots_of(records.payloads, works, records.payload)
            if all(w.ndim == 0 and w.dtype == np.float64 for w in works):  # numbers: one array
                numbers = np.empty(len(works))
                plan.form_slots = slots_of(records.payloads, [numbers], records.payload)
    return plan


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
    backend = ctx.backend
    plain = ctx.timeline is None and not ctx.settings.debug
    if plan.kind == "packed" and plain:
        works = run_packed(backend, plan, host_works(leaves), ctx.buffers)
        for leaf, work in zip(leaves, works, strict=True):
            if work is not leaf.work:
                leaf.work, leaf.is_view = work, False
        return _DONE, lambda: tree.unflatten(flat.spec, results(leaves, True))
    if plan.kind == "whole":  # every rank executes it, with a timeline or not
        run_whole(ctx, plan, leaves)
        return _DONE, lambda: tree.unflatten(flat.spec, results(leaves, True))
    if plan.kind == "inline":
        records = plan.records
        assert records is not None  # "inline" plans have their records
        pack_slots(plan.slots, host_works(leaves))
        records.exchange(backend, plan.describe, plan.replay_of)
        return run(ctx, collective, flat, leaves, plan.action, async_op, records.payloads)
    if plan.apart:  # leaves over the same memory: each reduced once, from its values now
        for i in overlapping([leaf.work for leaf in leaves]):
            leaf = leaves[i]
            leaf.work, leaf.is_view = np.array(leaf.work), False
    nans = None
    if plan.nans:
        nans = prepared(ctx, collective, lambda: local_nans(leaves))
    any_nan = False
    if backend.size > 1:
        _, any_nan = handshake(
            backend,
            plan.digest,
            plan.describe,
            records=plan.records,
            flag=None if nans is None else bool(nans),
            replay=plan.replay_of,
        )
    if any_nan:  # some rank has a NaN: every rank also reduces where its NaNs are
        return nan_preserving(ctx, collective, flat, leaves, plan.action, async_op, plan.wire)
    return run(ctx, collective, flat, leaves, plan.action, async_op, None, plan.wire)

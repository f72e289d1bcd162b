"""How a collective call runs, the skeleton every public collective shares.

Find the engine and settings (`context`); then, in `prepared` (a failure there fails the call on
every rank), identify each leaf's family and dtype (`leaves_of`), validate, and stage the leaves
(`stage`); make the handshake, in which every rank checks that every rank makes the same call and
small payloads travel (`agree`); run the leaves through the fusion engine, or reduce the payloads
that came with the handshake (`run`); and rebuild the tree from the results. Every public
collective in this package is these steps in this order; `requests.Request` wraps the ones
started without blocking.
"""

from __future__ import annotations

import math
import sys
from collections.abc import Callable
from dataclasses import dataclass
from math import prod
from typing import Any, TypeVar

import numpy as np

from dataparallel import world
from dataparallel.backends.base import Backend, DoneHandle, Handle
from dataparallel.checks import (
    HEADER_BYTES,
    ShadowOf,
    fail_together,
    handshake,
    inline_capacity,
    new_record,
)
from dataparallel.config import Settings
from dataparallel.engine import tree
from dataparallel.engine.actions import Broadcast, Exchange, Reduction, Scatter
from dataparallel.engine.arrays import Family, family_of, write_back
from dataparallel.engine.dtypes import storage_dtype
from dataparallel.engine.fusion import HOST_KEY, Fusion
from dataparallel.engine.inline import land_inline, pack_inline, padded
from dataparallel.engine.pool import BufferPool
from dataparallel.engine.trace import Timeline

__all__ = [
    "CallContext",
    "Context",
    "Leaf",
    "agree",
    "check_root",
    "check_rows",
    "context",
    "describe",
    "fuse",
    "host_work",
    "inline_fits",
    "leaf_of",
    "leaves_of",
    "log",
    "prepared",
    "results",
    "run",
    "run_split",
    "stage",
]


@dataclass
class Context:
    """What a call runs with: the world's engine, settings, buffers, requests and timeline."""

    backend: Backend
    settings: Settings
    buffers: BufferPool
    pending: list[Any] | None
    timeline: Timeline | None = None


CallContext = Context | world.World  # both have backend, settings, buffers, pending, timeline


def context(backend: Backend | None) -> CallContext:
    """Return the active world (the common case: nothing to build), or a context for `backend`."""
    if backend is None:
        return world.current()
    if world.initialized():
        active = world.current()
        if backend is active.backend:
            return active
        return Context(backend, active.settings, active.buffers, active.pending, active.timeline)
    return Context(backend, Settings.from_env(), BufferPool(), None)


@dataclass
class Leaf:
    value: Any
    index: int  # position among the tree's leaves, for its path
    family: Family
    dtype: str
    shape: tuple[int, ...]
    device: str  # "cpu", "cuda:0", ...
    work: Any = None  # a host array in the storage dtype, or a device.DeviceWork (`stage`)
    is_view: bool = False


def leaf_of(flat: tree.Flat, i: int) -> Leaf:
    value = flat.leaves[i]
    try:
        family = family_of(value)
    except TypeError:
        family_of(value, flat.path(i))  # raise again, naming the leaf's path
        raise
    return Leaf(value, i, family, family.dtype(value), family.shape(value), family.device(value))


def leaves_of(flat: tree.Flat) -> list[Leaf]:
    return [leaf_of(flat, i) for i in range(len(flat.leaves))]


def stage(leaves: list[Leaf]) -> None:
    """Give every leaf its `work` array (a view, a host copy, or a device bucket's member)."""
    for leaf in leaves:
        leaf.work, leaf.is_view = leaf.family.work(leaf.value)


_T = TypeVar("_T")


def prepared(ctx: CallContext, collective: str, prepare: Callable[[], _T]) -> _T:
    """Run `prepare` (what a call does before communicating); if it fails, fail on every rank.

    A rank whose input is rejected here still takes part in the call's handshake, with its
    failure as its call (`checks.fail_together`), then raises its error: the other ranks raise
    `CollectiveMismatchError`, and no rank's next call meets another's current one.
    """
    try:
        return prepare()
    except Exception as error:
        fail_together(ctx.backend, collective, error)
        raise


def inline_fits(ctx: CallContext, leaves: list[Leaf]) -> bool:
    """Whether the leaves' values travel in the handshake (host leaves, few bytes in all)."""
    room = inline_capacity(ctx.backend.size)
    if room == 0:
        return False
    for leaf in leaves:
        work = leaf.work
        if type(work) is not np.ndarray:
            return False
        room -= padded(work.nbytes)
        if room < 0:
            return False
    return True


def agree(
    ctx: CallContext,
    collective: str,
    flat: tree.Flat,
    leaves: list[Leaf],
    args: dict[str, Any],
    *,
    first_axis: bool = True,
    inline: bool = False,
    flag: bool | None = None,
    shadow: ShadowOf = None,
) -> tuple[np.ndarray | None, bool]:
    """Make the handshake (`checks.handshake`); return the records (when `inline`), the flag.

    With `inline`, the leaves' values travel in the records (`run` then reduces them there).
    `shadow` describes the calls that follow, for ranks that have joined (`dp.join`) to make
    them too; without one, the call raises `RankJoinedError` while some rank has joined.
    """
    if ctx.backend.size == 1:
        return None, False
    record = None
    if inline:
        record = new_record()
        pack_inline(record, HEADER_BYTES, [leaf.work for leaf in leaves])
    summary, details = describe(ctx, collective, flat, leaves, args, first_axis, inline)
    rows, flagged = handshake(
        ctx.backend, summary, details, record=record, flag=flag, shadow=shadow
    )
    return (rows if inline else None), flagged


def describe(
    ctx: CallContext,
    collective: str,
    flat: tree.Flat,
    leaves: list[Leaf],
    args: dict[str, Any],
    first_axis: bool = True,
    inline: bool = False,
) -> tuple[str, Callable[[], dict[str, Any]]]:
    """Return the call's summary (equal on two ranks exactly when their calls are the same) and
    the function that describes it field by field.

    With checks on, the summary covers the whole call; with `DATAPARALLEL_CHECK=0`, only what
    decides the messages that follow (each leaf's dtype, size and device).
    """
    wire = "inline" if inline else f"buckets of {ctx.settings.bucket_bytes} B"

    def signature(leaf: Leaf) -> str:
        shape = list(leaf.shape) if first_axis else ["*", *leaf.shape[1:]]
        # The device's kind, not its index: rank r's GPU is cuda:r, yet CPU against GPU differs.
        where = "" if leaf.device == "cpu" else f" on {leaf.device.partition(':')[0]}"
        return f"{leaf.dtype}{shape}{where}"

    if ctx.settings.check:
        signatures = [signature(leaf) for leaf in leaves]
        structure = flat.structure()
        summary = f"{collective}|{sorted(args.items())}|{structure}|{'|'.join(signatures)}"
    else:
        signatures, structure = [], ""
        sizes = [
            f"{leaf.dtype}:{prod(leaf.shape[0 if first_axis else 1 :])}:{leaf.device[:2]}"
            for leaf in leaves
        ]
        summary = f"{collective}|{sorted(args.items())}|{'|'.join(sizes)}"

    def details() -> dict[str, Any]:
        call: dict[str, Any] = {"collective": collective, **args, "messages": wire}
        call["tree structure"] = structure or flat.structure()
        for leaf, sig in zip(leaves, signatures or map(signature, leaves), strict=True):
            call[flat.path(leaf.index)] = sig
        return call

    return f"{summary}|{wire}", details


def check_root(root: int, backend: Backend) -> None:
    if not 0 <= root < backend.size:
        raise ValueError(f"root={root} is not a rank of this world of {backend.size}.")


def log(ctx: CallContext, message: str) -> None:
    """Write `message` to stderr with the rank, when `DATAPARALLEL_DEBUG=1`."""
    if ctx.settings.debug:
        b = ctx.backend
        sys.stderr.write(f"[dataparallel {b.rank}/{b.size}] {message}\n")  # one write per line
        sys.stderr.flush()


def run(
    ctx: CallContext,
    collective: str,
    flat: tree.Flat,
    leaves: list[Leaf],
    action: Reduction | Broadcast,
    async_op: bool,
    rows: np.ndarray | None = None,
) -> tuple[Handle, Callable[[], Any]]:
    """Start the collective; return what to wait for and the function that builds its result.

    With `rows` (every rank's handshake record, carrying the values), the result is computed
    here and nothing more is sent; otherwise the leaves go through the fusion engine.
    """
    if ctx.settings.debug:  # formatting costs more than a small call: only when asked
        log(
            ctx,
            f"{collective} {action} leaves={len(leaves)}{' inline' if rows is not None else ''}",
        )
    started = ctx.timeline.now() if ctx.timeline is not None else 0.0
    rank = ctx.backend.rank
    if isinstance(action, Broadcast):
        receives = rank != action.root
    else:
        receives = action.root is None or action.root == rank
    fusion = None
    if rows is not None:
        works = [leaf.work for leaf in leaves]
        land_inline(rows, HEADER_BYTES, works, [leaf.dtype for leaf in leaves], action, rank)
    else:
        fusion = fuse(ctx, leaves, action, async_op)

    def finish() -> Any:
        result = tree.unflatten(flat.spec, results(leaves, receives))
        if ctx.timeline is not None:
            calls = 0 if fusion is None else fusion.calls
            ctx.timeline.complete(collective, started, leaves=len(leaves), calls=calls)
        return result

    return (_DONE if fusion is None else fusion), finish


def fuse(
    ctx: CallContext, leaves: list[Leaf], action: Reduction | Broadcast, async_op: bool
) -> Fusion:
    """Send the leaves (`stage`d) through the fusion engine; return it, flushed."""
    fusion = Fusion(
        ctx.backend,
        action,
        bucket_bytes=ctx.settings.bucket_bytes,
        async_op=async_op,
        pool=ctx.buffers,
        timeline=ctx.timeline,
    )
    for leaf in leaves:
        if leaf.work is None:
            leaf.work, leaf.is_view = leaf.family.work(leaf.value)
        # Host buffers are packed alike whatever their family, so ranks may mix families.
        key = HOST_KEY if type(leaf.work) is np.ndarray else (leaf.family.name, leaf.device)
        fusion.add(leaf.work, leaf.dtype, key)
    fusion.flush()
    return fusion


_DONE = DoneHandle()


def results(leaves: list[Leaf], receives: bool) -> list[Any]:
    """Return the leaves' values after the call: written back where they were staged."""
    if not receives:
        return [leaf.value for leaf in leaves]
    return write_back([(leaf.family, leaf.value, leaf.work, leaf.is_view) for leaf in leaves])


def check_rows(collective: str, flat: tree.Flat, leaves: list[Leaf]) -> None:
    """Raise `ValueError` for a leaf without a first axis (a number, a 0-d array)."""
    for leaf in leaves:
        if not leaf.shape:
            raise ValueError(
                f"{flat.path(leaf.index)}: {collective} splits arrays along their first axis, "
                "but this leaf is a number or a 0-d array; give it one (np.reshape(x, (1,)), "
                "x[None]) or leave it out of the tree."
            )


def host_work(leaf: Leaf) -> np.ndarray:
    """Return a host array of the leaf's values (a zero-copy view where its family allows)."""
    view = leaf.family.host_view(leaf.value)
    return view if view is not None else leaf.family.to_host(leaf.value)


def run_split(
    ctx: CallContext,
    collective: str,
    flat: tree.Flat,
    leaves: list[Leaf],
    action: Scatter | Exchange,
) -> Any:
    """Run a reduce-scatter or an all-to-all of the leaves; return the rebuilt tree.

    Results change shape, so each comes back as a new array of its leaf's family; GPU leaves are
    staged through host memory. Every leaf is on the host here, so buckets are per dtype whatever
    the family. An all-to-all moves bytes, all leaves in one call: its bucketing must not depend
    on sizes, which differ between ranks.
    """
    if ctx.settings.debug:
        log(ctx, f"{collective} {action} leaves={len(leaves)}")
    started = ctx.timeline.now() if ctx.timeline is not None else 0.0
    moves = isinstance(action, Exchange)
    fusion = Fusion(
        ctx.backend,
        action,
        bucket_bytes=sys.maxsize if moves else ctx.settings.bucket_bytes,
        async_op=False,
        pool=ctx.buffers,
        timeline=ctx.timeline,
    )
    out: list[Any] = [None] * len(leaves)
    for i, leaf in enumerate(leaves):
        work, storage = host_work(leaf), storage_dtype(leaf.dtype)

        def deliver(host: np.ndarray, i: int = i, leaf: Leaf = leaf, kind: Any = storage) -> None:
            if moves:  # bytes, one row per row: back to the leaf's dtype and shape
                host = host.reshape(-1).view(kind).reshape(host.shape[0], *leaf.shape[1:])
            out[i] = leaf.family.adopt(leaf.value, host)  # host is the result's own memory

        if moves:
            row_bytes = storage.itemsize * math.prod(leaf.shape[1:])
            work = np.ascontiguousarray(work).reshape(-1).view(np.uint8)
            work = work.reshape(leaf.shape[0], row_bytes)
        fusion.add(work, "uint8" if moves else leaf.dtype, (), deliver)
    fusion.wait()
    if ctx.timeline is not None:
        ctx.timeline.complete(collective, started, leaves=len(leaves), calls=fusion.calls)
    return tree.unflatten(flat.spec, out)

"""How a collective call runs, the skeleton every public collective shares.

Find the engine and settings (`context`); then, in `prepared` (a failure there fails the call on
every rank), identify each leaf's family and dtype (`leaves_of`), validate, and stage the leaves
(`stage`); make the handshake, in which every rank checks that every rank makes the same call and
small payloads travel (`_agree.py`); run the leaves through `Fusion`, or reduce the payloads
that came with the handshake (`run`); and rebuild the tree from the results. Every public
collective in this package is these steps in this order; `requests.Request` wraps the ones
started without blocking.
"""

from __future__ import annotations

import numbers
import sys
from collections.abc import Callable
from dataclasses import dataclass
from typing import TypeVar, cast

import numpy as np

from dataparallel import caches, world
from dataparallel.arrays import tree
from dataparallel.arrays.actions import Broadcast, Reduction
from dataparallel.arrays.families import Family, Work, family_of, write_back
from dataparallel.arrays.fusion import HOST_KEY, Fusion
from dataparallel.arrays.inline import land_inline
from dataparallel.arrays.pool import BufferPool
from dataparallel.arrays.trace import Timeline
from dataparallel.backends.base import Backend, DoneHandle, Handle
from dataparallel.config import Settings
from dataparallel.protocol import fail_together

__all__ = [
    "CallContext",
    "Context",
    "Leaf",
    "check_root",
    "context",
    "fuse",
    "host_works",
    "leaf_of",
    "leaves_of",
    "log",
    "prepared",
    "results",
    "run",
    "stage",
    "writable",
]


@dataclass
class Context:
    """What a call runs with: the world's engine, settings, buffers, requests and timeline."""

    backend: Backend
    settings: Settings
    buffers: BufferPool
    pending: list[world.Waitable] | None
    plans: world.Plans
    timeline: Timeline | None = None


CallContext = Context | world.World  # both have backend, settings, buffers, pending, plans...


def context(backend: Backend | None) -> CallContext:
    """Return the active world (the common case: nothing to build), or a context for `backend`."""
    if backend is None:
        return world.current()
    if world.initialized():
        active = world.current()
        if backend is active.backend:
            return active
        return Context(
            backend, active.settings, active.buffers, active.pending, active.plans, active.timeline
        )
    return Context(backend, Settings.from_env(), BufferPool(), None, world.Plans())


@dataclass
class Leaf:
    value: object
    index: int  # position among the tree's leaves, for its path
    family: Family
    dtype: str
    shape: tuple[int, ...]
    device: str  # "cpu", "cuda:0", ...
    work: Work | None = None  # a host array in the storage dtype, or a device.DeviceWork (`stage`)
    is_view: bool = False


def leaf_of(flat: tree.Flat, i: int) -> Leaf:
    value = flat.leaves[i]
    if type(value) is np.ndarray:  # the common case, answered from a cache
        known = _PLAIN_NUMPY.get(value.dtype)
        if known is not None:
            return Leaf(value, i, known[0], known[1], value.shape, "cpu")
    try:
        family = family_of(value)
    except TypeError:
        family_of(value, flat.path(i))  # raise again, naming the leaf's path
        raise
    leaf = Leaf(value, i, family, family.dtype(value), family.shape(value), family.device(value))
    if type(value) is np.ndarray:
        _PLAIN_NUMPY[value.dtype] = (family, leaf.dtype)
    return leaf


# The family and dtype name of plain NumPy arrays, by dtype, once `family_of` has accepted it.
_PLAIN_NUMPY: dict[np.dtype, tuple[Family, str]] = {}
caches.register(_PLAIN_NUMPY.clear)


def host_works(leaves: list[Leaf]) -> list[np.ndarray]:
    """The leaves' staged host arrays (a caller that found every leaf's work on the host)."""
    works = [leaf.work for leaf in leaves]
    if any(type(work) is not np.ndarray for work in works):
        raise TypeError("host_works: some leaf was not staged on the host")
    return cast(list[np.ndarray], works)


def leaves_of(flat: tree.Flat) -> list[Leaf]:
    return [leaf_of(flat, i) for i in range(len(flat.leaves))]


def stage(leaves: list[Leaf], read_only: bool = False) -> None:
    """Give every leaf its `work` array (a view, a host copy, or a device bucket's member).

    With `read_only` (reductions), immutable leaves that allow it (JAX's CPU arrays) get a
    read-only view of their memory (`Family.read_view`): what reads them packs from it or sends
    it as it is (`Fusion.reads_only`), and what would write it makes a copy first (`writable`).
    """
    for leaf in leaves:
        view = leaf.family.read_view(leaf.value) if read_only else None
        if view is not None:
            leaf.work, leaf.is_view = view, False
        else:
            leaf.work, leaf.is_view = leaf.family.work(leaf.value)


def writable(leaves: list[Leaf]) -> None:
    """Replace the leaves' read-only views (`stage(read_only=True)`) by copies, to write into."""
    for leaf in leaves:
        work = leaf.work
        if type(work) is np.ndarray and not work.flags.writeable:
            leaf.work = work.copy()


_T = TypeVar("_T")


def prepared(ctx: CallContext, collective: str, prepare: Callable[[], _T]) -> _T:
    """Run `prepare` (what a call does before communicating); if it fails, fail on every rank.

    A rank whose input is rejected here still takes part in the call's handshake, with its
    failure as its call (`protocol.fail_together`), then raises its error: the other ranks raise
    `CollectiveMismatchError`, and no rank's next call meets another's current one.
    """
    try:
        return prepare()
    except Exception as error:
        fail_together(ctx.backend, collective, error)
        raise


def check_root(root: int, backend: Backend) -> int:
    """Return `root` as an `int` (`np.int64(1)` is 1: both make the same call); refuse one that
    is not an integer (`0.0`, `True`, `"0"`) or not a rank of the world."""
    if isinstance(root, bool) or not isinstance(root, numbers.Integral):
        raise TypeError(
            f"root={root!r} is not a rank: give an int from 0 to {backend.size - 1} "
            f"(got {type(root).__name__})."
        )
    if not 0 <= root < backend.size:
        raise ValueError(f"root={root} is not a rank of this world of {backend.size}.")
    return int(root)


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
    compression: str | None = None,
) -> tuple[Handle, Callable[[], object]]:
    """Start the collective; return what to wait for and the function that builds its result.

    With `rows` (every rank's handshake payload, carrying the values), the result is computed
    here and nothing more is sent; otherwise the leaves go through `Fusion` (with
    `compression`, a 16-bit wire dtype, floating buckets travel compressed).
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
        writable(leaves)
        land_inline(rows, host_works(leaves), [leaf.dtype for leaf in leaves], action, rank)
    else:
        fusion = fuse(ctx, leaves, action, async_op, compression)

    def finish() -> object:
        result = tree.unflatten(flat.spec, results(leaves, receives))
        if ctx.timeline is not None:
            calls = 0 if fusion is None else fusion.calls
            ctx.timeline.complete(collective, started, leaves=len(leaves), calls=calls)
        return result

    return (_DONE if fusion is None else fusion), finish


def fuse(
    ctx: CallContext,
    leaves: list[Leaf],
    action: Reduction | Broadcast,
    async_op: bool,
    compression: str | None = None,
) -> Fusion:
    """Send the leaves (`stage`d) through `Fusion`; return it, flushed."""
    for leaf in leaves:
        if leaf.work is None:
            leaf.work, leaf.is_view = leaf.family.work(leaf.value)
    # Device buckets are packed, staged or launched one at a time, nothing to pipeline as MPI's
    # small host buckets do: DDP's size (a 25.6 M-float tree, benchmarks/gpu.py).
    on_device = any(type(leaf.work) is not np.ndarray for leaf in leaves)
    settings = ctx.settings
    fusion = Fusion(
        ctx.backend,
        action,
        bucket_bytes=settings.thread_bucket_bytes if on_device else settings.bucket_bytes,
        async_op=async_op,
        pool=ctx.buffers,
        timeline=ctx.timeline,
        compression=compression,
    )
    for leaf in leaves:
        work = leaf.work
        assert work is not None
        if type(work) is np.ndarray and not work.flags.writeable:  # `stage(read_only=True)`
            if isinstance(action, Reduction) and action.root is None and compression is None:
                fusion.add(work, leaf.dtype, HOST_KEY, deliver=_into(leaf))  # read, not written
                continue
            leaf.work = work = work.copy()
        # Host buffers are packed alike whatever their family, so ranks may mix families.
        key = HOST_KEY if type(work) is np.ndarray else (leaf.family.name, leaf.device)
        fusion.add(work, leaf.dtype, key)
    fusion.flush()
    return fusion


def _into(leaf: Leaf) -> Callable[[np.ndarray], None]:
    """Where a read-only leaf's result goes: its new work, written back as a new array."""

    def land(result: np.ndarray) -> None:
        leaf.work = result

    return land


_DONE = DoneHandle()


def results(leaves: list[Leaf], receives: bool) -> list[object]:
    """Return the leaves' values after the call: written back where they were staged."""
    if not receives:
        return [leaf.value for leaf in leaves]
    return write_back([(leaf.family, leaf.value, leaf.work, leaf.is_view) for leaf in leaves])

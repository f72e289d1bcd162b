"""How a collective call runs, the skeleton every public collective shares.

Find the engine and settings (`context`), identify each leaf's family and dtype (`leaves_of`),
check that every rank makes the same call (`verify`), run the leaves through the fusion engine
(`run`), and rebuild the tree from the results. Every public collective in this package is these
steps in this order; `requests.Request` wraps the ones started without blocking.
"""

from __future__ import annotations

import numbers
import sys
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import numpy as np

from dataparallel import world
from dataparallel.backends.base import Backend
from dataparallel.checks import verify_same_call
from dataparallel.config import Settings
from dataparallel.engine import tree
from dataparallel.engine.arrays import Family, family_of
from dataparallel.engine.fusion import Broadcast, Fusion, Reduction
from dataparallel.engine.pool import BufferPool
from dataparallel.engine.trace import Timeline

__all__ = [
    "CallContext",
    "Context",
    "Leaf",
    "check_root",
    "context",
    "fuse",
    "leaf_of",
    "leaves_of",
    "log",
    "results",
    "run",
    "verify",
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
    work: np.ndarray | None = None
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


def verify(
    ctx: CallContext,
    collective: str,
    flat: tree.Flat,
    leaves: list[Leaf],
    args: dict[str, Any],
    *,
    first_axis: bool = True,
) -> None:
    """Check that every rank makes this call (see `checks.verify_same_call`)."""
    if not ctx.settings.check or ctx.backend.size == 1:
        return

    def signature(leaf: Leaf) -> str:
        shape = list(leaf.shape) if first_axis else ["*", *leaf.shape[1:]]
        # The device's kind, not its index: rank r's GPU is cuda:r, yet CPU against GPU differs.
        where = "" if leaf.device == "cpu" else f" on {leaf.device.partition(':')[0]}"
        return f"{leaf.dtype}{shape}{where}"

    signatures = [signature(leaf) for leaf in leaves]
    summary = f"{collective}|{sorted(args.items())}|{flat.structure()}|{'|'.join(signatures)}"

    def details() -> dict[str, Any]:
        call: dict[str, Any] = {"collective": collective, **args}
        call["tree structure"] = flat.structure()
        for leaf, sig in zip(leaves, signatures, strict=True):
            call[flat.path(leaf.index)] = sig
        return call

    verify_same_call(ctx.backend, details, summary)


def check_root(root: int, backend: Backend) -> None:
    """Refuse a `root` that is not an integer (`0.0`, `True`, `"0"`) or not a rank of the world."""
    if isinstance(root, bool) or not isinstance(root, numbers.Integral):
        raise TypeError(
            f"root={root!r} is not a rank: give an int from 0 to {backend.size - 1} "
            f"(got {type(root).__name__})."
        )
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
) -> tuple[Fusion, Callable[[], Any]]:
    """Start the fused collective; return it and the function that builds its result."""
    if ctx.settings.debug:  # formatting costs more than a small call: only when asked
        log(ctx, f"{collective} {action} leaves={len(leaves)}")
    started = ctx.timeline.now() if ctx.timeline is not None else 0.0
    fusion = fuse(ctx, leaves, action, async_op)
    rank = ctx.backend.rank
    if isinstance(action, Broadcast):
        receives = rank != action.root
    else:
        receives = action.root is None or action.root == rank

    def finish() -> Any:
        result = tree.unflatten(flat.spec, results(leaves, receives))
        if ctx.timeline is not None:
            ctx.timeline.complete(collective, started, leaves=len(leaves), calls=fusion.calls)
        return result

    return fusion, finish


def fuse(
    ctx: CallContext, leaves: list[Leaf], action: Reduction | Broadcast, async_op: bool
) -> Fusion:
    fusion = Fusion(
        ctx.backend,
        action,
        bucket_bytes=ctx.settings.bucket_bytes,
        async_op=async_op,
        pool=ctx.buffers,
        timeline=ctx.timeline,
    )
    for leaf in leaves:
        leaf.work, leaf.is_view = leaf.family.work(leaf.value)
        fusion.add(leaf.work, leaf.dtype, (leaf.family.name, leaf.device))
    return fusion


def results(leaves: list[Leaf], receives: bool) -> list[Any]:
    if not receives:
        return [leaf.value for leaf in leaves]
    return [
        leaf.value
        if leaf.is_view or leaf.work is None
        else leaf.family.from_host(leaf.value, leaf.work)
        for leaf in leaves
    ]

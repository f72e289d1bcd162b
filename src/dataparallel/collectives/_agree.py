"""The handshake of a collective call (`agree`): the call's summary, equal on two ranks exactly
when their calls are the same, and its description field by field for a mismatch's message
(`describe`), both of one `Call`; the digest kept by the world's plans; small payloads carried
in the records (`inline_fits`). `protocol.handshake` exchanges the records."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from math import prod

import numpy as np

from dataparallel.arrays import tree
from dataparallel.arrays.inline import pack_inline, padded
from dataparallel.collectives._call import CallContext, Leaf, host_works
from dataparallel.protocol import Records, ReplayOf, digest, handshake, payload_capacity

__all__ = ["Call", "agree", "describe", "inline_fits"]


@dataclass(slots=True)
class Call:
    """A collective call as its handshake sees it: what `agree` compares, `describe` tells."""

    ctx: CallContext
    collective: str
    flat: tree.Flat
    leaves: list[Leaf]
    args: dict[str, object]  # the call's arguments that every rank must give alike
    first_axis: bool = True  # False: the leaves' first axes may differ (gathers, alltoall)
    inline: bool = False  # the leaves' values travel in the handshake's records


def inline_fits(ctx: CallContext, leaves: list[Leaf]) -> bool:
    """Whether the leaves' values travel in the handshake (host leaves, few bytes in all)."""
    room = payload_capacity(ctx.backend.size)
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
    call: Call, *, flag: bool | None = None, replay: ReplayOf = None
) -> tuple[np.ndarray | None, bool]:
    """Make the handshake (`protocol.handshake`); return the records (when `inline`), the flag.

    With `inline`, the leaves' values travel in the records (`run` then reduces them there).
    `replay` describes the calls that follow, for ranks that have joined (`dp.join`) to make
    them too; without one, the call raises `RankJoinedError` while some rank has joined.
    """
    ctx, leaves, inline = call.ctx, call.leaves, call.inline
    if ctx.backend.size == 1:
        return None, False
    settings = ctx.settings
    key = (
        "digest",
        call.collective,
        tuple(call.args.items()),
        call.flat.spec,
        tuple([(leaf.dtype, leaf.shape, leaf.device) for leaf in leaves]),
        call.first_axis,
        inline,
        settings.check,
        settings.bucket_bytes,
        ctx.backend.size,
    )
    h: int | None = ctx.plans.get(key)

    def details() -> dict[str, object]:
        return describe(call)[1]()

    if h is None:  # the world keeps the digests of calls seen: a call repeated is described once
        h = digest(describe(call)[0])
        ctx.plans.put(key, h)
    records = None
    if inline:
        records = Records(ctx.backend.size, h)
        pack_inline(records.payload, 0, host_works(leaves))
    rows, flagged = handshake(ctx.backend, h, details, records=records, flag=flag, replay=replay)
    return (rows["payload"] if inline and rows is not None else None), flagged


def describe(
    call: Call, messages: str | None = None
) -> tuple[str, Callable[[], dict[str, object]]]:
    """Return the call's summary (equal on two ranks exactly when their calls are the same) and
    the function that describes it field by field (`messages`: how the values travel, when not
    inline nor in buckets).

    With checks on, the summary covers the whole call; with `DATAPARALLEL_CHECK=0`, only what
    decides the messages that follow (each leaf's dtype, size and device).
    """
    ctx, flat, leaves, first_axis = call.ctx, call.flat, call.leaves, call.first_axis
    collective, args = call.collective, call.args  # what `details` keeps (plans keep it: no leaf)
    wire = messages or ("inline" if call.inline else f"buckets of {ctx.settings.bucket_bytes} B")

    def signature(leaf: Leaf) -> str:
        shape = list(leaf.shape) if first_axis else ["*", *leaf.shape[1:]]
        # The device's kind, not its index: rank r's GPU is cuda:r, yet CPU against GPU differs.
        where = "" if leaf.device == "cpu" else f" on {leaf.device.partition(':')[0]}"
        return f"{leaf.dtype}{shape}{where}"

    signatures = [signature(leaf) for leaf in leaves]
    if ctx.settings.check:
        structure = flat.structure()
        summary = f"{collective}|{sorted(args.items())}|{structure}|{'|'.join(signatures)}"
    else:
        structure = ""
        sizes = [
            f"{leaf.dtype}:{prod(leaf.shape[0 if first_axis else 1 :])}:{leaf.device[:2]}"
            for leaf in leaves
        ]
        summary = f"{collective}|{sorted(args.items())}|{'|'.join(sizes)}"
    bare = tree.Flat([], flat.spec, flat.name)  # the structure without the leaves, kept by plans
    indices = [leaf.index for leaf in leaves]

    def details() -> dict[str, object]:
        told: dict[str, object] = {"collective": collective, **args, "messages": wire}
        told["tree structure"] = structure or bare.structure()
        for index, sig in zip(indices, signatures, strict=True):
            told[bare.path(index)] = sig
        return told

    return f"{summary}|{wire}", details

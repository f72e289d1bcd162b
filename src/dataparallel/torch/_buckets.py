"""How `GradientSync` cuts its parameters into buckets, and when the buckets go out.

Layout: buckets have fixed members, as DDP's do: parameters in reverse registration order (the
order backward usually produces them), grouped per (device, dtype), cut at `bucket_bytes`, the
first at most 1 MiB so that the first message leaves early in backward. After the first step the
order is rebuilt once from the order in which rank 0's gradients arrived, again as DDP does.

Mode: the buckets go out on the communication thread while backward runs, or all after it, each
mode with its own bucket size (`Modes`). Chosen alike on every rank, since the mode sets the
layout that every step's handshake compares: `DATAPARALLEL_OVERLAP` where set; else timed by the
first steps (`ModeTrial`) where either mode can run and some rank is on another node; else the
node's cores (`overlaps`). With no spare core, reducing during backward steals the core backward
runs on; over a network most of a reduction is waiting on the wire, which backward can fill, and
only timing tells which wins. Figures: benchmarks/NOTES.md.
"""

from __future__ import annotations

import itertools
import os
import time
from dataclasses import dataclass
from typing import TypedDict, cast

import numpy as np
import torch

from dataparallel.arrays.actions import Reduction, Scatter
from dataparallel.arrays.comm_thread import Leaf, leaf_of
from dataparallel.arrays.compression import Compressing
from dataparallel.arrays.dtypes import dtype_name
from dataparallel.arrays.families import Family, family_of
from dataparallel.arrays.families.torch import TorchFamily
from dataparallel.arrays.fusion import HOST_KEY
from dataparallel.arrays.replay import Add, Replay
from dataparallel.backends.base import Backend
from dataparallel.collectives import reductions
from dataparallel.config import Settings
from dataparallel.protocol import GATHER_LIMIT, Records, digest
from dataparallel.types import Op

__all__ = [
    "Bucket",
    "Compressing",
    "HostPack",
    "ModeTrial",
    "Modes",
    "NamedParams",
    "Options",
    "StepTemplate",
    "arrival_order",
    "assign",
    "bucket_bytes_for",
    "check_options",
    "describe",
    "flag_count",
    "grad_family",
    "kept_flags",
    "layout",
    "message",
    "offloadable",
    "on_host",
    "overlaps",
    "replay_of",
    "signature",
    "summarize",
]

NamedParams = list[tuple[str, torch.Tensor]]

# The first bucket's limit (DDP's): communication starts after about 1 MiB of gradients.
FIRST_BUCKET_BYTES = 1 << 20
# How many buckets a model's gradients make on the communication thread (`bucket_bytes_for`).
THREAD_BUCKETS = 8


class Options(TypedDict, total=False):
    """What decides a gradient reduction's messages, by the names mismatch reports give them."""

    op: Op
    bucket_bytes: int
    backward_passes_per_step: int
    compression: str | None  # the wire dtype, or the low-rank compressor's settings
    sparse_as_dense: bool
    sparse: list[int]  # the parameters whose gradients are gathered sparse


@dataclass
class Bucket:
    """Parameters reduced together: fixed members, one (device, dtype)."""

    members: list[int]  # parameter indices, in launch order
    key: tuple[str, str]  # (device, dtype)


def assign(
    params: NamedParams, order: list[int], bucket_bytes: int, first_bytes: int | None = None
) -> list[Bucket]:
    """Cut `order` into buckets of at most `bucket_bytes` per (device, dtype).

    A parameter of `bucket_bytes` or more is a bucket of its own, placed at once; smaller ones
    keep filling the open bucket of their key across it, which is placed when it is full (or at
    the end). So where large and small parameters alternate (a weight, its bias, a norm's two
    vectors) the small ones share buckets instead of going a few at a time. Until the first
    bucket is placed the limit is `first_bytes` (when smaller), so that the first message leaves
    early in backward (DDP caps its first bucket at 1 MiB for that).
    """
    buckets: list[Bucket] = []
    open_: dict[tuple[str, str], tuple[Bucket, int]] = {}
    for i in order:
        p = params[i][1]
        key = (str(p.device), str(p.dtype).removeprefix("torch."))
        nbytes = p.numel() * p.element_size()
        cap = bucket_bytes if buckets or first_bytes is None else min(first_bytes, bucket_bytes)
        if nbytes >= cap:
            buckets.append(Bucket([i], key))
            continue
        current = open_.get(key)
        if current is not None and current[1] + nbytes > cap:
            buckets.append(current[0])
            current = None
        if current is None:
            current = (Bucket([], key), 0)
        current[0].members.append(i)
        open_[key] = (current[0], current[1] + nbytes)
    buckets.extend(bucket for bucket, _ in open_.values())
    return buckets


def layout(
    owner: str,
    options: Options,
    params: NamedParams,
    order: list[int],
    bucket_bytes: int,
    full: bool,
) -> tuple[list[Bucket], str]:
    """Return the buckets and the reduction's summary (`summarize`)."""
    # Leave room for the flag vector that travels with the last bucket (two floats per parameter,
    # one for "a rank abandoned this step", and the promise's words). Parameters not in `order`
    # go in no bucket.
    flags = 4 * flag_count(len(params))
    budget = bucket_bytes - flags if 2 * flags <= bucket_bytes else bucket_bytes
    buckets = assign(params, order, budget, FIRST_BUCKET_BYTES)
    return buckets, summarize(owner, options, params, buckets, full)


# The words after a step's flags (`StepTemplate.flags`): this rank promises that its next call
# is this step again, it made this step (0: it kept a promise on zeros), it kept it as it joins.
PROMISES, MADE, JOINING = range(3)
WORDS = 3


def flag_count(n: int) -> int:
    """How many floats a step of `n` parameters sends with its last bucket: had a gradient (n),
    abandoned (1), was sparse (n), then the `WORDS`."""
    return 2 * n + 1 + WORDS


class StepTemplate:
    """What every step of one layout sends, made once per layout (`GradientSync._lay_out`) and
    kept while the layout holds, so that a step spends its Python on the gradients alone.

    A gradient has its parameter's dtype and device (torch refuses any other), so each
    parameter's array family is learnt from its first dense gradient and its dtype and device
    named once; a parameter converted since the template was made (`model.double()` between steps:
    the layout follows at the step's end, `GradientSync.refresh`) has its gradient's own used. The
    step's flags (with the promise's `WORDS`) have one buffer; the handshake's digest and records
    are made once (`protocol.Records`: a call plan keeps them), and each host bucket's pack
    (`HostPack`). A layout that changes (parameters added, frozen, converted; rebucketed; sparse
    ones found; another mode) makes a new template.
    """

    def __init__(
        self, params: NamedParams, summary: str, size: int, buckets: list[Bucket] | None = None
    ) -> None:
        n = len(params)
        # Each bucket of host parameters, as a pack sent in one piece (`HostPack`).
        self.packs = [
            HostPack([params[i][1] for i in b.members]) if b.key[0] == "cpu" else None
            for b in buckets or []
        ]
        self.families: list[Family | None] = [None] * n  # learnt from each first gradient
        self._kinds = [(p.dtype, p.device) for _, p in params]
        self._names = [(dtype_name(p.dtype), str(p.device)) for _, p in params]
        self.laid_out = frozenset(id(p) for _, p in params)
        self.digest = digest(summary)
        # The handshake's records (a world of one has none; larger worlds allreduce bounds).
        self.records = Records(size, self.digest) if 1 < size <= GATHER_LIMIT else None
        self._flags = np.empty(flag_count(n), np.float32)

    def leaf(self, owner: str, name: str, index: int, grad: torch.Tensor) -> Leaf:
        """Return parameter `index`'s gradient as a leaf to send: its array family, itself, its
        dtype and its device (checked the first time, and whenever it is not what the template
        knows: not dense, or its parameter converted since)."""
        family = self.families[index]
        dtype, device = self._kinds[index]
        known = grad.dtype is dtype and grad.device == device
        if family is None or not known or grad.layout != torch.strided:
            family = grad_family(owner, name, grad)
            if not known:
                return leaf_of(family, grad)
            self.families[index] = family
        return (family, grad, *self._names[index])

    def flags(
        self, filled: list[int], abandoned: bool, sparse: list[int], promises: bool
    ) -> np.ndarray:
        """The flags a step sends with its last bucket, in the template's buffer: had a gradient (n:
        0 for `filled`), this rank abandoned the step (1), each parameter's gradient was sparse
        here (n: 1 for `sparse`), then the `WORDS`: whether it `promises` the next step, and that
        it made this one. The reduced flags land in it."""
        flags = self._flags
        n = (flags.size - 1 - WORDS) // 2  # `flag_count`
        flags[: n + 1] = 1
        flags[n + 1 :] = 0
        flags[n] = abandoned
        if filled:
            flags[filled] = 0
        if sparse:
            flags[[n + 1 + i for i in sparse]] = 1
        words = flags[-WORDS:]
        words[PROMISES], words[MADE] = promises, 1
        return flags


class HostPack:
    """A bucket of host parameters (one dtype), whose gradients a step sends as one pack
    (`Fusion.add_pack`) when each is as the layout planned it: the members' parameters, the
    dtype they were laid out with, and each gradient's place in the pack's region of the
    bucket. So a step's Python for the pack is a few calls a gradient inside one loop each way
    (`gradients`, the family's `host_views` and `adopt_into`), not the way through
    `Fusion.add_leaf` that any leaf takes.
    """

    __slots__ = ("dtype", "family", "name", "params", "places")

    def __init__(self, params: list[torch.Tensor]) -> None:
        self.params = params
        self.dtype = params[0].dtype
        self.name = dtype_name(self.dtype)
        edges = [0, *itertools.accumulate(p.numel() for p in params)]
        self.places = list(itertools.pairwise(edges))  # each gradient's (start, stop) in the region
        self.family: TorchFamily | None = None  # learnt from the first gradient sent

    def gradients(self) -> list[torch.Tensor] | None:
        """The members' gradients, or None unless each is dense and of its parameter's dtype as
        laid out (none missing, made sparse, nor converted): those take `Fusion.add_leaf`'s way.
        Where each is seen (the host, no negative or conjugate bit) the family's `host_views`
        tells."""
        grads = [p.grad for p in self.params]
        dtype, strided = self.dtype, torch.strided
        for grad in grads:
            if grad is None or grad.layout is not strided or grad.dtype is not dtype:
                return None
        return cast("list[torch.Tensor]", grads)


def kept_flags(n: int, joining: bool) -> np.ndarray:
    """The flags of a step made on zeros to keep a promise: no gradient, not made, `joining`."""
    flags = np.zeros(flag_count(n), np.float32)
    flags[-WORDS + JOINING] = joining
    return flags


def arrival_order(arrival: list[int], n: int) -> list[int]:
    """Bucket order after the first step: as gradients arrived, then the others in reverse."""
    seen = set(arrival)
    return arrival + [i for i in reversed(range(n)) if i not in seen]


def signature(params: NamedParams) -> list[tuple[int, torch.dtype, torch.device]]:
    return [(id(p), p.dtype, p.device) for _, p in params]


def describe(owner: str, options: Options, params: NamedParams) -> dict[str, object]:
    """Describe a gradient reduction field by field, for mismatch reports."""
    call: dict[str, object] = {"collective": f"{owner} gradient reduction", **options}
    call["parameters"] = len(params)
    for i, (name, p) in enumerate(params):
        call[f"{name} ({i})"] = f"{str(p.dtype).removeprefix('torch.')}{list(p.shape)}"
    return call


def summarize(
    owner: str, options: Options, params: NamedParams, buckets: list[Bucket], full: bool
) -> str:
    """Return a string equal on two ranks exactly when their reductions are the same.

    `full`: every parameter's dtype and shape (mismatch checks on); else only what decides the
    messages: each bucket's dtype and size (`DATAPARALLEL_CHECK=0`).
    """
    head = f"{owner} gradient reduction|{sorted(options.items())}|{len(params)}"
    if full:
        return head + "|" + repr(sorted(describe(owner, options, params).items()))
    sizes = [(b.key[1], sum(params[i][1].numel() for i in b.members)) for b in buckets]
    return f"{head}|{sizes}"


def overlaps(local_size: int, overlap: bool | None) -> bool:
    """Whether buckets go out during backward (True) or all after it (False), for a reduction
    that cannot time both (`ModeTrial` chooses for the others).

    `overlap` (`DATAPARALLEL_OVERLAP`) decides when set. Otherwise overlap only when this node has
    a core to spare for it: with no idle core, reducing during backward slows backward by what
    the reduction costs and makes the ranks meet once per bucket inside it, while reducing after
    it costs less (benchmarks/NOTES.md).
    """
    if overlap is not None:
        return overlap
    cores = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count()
    return local_size < (cores or 1)


def on_host(params: NamedParams) -> bool:
    """Whether every parameter is a host tensor (their buckets may go to the comm thread)."""
    return all(p.device.type == "cpu" for _, p in params)


def offloadable(backend: Backend, private: Backend, host: bool) -> bool:
    """Whether buckets may go to the communication thread on every rank: host parameters and a
    private engine (collective in a world of several: a minimum over ranks)."""
    offload = host and private is not backend
    if backend.size > 1:
        offload = bool(reductions.allreduce(int(offload), op="min", backend=backend))
    return offload


def bucket_bytes_for(offload: bool, total: int, settings: Settings, *, whole: bool = False) -> int:
    """The bucket size of a `GradientSync` not given one, for `total` bytes of parameters.

    Reduced after backward (`offload` False): `Settings.bucket_bytes` (small buckets pipeline
    packing with sending over MPI's shared memory); `whole`, reduced after backward on an engine
    that carries calls in its own threads (Gloo, NCCL): `Settings.thread_bucket_bytes`, DDP's
    size, as each call there is a rendezvous of the ranks' threads. On the communication thread:
    about an eighth of the model, between 1 MiB and `Settings.thread_bucket_bytes`, so that any
    model sends several buckets while backward runs (a bucket that holds the whole model leaves
    nothing to overlap). Figures: benchmarks/NOTES.md.
    A `DATAPARALLEL_BUCKET_BYTES` set by the user sets every limit.
    """
    if not offload:
        return settings.thread_bucket_bytes if whole else settings.bucket_bytes
    cap = settings.thread_bucket_bytes
    return max(min(cap, FIRST_BUCKET_BYTES), min(cap, -(-total // THREAD_BUCKETS)))


def check_options(owner: str, op: str, passes: object, bucket_bytes: object) -> None:
    """Raise `ValueError` for options a gradient reduction cannot take."""
    if op not in ("avg", "sum"):
        raise ValueError(
            f"{owner}: op={op!r} cannot combine gradients; use 'avg' (the default) or 'sum'."
        )
    if isinstance(passes, bool) or not isinstance(passes, int) or passes < 1:
        raise ValueError(
            f"{owner}: backward_passes_per_step={passes!r} must be an int of at least 1."
        )
    if bucket_bytes is not None and (
        isinstance(bucket_bytes, bool) or not isinstance(bucket_bytes, int) or bucket_bytes < 1
    ):
        raise ValueError(f"{owner}: bucket_bytes={bucket_bytes!r} must be a positive int.")


def grad_family(owner: str, name: str, grad: torch.Tensor) -> Family:
    """Return the array family of a gradient to reduce, refusing layouts that are not dense."""
    if grad.layout != torch.strided:
        raise TypeError(
            f"{owner}: {name} has a {grad.layout} gradient; only dense gradients are "
            "reduced. Use dense gradients (nn.Embedding(..., sparse=False))."
        )
    return family_of(grad, f"{name}.grad")


def message(what: str, owner: str, passes: int) -> str:
    """Return the text of the error `what` (see `GradientSync`)."""
    if what == "late gradient":
        return (
            f"{owner}: a gradient was computed after this step's reduction had started "
            f"(more than backward_passes_per_step={passes} backward passes before "
            "step(), or a backward pass between synchronize() and step()). Call step() or "
            "zero_grad() before the next backward pass, or raise backward_passes_per_step "
            "to accumulate gradients locally. (Reentrant activation checkpointing also "
            "causes this: use torch.utils.checkpoint.checkpoint(..., use_reentrant=False).)"
        )
    if what == "abandoned":
        return (
            f"{owner}: another rank's backward pass failed during this step (it raised "
            "after its gradients began to go out), so these gradients are an incomplete "
            "average; the step is skipped. Look for that rank's traceback; call zero_grad() "
            "to go on."
        )
    return (
        f"{owner}: this step's gradient reduction failed (CollectiveMismatchError, raised by "
        "backward()); call zero_grad() to begin a new step."
    )


def replay_of(
    params: NamedParams,
    buckets: list[Bucket],
    current: NamedParams,
    action: Reduction | Scatter,
    bucket_bytes: int,
    compression: str | None = None,
    extra: list[list[Add]] | None = None,
) -> Replay:
    """Describe a step's reduction for ranks that have joined (`dp.join`) to make it on zeros.

    Mirrors `GradientSync`: one flush per bucket (the flag vector with the last), then one for
    the parameters of `current` that became trainable after the layout; with the step's wire dtype
    (`compression`), so that the zeros travel as the gradients do. `extra`: arrays sent after each
    bucket's members (a low-rank step's `P`s, whose members `buckets` then leaves out).
    """

    def add(p: torch.Tensor) -> Add:
        key = HOST_KEY if p.device.type == "cpu" else ("torch", str(p.device))
        return (key, dtype_name(p.dtype), tuple(p.shape))

    flushes = [[add(params[i][1]) for i in b.members] for b in buckets]
    if extra is not None:
        for flush, more in zip(flushes, extra, strict=True):
            flush.extend(more)
    if flushes:
        flushes[-1].append((HOST_KEY, "float32", (flag_count(len(params)),)))  # GradientSync's
    laid_out = {id(p) for _, p in params}
    late = [add(p) for _, p in current if id(p) not in laid_out]
    if late:
        flushes.append(late)
    return Replay.of(
        action, flushes, bucket_bytes=bucket_bytes, async_op=True, compression=compression
    )


class ModeTrial:
    """Time the two modes over a reduction's first steps; `mode` says the mode of the coming step.

    After `SKIP` steps (the first rebuilds the buckets), the modes alternate for `2 * TRIALS`
    steps, each timed from its first gradient to the end of its reduction (backward and
    communication, what the mode changes); the thread is kept if it was faster in the median of
    the pairs (each step on the thread minus the step after backward just before it). Pairs, not
    each mode's median: the load of a shared machine drifts over the trial, and two adjacent
    steps see the same load. A step costs what its slowest rank took (one allreduce of the times,
    at a step boundary, on every rank alike). Where ranks span nodes the thread is kept unless
    after backward wins by more than `MARGIN` of its time: there the thread's gain is structural
    (the wire's time runs beside backward), and within a few percent ten steps cannot tell the
    modes apart. Without ranks on other nodes there is no margin.
    """

    SKIP = 2  # steps before the trial: the first step's rebuild, warm caches
    TRIALS = 5  # steps timed in each mode (fewer chose differently for two copies of one model)
    MARGIN = 0.05  # across nodes, after backward must be this much faster to be kept

    def __init__(self) -> None:
        self.steps = 0  # steps completed (those a rank had joined are not counted)
        self.times: list[float] = []  # the trial's steps, after backward first, alternating
        self.chosen: bool | None = None
        self.medians: tuple[float, float] | None = None  # (after backward, thread), slowest rank

    @property
    def mode(self) -> bool:
        """Whether the coming step reduces on the communication thread (True) or after backward."""
        if self.chosen is not None:
            return self.chosen
        trial = self.steps - self.SKIP
        return trial < 0 or trial % 2 == 1

    @property
    def timing(self) -> bool:
        """Whether the coming step's time is recorded."""
        return self.chosen is None and self.steps >= self.SKIP

    def record(self, seconds: float, backend: Backend) -> bool:
        """Take the time of a completed step; return whether the mode of the next one changes.

        Collective on the step that ends the trial: every rank records the same steps.
        """
        before = self.mode
        if self.timing:
            self.times.append(seconds)
        self.steps += 1
        if self.chosen is None and self.steps == self.SKIP + 2 * self.TRIALS:
            times = np.array(self.times)
            if backend.size > 1:
                times = reductions.allreduce(times, op="max", backend=backend)
            after, thread = times[0::2], times[1::2]  # the trial starts after backward
            self.medians = (float(np.median(after)), float(np.median(thread)))
            across = backend.local_size < backend.size  # some ranks on other nodes
            margin = self.MARGIN * self.medians[0] if across else 0.0
            self.chosen = bool(np.median(thread - after) < margin)
        return self.mode != before


class Modes:
    """A `GradientSync`'s mode and bucket size, chosen from its parameters, engines and
    compression, and its trial if the mode is timed; a trial may switch the mode once, at a step's
    end on every rank alike. A bucket size the user gave stays whatever the mode.

    Collective, as `GradientSync`'s construction: every rank makes it at the same point.
    """

    def __init__(
        self,
        backend: Backend,
        private: Backend,
        trainable: NamedParams,
        settings: Settings,
        *,
        low_rank: bool = False,
    ) -> None:
        self.backend, self.settings = backend, settings
        self.low_rank = low_rank  # PowerSGD's buckets (`bucket_bytes`)
        self.offload = offloadable(backend, private, on_host(trainable))
        # Thread or after backward: timed by the steps themselves where either can be and some
        # rank is on another node; on one node the cores tell (`overlaps`).
        spans = backend.local_size < backend.size
        forced = settings.overlap
        self.trial = ModeTrial() if self.offload and forced is None and spans else None
        self.model_bytes = sum(p.numel() * p.element_size() for _, p in trainable)
        self.on_device = not on_host(trainable)

    def first(self) -> bool:
        """The mode of the first steps: the trial's, else `overlaps`, the same on every
        rank (collective where the cores choose)."""
        if self.trial is not None:
            return self.trial.mode
        forced = self.settings.overlap
        overlap = overlaps(self.backend.local_size, forced)
        if forced is None and self.backend.size > 1:
            overlap = bool(reductions.allreduce(int(overlap), op="min", backend=self.backend))
        return overlap

    def bucket_bytes(self, overlap: bool, offload: bool) -> int:
        """The bucket size of a mode (`bucket_bytes_for`); under PowerSGD, DDP's (the limit,
        `Settings.thread_bucket_bytes`) in either mode: a compressed bucket carries a few thin
        factors, whose wire time is small beside each call's own cost and each bucket's phases,
        so fewer, larger buckets win even though less of the step overlaps backward (figures:
        docs/compression.md)."""
        if self.low_rank:
            return self.settings.thread_bucket_bytes
        # DDP's size where each call costs the most: a rendezvous of threads (Gloo, NCCL), or
        # device buckets staged one at a time.
        whole = not overlap and (self.backend.progresses or self.on_device)
        return bucket_bytes_for(overlap and offload, self.model_bytes, self.settings, whole=whole)

    def switch(self, began: float) -> bool | None:
        """Time a step whose first gradient came at `began` (`time.perf_counter`; 0: none came)
        and return the mode to switch to, when the trial switches (collective: on every rank
        alike, at the same step)."""
        if self.trial is None:
            return None
        took = time.perf_counter() - began if began else 0.0
        return self.trial.mode if self.trial.record(took, self.backend) else None

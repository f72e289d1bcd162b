"""A `GradientSync`'s mode: its buckets go out on the communication thread while backward runs,
or all after it; and the bucket size of each mode.

Chosen at construction, alike on every rank (the mode sets the bucket layout, which every step's
handshake compares): `DATAPARALLEL_OVERLAP` where set; else timed by the first steps
(`_tuning.ModeTrial`) where either mode can be (host parameters, a private engine:
`_buckets.offloadable`) and some rank is on another node; else the node's cores
(`_buckets.overlaps`, the lowest of the ranks' answers). A trial may switch the mode once, at a
step's end on every rank alike; a bucket size the user gave stays whatever the mode.
"""

from __future__ import annotations

import time

from dataparallel.backends.base import Backend
from dataparallel.collectives import reductions
from dataparallel.config import Settings
from dataparallel.torch._buckets import (
    NamedParams,
    bucket_bytes_for,
    offloadable,
    on_host,
    overlaps,
)
from dataparallel.torch._tuning import ModeTrial

__all__ = ["Modes"]


class Modes:
    """What a `GradientSync`'s mode and bucket size are chosen from, and its trial if timed.

    Collective, as `GradientSync`'s construction: every rank makes it at the same point.
    """

    def __init__(
        self, backend: Backend, private: Backend, trainable: NamedParams, settings: Settings
    ) -> None:
        self.backend, self.settings = backend, settings
        self.offload = offloadable(backend, private, on_host(trainable))
        # Thread or after backward: timed by the steps themselves where either can be and some
        # rank is on another node (_tuning); on one node the cores tell (`_buckets.overlaps`).
        spans = backend.local_size < backend.size
        forced = settings.overlap
        self.trial = ModeTrial() if self.offload and forced is None and spans else None
        self.model_bytes = sum(p.numel() * p.element_size() for _, p in trainable)
        self.on_device = not on_host(trainable)

    def first(self) -> bool:
        """The mode of the first steps: the trial's, else `_buckets.overlaps`, the same on every
        rank (collective where the cores choose)."""
        if self.trial is not None:
            return self.trial.mode
        forced = self.settings.overlap
        overlap = overlaps(self.backend.local_size, forced)
        if forced is None and self.backend.size > 1:
            overlap = bool(reductions.allreduce(int(overlap), op="min", backend=self.backend))
        return overlap

    def bucket_bytes(self, overlap: bool, offload: bool) -> int:
        """The bucket size of a mode (`_buckets.bucket_bytes_for`)."""
        # DDP's size where each call costs the most: a rendezvous of threads (Gloo, NCCL), or
        # device buckets staged one at a time (benchmarks/gpu.py).
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

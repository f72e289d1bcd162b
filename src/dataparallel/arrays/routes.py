"""Where a bucketed step's calls go: `Router`, the engine under `GradientSync`.

A step's buckets travel on a private duplicate of the caller's engine (`World.private`), so that
collectives the program makes meanwhile on the world's engine never meet them, whichever thread
makes each. They are made either on the caller's thread (non-blocking, one in flight: the hooks
make them as backward goes, or all at its end), or on the communication thread
(`arrays/worker.py`), which waits with the GIL released while autograd computes (Horovod's
overlap): on an engine that progresses only inside its calls (MPI) by testing each call with
pauses (`THREAD_PAUSE`) where some ranks are on other nodes, since waiting in MPICH spins a
core that backward needs. The choice is made per step and may differ between ranks (the private
engine is the same, and each bucket is one non-blocking call either way), except for a step that
a rank has joined (`dp.join`): the joined rank answers it on the world's engine, so every rank
makes it there, on its caller's thread.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence

import numpy as np

from dataparallel.arrays.families import Family
from dataparallel.arrays.fusion import HOST_KEY, Fusion
from dataparallel.arrays.trace import Timeline
from dataparallel.arrays.worker import CommThread, Job
from dataparallel.backends.base import Backend

__all__ = ["LEAVE_IN_FLIGHT", "THREAD_PAUSE", "Router"]

# Seconds the communication thread sleeps between tests of an MPI call (`landing.settle`).
THREAD_PAUSE = 1e-4
# Whether the thread leaves calls in flight on engines that progress by themselves (`_land`).
LEAVE_IN_FLIGHT = True


class Router:
    """A step's buckets, sent through a `Fusion` on the chosen engine, inline or off-thread.

    Args:
        fusion_on: makes the `Fusion` of an engine (non-blocking).
        backend: the caller's engine.
        private: its duplicate (`World.private`); `backend` itself where it has none.
        thread: the communication thread (used only with a private engine).
    """

    def __init__(
        self,
        fusion_on: Callable[[Backend], Fusion],
        backend: Backend,
        private: Backend,
        thread: CommThread,
    ) -> None:
        self.base = fusion_on(backend)
        self.private = fusion_on(private) if private is not backend else None
        self.thread = thread if self.private is not None else None
        self.fusion = self.private or self.base  # this step's
        self.threaded = False  # whether this step's calls are made on the communication thread
        self._jobs: list[Job] = []
        self._failed = False  # a bucket of this step failed on the thread: the rest are skipped

    def begin(self, *, joined: bool, offload: bool) -> None:
        """Choose this step's lane: the world's engine if some rank has joined; else the private
        one, on the communication thread when `offload` (and there is one)."""
        self.fusion = self.base if joined or self.private is None else self.private
        self.threaded = offload and not joined and self.thread is not None
        # On the thread, an engine that progresses only inside its calls (MPI) is tested with
        # pauses rather than waited in, which would spin a core backward needs (`landing.settle`),
        # where some ranks are on other nodes: the wait is on the wire. On one node the waiting
        # is shared-memory copying, which pauses can only delay: it is left as it was.
        engine = self.fusion.backend
        wire = self.threaded and not engine.progresses and engine.local_size < engine.size
        self.fusion.pause = THREAD_PAUSE if wire else 0.0

    def send(
        self, leaves: Sequence[tuple[Family, object]], extra: np.ndarray | None = None
    ) -> None:
        """Send one bucket: `leaves` (validated, with their family), then `extra` host float32."""
        if self.thread is not None and self.threaded:
            self._jobs.append(self.thread.submit(lambda: self._land(leaves, extra)))
        else:
            self._add(leaves, extra)
            self.fusion.flush()

    def _add(self, leaves: Sequence[tuple[Family, object]], extra: np.ndarray | None) -> None:
        fusion = self.fusion
        for family, x in leaves:
            fusion.add_leaf(family, x, family.dtype(x), family.device(x))
        if extra is not None:
            fusion.add(extra, "float32", HOST_KEY)

    def _land(self, leaves: Sequence[tuple[Family, object]], extra: np.ndarray | None) -> None:
        """On the thread: send, wait in the engine (GIL released), write the results.

        On an engine that moves calls on by itself (Gloo, NCCL) the call is left in flight, as
        DDP leaves its buckets: the next bucket's launch lands it (`fusion.MAX_IN_FLIGHT`),
        `finish` the last, so the link never waits for a bucket's results to be written.
        """
        if self._failed:  # the other ranks' calls no longer line up with this rank's
            raise RuntimeError("an earlier bucket of this step failed")  # finish() raises that
        try:
            self._add(leaves, extra)
            if LEAVE_IN_FLIGHT and self.fusion.backend.progresses:
                self.fusion.flush()
            else:
                self.fusion.wait()
        except BaseException:
            self._failed = True
            raise

    def progress(self) -> None:
        """Let the engine move the caller's calls in flight along (MPI moves them only in calls)."""
        if not self.threaded:
            self.fusion.test()

    def finish(self) -> None:
        """Wait for every bucket sent this step; their results are written when it returns.

        Raises what the first bucket that failed on the thread raised.
        """
        jobs, self._jobs = self._jobs, []
        first: BaseException | None = None
        for job in jobs:
            try:
                job.wait()
            except BaseException as error:
                first = first or error
        self._failed = False
        if first is not None:
            raise first
        self.fusion.wait()

    def discard(self) -> None:
        """Drop what a failed step left queued or in flight on either engine (`Fusion.discard`)."""
        self.base.discard()
        if self.private is not None:
            self.private.discard()

    @property
    def calls(self) -> int:
        """Communication calls made so far, on either engine."""
        return self.base.calls + (self.private.calls if self.private is not None else 0)

    def trace(self, timeline: Timeline | None) -> None:
        """Record the calls' phases on `timeline` (None: stop)."""
        self.base.timeline = timeline
        if self.private is not None:
            self.private.timeline = timeline

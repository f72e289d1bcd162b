"""The communication thread and where a bucketed step's calls go.

`CommThread` is Horovod's background thread, reduced to what dataparallel needs: jobs run one at a
time, in the order they were submitted. Every rank submits the same jobs in the same order, so the
calls stay aligned across ranks. What a job raises is kept on it and re-raised by `Job.wait()` on
the caller's thread; the jobs after it still run (`Router` skips the rest of a failed step). The
thread starts on the first `submit` and is joined by `close()` (`dp.finalize()`, run at exit too:
a thread of torch calls still running as the interpreter finalizes aborts the process,
`world._finalize_at_exit`).

`Router`, the engine under `GradientSync`, sends a step's buckets on a private duplicate of the
caller's engine (`Privates`, `World.private`), so that collectives the program makes meanwhile on
the world's engine never meet them. They are made either on the caller's thread (non-blocking, one
in flight), or on the communication thread, which waits with the GIL released while autograd
computes (Horovod's overlap): on an engine that progresses only inside its calls (MPI), by testing
each call with pauses (`THREAD_PAUSE`, `fusion.settle`) where some ranks are on other nodes, since
waiting in MPICH spins a core that backward needs. The choice is made per step and may differ
between ranks (each bucket is one non-blocking call either way), except for a step that a rank has
joined (`dp.join`): the joined rank answers it on the world's engine, so every rank makes it there.
"""

from __future__ import annotations

import queue
import threading
from collections.abc import Callable, Sequence

import numpy as np

from dataparallel.arrays.families import Family
from dataparallel.arrays.fusion import HOST_KEY, Deliver, Fusion
from dataparallel.arrays.trace import Timeline
from dataparallel.backends.base import Backend, released

__all__ = [
    "LEAVE_IN_FLIGHT",
    "THREAD_PAUSE",
    "CommThread",
    "Job",
    "Leaf",
    "Pack",
    "Privates",
    "Router",
    "leaf_of",
]

# Seconds the communication thread sleeps between tests of an MPI call (`fusion.settle`).
THREAD_PAUSE = 1e-4
# Whether the thread leaves calls in flight on engines that progress by themselves (`_land`).
LEAVE_IN_FLIGHT = True

# An array to send, validated: its family, itself, its dtype and its device (`Family.dtype`,
# `Family.device`), which the caller knows (a gradient's are its parameter's).
Leaf = tuple[Family, object, str, str]
# A pack: host leaves of one family and dtype packed one after the other, their writable views,
# their dtype, and where their region of the bucket goes once reduced (`Fusion.add_pack`).
Pack = tuple[Family, list[object], list[np.ndarray], str, Deliver]


def leaf_of(family: Family, x: object) -> Leaf:
    """`x` as a leaf to send, its dtype and device asked of its family."""
    return family, x, family.dtype(x), family.device(x)


class Job:
    """One function run by the `CommThread`: `wait()` returns when it has run."""

    __slots__ = ("_done", "_error", "fn")

    def __init__(self, fn: Callable[[], object]) -> None:
        self.fn = fn
        self._done = threading.Event()
        self._error: BaseException | None = None

    def _run(self) -> None:
        try:
            self.fn()
        except BaseException as error:  # re-raised by wait(), on the caller's thread
            self._error = error
        self._done.set()

    def wait(self) -> None:
        """Wait until the job has run; raise what it raised."""
        self._done.wait()
        if self._error is not None:
            raise self._error

    @property
    def done(self) -> bool:
        return self._done.is_set()


class CommThread:
    """A daemon thread that runs submitted jobs one at a time, in order."""

    def __init__(self, name: str = "dataparallel-comm") -> None:
        self.name = name
        self._jobs: queue.SimpleQueue[Job | None] = queue.SimpleQueue()
        self._thread: threading.Thread | None = None
        self._lock = threading.Lock()
        self._closed = False

    def submit(self, fn: Callable[[], object]) -> Job:
        """Queue `fn` to run after every job submitted before it; return its `Job`."""
        job = Job(fn)
        with self._lock:
            if self._closed:
                raise RuntimeError(f"{self.name}: closed (dp.finalize() ran); no job can run.")
            if self._thread is None:
                self._thread = threading.Thread(target=self._serve, name=self.name, daemon=True)
                self._thread.start()
            self._jobs.put(job)
        return job

    def _serve(self) -> None:
        while (job := self._jobs.get()) is not None:
            job._run()

    def close(self) -> None:
        """Run the jobs already submitted, then stop the thread (safe to call twice)."""
        with self._lock:
            self._closed, thread = True, self._thread
            if thread is None:
                return
            self._thread = None
            self._jobs.put(None)
        if thread is not threading.current_thread():
            thread.join()


class Privates:
    """Each engine's private duplicate (`Backend.duplicate`), made the first time it is asked for.

    `privates(backend)` is collective the first time for an engine of several ranks: every rank
    of `backend` asks at the same point of its calls. Calls made from another thread (the
    communication thread, JAX's host callbacks) go there, so they never meet the caller's.
    """

    def __init__(self) -> None:
        self._pairs: dict[int, tuple[Backend, Backend]] = {}
        self._closed = False

    def __call__(self, backend: Backend) -> Backend:
        pair = self._pairs.get(id(backend))
        if pair is None or pair[0] is not backend:
            if self._closed:
                raise RuntimeError("the world's private engines are closed (dp.finalize() ran).")
            pair = (backend, backend.duplicate() if backend.size > 1 else backend)
            self._pairs[id(backend)] = pair
        return pair[1]

    def close(self) -> None:
        """Close every duplicate made (`dp.finalize()`; safe to call twice).

        Each engine frees what its duplicate holds: MPI its communicators, Gloo its process group.
        Collective, as `Backend.close` is: every rank closes the same duplicates. An engine that
        returned itself as its duplicate is left alone: its owner closes it. The first error is
        raised once every duplicate has been closed.
        """
        first: BaseException | None = None
        for finish in self.release():
            try:
                finish()
            except Exception as error:
                first = first or error
        if first is not None:
            raise first

    def release(self, *, cut: bool = False) -> list[Callable[[], None]]:
        """`close`, but each duplicate only released (`Backend.release`; cut first if `cut`):
        return what finishes closing each, which raises what its release raised."""
        pairs, self._pairs, self._closed = list(self._pairs.values()), {}, True
        return [released(twin, cut=cut) for engine, twin in pairs if twin is not engine]


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
        # pauses rather than waited in, which would spin a core backward needs (`fusion.settle`),
        # where some ranks are on other nodes: the wait is on the wire. On one node the waiting
        # is shared-memory copying, which pauses can only delay: it is left as it was.
        engine = self.fusion.backend
        wire = self.threaded and not engine.progresses and engine.local_size < engine.size
        self.fusion.pause = THREAD_PAUSE if wire else 0.0

    def send(
        self,
        leaves: Sequence[Leaf],
        extra: np.ndarray | None = None,
        delivers: Sequence[Deliver | None] | None = None,
        pack: Pack | None = None,
    ) -> None:
        """Send one bucket: `pack` (`Fusion.add_pack`), `leaves`, then `extra` host float32;
        `delivers`: per leaf, where its result's place in the bucket goes (`Fusion.add_leaf`)."""
        if self.thread is not None and self.threaded:
            self.run(lambda: self.put(leaves, extra, delivers, pack))
        else:  # (`run`'s other way, without its function)
            self.put(leaves, extra, delivers, pack)

    def run(self, fn: Callable[[], object]) -> None:
        """Run `fn` where this step's calls are made, after the buckets sent before it: on the
        communication thread when the step is there (what it raises, `finish` raises), else now.
        A step's later phases (PowerSGD's) go this way, so that its calls keep their order."""
        if self.thread is not None and self.threaded:
            self._jobs.append(self.thread.submit(lambda: self._land(fn)))
        else:
            fn()

    def put(
        self,
        leaves: Sequence[Leaf],
        extra: np.ndarray | None = None,
        delivers: Sequence[Deliver | None] | None = None,
        pack: Pack | None = None,
    ) -> None:
        """Send `leaves` and `extra` as `send` does, from the thread the step's calls are made on
        (inside a `run` function, or `send`).

        On the communication thread, on an engine that moves calls on by itself (Gloo, NCCL),
        the call is left in flight, as DDP leaves its buckets: the next bucket's launch lands it
        (`Backend.calls_in_flight`), `finish` the last, so the link never waits for a bucket's
        results to be written. On MPI the thread waits for it (GIL released).
        """
        if pack is not None:
            self.fusion.add_pack(*pack)
        self._add(leaves, extra, delivers)
        if self.threaded and not (LEAVE_IN_FLIGHT and self.fusion.backend.progresses):
            self.fusion.wait()
        else:
            self.fusion.flush()

    def _add(
        self,
        leaves: Sequence[Leaf],
        extra: np.ndarray | None,
        delivers: Sequence[Deliver | None] | None,
    ) -> None:
        fusion = self.fusion
        given = delivers if delivers is not None else [None] * len(leaves)
        for (family, x, dtype, device), deliver in zip(leaves, given, strict=True):
            fusion.add_leaf(family, x, dtype, device, deliver=deliver)
        if extra is not None:
            fusion.add(extra, "float32", HOST_KEY)

    def _land(self, fn: Callable[[], object]) -> None:
        """On the thread: run a job of the step, unless one before it failed."""
        if self._failed:  # the other ranks' calls no longer line up with this rank's
            raise RuntimeError("an earlier bucket of this step failed")  # finish() raises that
        try:
            fn()
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

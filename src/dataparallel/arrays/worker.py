"""The communication thread: jobs run one at a time, in the order they were submitted; and
the private engines such calls go on (`Privates`), closed by `dp.finalize()`.

Horovod's background thread, reduced to what dataparallel needs: the gradient hooks of
`GradientSync` hand each ready bucket over (`submit`) and return at once; the thread packs it,
waits for the collective with the GIL released (on MPI across nodes testing it with pauses,
`landing.settle`; on Gloo leaving it in flight while the next one starts), and unpacks it,
while autograd keeps computing. Every rank submits the
same jobs in the same order, and the thread runs them in that order, so the calls stay aligned
across ranks.

What a job raises is kept on it and re-raised by `Job.wait()` on the caller's thread, so nothing
is lost; the jobs after it still run (a caller whose later jobs depend on an earlier one skips
them: `arrays/routes.py`). The thread starts on the first `submit` and is joined by `close()`
(`dp.finalize()`).
"""

from __future__ import annotations

import queue
import threading
from collections.abc import Callable
from typing import Any

from dataparallel.backends.base import Backend

__all__ = ["CommThread", "Job", "Privates"]


class Job:
    """One function run by the `CommThread`: `wait()` returns when it has run."""

    __slots__ = ("_done", "_error", "fn")

    def __init__(self, fn: Callable[[], Any]) -> None:
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

    def submit(self, fn: Callable[[], Any]) -> Job:
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
        pairs, self._pairs, self._closed = list(self._pairs.values()), {}, True
        first: BaseException | None = None
        for backend, duplicate in pairs:
            if duplicate is backend:
                continue
            try:
                duplicate.close()
            except Exception as error:
                first = first or error
        if first is not None:
            raise first

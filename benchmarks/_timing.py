"""The one timing loop every MPI benchmark here uses, so their figures compare."""

from __future__ import annotations

import statistics
import time
from collections.abc import Callable

from mpi4py import MPI


def timed(fn: Callable[[], object], comm: MPI.Comm, repeat: int = 7, budget: float = 0.3) -> float:
    """Return the median over `repeat` runs of the mean time of a call, in seconds.

    Each run makes as many calls as fit in about `budget` seconds (the same count on every rank,
    from the slowest rank's first timing); a run's time is the slowest rank's.
    """
    for _ in range(2):
        fn()
    start = time.perf_counter()
    fn()
    once = comm.allreduce(time.perf_counter() - start, op=MPI.MAX)
    inner = max(3, min(1000, int(budget / max(once, 1e-6))))
    samples = []
    for _ in range(repeat):
        comm.Barrier()
        start = time.perf_counter()
        for _ in range(inner):
            fn()
        elapsed = comm.allreduce(time.perf_counter() - start, op=MPI.MAX)
        samples.append(elapsed / inner)
    return statistics.median(samples)

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


def compare(
    cases: dict[str, Callable[[], object]], comm: MPI.Comm, rounds: int = 3
) -> dict[str, float]:
    """Time every case in turn, `rounds` times round-robin; return each case's best median.

    Interleaving the cases spreads the machine's drifts (frequency, neighbours, page cache) over
    all of them, so their ratios mean something even on a noisy machine.
    """
    best: dict[str, float] = {}
    for _ in range(rounds):
        for name, fn in cases.items():
            seconds = timed(fn, comm)
            best[name] = min(best.get(name, seconds), seconds)
    return best

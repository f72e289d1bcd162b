"""The one timing loop every MPI benchmark here uses, so their figures compare."""

from __future__ import annotations

import os
import statistics
import time
from collections.abc import Callable

from mpi4py import MPI

# `make bench-smoke`: every case once, in one short batch, to show that the benchmark still runs
# (the suite does not run the benchmarks); its figures mean nothing.
SMOKE = os.environ.get("BENCH_SMOKE") == "1"


def timed(fn: Callable[[], object], comm: MPI.Comm, repeat: int = 7, budget: float = 0.3) -> float:
    """Return the median over `repeat` runs of the mean time of a call, in seconds.

    Each run makes as many calls as fit in about `budget` seconds (the same count on every rank,
    from the slowest rank's first timing); a run's time is the slowest rank's.
    """
    if SMOKE:
        repeat, budget = 1, 0.0
    for _ in range(2):
        fn()
    start = time.perf_counter()
    fn()
    once = comm.allreduce(time.perf_counter() - start, op=MPI.MAX)
    inner = max(1 if SMOKE else 3, min(1000, int(budget / max(once, 1e-6))))
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
    cases: dict[str, Callable[[], object]],
    comm: MPI.Comm,
    batches: int = 45,
    budget: float = 0.05,
) -> dict[str, float]:
    """Time every case in short batches taken in turn; return each case's median time per call.

    A batch makes as many calls as fit in about `budget` seconds (the same count on every rank,
    from the slowest rank's first timing); its time is the slowest rank's. Taking the cases' batches
    in turn, a few hundredths of a second each, spreads the machine's drifts over all of them: this
    machine flips between a fast and a slow mode for seconds at a time (a raw 64 KiB Allreduce:
    22 or 48 us), and cases timed one after the other for seconds each landed in different modes.
    """
    if SMOKE:
        batches, budget = 1, 0.0
    inner: dict[str, int] = {}
    for name, fn in cases.items():
        for _ in range(2):
            fn()
        start = time.perf_counter()
        fn()
        once = comm.allreduce(time.perf_counter() - start, op=MPI.MAX)
        inner[name] = max(1 if SMOKE else 3, min(1000, int(budget / max(once, 1e-6))))
    samples: dict[str, list[float]] = {name: [] for name in cases}
    for _ in range(batches):
        for name, fn in cases.items():
            comm.Barrier()
            start = time.perf_counter()
            for _ in range(inner[name]):
                fn()
            elapsed = comm.allreduce(time.perf_counter() - start, op=MPI.MAX)
            samples[name].append(elapsed / inner[name])
    return {name: statistics.median(values) for name, values in samples.items()}

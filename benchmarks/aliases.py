"""What finding leaves that share memory costs a reduction (issue 18.1), measured in one run.

Run: `OMP_NUM_THREADS=1 dataparallel run -n 2 benchmarks/aliases.py`

Only a fused call whose leaves may land in more than one bucket looks for aliases
(`arrays/aliases.py`, the plan's `apart`); the 4-byte call and a tree of 200 small arrays (inline
and packed plans) run no new code. Rows, each the median of batches taken in turn
(`_timing.compare`): raw mpi4py, dp.allreduce, and for the fused trees dp.allreduce with the alias
search replaced by one that finds nothing (what the call cost before it). Columns: the times,
dp/raw, and the search's share of the call. Run it under the code before and after to compare
the rows that run no new code.
"""

from __future__ import annotations

from collections.abc import Callable

import numpy as np
from _timing import compare
from mpi4py import MPI

import dataparallel as dp

try:
    from dataparallel.collectives import _plans

    HAS_SEARCH = hasattr(_plans, "overlapping")
except ImportError:  # pragma: no cover - the code before the call plans
    HAS_SEARCH = False


def without_search(fn: Callable[[], object]) -> Callable[[], object]:
    """Return `fn` run with the alias search finding nothing (what the call did before)."""

    def nothing(works: object) -> list[int]:
        return []

    def run() -> object:
        found = _plans.overlapping
        _plans.overlapping = nothing  # type: ignore[assignment]
        try:
            return fn()
        finally:
            _plans.overlapping = found  # type: ignore[assignment]

    return run


def main() -> None:
    dp.initialize("mpi")
    comm = MPI.COMM_WORLD.Dup()
    rows: list[tuple[str, float, float, float | None]] = []

    tiny = np.zeros(1, np.float32)
    best = compare(
        {
            "raw": lambda: comm.Allreduce(MPI.IN_PLACE, tiny, MPI.SUM),
            "dp": lambda: dp.allreduce(tiny),
        },
        comm,
    )
    rows.append(("4 B", best["raw"], best["dp"], None))

    trees = {
        "200 x 64 floats (packed)": [np.zeros(64, np.float32) for _ in range(200)],
        "10 x 100,000 float64 (fused, 10 in place)": [np.zeros(100_000) for _ in range(10)],
        "200 x 2,000 float64 (fused, 13 buckets)": [np.zeros(2_000) for _ in range(200)],
    }
    for label, leaves in trees.items():

        def raw(leaves: list[np.ndarray] = leaves) -> None:
            for leaf in leaves:
                comm.Allreduce(MPI.IN_PLACE, leaf, MPI.SUM)

        cases: dict[str, Callable[[], object]] = {
            "raw": raw,
            "dp": lambda leaves=leaves: dp.allreduce(leaves),
        }
        if HAS_SEARCH:
            cases["before"] = without_search(cases["dp"])
        best = compare(cases, comm, batches=25)
        rows.append((label, best["raw"], best["dp"], best.get("before")))

    if comm.rank == 0:
        print(f"alias search, {comm.size} ranks")
        print("| case | raw | dp | dp/raw | dp, search finding nothing | search's share |")
        print("| --- | --- | --- | --- | --- | --- |")
        for name, raw_s, dp_s, before in rows:
            share = "-" if before is None else f"{(dp_s - before) / dp_s:+.1%}"
            old = "-" if before is None else _fmt(before)
            print(
                f"| {name} | {_fmt(raw_s)} | {_fmt(dp_s)} | {dp_s / raw_s:.2f} | {old} | {share} |"
            )
    comm.Free()
    dp.finalize()


def _fmt(seconds: float) -> str:
    return f"{seconds * 1e6:.1f} us" if abs(seconds) < 1e-3 else f"{seconds * 1e3:.2f} ms"


if __name__ == "__main__":
    main()

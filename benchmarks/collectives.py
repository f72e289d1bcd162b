"""Latency and bandwidth of dp.allreduce next to raw mpi4py, measured side by side in one run.

Run: `OMP_NUM_THREADS=1 dataparallel run -n 2 benchmarks/collectives.py`

Rows (each the best of 3 interleaved rounds of medians, every rank in lock step):
- a 4-byte allreduce: raw `comm.Allreduce(IN_PLACE, ...)`, dp with and without mismatch checks;
- three metrics in a dict: raw Allreduce of the 3 packed doubles vs dp.allreduce(dict) (both one
  message: dp's values travel in the handshake);
- 1 MiB of float64 under max: raw vs dp, whose NaN check adds one pass over the values;
- one array of 1, 16 and 64 MiB: raw Allreduce vs dp.allreduce (zero-copy, in place);
- a tree of 200 arrays (16 MiB in all): raw Allreduce per leaf vs dp.allreduce (fused buckets);
- the same tree through raw pickled `comm.allreduce` per leaf, the way not to do it.
The ratio column is raw time / dp time: above 1, dp is faster.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable

import numpy as np
from _timing import compare
from mpi4py import MPI

import dataparallel as dp
from dataparallel import world

MiB = 1 << 20


def checked(enabled: bool, fn: Callable[[], object]) -> Callable[[], object]:
    """Return `fn` run with mismatch detection on or off (two attribute writes around it)."""
    active = world.current()
    on = active.settings
    wanted = dataclasses.replace(on, check=enabled)

    def run() -> object:
        active.settings = wanted
        try:
            return fn()
        finally:
            active.settings = on

    return run


def main() -> None:
    dp.initialize("mpi")
    comm = MPI.COMM_WORLD.Dup()
    rows: list[tuple[str, float, float]] = []

    tiny = np.ones(1, np.float32)
    best = compare(
        {
            "raw": lambda: comm.Allreduce(MPI.IN_PLACE, tiny, MPI.SUM),
            "checks on": checked(True, lambda: dp.allreduce(tiny)),
            "checks off": checked(False, lambda: dp.allreduce(tiny)),
        },
        comm,
    )
    rows += [("4 B, checks on", best["raw"], best["checks on"])]
    rows += [("4 B, checks off", best["raw"], best["checks off"])]

    metrics = {"loss": 1.0, "accuracy": 0.5, "samples": 32.0}
    packed = np.ones(3)
    best = compare(
        {
            "raw": lambda: comm.Allreduce(MPI.IN_PLACE, packed, MPI.SUM),
            "dp": lambda: dp.allreduce(metrics),
        },
        comm,
    )
    rows.append(("3 metrics (a dict of floats)", best["raw"], best["dp"]))

    big = np.ones(MiB // 8)
    best = compare(
        {
            "raw": lambda: comm.Allreduce(MPI.IN_PLACE, big, MPI.MAX),
            "dp": lambda: dp.allreduce(big, op="max"),
        },
        comm,
    )
    rows.append(("1 MiB max (NaN check, no NaN)", best["raw"], best["dp"]))

    for mib in (1, 16, 64):
        buf = np.ones(mib * MiB // 4, np.float32)
        best = compare(
            {
                "raw": lambda buf=buf: comm.Allreduce(MPI.IN_PLACE, buf, MPI.SUM),
                "dp": lambda buf=buf: dp.allreduce(buf),
            },
            comm,
        )
        rows.append((f"{mib} MiB array", best["raw"], best["dp"]))

    rng = np.random.default_rng(0)
    sizes = rng.integers(1, 40_000, 200)
    sizes = (sizes * (16 * MiB // 4) // sizes.sum()).astype(int)
    leaves = [np.ones(int(n), np.float32) for n in sizes]

    def per_leaf() -> None:
        for leaf in leaves:
            comm.Allreduce(MPI.IN_PLACE, leaf, MPI.SUM)

    def pickled() -> None:
        for leaf in leaves:
            comm.allreduce(leaf, op=MPI.SUM)

    best = compare(
        {"per leaf": per_leaf, "pickled": pickled, "dp": lambda: dp.allreduce(leaves)}, comm
    )
    rows.append(("tree 200 x 16 MiB, raw per leaf", best["per leaf"], best["dp"]))
    rows.append(("tree 200 x 16 MiB, raw pickled", best["pickled"], best["dp"]))

    if comm.rank == 0:
        print(f"dataparallel vs raw mpi4py, {comm.size} ranks, {MPI.Get_library_version()[:12]}")
        print(f"{'case':36} {'raw':>12} {'dataparallel':>14} {'raw/dp':>8}")
        for name, raw_s, dp_s in rows:
            print(f"{name:36} {_fmt(raw_s):>12} {_fmt(dp_s):>14} {raw_s / dp_s:8.2f}")
        raw_s, dp_s = next((r, d) for n, r, d in rows if n == "4 B, checks on")
        print(f"4 B, checks on: dataparallel - raw = {_fmt(dp_s - raw_s)} (issue 9: at most 5 us)")
        for mib in (1, 16, 64):
            raw_s, dp_s = next((r, d) for n, r, d in rows if n == f"{mib} MiB array")
            print(
                f"bandwidth {mib:2} MiB (algorithm bytes/s): raw {mib * MiB / raw_s / 1e9:.2f} "
                f"GB/s, dataparallel {mib * MiB / dp_s / 1e9:.2f} GB/s"
            )
    comm.Free()
    dp.finalize()


def _fmt(seconds: float) -> str:
    return f"{seconds * 1e6:.1f} us" if seconds < 1e-3 else f"{seconds * 1e3:.2f} ms"


if __name__ == "__main__":
    main()

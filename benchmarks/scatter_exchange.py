"""dp.reducescatter and dp.alltoall next to raw mpi4py, measured side by side in one run.

Run: `OMP_NUM_THREADS=1 dataparallel run -n 2 benchmarks/scatter_exchange.py`

Rows (each the median of 45 batches taken in turn with the other cases, every rank in lock step):
- reduce-scatter of a small array (1 KiB) with and without mismatch checks;
- one float32 array of 1, 16 and 64 MiB: raw `comm.Reduce_scatter` into a preallocated buffer vs
  dp.reducescatter (which returns a new array), and raw `Allreduce` + slice, the design that
  dp.reducescatter did not take (docs/design.md);
- a tree of 200 arrays (16 MiB in all): raw `Reduce_scatter` per leaf vs dp (one call per bucket);
- all-to-all of one array of 1 KiB, 1, 16 and 64 MiB with equal splits: raw `comm.Alltoallv` with
  the counts known in advance vs dp.alltoall (which first exchanges the splits and returns a new
  array); from 16 MiB also raw with a new output array each call;
- all-to-all of a tree of 8 arrays (16 MiB in all): raw `Alltoallv` per leaf vs dp (one call).
The ratio column is raw time / dp time: above 1, dp is faster.
"""

from __future__ import annotations

from collections.abc import Callable

import numpy as np
from _timing import compare
from collectives import checked
from mpi4py import MPI

import dataparallel as dp
from dataparallel.arrays.segments import row_parts

MiB = 1 << 20


def _fmt(seconds: float) -> str:
    return f"{seconds * 1e6:.1f} us" if seconds < 1e-3 else f"{seconds * 1e3:.2f} ms"


def raw_reducescatter(comm: MPI.Comm, buf: np.ndarray) -> Callable[[], object]:
    """Return raw mpi4py's reduce-scatter of `buf` (first axis split as Horovod does)."""
    parts = row_parts(buf.shape[0], comm.size)
    row = buf[0].size if buf.ndim > 1 else 1
    counts = [n * row for n in parts]
    recv = np.empty(counts[comm.rank], buf.dtype)
    return lambda: comm.Reduce_scatter(buf, recv, counts, MPI.SUM)


def raw_allreduce_slice(comm: MPI.Comm, buf: np.ndarray) -> Callable[[], object]:
    """Return the other design: allreduce a copy of everything, then keep this rank's rows."""
    parts = row_parts(buf.shape[0], comm.size)
    start = sum(parts[: comm.rank])

    def run() -> object:
        whole = buf.copy()
        comm.Allreduce(MPI.IN_PLACE, whole, MPI.SUM)
        return whole[start : start + parts[comm.rank]].copy()

    return run


def raw_alltoall(comm: MPI.Comm, buf: np.ndarray, fresh: bool = False) -> Callable[[], object]:
    """Return raw mpi4py's all-to-all of `buf` in equal parts, counts known in advance.

    With `fresh`, the output is a new array each call, as dp.alltoall's is (and Horovod's).
    """
    count = buf.size // comm.size
    counts, displacements = [count] * comm.size, [i * count for i in range(comm.size)]
    recv = np.empty_like(buf)

    def run() -> object:
        out = np.empty_like(buf) if fresh else recv
        comm.Alltoallv([buf, (counts, displacements)], [out, (counts, displacements)])
        return out

    return run


def main() -> None:
    dp.initialize("mpi")
    comm = MPI.COMM_WORLD.Dup()
    size = comm.size
    rows: list[tuple[str, float, float]] = []

    small = np.ones(256 * size, np.float32)
    best = compare(
        {
            "raw": raw_reducescatter(comm, small),
            "checks on": checked(True, lambda: dp.reducescatter(small)),
            "checks off": checked(False, lambda: dp.reducescatter(small)),
        },
        comm,
    )
    rows += [("reducescatter 1 KiB, checks on", best["raw"], best["checks on"])]
    rows += [("reducescatter 1 KiB, checks off", best["raw"], best["checks off"])]

    for mib in (1, 16, 64):
        buf = np.ones((mib * MiB // 4 // 256, 256), np.float32)
        best = compare(
            {
                "raw": raw_reducescatter(comm, buf),
                "allreduce": raw_allreduce_slice(comm, buf),
                "dp": lambda buf=buf: dp.reducescatter(buf),
            },
            comm,
        )
        rows.append((f"reducescatter {mib} MiB", best["raw"], best["dp"]))
        rows.append((f"  allreduce+slice {mib} MiB (raw)", best["allreduce"], best["dp"]))

    rng = np.random.default_rng(0)
    sizes = rng.integers(1, 40_000, 200)
    sizes = (sizes * (16 * MiB // 4) // sizes.sum()).astype(int)
    leaves = [np.ones(int(n), np.float32) for n in sizes]
    per_leaf = [raw_reducescatter(comm, leaf) for leaf in leaves]
    best = compare(
        {"raw": lambda: [f() for f in per_leaf], "dp": lambda: dp.reducescatter(leaves)}, comm
    )
    rows.append(("reducescatter tree 200 x 16 MiB", best["raw"], best["dp"]))

    sizes_of = {"1 KiB": 1024, "1 MiB": MiB, "16 MiB": 16 * MiB, "64 MiB": 64 * MiB}
    for label, nbytes in sizes_of.items():
        buf = np.ones((max(nbytes // 256 // size, 1) * size, 64), np.float32)
        cases = {"raw": raw_alltoall(comm, buf), "dp": lambda buf=buf: dp.alltoall(buf)}
        if nbytes >= 16 * MiB:
            cases["fresh"] = raw_alltoall(comm, buf, fresh=True)
        best = compare(cases, comm)
        rows.append((f"alltoall {label}", best["raw"], best["dp"]))
        if "fresh" in best:
            rows.append((f"  raw, new output {label}", best["fresh"], best["dp"]))

    widths = [64 * (i + 1) for i in range(8)]  # records: one first axis for every leaf
    records = 16 * MiB // (4 * sum(widths)) // size * size
    tree = [np.ones((records, width), np.float32) for width in widths]
    per_leaf = [raw_alltoall(comm, leaf) for leaf in tree]
    best = compare({"raw": lambda: [f() for f in per_leaf], "dp": lambda: dp.alltoall(tree)}, comm)
    rows.append(("alltoall tree 8 x 16 MiB", best["raw"], best["dp"]))

    if comm.rank == 0:
        print(f"dataparallel vs raw mpi4py, {size} ranks, {MPI.Get_library_version()[:12]}")
        print(f"{'case':36} {'raw':>12} {'dataparallel':>14} {'raw/dp':>8}")
        for name, raw_s, dp_s in rows:
            print(f"{name:36} {_fmt(raw_s):>12} {_fmt(dp_s):>14} {raw_s / dp_s:8.2f}")
    comm.Free()
    dp.finalize()


if __name__ == "__main__":
    main()

"""MPI's 16-bit sum: one `Iallreduce` with the `half_sum` op of the MPI backend, against the
two-phase path.

Run: `OMP_NUM_THREADS=1 mpiexec -n 2 python benchmarks/half_sum.py [--numpy]`
(`--numpy`: without torch loaded, so the op adds in NumPy's float32 blocks)

For each size of 16-bit buffer (64 KiB to 16 MiB), taken in turn (`_timing.compare`): the op
(`MPIBackend.iallreduce_half`), `half.TwoPhase` (an all-to-all, a float32 sum of this rank's part,
an allgather: what a compressed sum was before), and the raw `Allreduce` of the same values in
float32 (twice the bytes: what compression saves against, within one machine's memory).
"""

from __future__ import annotations

import sys

import numpy as np
from _timing import compare
from mpi4py import MPI

import dataparallel as dp
from dataparallel.backends.base import ReduceOp
from dataparallel.backends.half import TwoPhase


def main() -> None:
    if "--numpy" not in sys.argv:
        import torch  # noqa: F401 - a training job has it loaded

    dp.initialize("mpi")
    engine = dp.world.current().backend
    comm = MPI.COMM_WORLD
    adds = "torch" if "torch" in sys.modules else "NumPy"
    if comm.rank == 0:
        print(f"{comm.size} ranks, {adds} additions; time per sum, and vs the two-phase path")
        head = ("16-bit bytes", "dtype", "op", "two-phase", "f32 raw")
        print("{:>12} {:>9} {:>10} {:>10} {:>10} ratio".format(*head))
    for kib in (64, 256, 1024, 4096, 16384):
        for dtype in ("float16", "bfloat16"):
            items = kib * 512
            buf = np.zeros(items, np.float16 if dtype == "float16" else np.uint16)
            wide = np.zeros(items, np.float32)
            cases = {
                "op": lambda b=buf, d=dtype: engine.iallreduce_half(b, ReduceOp.SUM, d).wait(),
                "two-phase": lambda b=buf, d=dtype: TwoPhase(engine, b, ReduceOp.SUM, d).wait(),
                "raw": lambda w=wide: comm.Allreduce(MPI.IN_PLACE, w, MPI.SUM),
            }
            t = compare(cases, comm, batches=15)
            if comm.rank == 0:
                print(
                    f"{kib:>8} KiB {dtype:>9} {t['op'] * 1e3:8.3f}ms {t['two-phase'] * 1e3:8.3f}ms"
                    f" {t['raw'] * 1e3:8.3f}ms {t['two-phase'] / t['op']:5.2f}x"
                )
    dp.finalize()


if __name__ == "__main__":
    main()

"""What compression costs and saves on this machine: `dp.allreduce` of float32 in 32 or 16 bits.

Run: `OMP_NUM_THREADS=1 dataparallel run -n 2 benchmarks/compression.py [--numpy]`
(`--numpy`: without torch loaded, so the 16-bit casts are NumPy's)

One float32 array of each size is averaged with no compression, `Compression.fp16` (MPICH's
float16 and bfloat16, both moved in 16 bits by an all-to-all and an allgather with a float32 sum
in between on MPI: `backends/half.py`), next to the
raw mpi4py reference of one `Allreduce` of the float32 array. Compression halves the bytes on the
wire and adds conversions and a second call: it pays where the network is the bottleneck, not
within one machine's shared memory. The figures say how much it costs where bandwidth is free.
"""

from __future__ import annotations

import sys

import numpy as np
from _timing import compare
from mpi4py import MPI

import dataparallel as dp


def main() -> None:
    if "--numpy" not in sys.argv:
        import torch  # noqa: F401 - a training job has it loaded: the casts are torch's

    dp.initialize("mpi")
    comm = MPI.COMM_WORLD
    casts = "NumPy" if "torch" not in sys.modules else "torch"
    for items in (1 << 16, 1 << 20, 1 << 23):
        x = np.ones(items, np.float32)
        cases = {
            "raw: Allreduce float32": lambda x=x: comm.Allreduce(MPI.IN_PLACE, x, MPI.SUM),
            "dp: float32": lambda x=x: dp.allreduce(x, "avg"),
            "dp: fp16 on the wire": lambda x=x: dp.allreduce(
                x, "avg", compression=dp.Compression.fp16
            ),
            "dp: bf16 on the wire": lambda x=x: dp.allreduce(
                x, "avg", compression=dp.Compression.bf16
            ),
        }
        rows = list(compare(cases, comm).items())
        if comm.rank == 0:
            reference = rows[0][1]
            print(
                f"allreduce of {items * 4 // 1024} KiB of float32, {comm.size} ranks, {casts} casts"
            )
            print(f"{'case':26} {'time':>10} {'vs raw':>8}")
            for name, seconds in rows:
                print(f"{name:26} {seconds * 1e3:8.3f} ms {reference / seconds:7.2f}x")
    dp.finalize()


if __name__ == "__main__":
    main()

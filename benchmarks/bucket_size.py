"""How the fusion bucket size changes the time to allreduce a gradient-shaped tree.

Run: `OMP_NUM_THREADS=1 dataparallel run -n 2 benchmarks/bucket_size.py`

The tree mimics a convolutional network's gradients: 160 arrays from 64 floats to 2.4 M floats,
32 MiB in all. Each row reduces it through `CoalescingReducer` (non-blocking flushes, one
`finalize`) with one bucket size, next to the raw mpi4py reference of one `Allreduce` per array
and of one `Allreduce` over a single pre-packed buffer (the floor: no packing cost). The default
`DATAPARALLEL_BUCKET_BYTES` is chosen from this table.
"""

from __future__ import annotations

import numpy as np
from _timing import compare
from mpi4py import MPI

import dataparallel as dp

MiB = 1 << 20


def gradient_tree() -> list[np.ndarray]:
    rng = np.random.default_rng(0)
    sizes = np.exp(rng.uniform(np.log(64), np.log(2.4e6), 160)).astype(int)
    sizes = (sizes * (32 * MiB // 4) / sizes.sum()).astype(int) + 1
    return [np.ones(int(n), np.float32) for n in sizes]


def main() -> None:
    dp.initialize("mpi")
    comm = MPI.COMM_WORLD
    leaves = gradient_tree()
    packed = np.ones(sum(leaf.size for leaf in leaves), np.float32)

    def per_array() -> None:
        for leaf in leaves:
            comm.Allreduce(MPI.IN_PLACE, leaf, MPI.SUM)

    cases = {
        "raw: one Allreduce per array": per_array,
        "raw: one Allreduce, pre-packed": lambda: comm.Allreduce(MPI.IN_PLACE, packed, MPI.SUM),
    }
    for kib in (64, 256, 1024, 4096, 16384, 65536):

        def fused(kib: int = kib) -> None:
            with dp.CoalescingReducer(bucket_bytes=kib * 1024) as reducer:
                for leaf in leaves:
                    reducer.add(leaf)

        cases[f"dp: bucket {kib} KiB"] = fused
    rows = list(compare(cases, comm).items())
    if comm.rank == 0:
        reference = rows[0][1]
        print(f"allreduce of {len(leaves)} arrays, 32 MiB, {comm.size} ranks")
        print(f"{'case':34} {'time':>10} {'vs per-array':>13}")
        for name, seconds in rows:
            print(f"{name:34} {seconds * 1e3:8.2f} ms {reference / seconds:12.2f}x")
    dp.finalize()


if __name__ == "__main__":
    main()

"""One rank of a Slurm job: print the world it joined and the sum of every rank's number."""

import sys

import numpy as np

import dataparallel as dp

backend = dp.initialize(sys.argv[1] if len(sys.argv) > 1 else "auto")
total = dp.allreduce(np.array([dp.rank() + 1.0]), op="sum")
print(
    f"world rank={dp.rank()} size={dp.size()} local={dp.local_rank()}/{dp.local_size()} "
    f"backend={backend.name} sum={int(total[0])}",
    flush=True,
)
dp.finalize()

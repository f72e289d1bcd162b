"""One rank of a Slurm job: print the world it joined and the sum of every rank's number."""

import sys

import numpy as np

import dataparallel as dp


def say(line: str) -> None:
    """Print `line` in one write (mpiexec interleaves the ranks' output by writes)."""
    sys.stdout.write(line + "\n")
    sys.stdout.flush()


backend = dp.initialize(sys.argv[1] if len(sys.argv) > 1 else "auto")
total = dp.allreduce(np.array([dp.rank() + 1.0]), op="sum")
say(
    f"world rank={dp.rank()} size={dp.size()} local={dp.local_rank()}/{dp.local_size()} "
    f"backend={backend.name} sum={int(total[0])}",
)
dp.finalize()

"""Rank 1 raises; the others wait (`sleep`: 600 s; `barrier`: in MPI, which rank 1 never joins)."""

import os
import sys
import time

mode = sys.argv[1]
rank = int(os.environ.get("RANK") or os.environ.get("PMI_RANK") or 0)
if rank == 1:
    raise RuntimeError("rank 1 fails on purpose")
if mode == "barrier":
    from mpi4py import MPI

    MPI.COMM_WORLD.Barrier()
time.sleep(600)

"""Print this rank, the world size and the arguments as one JSON line, through mpi4py only."""

import json
import sys

from mpi4py import MPI

comm = MPI.COMM_WORLD
total = comm.allreduce(comm.Get_rank())  # proves the ranks share one world
line = {"rank": comm.Get_rank(), "size": comm.Get_size(), "sum": total, "argv": sys.argv[1:]}
# One write per line: mpiexec interleaves the ranks' output by writes, and under PYTHONUNBUFFERED
# `print` writes the text and its newline separately.
sys.stdout.write(json.dumps(line) + "\n")
sys.stdout.flush()

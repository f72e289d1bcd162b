"""Rank 1 never joins: rank 0's collective must end with CollectiveTimeoutError, not a hang.

Usage: `timeout_job.py CALL` where CALL is one of the collectives below. Rank 0 prints
`TIMEOUT <message>` when the error comes, then exits 3; rank 1 sleeps until the launcher ends it.
"""

import sys
import time

import numpy as np

import dataparallel as dp

dp.initialize(timeout=1.0)
calls = {
    "allreduce": lambda: dp.allreduce(np.ones(4)),
    "iallreduce": lambda: dp.iallreduce(np.ones(4)).wait(),
    "broadcast": lambda: dp.broadcast(np.ones(4), root=1),  # the root alone may finish early
    "barrier": dp.barrier,
    "allgather_object": lambda: dp.allgather_object("x"),
    "reducescatter": lambda: dp.reducescatter(np.ones(4)),
    "alltoall": lambda: dp.alltoall(np.ones(4)),
}
if dp.rank() == 0:
    try:
        calls[sys.argv[1]]()
    except dp.CollectiveTimeoutError as error:
        print("TIMEOUT", error, flush=True)
        sys.exit(3)
    print("NO TIMEOUT", flush=True)
else:
    time.sleep(600)  # until the launcher ends it

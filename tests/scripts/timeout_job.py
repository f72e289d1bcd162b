"""Rank 1 never joins: rank 0's collective must end with CollectiveTimeoutError, not a hang.

Usage: `timeout_job.py [--timeout S] CALL [CALL ...]`, each CALL one of the collectives below,
S the calls' timeout (default 1 s). Every rank first prints `hello from R` with `dp.print`,
which never communicates (tests/test_quiet.py reads the lines' prefixes). Rank 0 then makes each
call in turn (rank 1 joins none, so each one's peer never comes) and prints `TIMEOUT <message>`
when its error comes, or `NO TIMEOUT`; after the last it exits 3 if every call timed out. Rank 1
sleeps until the launcher ends it.
"""

import sys
import time

import numpy as np

import dataparallel as dp

timeout, names = 1.0, sys.argv[1:]
if names[:1] == ["--timeout"]:
    timeout, names = float(names[1]), names[2:]
dp.initialize(timeout=timeout)
dp.print("hello from", dp.rank())
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
    timed_out = 0
    for name in names:
        try:
            calls[name]()
        except dp.CollectiveTimeoutError as error:
            print("TIMEOUT", error, flush=True)
            timed_out += 1
        else:
            print("NO TIMEOUT", flush=True)
    sys.exit(3 if timed_out == len(names) else 0)
else:
    time.sleep(600)  # until the launcher ends it

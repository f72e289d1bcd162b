"""`leaves_early.py HOW`: rank 1 ends early while the other ranks wait in a collective.

HOW is how rank 1 ends: `os._exit` (`os._exit(0)`), `sys.exit` (`sys.exit(0)`), or `skip` (it
skips the last collective and its script ends). With `late`, nothing is wrong: rank 0 finishes
a second after the others, with no collective left, and the job must succeed.
"""

import os
import sys
import time

import numpy as np

import dataparallel as dp

how = sys.argv[1]
dp.initialize()
dp.allreduce(np.ones(1))  # a call every rank makes
if how == "late":
    if dp.rank() == 0:
        time.sleep(1.0)  # the others are in dp.finalize() (the runner's) or at exit meanwhile
    print(f"rank {dp.rank()} finished", flush=True)
    sys.exit(0)
if dp.rank() == 1:
    if how == "os._exit":
        os._exit(0)
    if how == "sys.exit":
        sys.exit(0)
else:
    dp.allreduce(np.ones(1))  # rank 1 never joins
    print("UNREACHABLE", flush=True)

"""Rank 1 is killed (SIGKILL: no traceback, no cleanup) while the others wait in a collective."""

import os
import signal

import numpy as np

import dataparallel as dp

dp.initialize()
if dp.rank() == 1:
    os.kill(os.getpid(), signal.SIGKILL)
dp.allreduce(np.ones(4))  # rank 1 never joins
print("UNREACHABLE", flush=True)

"""Rank 1 finishes its script without calling dp.initialize; the others wait there for it."""

import os
import sys

import numpy as np

import dataparallel as dp

if os.environ.get("RANK", os.environ.get("PMI_RANK")) == "1":
    sys.exit(0)
dp.initialize()
dp.allreduce(np.ones(4))
print("UNREACHABLE", flush=True)

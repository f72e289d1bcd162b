"""`ctrl_c.py DIR`: rank 0 waits in a collective that rank 1 never joins; rank 1 sleeps 600 s.

Each rank writes its pid to DIR/<rank>.pid once it has initialized, for the test to press Ctrl-C.
"""

import os
import sys
import time
from pathlib import Path

import numpy as np

import dataparallel as dp

dp.initialize()
(Path(sys.argv[1]) / f"{dp.rank()}.pid").write_text(str(os.getpid()))
if dp.rank() == 0:
    dp.allreduce(np.ones(1))  # blocked in MPI's C code, where Python sees no signal
time.sleep(600)

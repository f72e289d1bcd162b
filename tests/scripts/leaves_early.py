"""`leaves_early.py HOW`: rank 1 ends early while the other ranks wait in a collective.

HOW is how rank 1 ends: `os._exit` (`os._exit(0)`), `sys.exit` (`sys.exit(0)`), `skip` (it
skips the last collective and its script ends), or `raise` (a failure, for contrast: the job's
failure is rank 1's, not that of the ranks whose collective it ended). With `late DIR`, nothing
is wrong: rank 0 finishes after the others, with no collective left, and the job must succeed.
Each other rank notes DIR/finished-R on its way out (to the runner's `dp.finalize()`, or to
exit), and rank 0 waits for every note before it finishes.
"""

import os
import sys
import time
from pathlib import Path

import numpy as np

import dataparallel as dp

how = sys.argv[1]
dp.initialize()
dp.allreduce(np.ones(1))  # a call every rank makes
if how == "late":
    notes = [Path(sys.argv[2], f"finished-{rank}") for rank in range(1, dp.size())]
    if dp.rank() == 0:
        while not all(note.exists() for note in notes):  # the launcher's --timeout guards it
            time.sleep(0.01)
    print(f"rank {dp.rank()} finished", flush=True)
    if dp.rank() > 0:
        notes[dp.rank() - 1].touch()
    sys.exit(0)
if dp.rank() == 1:
    if how == "os._exit":
        os._exit(0)
    if how == "sys.exit":
        sys.exit(0)
    if how == "raise":
        raise RuntimeError("rank 1 fails on purpose")
else:
    dp.allreduce(np.ones(1))  # rank 1 never joins
    print("UNREACHABLE", flush=True)

"""Under a plain `mpiexec` (no dataparallel launcher): rank 1 raises while the others wait."""

import dataparallel as dp

dp.initialize()
if dp.rank() == 1:
    raise RuntimeError("rank 1 fails on purpose")
dp.barrier()  # never completes: rank 1 is gone

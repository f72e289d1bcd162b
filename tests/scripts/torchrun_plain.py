"""A torchrun script, unchanged: torchrun's variables and its own init_process_group (env://).

With `--dp-after`, it then calls dp.initialize() too, which joins the group the script made.
With `--leave-group`, it ends without destroying its group, and prints `exit rank=R` when
`destroy_process_group()` is called after its end (by `dataparallel run`'s exit hook).
"""

import os
import sys

import torch
import torch.distributed as dist


def say(line: str) -> None:
    """Print `line` in one write (mpiexec interleaves the ranks' output by writes)."""
    sys.stdout.write(line + "\n")
    sys.stdout.flush()


rank, size = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
local = int(os.environ["LOCAL_RANK"])
dist.init_process_group("gloo")
x = torch.tensor([rank + 1.0])
dist.all_reduce(x)
assert dist.get_rank() == rank and dist.get_world_size() == size
say(f"torchrun rank={rank} size={size} local={local} sum={x.item():g}")
if "--dp-after" in sys.argv:
    import numpy as np

    import dataparallel as dp

    dp.initialize()
    total = dp.allreduce(np.array([1.0]), op="sum")
    say(f"dp rank={dp.rank()} size={dp.size()} sum={total[0]:g}")
    dp.finalize()
    assert dist.is_initialized(), "dp.finalize() destroyed the script's own group"
if "--leave-group" in sys.argv:
    destroy = dist.destroy_process_group

    def noted(group: dist.ProcessGroup | None = None) -> None:
        say(f"exit rank={rank} initialized={dist.is_initialized()}")
        destroy(group)

    dist.destroy_process_group = noted
else:
    dist.destroy_process_group()

"""torch.distributed beside dataparallel's world; prints what a test checks, one line each.

Usage: `torch_alongside.py MODE`:
- `check`: after dp.initialize(), is torch's group there, over the same ranks, and does it work?
  After dp.finalize(), is it gone?
- `user-after`: the script calls dist.init_process_group() after dp.initialize(): torch refuses.
"""

import sys

import torch
import torch.distributed as dist

import dataparallel as dp


def say(line: str) -> None:
    """Print `line` in one write (mpiexec interleaves the ranks' output by writes)."""
    sys.stdout.write(line + "\n")
    sys.stdout.flush()


mode = sys.argv[1]
dp.initialize()
if mode == "check":
    if dist.is_initialized():
        x = torch.tensor([dp.rank() + 1.0])
        dist.all_reduce(x)
        same = (dist.get_rank(), dist.get_world_size()) == (dp.rank(), dp.size())
        say(f"ALONGSIDE rank={dp.rank()} same_ranks={same} sum={x.item():g}")
    else:
        say(f"NOT INITIALIZED rank={dp.rank()}")
    dp.finalize()
    say(
        f"AFTER FINALIZE rank={dp.rank() if dp.initialized() else '-'} "
        f"initialized={dist.is_initialized()}",
    )
elif mode == "user-after":
    try:
        dist.init_process_group("gloo")
    except (ValueError, RuntimeError) as error:
        say(f"REFUSED {type(error).__name__}: {error}")
    dp.finalize()

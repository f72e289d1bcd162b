"""torch.distributed beside dataparallel's world; prints what a test checks, one line each.

Usage: `torch_alongside.py MODE`:
- `check`: after dp.initialize(), is torch's group there, over the same ranks, and does it work?
  After dp.finalize(), is it gone?
- `user-after`: the script calls dist.init_process_group() after dp.initialize(): under MPI its
  own group replaces the one made beside the world (and outlives dp.finalize()); under Gloo,
  whose engine is torch's group, the call is refused with what to do.
- `user-first-late`: dist.init_process_group() first, then dp.initialize(timeout=3); rank 1 then
  waits on a pipe nobody writes to, so rank 0's allreduce must time out after the setting's 3 s.
"""

import os
import sys

import torch
import torch.distributed as dist

import dataparallel as dp


def say(line: str) -> None:
    """Print `line` in one write (mpiexec interleaves the ranks' output by writes)."""
    sys.stdout.write(line + "\n")
    sys.stdout.flush()


mode = sys.argv[1]
if mode == "user-first-late":
    dist.init_process_group("gloo")
    dp.initialize(timeout=3)
    if dp.rank() != 0:
        never, _ = os.pipe()
        os.read(never, 1)  # the late peer: it never comes
    try:
        dp.allreduce(torch.ones(4))
    except dp.CollectiveTimeoutError as error:
        say(f"TIMEOUT {error}")
        os._exit(3)  # a peer is stuck: leave at once, the launcher ends the job
    say("NO TIMEOUT")
    os._exit(0)
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
        sys.exit(0)
    x = torch.tensor([dp.rank() + 1.0])
    dist.all_reduce(x)
    theirs = dist.group.WORLD
    total = dp.allreduce(torch.tensor([1.0])).item()  # the engine still works beside it
    dp.finalize()
    kept = dist.is_initialized() and dist.group.WORLD is theirs
    say(f"OWN rank={dist.get_rank()} sum={x.item():g} dp_sum={total:g} kept={kept}")
    dist.destroy_process_group()

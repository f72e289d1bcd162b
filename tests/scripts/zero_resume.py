"""Resume a `ZeroRedundancyOptimizer` checkpoint at this world's size, train, save again.

`resume(previous, saved)`: loads `previous` (a file another world size saved; "-" to start),
trains two more steps on this rank's share of the global batches, consolidates on rank 0, which
saves the model, the optimizer's consolidated state, the steps taken and the world sizes so far.
Odd world sizes use stage 2, even ones stage 1 under `DataParallelModel`, with other buckets.
A step of `checkpoint_job.py` (`zero-resume`), so that the jobs that check `dp.checkpoint`
carry this chain too, and of `test_checkpoint.py` itself for a world of one.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from _torch_common import global_batch, loss_of, make_model, share

import dataparallel as dp

STEPS = 2


def resume(previous: str, saved: str | Path) -> None:
    """Load `previous` ("-": none), train `STEPS` steps at this world's size, save `saved`."""
    stage = 2 if dp.size() % 2 else 1
    model = make_model()
    sizes: list[int] = []
    done = 0
    checkpoint = None
    if previous != "-":
        checkpoint = torch.load(previous, weights_only=False)
        model.load_state_dict(checkpoint["model"])
        sizes, done = json.loads(checkpoint["sizes"]), checkpoint["steps"]
    opt = dp.torch.ZeroRedundancyOptimizer(
        model.parameters(),
        torch.optim.Adam,
        stage=stage,
        bucket_bytes=40 + 24 * dp.size(),
        lr=0.01,
    )
    if checkpoint is not None:
        opt.load_state_dict(checkpoint["optimizer"])
    net = dp.torch.DataParallelModel(model) if stage == 1 else model
    for step in range(done, done + STEPS):
        x, y = global_batch(step)
        opt.zero_grad()
        loss_of(net, share(x), share(y)).backward()
        opt.step()
    opt.consolidate_state_dict(to=0)
    if dp.rank() == 0:
        state = {"model": model.state_dict(), "optimizer": opt.state_dict()}
        torch.save(
            {**state, "steps": done + STEPS, "sizes": json.dumps([*sizes, dp.size()])}, saved
        )
    dp.barrier()  # the file is whole before any rank's next step reads it

"""Resume a `ZeroRedundancyOptimizer` checkpoint at this job's world size, train, save again.

Usage: zero_resume.py PREVIOUS|- SAVED DONE STEPS. Loads PREVIOUS (saved by another world size),
trains steps DONE..DONE+STEPS on this rank's share of the global batches, consolidates on rank 0,
which saves the model, the optimizer's consolidated state and the world sizes so far.
Odd world sizes use stage 2, even ones stage 1 under `DataParallelModel`, with other buckets.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from _torch_common import global_batch, loss_of, make_model, share

import dataparallel as dp

previous, saved, done, steps = sys.argv[1], Path(sys.argv[2]), int(sys.argv[3]), int(sys.argv[4])
dp.initialize()
stage = 2 if dp.size() % 2 else 1
model = make_model()
sizes = []
checkpoint = None
if previous != "-":
    checkpoint = torch.load(previous, weights_only=False)
    model.load_state_dict(checkpoint["model"])
    sizes = json.loads(checkpoint["sizes"])
opt = dp.torch.ZeroRedundancyOptimizer(
    model.parameters(), torch.optim.Adam, stage=stage, bucket_bytes=40 + 24 * dp.size(), lr=0.01
)
if checkpoint is not None:
    opt.load_state_dict(checkpoint["optimizer"])
net = dp.torch.DataParallelModel(model) if stage == 1 else model
for step in range(done, done + steps):
    x, y = global_batch(step)
    opt.zero_grad()
    loss_of(net, share(x), share(y)).backward()
    opt.step()
opt.consolidate_state_dict(to=0)
if dp.rank() == 0:
    state = {"model": model.state_dict(), "optimizer": opt.state_dict()}
    torch.save({**state, "sizes": json.dumps([*sizes, dp.size()])}, saved)
dp.finalize()

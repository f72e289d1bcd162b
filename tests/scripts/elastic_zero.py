"""An elastic run with a `dp.torch.ZeroRedundancyOptimizer` (Adam, stage 1 under a
`DataParallelModel` or stage 2 alone), a commit every other step; worker `--die W` SIGKILLs
itself in the middle of step `--at` (after its backward, before the optimizer's step).

After each commit every rank copies the consolidated state the commit made (`opt.state_dict()`,
every rank holds it) and the parameters. When the function is entered again on a re-formed
world, the optimizer, laid out over the new world, is consolidated on rank 0 and compared with
rank 0's copy: every tensor equal, bit for bit. Rank 0 writes `--out`: the world size at the end,
the steps, how many re-formed worlds were checked, and whether each check held.
"""

from __future__ import annotations

import argparse
import copy
import json
import os
import signal
from typing import Any

import torch

import dataparallel as dp

parser = argparse.ArgumentParser()
parser.add_argument("--out", required=True)
parser.add_argument("--die", default="")
parser.add_argument("--at", type=int, default=5)
parser.add_argument("--steps", type=int, default=10)
parser.add_argument("--stage", type=int, default=2)
args = parser.parse_args()
me = os.environ.get("DATAPARALLEL_ELASTIC_WORKER")

dp.initialize()
torch.manual_seed(0)
model = torch.nn.Sequential(torch.nn.Linear(6, 5), torch.nn.Tanh(), torch.nn.Linear(5, 3)).double()
net: torch.nn.Module = dp.torch.DataParallelModel(model) if args.stage == 1 else model
opt = dp.torch.ZeroRedundancyOptimizer(
    model.parameters(), torch.optim.Adam, stage=args.stage, lr=0.05, bucket_bytes=64
)
state = dp.elastic.TorchState(net, opt, step=0)
committed: dict[str, Any] = {}
checks: list[bool] = []


def same(a: Any, b: Any) -> bool:
    if isinstance(a, torch.Tensor):
        return isinstance(b, torch.Tensor) and a.dtype == b.dtype and torch.equal(a, b)
    if isinstance(a, dict):
        return isinstance(b, dict) and a.keys() == b.keys() and all(same(a[k], b[k]) for k in a)
    if isinstance(a, list):
        return isinstance(b, list) and len(a) == len(b) and all(map(same, a, b))
    return bool(a == b)


@dp.elastic.run
def train(state: dp.elastic.TorchState) -> None:
    if committed and committed["size"] != dp.size():  # entered again on a re-formed world
        opt.consolidate_state_dict(to=0)
        if dp.rank() == 0:
            now = {"optimizer": opt.state_dict(), "model": model.state_dict()}
            checks.append(same(now["optimizer"]["state"], committed["optimizer"]["state"]))
            checks.append(same(now["model"], committed["model"]))
        committed["size"] = dp.size()
    while state.step < args.steps:
        g = torch.Generator().manual_seed(1000 * state.step + dp.rank())
        x, y = torch.randn(4, 6, generator=g).double(), torch.randn(4, 3, generator=g).double()
        opt.zero_grad()
        ((net(x) - y) ** 2).mean().backward()
        if me == args.die and state.step == args.at:
            os.kill(os.getpid(), signal.SIGKILL)
        opt.step()
        state.step += 1
        if state.step % 2 == 0:
            state.commit()
            committed.update(
                size=dp.size(),
                optimizer=copy.deepcopy(opt.state_dict()),
                model=copy.deepcopy(model.state_dict()),
            )


train(state)
if dp.rank() == 0:
    with open(args.out, "w") as file:
        json.dump({"size": dp.size(), "step": state.step, "checks": checks}, file)

"""An elastic run with two `dp.torch.ZeroRedundancyOptimizer`s (Adam): stage 1 under a
`DataParallelModel`, stage 2 on a model of its own, both stepped every step, a commit every
other step. Each `--die W:STEP` makes worker W SIGKILL itself in the middle of step STEP (after
both backward passes, before the optimizers' steps).

After each commit every rank copies the consolidated states the commit made (`opt.state_dict()`,
every rank holds them) and the parameters. When the function is entered again on a re-formed
world, each optimizer, laid out over the new world, is consolidated again and compared with the
copy: every tensor equal, bit for bit (four checks per re-formed world, on every rank). Rank 0
writes `--out`: the world size at the end, the steps, and its checks.
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
parser.add_argument("--die", nargs="*", default=[], metavar="W:STEP")
parser.add_argument("--steps", type=int, default=10)
args = parser.parse_args()
me = os.environ.get("DATAPARALLEL_ELASTIC_WORKER")
deaths = {worker: int(step) for worker, step in (d.split(":") for d in args.die)}

dp.initialize()
torch.manual_seed(0)


def mlp() -> torch.nn.Module:
    return torch.nn.Sequential(
        torch.nn.Linear(6, 5), torch.nn.Tanh(), torch.nn.Linear(5, 3)
    ).double()


model1, model2 = mlp(), mlp()
net1 = dp.torch.DataParallelModel(model1)
opt1 = dp.torch.ZeroRedundancyOptimizer(
    model1.parameters(), torch.optim.Adam, stage=1, lr=0.05, bucket_bytes=64
)
opt2 = dp.torch.ZeroRedundancyOptimizer(
    model2.parameters(), torch.optim.Adam, stage=2, lr=0.05, bucket_bytes=64
)
state = dp.elastic.TorchState(net1, opt1, model2=model2, opt2=opt2, step=0)
pairs = {"1": (model1, opt1), "2": (model2, opt2)}
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
        for key, (model, opt) in pairs.items():
            opt.consolidate_state_dict(to=None)
            checks.append(same(opt.state_dict()["state"], committed[f"opt{key}"]["state"]))
            checks.append(same(model.state_dict(), committed[f"model{key}"]))
        committed["size"] = dp.size()
    while state.step < args.steps:
        g = torch.Generator().manual_seed(1000 * state.step + dp.rank())
        x, y = torch.randn(4, 6, generator=g).double(), torch.randn(4, 3, generator=g).double()
        opt1.zero_grad()
        opt2.zero_grad()
        ((net1(x) - y) ** 2).mean().backward()
        ((model2(x) - y) ** 2).mean().backward()
        if deaths.get(me or "") == state.step:
            os.kill(os.getpid(), signal.SIGKILL)
        opt1.step()
        opt2.step()
        state.step += 1
        if state.step % 2 == 0:
            state.commit()
            committed["size"] = dp.size()
            for key, (model, opt) in pairs.items():
                committed[f"opt{key}"] = copy.deepcopy(opt.state_dict())
                committed[f"model{key}"] = copy.deepcopy(model.state_dict())


train(state)
if dp.rank() == 0:
    with open(args.out, "w") as file:
        json.dump({"size": dp.size(), "step": state.step, "checks": checks}, file)

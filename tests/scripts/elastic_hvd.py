"""A Horovod elastic script (Horovod's names only, its import changed): `hvd.elastic.run`,
`hvd.elastic.TorchState` with a `hvd.DistributedOptimizer`, a reset callback, a commit per step.

With `--ddp`, the model is a `dp.torch.DataParallelModel` and the optimizer a plain SGD: the
model's gradient hooks are carried over to the re-formed world instead of the optimizer's.

Worker `--die W` SIGKILLs itself in the middle of step `--at` (after its backward, before the
optimizer's step). Worker `--die-grouping W` SIGKILLs itself as the wrapper (made before
`hvd.elastic.run`) begins making its private group over the world, before its address is in the
store: the others wait there for it. Rank 0 writes `--out`: the world size at the end, the
steps, the resets seen, and whether every rank holds the same parameters.
"""

from __future__ import annotations

import argparse
import json
import os
import signal

import torch

import dataparallel as dp
import dataparallel.horovod.torch as hvd

parser = argparse.ArgumentParser()
parser.add_argument("--out", required=True)
parser.add_argument("--die", default="")
parser.add_argument("--at", type=int, default=5)
parser.add_argument("--steps", type=int, default=12)
parser.add_argument("--ddp", action="store_true")
parser.add_argument("--die-grouping", default="")
args = parser.parse_args()
me = os.environ.get("DATAPARALLEL_ELASTIC_WORKER")
if me == args.die_grouping:
    from dataparallel.backends.gloo.backend import GlooBackend

    def dying(self: GlooBackend) -> GlooBackend:
        os.kill(os.getpid(), signal.SIGKILL)
        raise AssertionError("not reached")

    GlooBackend.duplicate = dying  # type: ignore[method-assign]

hvd.init()
torch.manual_seed(hvd.rank())  # different on each rank: the first sync must make them equal
model: torch.nn.Module = torch.nn.Linear(8, 1)
optimizer = torch.optim.SGD(model.parameters(), lr=0.1 * hvd.size())
if args.ddp:
    model = dp.torch.DataParallelModel(model)
else:
    optimizer = hvd.DistributedOptimizer(optimizer, named_parameters=model.named_parameters())
resets = []


def on_reset() -> None:
    resets.append(hvd.size())
    for group in optimizer.param_groups:
        group["lr"] = 0.1 * hvd.size()


data = torch.randn(16, 8, generator=torch.Generator().manual_seed(1))


@hvd.elastic.run
def train(state: hvd.elastic.TorchState) -> None:
    while state.step < args.steps:
        optimizer.zero_grad()
        model(data).pow(2).mean().backward()
        if me == args.die and state.step == args.at:
            os.kill(os.getpid(), signal.SIGKILL)
        optimizer.step()
        state.step += 1
        state.commit()


state = hvd.elastic.TorchState(model, optimizer, step=0)
state.register_reset_callbacks([on_reset])
train(state)
flat = torch.cat([p.detach().flatten() for p in model.parameters()])
same = all(torch.equal(flat, other) for other in hvd.allgather_object(flat))
if hvd.rank() == 0:
    with open(args.out, "w") as file:
        json.dump({"size": hvd.size(), "step": state.step, "resets": resets, "same": same}, file)

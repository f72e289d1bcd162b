"""An elastic run of a `dp.torch.fully_shard` model with Adam over its shards, whose every
update can be replayed in one process.

A float64 MLP (hidden width 7: chunks padded, and over 3 ranks the last holds 1 row of 7 and of
the head's 3), each block sharded, then the model; `TorchState(model, opt, sampler=..., ...)`
commits every `--commit` steps and at each epoch's end. Each step's loss is the sum of its
samples' losses over the global batch's count, times the world size (the reduce-scatter
averages over ranks), so the update is that of one process on the global batch: `replay`
recomputes it on an unsharded copy from the history kept in the state.

After each commit every rank gathers the whole parameters and Adam state (`whole`); when the
function is entered again on a re-formed world, the same is gathered from the carried-over
shards and compared with rank 0's, bit for bit, and the verdict kept in the state (so that a
worker that joined later, or the last survivor, holds every re-form's). Rank 0 writes `--out`:
the final whole parameters, the history, the world size and the checks.

Options:
    --die W:K          worker W SIGKILLs itself after its K-th commit, in the next step (after
                       backward, before the optimizer's step); may be given for several workers
    --slots FILE:K:LINE  after its K-th commit, worker 0 writes LINE to FILE (what the discovery
                       script prints) and waits until the launcher has opened a new round
"""

from __future__ import annotations

import argparse
import json
import os
import signal
from typing import Any

import torch

import dataparallel as dp

LR = 0.05


def make_model() -> torch.nn.Sequential:
    torch.manual_seed(0)
    return torch.nn.Sequential(
        torch.nn.Linear(6, 7), torch.nn.Tanh(), torch.nn.Linear(7, 3)
    ).double()


def sample(i: int) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(i)
    return torch.randn(6, generator=g).double(), torch.randn(3, generator=g).double()


def loss_of(model: torch.nn.Module, indices: list[int]) -> torch.Tensor:
    """The summed squared error of `indices`, in one forward (a rank with no sample runs one
    all the same, on a zero input, weighted 0: every rank runs the same modules)."""
    if not indices:
        return 0.0 * model(torch.zeros(1, 6, dtype=torch.float64)).sum()
    xs, ys = zip(*(sample(i) for i in indices), strict=True)
    return ((model(torch.stack(xs)) - torch.stack(ys)) ** 2).sum()


def replay(history: list[list[Any]]) -> dict[str, torch.Tensor]:
    """The parameters after the committed steps of `history`, on one unsharded model."""
    model = make_model()
    opt = torch.optim.Adam(model.parameters(), lr=LR)
    for _, _, batch in history:
        opt.zero_grad()
        (loss_of(model, batch) / max(len(batch), 1)).backward()
        opt.step()
    return {k: v.detach().clone() for k, v in model.state_dict().items()}


def whole(model: Any, opt: torch.optim.Optimizer) -> dict[str, Any]:
    """The whole parameters and Adam state, from every rank's shards (collective)."""
    mine = {}
    for name, shard in model.parameter_shards().items():
        state = opt.state.get(shard.param, {})
        rows = {k: v.clone() for k, v in state.items() if k != "step"}
        step = float(state["step"]) if "step" in state else None
        mine[name] = (shard.offsets, shard.param.detach().clone(), rows, step)
    out: dict[str, Any] = {}
    parts = dp.allgather_object(mine)
    for name in mine:
        pieces = sorted((p[name] for p in parts if p[name][1].numel()), key=lambda p: p[0])
        out[name] = torch.cat([p[1] for p in pieces])
        for key in pieces[0][2]:
            out[f"{name}.{key}"] = torch.cat([p[2][key] for p in pieces])
        out[f"{name}.step"] = pieces[0][3]
    return out


def same(a: dict[str, Any], b: dict[str, Any]) -> bool:
    if a.keys() != b.keys():
        return False
    for key, value in a.items():
        if isinstance(value, torch.Tensor):
            if not torch.equal(value, b[key]):
                return False
        elif value != b[key]:
            return False
    return True


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--out", required=True)
    parser.add_argument("--samples", type=int, default=23)
    parser.add_argument("--batch", type=int, default=2)
    parser.add_argument("--epochs", type=int, default=2)
    parser.add_argument("--commit", type=int, default=2)
    parser.add_argument("--die", action="append", default=[])
    parser.add_argument("--slots", default="")
    args = parser.parse_args()
    me = os.environ.get("DATAPARALLEL_ELASTIC_WORKER", "")
    dies_after = dict(die.split(":") for die in args.die)

    dp.initialize()
    model = make_model()
    for block in (model[0], model[2]):
        dp.torch.fully_shard(block)
    dp.torch.fully_shard(model)
    opt = torch.optim.Adam(model.parameters(), lr=LR)
    sampler = dp.elastic.ElasticSampler(range(args.samples), shuffle=True, seed=5)
    state = dp.elastic.TorchState(
        model, opt, sampler=sampler, epoch=0, steps=0, history=[], checks=[]
    )
    commits = 0
    committed: dict[str, Any] = {}
    rediscovered = False

    def commit() -> None:
        nonlocal commits, rediscovered
        try:
            state.commit()
        except dp.elastic.HostsUpdatedInterrupt:  # committed all the same, on every rank
            committed.update(size=dp.size(), whole=whole(model, opt))
            raise
        commits += 1
        committed.update(size=dp.size(), whole=whole(model, opt))
        if args.slots and not rediscovered and me == "w0":
            path, k, line = args.slots.split(":", 2)
            if commits >= int(k):
                rediscovered = True
                with open(path, "w") as file:
                    file.write(line + "\n")
                from dataparallel.config import Settings
                from dataparallel.elastic import rounds

                joined = rounds.current()
                assert joined is not None
                store = rounds.connect(Settings.from_env())
                store.wait([rounds.round_key(joined.generation + 1)])

    @dp.elastic.run
    def train(state: dp.elastic.TorchState) -> None:
        now = whole(model, opt)  # collective: every rank, a newcomer too
        reformed = "whole" in committed and committed["size"] != dp.size()
        verdict = same(now, committed["whole"]) if reformed and dp.rank() == 0 else None
        verdict = dp.broadcast_object(verdict)  # a newcomer has committed nothing to compare
        if verdict is not None:
            state.checks.append(verdict)
        while state.epoch < args.epochs:
            s = state.sampler
            for b in range(s.steps(args.batch)):
                every = s.global_indices(b, args.batch)
                mine = s.get_indices(b, args.batch)
                opt.zero_grad()
                (loss_of(model, mine) * (dp.size() / max(len(every), 1))).backward()
                if me in dies_after and commits >= int(dies_after[me]):
                    os.kill(os.getpid(), signal.SIGKILL)
                opt.step()
                state.history.append([state.epoch, dp.size(), list(every)])
                s.record_batch(b, args.batch)
                state.steps += 1
                if state.steps % args.commit == 0:
                    commit()
            state.epoch += 1
            s.set_epoch(state.epoch)
            commit()

    train(state)
    if dp.rank() == 0:
        final = whole(model, opt)
    else:
        whole(model, opt)
    if dp.rank() == 0:
        params = {k: final[k].tolist() for k in model.parameter_shards()}
        out = {
            "params": params,
            "history": state.history,
            "size": dp.size(),
            "checks": state.checks,
        }
        with open(args.out + ".part", "w") as file:
            json.dump(out, file)
        os.replace(args.out + ".part", args.out)


if __name__ == "__main__":
    main()

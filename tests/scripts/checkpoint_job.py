"""A job that trains a small model under ZeRO and saves or loads sharded checkpoints, in turn.

    checkpoint_job.py MODE FOLDER PATH [MODE FOLDER PATH ...] [--stage S] [--die-rank R]

Each MODE FOLDER PATH is one step, taken in order in the same processes, each with a model and
an optimizer of its own: one job checks several checkpoints (a job's start costs seconds).
`save` trains two steps, writes FOLDER with `dp.checkpoint.save`, and rank 0 writes PATH: the
consolidated state (`torch.save`), what any later job must find in FOLDER bit for bit. With
`--die-rank R`, the job's last step, a `save`, then saves into FOLDER again, and rank R is killed
(SIGKILL) while writing its shards: the folder is left as a job that died midway leaves it. `load`
builds the same model at its own world size, loads FOLDER, and rank 0 writes the consolidated
state it got to PATH; `load-plain` loads a plain torch program's checkpoint (no sampler).
`zero-resume PREVIOUS SAVED` is `zero_resume.resume` (a chain of ZeRO runs that each load what a
world of another size saved, train on and save: PREVIOUS "-" starts it). `optax-save`,
`optax-load` and `optax-resume` are `optax_checkpoint.act`'s `save`, `load` and `resume`, for
optax's sharded state (JAX is imported only for them).
"""

from __future__ import annotations

import argparse
import os
import signal
from typing import Any

import torch
from torch import nn

import dataparallel as dp

MODES = ("save", "load", "load-plain", "zero-resume", "optax-save", "optax-load", "optax-resume")


def make_model() -> nn.Module:
    torch.manual_seed(0)  # odd sizes: ZeRO's slices cut rows
    return nn.Sequential(nn.Linear(5, 7), nn.ReLU(), nn.Linear(7, 3))


def consolidated(
    model: nn.Module, opt: dp.torch.ZeroRedundancyOptimizer, state: dict[str, Any]
) -> dict[str, Any]:
    opt.consolidate_state_dict(to=0)
    if dp.rank() != 0:
        return {}
    return {
        "model": model.state_dict(),
        "optim": opt.state_dict(),
        "step": state["step"],
        **({"sampler": state["sampler"].state_dict()} if "sampler" in state else {}),
    }


def step(mode: str, folder: str, path: str, stage: int, die_rank: int | None) -> None:
    """Take one step (see the module docstring) with a model and an optimizer of its own."""
    if mode == "zero-resume":
        from zero_resume import resume

        resume(folder, path)
        return
    if mode.startswith("optax-"):
        from optax_checkpoint import act

        act(mode.removeprefix("optax-"), folder, path)
        return
    model = make_model()
    opt = dp.torch.ZeroRedundancyOptimizer(
        model.parameters(), torch.optim.Adam, stage=stage, bucket_bytes=64, lr=0.01
    )
    sampler = dp.elastic.ElasticSampler(list(range(10)), seed=1)
    state = {"model": model, "optim": opt, "step": 0, "sampler": sampler}
    if mode == "load-plain":
        del state["sampler"]
    if mode == "save":
        for number in range(2):
            g = torch.Generator().manual_seed(100 * number + dp.rank())
            x = torch.randn(4, 5, generator=g)
            model(x).pow(2).sum().backward()
            opt.step()
            opt.zero_grad()
        state["step"] = 2
        sampler.record_batch(0, 2)
        dp.checkpoint.save(state, folder)
        ref = consolidated(model, opt, state)
        if dp.rank() == 0:
            torch.save(ref, path)
        if die_rank is not None:
            from torch.distributed.checkpoint import FileSystemWriter

            write = FileSystemWriter.write_data

            def dying(self: FileSystemWriter, plan: Any, planner: Any) -> Any:
                if dp.rank() == die_rank:
                    with open(os.path.join(folder, f"__{dp.rank()}_0.distcp"), "wb") as f:
                        f.write(b"half")
                        f.flush()
                    os.kill(os.getpid(), signal.SIGKILL)
                return write(self, plan, planner)

            FileSystemWriter.write_data = dying  # type: ignore[method-assign,assignment]
            dp.checkpoint.save(state, folder)
    else:
        state = dict(dp.checkpoint.load(state, folder))
        out = consolidated(model, opt, state)
        if dp.rank() == 0:
            torch.save(out, path)


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("steps", nargs="+", metavar="MODE FOLDER PATH")
    parser.add_argument("--stage", type=int, default=2)
    parser.add_argument("--die-rank", type=int, default=None)
    parser.add_argument("--plain", action="store_true", help="every load: a plain torch program's")
    args = parser.parse_args()
    if len(args.steps) % 3:
        parser.error("steps come in threes: MODE FOLDER PATH")
    steps = [args.steps[i : i + 3] for i in range(0, len(args.steps), 3)]
    for mode, _, _ in steps:
        if mode not in MODES:
            parser.error(f"{mode!r} is not one of {', '.join(MODES)}")
    if args.die_rank is not None and steps[-1][0] != "save":
        parser.error("--die-rank kills a rank in the last step, a save")
    dp.initialize()
    for number, (mode, folder, path) in enumerate(steps, 1):
        if args.plain and mode == "load":
            mode = "load-plain"
        step(mode, folder, path, args.stage, args.die_rank if number == len(steps) else None)
    dp.finalize()


if __name__ == "__main__":
    main()

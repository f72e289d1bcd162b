"""A job that trains a small model under ZeRO and saves or loads a sharded checkpoint.

    checkpoint_job.py save FOLDER REF [--stage S] [--die-rank R]
    checkpoint_job.py load FOLDER OUT [--stage S] [--plain]

`save` trains two steps, writes FOLDER with `dp.checkpoint.save`, and rank 0 writes REF: the
consolidated state (`torch.save`), what any later job must find in FOLDER bit for bit. With
`--die-rank R` it then saves into FOLDER again, and rank R is killed (SIGKILL) while writing its
shards: the folder is left as a job that died midway leaves it. `load` builds the same model at
its own world size, loads FOLDER, and rank 0 writes the consolidated state it got to OUT.
"""

from __future__ import annotations

import argparse
import os
import signal
from typing import Any

import torch
from torch import nn

import dataparallel as dp


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


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("mode", choices=["save", "load"])
    parser.add_argument("folder")
    parser.add_argument("out")
    parser.add_argument("--stage", type=int, default=2)
    parser.add_argument("--die-rank", type=int, default=None)
    parser.add_argument("--plain", action="store_true", help="load a plain torch program's")
    args = parser.parse_args()
    dp.initialize()
    model = make_model()
    opt = dp.torch.ZeroRedundancyOptimizer(
        model.parameters(), torch.optim.Adam, stage=args.stage, bucket_bytes=64, lr=0.01
    )
    sampler = dp.elastic.ElasticSampler(list(range(10)), seed=1)
    state = {"model": model, "optim": opt, "step": 0, "sampler": sampler}
    if args.plain:
        del state["sampler"]
    if args.mode == "save":
        for step in range(2):
            g = torch.Generator().manual_seed(100 * step + dp.rank())
            x = torch.randn(4, 5, generator=g)
            model(x).pow(2).sum().backward()
            opt.step()
            opt.zero_grad()
        state["step"] = 2
        sampler.record_batch(0, 2)
        dp.checkpoint.save(state, args.folder)
        ref = consolidated(model, opt, state)
        if dp.rank() == 0:
            torch.save(ref, args.out)
        if args.die_rank is not None:
            from torch.distributed.checkpoint import FileSystemWriter

            write = FileSystemWriter.write_data

            def dying(self: FileSystemWriter, plan: Any, planner: Any) -> Any:
                if dp.rank() == args.die_rank:
                    with open(os.path.join(args.folder, f"__{dp.rank()}_0.distcp"), "wb") as f:
                        f.write(b"half")
                        f.flush()
                    os.kill(os.getpid(), signal.SIGKILL)
                return write(self, plan, planner)

            FileSystemWriter.write_data = dying  # type: ignore[method-assign,assignment]
            dp.checkpoint.save(state, args.folder)
    else:
        state = dict(dp.checkpoint.load(state, args.folder))
        out = consolidated(model, opt, state)
        if dp.rank() == 0:
            torch.save(out, args.out)
    dp.finalize()


if __name__ == "__main__":
    main()

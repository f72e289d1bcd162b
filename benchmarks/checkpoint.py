"""How long `dp.checkpoint.async_save` blocks the program, against a synchronous save of the
same state, in the same processes.

Run: `OMP_NUM_THREADS=1 .venv/bin/dataparallel run -n 3 --backend gloo benchmarks/checkpoint.py`
(or MPI, without `--backend`). The state: an MLP of `--params` float32 parameters (default
50 M: 200 MB) under `dp.torch.ZeroRedundancyOptimizer(stage=2)` with Adam after one step (each
rank holds a third of the 400 MB of Adam state), the step and a sampler. Each round saves it
synchronously into one folder, then with `async_save` into another and waits for the result;
both are timed on every rank and the slowest rank counts, as it holds the job. Printed: the
median of each; how long until `async_save` had copied the parameters and the optimizer's state
(it copies them on its thread; an optimizer step taken at once waits until then: the blocking
of a save that copies everything before it returns); the async save's whole write; and the
ratio async blocking / synchronous save (the goal: at most 0.10).
"""

from __future__ import annotations

import argparse
import shutil
import statistics
import tempfile
import time
from pathlib import Path

import torch
from torch import nn

import dataparallel as dp


def mlp(params: int) -> nn.Module:
    width = 2048
    layers = max(1, round(params / (width * width + width)))
    torch.manual_seed(0)
    return nn.Sequential(*[nn.Linear(width, width) for _ in range(layers)])


def slowest(seconds: float) -> float:
    return max(dp.allgather_object(seconds))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--params", type=float, default=50e6, help="parameters (float32)")
    parser.add_argument("--rounds", type=int, default=4)
    parser.add_argument("--folder", default=None, help="where to write (default: a temp folder)")
    args = parser.parse_args()
    dp.initialize()
    model = mlp(int(args.params))
    n = sum(p.numel() for p in model.parameters())
    opt = dp.torch.ZeroRedundancyOptimizer(model.parameters(), torch.optim.Adam, stage=2, lr=1e-4)
    model(torch.randn(8, 2048)).sum().backward()
    opt.step()
    state = {"model": model, "optim": opt, "step": 1}
    base = args.folder or (tempfile.mkdtemp(prefix="dp-ckpt-bench-") if dp.rank() == 0 else None)
    root = Path(dp.broadcast_object(base))
    sync, blocking, copied, whole = [], [], [], []
    for r in range(args.rounds):
        dp.barrier()
        t = time.perf_counter()
        dp.checkpoint.save(state, root / f"sync{r}")
        sync.append(slowest(time.perf_counter() - t))
        dp.barrier()
        t = time.perf_counter()
        future = dp.checkpoint.async_save(state, root / f"async{r}")
        blocking.append(slowest(time.perf_counter() - t))
        future.staged()
        copied.append(slowest(time.perf_counter() - t))
        future.result()
        whole.append(slowest(time.perf_counter() - t))
        dp.barrier()
        if dp.rank() == 0:
            for kind in ("sync", "async"):
                shutil.rmtree(root / f"{kind}{r}", ignore_errors=True)
    if dp.rank() == 0:
        if args.folder is None:
            shutil.rmtree(root, ignore_errors=True)
        s, b, c, w = (statistics.median(x) for x in (sync, blocking, copied, whole))
        print(
            f"{dp.size()} ranks ({type(dp.get_backend()).__name__}), {n / 1e6:.1f} M parameters "
            f"+ Adam state, ZeRO stage 2, {args.rounds} rounds (median, slowest rank):"
        )
        print(f"  synchronous save           {s * 1e3:9.1f} ms")
        print(f"  async_save, blocking       {b * 1e3:9.1f} ms")
        print(f"  async_save, until copied   {c * 1e3:9.1f} ms")
        print(f"  async_save, until written  {w * 1e3:9.1f} ms")
        print(f"  ratio async blocking / synchronous save: {b / s:.3f} (goal <= 0.10)")
        print(f"  ratio until copied / synchronous save:   {c / s:.3f} (a step taken at once)")
    dp.finalize()


if __name__ == "__main__":
    main()

"""`dp.torch.DataParallelModel`'s gradient reduction in each of its ways, beside DDP (issue 21).

Run: `OMP_NUM_THREADS=1 .venv/bin/dataparallel run -n 3 --backend gloo benchmarks/gradsync_modes.py`
(or under MPI). The model is benchmarks/zero.py's MLP (1.59 M float32 parameters), Adam, 32
samples per rank. Cases, each on its own copy, in the same processes:

- `after backward, 256 KiB` / `after backward, 25 MiB`: every bucket launched at the end of
  backward (256 KiB: the size MPI keeps; 25 MiB: DDP's, what Gloo now takes);
- `thread, 1 MiB`: buckets handed to the communication thread during backward (an eighth of the
  model, at least 1 MiB);
- `after backward, 25 MiB, blocking handshake`: the step's handshake made before the first bucket
  (as before issue 21) instead of begun at the first gradient (Gloo only: MPI always blocks);
- `torch DDP (gloo)` (the reference) and `one process` (no communication).

The mode and the handshake are set on each copy's `GradientSync` (private attributes: this is a
probe of the engine's choices, not an API; the handshake's after the first step, whose rebuild
plans it again). Rounds take the cases in turn, each a batch of
`--steps` steps timed as the slowest rank's; printed: per case, the median over rounds of its
batch time over DDP's batch time in the same round, and the medians of forward, backward and
`step()` (each rank's median, the largest over ranks).
"""

from __future__ import annotations

import argparse
import copy
import statistics
import time
from typing import Any

import torch
from torch import nn
from train_step import init_gloo
from zero import batch, mlp

import dataparallel as dp

KiB, MiB = 1 << 10, 1 << 20
DDP = "torch DDP (gloo)"
BLOCKING = "after backward, 25 MiB, blocking handshake"
# name: (on the communication thread, bucket bytes)
MODES = {
    "after backward, 256 KiB": (False, 256 * KiB),
    "after backward, 25 MiB": (False, 25 * MiB),
    "thread, 1 MiB": (True, MiB),
    BLOCKING: (False, 25 * MiB),
}


def forced(base: nn.Module, thread: bool, size: int) -> nn.Module:
    """A `DataParallelModel` whose reduction keeps the given mode and bucket size."""
    model = dp.torch.DataParallelModel(copy.deepcopy(base), bucket_bytes=size)
    sync: Any = model.gradient_sync
    sync._modes.trial = None
    sync._switch(thread)
    sync._clear()
    return model


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rounds", type=int, default=30)
    parser.add_argument("--steps", type=int, default=5, help="timed steps per case per round")
    args = parser.parse_args()
    torch.set_num_threads(1)
    dp.initialize()
    init_gloo()
    base = mlp()
    models: dict[str, nn.Module] = {n: forced(base, *m) for n, m in MODES.items()}
    models[DDP] = nn.parallel.DistributedDataParallel(copy.deepcopy(base))
    models["one process"] = copy.deepcopy(base)
    opts = {n: torch.optim.Adam(m.parameters(), lr=1e-3) for n, m in models.items()}
    x, y = batch(0, 32)
    loss_fn = nn.CrossEntropyLoss()
    phases: dict[str, list[tuple[float, float, float]]] = {n: [] for n in models}
    rounds: dict[str, list[float]] = {n: [] for n in models}

    def step(name: str) -> tuple[float, float, float]:
        start = time.perf_counter()
        opts[name].zero_grad()
        loss = loss_fn(models[name](x), y)
        forward = time.perf_counter()
        loss.backward()
        backward = time.perf_counter()
        opts[name].step()
        return forward - start, backward - forward, time.perf_counter() - backward

    for name in models:  # the first step rebuilds the buckets
        step(name)
    sync: Any = models[BLOCKING].gradient_sync  # type: ignore[union-attr]
    sync._begins_early = False
    for _ in range(args.rounds):
        for name in models:
            dp.barrier()
            start = time.perf_counter()
            for _ in range(args.steps):
                phases[name].append(step(name))
            rounds[name].append(float(dp.allreduce(time.perf_counter() - start, op="max")))
    mine = {n: [statistics.median(p) for p in zip(*v, strict=True)] for n, v in phases.items()}
    every = dp.allgather_object(mine)
    if not dp.is_main():
        return
    print(f"{dp.size()} ranks, engine {dp.get_backend().name}, {args.rounds} rounds")
    print(f"{'case':44} {'vs DDP':>7} {'forward':>8} {'backward':>9} {'step()':>8}")
    for name in models:
        ratio = statistics.median(a / b for a, b in zip(rounds[name], rounds[DDP], strict=True))
        f, b, s = (1e3 * max(r[name][i] for r in every) for i in range(3))  # type: ignore[index]
        print(f"{name:44} {ratio:7.2f} {f:6.2f}ms {b:7.2f}ms {s:6.2f}ms")


if __name__ == "__main__":
    main()

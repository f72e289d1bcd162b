"""A Lightning training step: `DataParallelStrategy` against `strategy="ddp"`, same processes.

Run: `dataparallel run -n 2 benchmarks/lightning_strategy.py` (MPI; `--backend gloo` for Gloo),
or `mpiexec -n 2 python benchmarks/lightning_strategy.py`.

The model is an MLP of about 2.4 M parameters (`--width`, `--depth`), SGD, `--batch` samples per
rank. Each round fits it once per case, the order rotating every round, with
`Trainer(max_steps=--steps)`; a callback times every batch from `on_train_batch_start` to
`on_train_batch_end` (forward, backward, the gradient reduction, the optimizer's step and
Lightning's own work around them), and a fit's step time is the median of its batches after the
first `--skip`, the slowest rank's. Cases:

- `one process`: `SingleDeviceStrategy`, each rank fitting alone (no communication: the floor);
- `DataParallelStrategy`: this library's (`dp.torch.DataParallelModel` under Lightning);
- `strategy="ddp"`: torch's `DistributedDataParallel` over torch's Gloo group (which
  `dp.initialize()` made, and Lightning's DDP finds).

A case's overhead in a round is its step time minus that round's one-process time. Printed: each
case's median step time and median overhead over rounds, and the ratios `DataParallelStrategy /
ddp` of both (below 1: this library's strategy is faster).
"""

from __future__ import annotations

import argparse
import statistics
import time
from typing import Any

import pytorch_lightning as pl
import torch
from pytorch_lightning.strategies import SingleDeviceStrategy
from torch import nn

import dataparallel as dp
from dataparallel.lightning import DataParallelStrategy


class Timer(pl.Callback):
    """Each batch's time, start to end of Lightning's batch hooks."""

    def __init__(self) -> None:
        self.times: list[float] = []
        self._start = 0.0

    def on_train_batch_start(self, *args: Any) -> None:
        self._start = time.perf_counter()

    def on_train_batch_end(self, *args: Any) -> None:
        self.times.append(time.perf_counter() - self._start)


class MLP(pl.LightningModule):
    def __init__(self, width: int, depth: int) -> None:
        super().__init__()
        layers: list[nn.Module] = [nn.Linear(256, width), nn.ReLU()]
        for _ in range(depth - 1):
            layers += [nn.Linear(width, width), nn.ReLU()]
        self.net = nn.Sequential(*layers, nn.Linear(width, 10))

    def training_step(self, batch: list[torch.Tensor], index: int) -> torch.Tensor:
        x, y = batch
        return nn.functional.cross_entropy(self.net(x), y)

    def configure_optimizers(self) -> torch.optim.Optimizer:
        return torch.optim.SGD(self.parameters(), lr=0.01)


def step_time(case: str, args: argparse.Namespace) -> float:
    """Fit once with `case`'s strategy; return the slowest rank's median batch time."""
    strategies: dict[str, Any] = {
        "one process": SingleDeviceStrategy(device=torch.device("cpu")),
        "DataParallelStrategy": DataParallelStrategy(),
        'strategy="ddp"': "ddp",
    }
    timer = Timer()
    # Lightning's DDP checks devices x nodes against the launcher's world.
    ddp = {"devices": dp.local_size(), "num_nodes": dp.size() // dp.local_size()}
    trainer = pl.Trainer(
        strategy=strategies[case],
        accelerator="cpu",
        **(ddp if case == 'strategy="ddp"' else {"devices": 1}),
        max_steps=args.steps,
        callbacks=[timer],
        logger=False,
        enable_progress_bar=False,
        enable_model_summary=False,
        enable_checkpointing=False,
        use_distributed_sampler=False,  # the same batches for every case
    )
    torch.manual_seed(0)
    rows = args.steps * args.batch
    data = torch.utils.data.TensorDataset(torch.randn(rows, 256), torch.randint(0, 10, (rows,)))
    trainer.fit(MLP(args.width, args.depth), torch.utils.data.DataLoader(data, args.batch))
    mine = statistics.median(timer.times[args.skip :])
    return float(dp.allreduce(torch.tensor(mine, dtype=torch.float64), op="max"))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rounds", type=int, default=6)
    parser.add_argument("--steps", type=int, default=40)
    parser.add_argument("--skip", type=int, default=5, help="first batches left out of a fit")
    parser.add_argument("--batch", type=int, default=32)
    parser.add_argument("--width", type=int, default=1024)
    parser.add_argument("--depth", type=int, default=3)
    args = parser.parse_args()
    torch.set_num_threads(1)
    dp.initialize()
    cases = ["one process", "DataParallelStrategy", 'strategy="ddp"']
    times: dict[str, list[float]] = {case: [] for case in cases}
    overheads: dict[str, list[float]] = {case: [] for case in cases[1:]}
    for r in range(args.rounds):
        order = cases[1:] if r % 2 == 0 else cases[:0:-1]
        this_round = {case: step_time(case, args) for case in ["one process", *order]}
        for case, t in this_round.items():
            times[case].append(t)
        for case in cases[1:]:
            overheads[case].append(this_round[case] - this_round["one process"])
    if dp.rank() != 0:
        return
    params = sum(p.numel() for p in MLP(args.width, args.depth).parameters())
    print(
        f"Lightning step, {dp.size()} ranks, engine {dp.get_backend().name}, MLP "
        f"{params / 1e6:.2f} M parameters, batch {args.batch}, {args.rounds} rounds of "
        f"{args.steps} steps (median of steps {args.skip + 1}..{args.steps}, slowest rank)"
    )
    print(f"{'case':<22} {'step ms':>9} {'overhead ms':>12}")
    for case in cases:
        step = statistics.median(times[case]) * 1e3
        over = statistics.median(overheads[case]) * 1e3 if case in overheads else 0.0
        print(f"{case:<22} {step:9.2f} {over:12.2f}")
    ours, ddp = "DataParallelStrategy", 'strategy="ddp"'
    step_ratio = statistics.median(times[ours]) / statistics.median(times[ddp])
    over_ratio = statistics.median(overheads[ours]) / statistics.median(overheads[ddp])
    print(f"ratio DataParallelStrategy / ddp: step {step_ratio:.2f}, overhead {over_ratio:.2f}")


if __name__ == "__main__":
    main()

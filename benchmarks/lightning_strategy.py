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

A case's overhead in a round is its step time minus that round's one-process time; its CPU
overhead, the CPU time of a batch (every thread of every rank, summed over the ranks: on a
machine with fewer cores than ranks and their threads, what a step costs) minus the
one-process case's. Printed: each case's median step time, overhead, CPU and CPU overhead over
rounds, and the ratios `DataParallelStrategy / ddp` of the step, the overhead and the CPU
overhead (below 1: this library's strategy is faster, or cheaper).

`--before FILE` (another commit's `src/dataparallel/arrays/fusion.py`) adds a case
`DataParallelStrategy, --before`: the same strategy whose buckets that file's `Fusion` packs and
unpacks, taken in turn with the others, and prints the overhead ratio after / before: a change to
the bucket path measured before and after in the same processes.

`--without FEATURES` (repeatable; a comma-separated list of `views`, `sleeps`) adds a case
`DataParallelStrategy without FEATURES`: the same strategy with those features of the gradient
reduction turned off, in turn with the others, and prints its overhead against the full
strategy's. `views`: the gradients of a packed bucket are copied out of it instead of becoming
views of it; `sleeps`: MPICH's waits only yield (`MPIR_CVAR_ENABLE_HEAVY_YIELD=0`, MPICH's
default) where the world made them sleep (`DATAPARALLEL_MPI_SLEEP=1` makes them sleep in the
other cases where the machine would not).
"""

from __future__ import annotations

import argparse
import contextlib
import importlib.util
import inspect
import statistics
import sys
import time
from typing import Any

import pytorch_lightning as pl
import torch
from pytorch_lightning.strategies import SingleDeviceStrategy
from torch import nn

import dataparallel as dp
import dataparallel.torch._gradsync as gradsync
from dataparallel.lightning import DataParallelStrategy

OURS, DDP, BEFORE = "DataParallelStrategy", 'strategy="ddp"', "DataParallelStrategy, --before"
WITHOUT = "DataParallelStrategy without "
FEATURES = ("views", "sleeps")


class Timer(pl.Callback):
    """Each batch's time, start to end of Lightning's batch hooks, and the CPU time the process
    spent meanwhile (every thread: Gloo's own included)."""

    def __init__(self) -> None:
        self.times: list[float] = []
        self.cpu: list[float] = []
        self._start = self._cpu = 0.0

    def on_train_batch_start(self, *args: Any) -> None:
        self._start, self._cpu = time.perf_counter(), time.process_time()

    def on_train_batch_end(self, *args: Any) -> None:
        self.times.append(time.perf_counter() - self._start)
        self.cpu.append(time.process_time() - self._cpu)


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


def fusion_of(path: str) -> type:
    """The `Fusion` class of another commit's `arrays/fusion.py` at `path`."""
    spec = importlib.util.spec_from_file_location("fusion_before", path)
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module  # its dataclasses look their module up there
    spec.loader.exec_module(module)
    fusion: type = module.Fusion
    if "deliver" in inspect.signature(fusion.add_leaf).parameters:
        return fusion

    class Before(fusion):  # type: ignore[misc, valid-type]
        """A `Fusion` from before results were handed over as views: it copies them back."""

        def add_leaf(self, *args: Any, deliver: Any = None, **kwargs: Any) -> None:
            super().add_leaf(*args, **kwargs)

    return Before


def step_time(
    case: str, args: argparse.Namespace, before: type | None = None
) -> tuple[float, float]:
    """Fit once with `case`'s strategy; return the slowest rank's median batch time and the
    mean CPU time of a batch summed over the ranks."""
    strategies: dict[str, Any] = {
        "one process": SingleDeviceStrategy(device=torch.device("cpu")),
        OURS: DataParallelStrategy(),
        BEFORE: DataParallelStrategy(),
        DDP: "ddp",
    }
    if case.startswith(WITHOUT):
        strategies[case] = DataParallelStrategy()
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
    with contextlib.ExitStack() as stack:
        if case == BEFORE:  # the reducer made in this fit packs with the other commit's Fusion
            stack.enter_context(_swapped(gradsync, "Fusion", before))
        off = case.removeprefix(WITHOUT).split(",") if case.startswith(WITHOUT) else []
        if "views" in off:
            stack.enter_context(_swapped(gradsync, "_all_alone", lambda ts: False))
        if "sleeps" in off:
            stack.enter_context(_yielding())
        trainer.fit(MLP(args.width, args.depth), torch.utils.data.DataLoader(data, args.batch))
    mine = statistics.median(timer.times[args.skip :])
    cpu = statistics.mean(timer.cpu[args.skip :])
    slowest = float(dp.allreduce(torch.tensor(mine, dtype=torch.float64), op="max"))
    return slowest, float(dp.allreduce(torch.tensor(cpu, dtype=torch.float64)))


@contextlib.contextmanager
def _swapped(module: Any, name: str, value: Any) -> Any:
    kept = getattr(module, name)
    setattr(module, name, value)
    try:
        yield
    finally:
        setattr(module, name, kept)


@contextlib.contextmanager
def _yielding() -> Any:
    """MPICH's waits only yield meanwhile, as its default is (the world may make them sleep)."""
    from mpi4py import MPI

    from dataparallel.backends.mpi.backend import SLEEP_VARIABLE
    from dataparallel.backends.mpi.library import control

    kept = control(MPI, SLEEP_VARIABLE, 0)
    try:
        yield
    finally:
        if kept is not None:
            control(MPI, SLEEP_VARIABLE, kept)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rounds", type=int, default=6)
    parser.add_argument("--steps", type=int, default=40)
    parser.add_argument("--skip", type=int, default=5, help="first batches left out of a fit")
    parser.add_argument("--batch", type=int, default=32)
    parser.add_argument("--width", type=int, default=1024)
    parser.add_argument("--depth", type=int, default=3)
    parser.add_argument(
        "--before",
        metavar="FILE",
        help="another commit's fusion.py (src/dataparallel/arrays/fusion.py), for a "
        "before/after of the bucket path in the same run",
    )
    parser.add_argument(
        "--without",
        action="append",
        default=[],
        metavar="FEATURES",
        help=f"a case with these features off (comma-separated: {', '.join(FEATURES)})",
    )
    args = parser.parse_args()
    for features in args.without:
        unknown = set(features.split(",")) - set(FEATURES)
        if unknown:
            parser.error(f"--without {features}: no feature {sorted(unknown)}; of {FEATURES}")
    before = fusion_of(args.before) if args.before else None
    torch.set_num_threads(1)
    dp.initialize()
    withouts = [WITHOUT + features for features in args.without]
    cases = ["one process", OURS, DDP, *([BEFORE] if before else []), *withouts]
    times: dict[str, list[float]] = {case: [] for case in cases}
    cpus: dict[str, list[float]] = {case: [] for case in cases}
    overheads: dict[str, list[float]] = {case: [] for case in cases[1:]}
    cpu_over: dict[str, list[float]] = {case: [] for case in cases[1:]}
    for r in range(args.rounds):
        order = cases[1:] if r % 2 == 0 else cases[:0:-1]
        this_round = {case: step_time(case, args, before) for case in ["one process", *order]}
        for case, (t, cpu) in this_round.items():
            times[case].append(t)
            cpus[case].append(cpu)
        for case in cases[1:]:
            overheads[case].append(this_round[case][0] - this_round["one process"][0])
            cpu_over[case].append(this_round[case][1] - this_round["one process"][1])
    if dp.rank() != 0:
        return
    params = sum(p.numel() for p in MLP(args.width, args.depth).parameters())
    print(
        f"Lightning step, {dp.size()} ranks, engine {dp.get_backend().name}, MLP "
        f"{params / 1e6:.2f} M parameters, batch {args.batch}, {args.rounds} rounds of "
        f"{args.steps} steps (median of steps {args.skip + 1}..{args.steps}, slowest rank)"
    )
    print(f"{'case':<44} {'step ms':>9} {'overhead ms':>12} {'CPU ms':>8} {'CPU overhead':>13}")
    for case in cases:
        step = statistics.median(times[case]) * 1e3
        over = statistics.median(overheads[case]) * 1e3 if case in overheads else 0.0
        cpu = statistics.median(cpus[case]) * 1e3
        cpu_above = statistics.median(cpu_over[case]) * 1e3 if case in cpu_over else 0.0
        print(f"{case:<44} {step:9.2f} {over:12.2f} {cpu:8.2f} {cpu_above:13.2f}")
    step_ratio = statistics.median(times[OURS]) / statistics.median(times[DDP])
    over_ratio = statistics.median(overheads[OURS]) / statistics.median(overheads[DDP])
    print(f"ratio DataParallelStrategy / ddp: step {step_ratio:.2f}, overhead {over_ratio:.2f}")
    cpu_ratio = statistics.median(cpu_over[OURS]) / statistics.median(cpu_over[DDP])
    print(f"ratio DataParallelStrategy / ddp: CPU overhead {cpu_ratio:.2f}")
    if before:
        after = statistics.median(overheads[OURS]) / statistics.median(overheads[BEFORE])
        print(f"ratio after / before (overhead): {after:.3f}")
        over_ratio = statistics.median(overheads[BEFORE]) / statistics.median(overheads[DDP])
        print(f"ratio --before / ddp: overhead {over_ratio:.2f}")
    for case in withouts:
        theirs = statistics.median(overheads[case])
        after = statistics.median(overheads[OURS]) / theirs
        print(f"ratio with / {case[len(OURS) + 1 :]} (overhead): {after:.3f}")
        to_ddp = theirs / statistics.median(overheads[DDP])
        print(f"ratio {case[len(OURS) + 1 :]} / ddp: overhead {to_ddp:.2f}")


if __name__ == "__main__":
    main()

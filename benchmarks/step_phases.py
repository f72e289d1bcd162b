"""Where a training step's communication time goes: forward, backward, step, hooks and waits.

Run (Horovod's venv, as `train_step.py`):
`OMP_NUM_THREADS=1 mpiexec -n 2 python benchmarks/step_phases.py --d 512`

For each case of `train_step.py` (one process, dp.DistributedOptimizer, dp.torch.DataParallelModel,
Horovod, DDP over Gloo) it times every phase of each step on every rank: `forward`, `backward`
(for dp: including the gradient hooks and the end-of-pass callback), `step` (`optimizer.step()`:
for dp and Horovod, waiting for the reduction, then Adam). For dataparallel it also wraps, from the
outside (nothing in `src/` changes), the engine's entry points to split the backward and step time:
- `hooks`: total time inside `GradientSync.on_grad` and the end-of-pass callback,
- `wait in bwd` / `wait in step`: time blocked in an MPI request's `wait()` (MAX_IN_FLIGHT makes a
  hook wait for the previous bucket before launching the next),
- `pack+unpack`: copies into and out of fusion buffers, plus scaling by 1/size,
- `launched in bwd`: the share of the step's communication calls started before `backward()`
  returned, and `done in bwd`: the share that had also completed by then.
`--hvd-idle` keeps Horovod initialized during every case, as the reference numbers in the peers
README were taken (an idle Horovod keeps a core busy; see `train_step.py`).
Medians over `--steps` steps per case in each of `--rounds` interleaved rounds; one line per rank.
"""

from __future__ import annotations

import argparse
import contextlib
import copy
import statistics
import time
from collections import defaultdict
from collections.abc import Callable, Iterator
from typing import Any

import torch
import torch.distributed as dist
from torch import nn
from train_step import VOCAB, Horovod, init_gloo, transformer

import dataparallel as dp
from dataparallel.arrays import fusion
from dataparallel.backends.mpi.backend import MPIHandle
from dataparallel.torch import _gradsync

PHASE = ["idle"]
STATS: dict[str, float] = defaultdict(float)


def timed_method(cls: Any, name: str, key: str) -> None:
    """Accumulate the time spent in `cls.name` into STATS[key + phase]."""
    original = getattr(cls, name)

    def wrapper(*args: Any, **kwargs: Any) -> Any:
        start = time.perf_counter()
        try:
            return original(*args, **kwargs)
        finally:
            STATS[f"{key} {PHASE[0]}"] += time.perf_counter() - start

    setattr(cls, name, wrapper)


def instrument() -> None:
    timed_method(_gradsync.GradientSync, "on_grad", "hooks")
    timed_method(_gradsync.GradientSync, "_end_of_pass", "hooks")
    timed_method(MPIHandle, "wait", "wait")
    timed_method(fusion.Fusion, "_pack", "pack")
    timed_method(fusion.Fusion, "_land", "land")
    start = fusion.Fusion._start
    land = fusion.Fusion._land

    def counted_start(self: Any, flight: Any) -> None:
        STATS[f"calls {PHASE[0]}"] += 1
        start(self, flight)

    def counted_land(self: Any, flight: Any) -> None:
        land(self, flight)
        STATS[f"landed {PHASE[0]}"] += 1

    fusion.Fusion._start = counted_start  # type: ignore[method-assign]
    fusion.Fusion._land = counted_land  # type: ignore[method-assign]


@contextlib.contextmanager
def phase(name: str, times: dict[str, float]) -> Iterator[None]:
    PHASE[0] = name
    start = time.perf_counter()
    try:
        yield
    finally:
        times[name] = time.perf_counter() - start
        PHASE[0] = "idle"


def stepper(model: nn.Module, opt: torch.optim.Optimizer, x: torch.Tensor, y: torch.Tensor) -> Any:
    loss_fn = nn.CrossEntropyLoss()

    def step() -> dict[str, float]:
        times: dict[str, float] = {}
        STATS.clear()
        opt.zero_grad()
        with phase("fwd", times):
            out = model(x)
            loss = loss_fn(out.reshape(-1, VOCAB), y.reshape(-1))
        with phase("bwd", times):
            loss.backward()
        with phase("step", times):
            opt.step()
        times.update(STATS)
        return times

    return step


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--d", type=int, default=512)
    parser.add_argument("--batch", type=int, default=8)
    parser.add_argument("--seq", type=int, default=32)
    parser.add_argument("--steps", type=int, default=5)
    parser.add_argument("--rounds", type=int, default=4)
    parser.add_argument("--hvd-idle", action="store_true")
    args = parser.parse_args()
    torch.set_num_threads(1)
    dp.initialize()
    init_gloo()
    instrument()
    horovod = Horovod()
    g = torch.Generator().manual_seed(dp.rank())
    tokens = torch.randint(0, VOCAB, (args.batch, args.seq + 1), generator=g)
    x, y = tokens[:, :-1], tokens[:, 1:]
    base = transformer(args.d)

    def adam(m: nn.Module) -> torch.optim.Optimizer:
        return torch.optim.Adam(m.parameters(), lr=1e-4)

    models = {name: copy.deepcopy(base) for name in ("alone", "dpopt", "hvd")}
    wrapped = dp.torch.DataParallelModel(copy.deepcopy(base))
    ddp = nn.parallel.DistributedDataParallel(copy.deepcopy(base))
    cases: dict[str, Callable[[], dict[str, float]]] = {
        "one process": stepper(models["alone"], adam(models["alone"]), x, y),
        "dp.DistributedOptimizer": stepper(
            models["dpopt"], dp.DistributedOptimizer(adam(models["dpopt"])), x, y
        ),
        "dp.DataParallelModel": stepper(wrapped, adam(wrapped), x, y),
        "torch DDP (gloo)": stepper(ddp, adam(ddp), x, y),
    }
    contexts: dict[str, Any] = {}
    if horovod.hvd is not None:
        theirs = models["hvd"]
        with horovod:
            opt = horovod.hvd.DistributedOptimizer(
                adam(theirs), named_parameters=theirs.named_parameters()
            )
        cases["Horovod"] = stepper(theirs, opt, x, y)
        contexts["Horovod"] = horovod
    if args.hvd_idle and horovod.hvd is not None:
        horovod.hvd.init()
        contexts = {}
    records: dict[str, list[dict[str, float]]] = defaultdict(list)
    for _ in range(args.rounds):
        for name, step in cases.items():
            with contexts.get(name) or contextlib.nullcontext():
                for _ in range(2):
                    step()
                dp.barrier()
                for _ in range(args.steps):
                    records[name].append(step())
    if args.hvd_idle and horovod.hvd is not None:
        horovod.hvd.shutdown()
    lines = [summarize(name, rows) for name, rows in records.items()]
    gathered = dp.allgather_object(lines)
    if dp.is_main():
        n = sum(p.numel() for p in base.parameters())
        print(
            f"d={args.d} ({n / 1e6:.2f} M params), {args.batch}x{args.seq} tokens, "
            f"{dp.size()} ranks, medians over {args.rounds}x{args.steps} steps, ms"
            + (", Horovod initialized throughout" if args.hvd_idle else "")
        )
        print(
            f"{'case':24} {'rank':>4} {'total':>7} {'fwd':>7} {'bwd':>7} {'step':>7} "
            f"{'hooks':>7} {'wait bwd':>8} {'wait st':>8} {'pack+un':>8} {'calls':>6} "
            f"{'launched in bwd':>15} {'done in bwd':>11}"
        )
        for i in range(len(cases)):
            for rank, rank_lines in enumerate(gathered):
                print(rank_lines[i].replace("RANK", f"{rank:4}"))
    dist.destroy_process_group()
    dp.finalize()


def summarize(name: str, rows: list[dict[str, float]]) -> str:
    def med(*keys: str) -> float:
        return statistics.median(sum(row.get(k, 0.0) for k in keys) for row in rows) * 1e3

    calls = statistics.median(
        sum(row.get(f"calls {p}", 0) for p in ("bwd", "step")) for row in rows
    )
    launched = statistics.median(row.get("calls bwd", 0) / max(calls, 1) for row in rows)
    done = statistics.median(row.get("landed bwd", 0) / max(calls, 1) for row in rows)
    total = med("fwd", "bwd", "step")
    pack = med("pack bwd", "pack step", "land bwd", "land step") - med("wait bwd", "wait step")
    return (
        f"{name:24} RANK {total:7.1f} {med('fwd'):7.1f} {med('bwd'):7.1f} {med('step'):7.1f} "
        f"{med('hooks bwd'):7.1f} {med('wait bwd'):8.1f} {med('wait step'):8.1f} {pack:8.1f} "
        f"{calls:6.0f} {launched:15.0%} {done:11.0%}"
    )


if __name__ == "__main__":
    main()

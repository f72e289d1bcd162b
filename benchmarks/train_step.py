"""Training step time of one MLP under dataparallel, under PyTorch DDP, and in one process.

Run: `OMP_NUM_THREADS=1 .venv/bin/mpiexec -n 2 .venv/bin/python benchmarks/train_step.py`

The model is an MLP of about 3.2 M parameters (12.6 MiB of float32 gradients), big enough for
communication to matter. A step is `zero_grad`, forward, loss, backward and an SGD step on a batch
of `--batch` samples per rank. Every case runs in the same processes, side by side, in rounds
(each round times every case once, in turn), so that drift in the machine's load hits them alike:

- `one process`: each rank trains its own copy with no communication (the floor);
- `dp.DistributedOptimizer`: reduction in buckets from gradient hooks, overlapped with backward,
  over MPI;
- `dp.torch.DataParallelModel`: the same reduction, finished at the end of backward;
- `dp.allreduce_gradients`: one fused allreduce after backward (no overlap);
- `torch DDP (gloo)`: `torch.nn.parallel.DistributedDataParallel` over a Gloo group created in
  the same processes (port chosen by rank 0, broadcast through dp), with DDP's default buckets.

Each case's time is the median over rounds of (the slowest rank's time for `--steps` steps) /
`--steps`. The last column is DDP's time divided by each case's (above 1: faster than DDP).
"""

from __future__ import annotations

import argparse
import copy
import socket
import statistics
import time
from collections.abc import Callable

import torch
import torch.distributed as dist
from torch import nn

import dataparallel as dp


def make_model(width: int, depth: int) -> nn.Sequential:
    torch.manual_seed(0)
    layers: list[nn.Module] = [nn.Linear(256, width), nn.ReLU()]
    for _ in range(depth):
        layers += [nn.Linear(width, width), nn.ReLU()]
    layers.append(nn.Linear(width, 10))
    return nn.Sequential(*layers)


def init_gloo() -> None:
    port = None
    if dp.rank() == 0:
        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))
            port = s.getsockname()[1]
    port = dp.broadcast_object(port)
    dist.init_process_group(
        "gloo", init_method=f"tcp://127.0.0.1:{port}", rank=dp.rank(), world_size=dp.size()
    )


Step = Callable[[], None]


def trainer(model: nn.Module, opt: torch.optim.Optimizer, x: torch.Tensor, y: torch.Tensor) -> Step:
    loss_fn = nn.CrossEntropyLoss()

    def step() -> None:
        opt.zero_grad()
        loss_fn(model(x), y).backward()
        opt.step()

    return step


def after_backward(model: nn.Module, x: torch.Tensor, y: torch.Tensor, lr: float) -> Step:
    opt = torch.optim.SGD(model.parameters(), lr=lr)
    loss_fn = nn.CrossEntropyLoss()

    def step() -> None:
        opt.zero_grad()
        loss_fn(model(x), y).backward()
        dp.allreduce_gradients([p.grad for p in model.parameters()])
        opt.step()

    return step


def timed(step: Step, steps: int) -> float:
    """Return the slowest rank's seconds per step over `steps` steps."""
    dp.barrier()
    start = time.perf_counter()
    for _ in range(steps):
        step()
    elapsed = (time.perf_counter() - start) / steps
    return float(dp.allreduce(elapsed, op="max"))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--width", type=int, default=1024)
    parser.add_argument("--depth", type=int, default=3, help="hidden width x width layers")
    parser.add_argument("--batch", type=int, default=64, help="samples per rank per step")
    parser.add_argument("--steps", type=int, default=10, help="steps per timing")
    parser.add_argument("--rounds", type=int, default=7)
    args = parser.parse_args()

    dp.initialize()
    init_gloo()
    lr = 0.01
    base = make_model(args.width, args.depth)
    n_params = sum(p.numel() for p in base.parameters())
    g = torch.Generator().manual_seed(dp.rank())
    x = torch.randn(args.batch, 256, generator=g)
    y = torch.randint(0, 10, (args.batch,), generator=g)

    def sgd(m: nn.Module) -> torch.optim.Optimizer:
        return torch.optim.SGD(m.parameters(), lr=lr)

    single = copy.deepcopy(base)
    ours = copy.deepcopy(base)
    wrapped = dp.torch.DataParallelModel(copy.deepcopy(base))
    plain = copy.deepcopy(base)
    ddp = nn.parallel.DistributedDataParallel(copy.deepcopy(base))
    cases: dict[str, Step] = {
        "one process (no communication)": trainer(single, sgd(single), x, y),
        "dp.DistributedOptimizer (MPI)": trainer(ours, dp.DistributedOptimizer(sgd(ours)), x, y),
        "dp.torch.DataParallelModel (MPI)": trainer(wrapped, sgd(wrapped), x, y),
        "dp.allreduce_gradients after backward": after_backward(plain, x, y, lr),
        "torch DDP (gloo)": trainer(ddp, sgd(ddp), x, y),
    }
    for step in cases.values():  # warm up: first-step allocations, bucket rebuilds
        for _ in range(3):
            step()
    samples: dict[str, list[float]] = {name: [] for name in cases}
    for _ in range(args.rounds):
        for name, step in cases.items():
            samples[name].append(timed(step, args.steps))
    times = {name: statistics.median(values) for name, values in samples.items()}

    if dp.is_main():
        ddp_time = times["torch DDP (gloo)"]
        mib = n_params * 4 / 2**20
        print(
            f"MLP of {n_params / 1e6:.2f} M parameters ({mib:.1f} MiB of gradients), batch "
            f"{args.batch} per rank, {dp.size()} ranks, torch threads {torch.get_num_threads()}"
        )
        print(f"{'case':40} {'step':>10} {'DDP time / this':>16}")
        for name, seconds in times.items():
            print(f"{name:40} {seconds * 1e3:7.2f} ms {ddp_time / seconds:15.2f}x")
    dist.destroy_process_group()
    dp.finalize()


if __name__ == "__main__":
    main()

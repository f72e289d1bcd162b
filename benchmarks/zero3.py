"""Fully sharded parameters: `dp.torch.fully_shard` beside torch's FSDP2, ZeRO-2 and unsharded.

Run: `OMP_NUM_THREADS=1 .venv/bin/dataparallel run -n 3 --backend gloo benchmarks/zero3.py`
(or MPI without `--backend`). One process per rank, one torch thread each.

Model: `--layers` blocks of `Linear(W, W) + ReLU` (W = `--width`) between a stem and a head,
float32: 50.9 M parameters by default (12 blocks of 2048). Adam, `--batch` samples per rank.
Cases, in the same processes, each on its own copy of the model:

- `unsharded`: `dp.DistributedOptimizer(Adam)`, every rank holds everything: the reference;
- `ZeRO stage 2`: `dp.torch.ZeroRedundancyOptimizer(stage=2)`;
- `dp fully_shard`: `dp.torch.fully_shard` on each block, then on the model (ZeRO stage 3);
- `torch FSDP2`: `torch.distributed.fsdp.fully_shard` the same way, over torch's Gloo group.

Printed, per case: the step time (median over rounds in which the cases take turns, each the
largest over the ranks), its ratio to unsharded and to FSDP2; the bytes of parameters, gradients
and optimizer state a rank holds between steps (the largest rank's, counted from the live
tensors), and the peak memory of a step: the largest growth of the process's resident memory
over what it held before the case was made (sampled every 0.2 ms by a thread during two steps,
each case measured alone, in a second round: the first pays for what is allocated once; large
allocations are mmapped, glibc's `M_MMAP_THRESHOLD` fixed at 64 KiB, so that freed memory
leaves the resident set at once and the samples follow what is live). Last, the largest
difference of `dp fully_shard`'s and ZeRO stage 2's parameters from unsharded's after the same
steps from the same start.
"""

from __future__ import annotations

import argparse
import copy
import ctypes
import ctypes.util
import gc
import os
import statistics
import threading
import time
from collections.abc import Callable

import torch
from torch import nn
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.fsdp import fully_shard as torch_fully_shard
from train_step import init_gloo

import dataparallel as dp

Step = Callable[[], None]
UNSHARDED = "unsharded (dp.DistributedOptimizer)"
STAGE2 = "ZeRO stage 2"
STAGE3 = "dp fully_shard (ZeRO stage 3)"
FSDP2 = "torch FSDP2 fully_shard"
CASES = (UNSHARDED, STAGE2, STAGE3, FSDP2)
PAGE = os.sysconf("SC_PAGE_SIZE")


class Net(nn.Module):
    def __init__(self, width: int, layers: int) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.stem = nn.Linear(256, width)
        self.blocks = nn.ModuleList(
            nn.Sequential(nn.Linear(width, width), nn.ReLU()) for _ in range(layers)
        )
        self.head = nn.Linear(width, 10)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = torch.relu(self.stem(x))
        for block in self.blocks:
            h = block(h)
        return self.head(h)


def batch(step: int, size: int) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(1000 * step + dp.rank())
    return torch.randn(size, 256, generator=g), torch.randint(0, 10, (size,), generator=g)


def make(name: str, base: Net, lr: float) -> tuple[nn.Module, torch.optim.Optimizer]:
    model = copy.deepcopy(base)
    if name == UNSHARDED:
        return model, dp.DistributedOptimizer(torch.optim.Adam(model.parameters(), lr=lr))
    if name == STAGE2:
        return model, dp.torch.ZeroRedundancyOptimizer(
            model.parameters(), torch.optim.Adam, stage=2, lr=lr
        )
    if name == STAGE3:
        for block in model.blocks:
            dp.torch.fully_shard(block)
        dp.torch.fully_shard(model)
        return model, torch.optim.Adam(model.parameters(), lr=lr)
    mesh = init_device_mesh("cpu", (dp.size(),))
    for block in model.blocks:
        torch_fully_shard(block, mesh=mesh)
    torch_fully_shard(model, mesh=mesh)
    return model, torch.optim.Adam(model.parameters(), lr=lr)


def trainer(model: nn.Module, opt: torch.optim.Optimizer, size: int, step: int = 0) -> Step:
    loss_fn = nn.CrossEntropyLoss()
    at = [step]

    def run() -> None:
        x, y = batch(at[0], size)
        at[0] += 1
        opt.zero_grad()
        loss_fn(model(x), y).backward()
        opt.step()

    return run


def local(t: torch.Tensor) -> torch.Tensor:
    to_local = getattr(t, "to_local", None)  # FSDP2's DTensors: this rank's shard
    return to_local() if to_local is not None else t


def held_bytes(model: nn.Module, opt: torch.optim.Optimizer) -> int:
    """Bytes of parameters, gradients and optimizer state this rank holds (unique storages)."""
    storages: dict[int, int] = {}

    def count(t: torch.Tensor | None) -> None:
        if t is not None:
            t = local(t)
            storages[t.untyped_storage().data_ptr()] = t.untyped_storage().nbytes()

    for p in model.parameters():
        count(p)
        count(p.grad)
    if isinstance(opt, dp.torch.ZeroRedundancyOptimizer):
        extra = opt.gradient_bytes
        inner = opt.optim
    else:
        extra, inner = 0, opt
    for state in inner.state.values():
        for v in state.values():
            if isinstance(v, torch.Tensor) and v.dim():
                count(v)
    return sum(storages.values()) + extra


def resident() -> int:
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * PAGE


class PeakSampler:
    """The largest resident set seen by a thread sampling it while the block runs."""

    def __init__(self) -> None:
        self.peak = 0
        self._stop = threading.Event()

    def _run(self) -> None:
        while not self._stop.is_set():
            self.peak = max(self.peak, resident())
            time.sleep(0.0002)

    def __enter__(self) -> PeakSampler:
        self.peak = resident()
        self._thread = threading.Thread(target=self._run, daemon=True)
        self._thread.start()
        return self

    def __exit__(self, *_: object) -> None:
        self._stop.set()
        self._thread.join()
        self.peak = max(self.peak, resident())


def measure(
    name: str, base: Net, args: argparse.Namespace
) -> tuple[int, int, list[torch.Tensor] | None]:
    """Make case `name` alone, run `--steps` steps; return its held bytes between steps, the
    peak growth of the resident set over two steps, and the whole parameters (unsharded and
    dp fully_shard: every rank's rows, by `parameter_shards()`) for the parity check."""
    gc.collect()
    dp.barrier()
    before = resident()
    model, opt = make(name, base, 1e-3)
    step = trainer(model, opt, args.batch)
    for _ in range(args.steps - 2):
        step()
    with PeakSampler() as sampler:
        for _ in range(2):
            step()
    held = held_bytes(model, opt)
    final = None
    if name in (UNSHARDED, STAGE2):
        final = [p.detach().clone() for p in model.parameters()]
    elif name == STAGE3:
        shards = model.parameter_shards()  # type: ignore[operator]
        mine = {n: (s.offsets, s.param.detach().clone()) for n, s in shards.items()}
        every = dp.allgather_object(mine)
        final = []
        for n, p in base.named_parameters():
            whole = torch.empty_like(p)
            for theirs in every:
                offsets, part = theirs[n]
                if part.numel():
                    whole[offsets[0] : offsets[0] + len(part)] = part
            final.append(whole)
    del model, opt, step
    gc.collect()
    return held, sampler.peak - before, final


def timed(steps: dict[str, Step], rounds: int) -> dict[str, float]:
    """Median seconds per step of each case, the cases taking turns, each the ranks' largest."""
    samples: dict[str, list[float]] = {name: [] for name in steps}
    for _ in range(rounds):
        for name, step in steps.items():
            dp.barrier()
            start = time.perf_counter()
            step()
            samples[name].append(float(dp.allreduce(time.perf_counter() - start, op="max")))
    return {name: statistics.median(v) for name, v in samples.items()}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--width", type=int, default=2048)
    parser.add_argument("--layers", type=int, default=12)
    parser.add_argument("--batch", type=int, default=8, help="samples per rank (default 8)")
    parser.add_argument("--steps", type=int, default=4, help="steps per case, memory phase")
    parser.add_argument("--rounds", type=int, default=6, help="timed steps per case")
    parser.add_argument("--cases", nargs="*", default=list(CASES), choices=CASES)
    args = parser.parse_args()
    # glibc's M_MMAP_THRESHOLD, fixed (not raised as large blocks are freed): see the docstring.
    ctypes.CDLL(ctypes.util.find_library("c")).mallopt(-3, 64 * 1024)
    torch.set_num_threads(1)
    dp.initialize()
    init_gloo()  # FSDP2's case needs torch's default group
    base = Net(args.width, args.layers)
    n = sum(p.numel() for p in base.parameters())
    layer = max(p.numel() for p in base.parameters()) * 4 + 4 * args.width

    memory: dict[str, tuple[int, int]] = {}
    finals: dict[str, list[torch.Tensor] | None] = {}
    for name in [*args.cases, *args.cases]:  # the first round pays for first-time allocations
        held, peak, final = measure(name, base, args)
        memory[name] = (
            max(dp.allgather_object(held)),
            max(dp.allgather_object(peak)),
        )
        finals[name] = final
    parity = {}
    want = finals.get(UNSHARDED)
    for name in (STAGE2, STAGE3):
        got = finals.get(name)
        if got is not None and want is not None:
            parity[name] = max(float((a - b).abs().max()) for a, b in zip(got, want, strict=True))
    finals.clear()

    made = {name: make(name, base, 1e-3) for name in args.cases}
    steps = {name: trainer(model, opt, args.batch) for name, (model, opt) in made.items()}
    for step in steps.values():
        step()  # state made, buckets and orders settled
        step()
    times = timed(steps, args.rounds)
    if not dp.is_main():
        return
    size, engine = dp.size(), dp.get_backend().name
    print(
        f"{size} ranks, engine {engine}, {n / 1e6:.1f} M float32 parameters "
        f"({args.layers} blocks of {args.width}), Adam, batch {args.batch}/rank, "
        f"torch {torch.__version__}"
    )
    head = ("step ms", "/unsharded", "/FSDP2", "held MB", "/unsharded", "peak MB", "/unsharded")
    print(f"{'case':34}" + "".join(f"{h:>12}" for h in head))
    ref_t = times.get(UNSHARDED)
    ref_f = times.get(FSDP2)
    ref_h, ref_p = memory.get(UNSHARDED, (0, 0))
    for name in args.cases:
        held, peak = memory[name]
        t = times[name]
        cells = [
            f"{t * 1e3:.0f}",
            f"{t / ref_t:.2f}" if ref_t else "-",
            f"{t / ref_f:.2f}" if ref_f else "-",
            f"{held / 1e6:.0f}",
            f"{held / ref_h:.3f}" if ref_h else "-",
            f"{peak / 1e6:.0f}",
            f"{peak / ref_p:.3f}" if ref_p else "-",
        ]
        print(f"{name:34}" + "".join(f"{c:>12}" for c in cells))
    if ref_h:
        goal = ref_h / size + layer
        print(
            f"goal for held bytes: unsharded / N + one layer = {goal / 1e6:.0f} MB "
            f"(+5%: {1.05 * goal / 1e6:.0f} MB)"
        )
    for name, diff in parity.items():
        print(f"{name}: max |param - unsharded| after {args.steps} Adam steps = {diff:.2e}")


if __name__ == "__main__":
    main()

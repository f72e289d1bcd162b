"""GPU arrays through dp beside what a user writes by hand, and a GPU training step beside DDP.

Run on a machine with a GPU (ranks may share it: staging through pinned host memory):
`OMP_NUM_THREADS=1 mpiexec -n 2 python benchmarks/gpu.py` (MPI; the `mpich` wheel is not
CUDA-aware, so dp stages each bucket once through pinned memory), or `python benchmarks/gpu.py
--backend nccl` for a world of one on NCCL (buffers stay on the GPU).

Rows (each the median of batches taken in turn, `_timing.compare`; every case ends synchronized):
- a ResNet-50-shaped gradient tree (161 CUDA tensors, 25.6 M floats), sum:
  - `raw per tensor`: per tensor `t.cpu()`, `comm.Allreduce`, `t.copy_(host)`, as an mpi4py user
    writes it for CUDA tensors;
  - `raw packed`: `torch.cat` on the GPU, one copy into a pinned buffer made once, one Allreduce,
    one copy back, the slices copied into the tensors (the best hand-written staging);
  - `dp.allreduce`: the tree as it is; `dp, 256 KiB`: with the host bucket size for device
    buckets too (what dp did before device buckets took DDP's 25 MiB).
- the same tree as CuPy arrays: raw packed (CuPy) against `dp.allreduce`, when CuPy is there.
- a training step (transformer, Adam, on the GPU): one process, `dp.torch.DataParallelModel`,
  `dp.DistributedOptimizer` (also with 256 KiB buckets), torch DDP on a Gloo group (`--d`;
  skipped with `--no-step`).
"""

from __future__ import annotations

import argparse
import copy
import dataclasses
from collections.abc import Callable

import numpy as np
import torch
from _timing import compare
from collectives import resnet50_shapes
from mpi4py import MPI
from torch import nn
from train_step import Horovod, cases_for, init_gloo, measure, report, trainer, transformer

import dataparallel as dp
from dataparallel.world import current

SMALL = 256 << 10  # the host bucket size, which device buckets used before


def synchronized(fn: Callable[[], object]) -> Callable[[], None]:
    def once() -> None:
        fn()
        torch.cuda.synchronize()

    return once


def tree_rows(comm: MPI.Comm, device: torch.device) -> None:
    tree = [torch.ones(s, device=device) for s in resnet50_shapes()]
    flat = torch.empty(sum(t.numel() for t in tree), device=device)
    host = torch.empty(flat.numel(), pin_memory=True)

    def per_tensor() -> None:
        for t in tree:
            h = t.cpu()
            comm.Allreduce(MPI.IN_PLACE, h.numpy(), MPI.SUM)
            t.copy_(h)

    def packed() -> None:
        torch.cat([t.view(-1) for t in tree], out=flat)
        host.copy_(flat)
        comm.Allreduce(MPI.IN_PLACE, host.numpy(), MPI.SUM)
        flat.copy_(host)
        parts = flat.split([t.numel() for t in tree])
        torch._foreach_copy_(tree, [p.view(t.shape) for p, t in zip(parts, tree, strict=True)])

    world = current()
    usual, small = world.settings, dataclasses.replace(world.settings, thread_bucket_bytes=SMALL)

    def small_buckets() -> None:  # what dp did before device buckets took DDP's size
        world.settings = small
        try:
            dp.allreduce(tree)
        finally:
            world.settings = usual

    cases = {
        "raw per tensor": per_tensor,
        "raw packed": packed,
        "dp.allreduce": lambda: dp.allreduce(tree),
        "dp, 256 KiB": small_buckets,
    }
    times = compare({k: synchronized(v) for k, v in cases.items()}, comm, batches=15)
    if dp.is_main():
        best = min(times["raw per tensor"], times["raw packed"])
        print(f"\nResNet-50 tree, 161 CUDA tensors, 25.6 M float32, sum ({dp.size()} ranks)")
        for name, t in times.items():
            print(f"  {name:16s} {t * 1e3:8.2f} ms")
        print(f"  dp / best raw = {times['dp.allreduce'] / best:.2f}")


def cupy_rows(comm: MPI.Comm) -> None:
    try:
        import cupy
    except ImportError as e:
        if dp.is_main():
            print(f"\nCuPy rows skipped: {e}")
        return
    tree = [cupy.ones(s, cupy.float32) for s in resnet50_shapes()]
    sizes = [a.size for a in tree]
    host = cupy.cuda.alloc_pinned_memory(4 * sum(sizes))

    staged = np.frombuffer(host, np.float32, sum(sizes))

    def packed() -> None:
        flat = cupy.concatenate([a.ravel() for a in tree])
        flat.get(out=staged)
        comm.Allreduce(MPI.IN_PLACE, staged, MPI.SUM)
        flat.set(staged)
        offset = 0
        for a in tree:
            a.ravel()[...] = flat[offset : offset + a.size]
            offset += a.size
        cupy.cuda.get_current_stream().synchronize()

    def ours() -> None:
        dp.allreduce(tree)
        cupy.cuda.get_current_stream().synchronize()

    times = compare({"raw packed": packed, "dp.allreduce": ours}, comm, batches=15)
    if dp.is_main():
        print(f"\nResNet-50 tree as CuPy arrays, sum ({dp.size()} ranks)")
        for name, t in times.items():
            print(f"  {name:16s} {t * 1e3:8.2f} ms")
        print(f"  dp / raw packed = {times['dp.allreduce'] / times['raw packed']:.2f}")


def adam(m: nn.Module) -> torch.optim.Optimizer:
    return torch.optim.Adam(m.parameters(), lr=1e-4)


def step_rows(device: torch.device, widths: list[int], rounds: int) -> None:
    init_gloo()
    g = torch.Generator().manual_seed(dp.rank())
    tokens = torch.randint(0, 1000, (16, 129), generator=g).to(device)
    batch = (tokens[:, :-1], tokens[:, 1:])
    for d in widths:
        base = transformer(d).to(device)
        n = sum(p.numel() for p in base.parameters())
        cases = cases_for(base, adam, batch, Horovod())
        small = copy.deepcopy(base)
        opt = dp.DistributedOptimizer(adam(small), bucket_bytes=SMALL)
        cases["dp.DistributedOptimizer, 256 KiB buckets"] = (trainer(small, opt, batch), None)
        timed = {name: (synchronized(step), ctx) for name, (step, ctx) in cases.items()}
        samples = measure(timed, rounds, budget=0.3, tolerance=0.15)
        if dp.is_main():
            report(
                f"GPU transformer d={d}, {n / 1e6:.1f} M parameters, Adam, 16x128 tokens", samples
            )


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--backend", default="auto")
    parser.add_argument("--d", default="512,1024", help="transformer widths for the step rows")
    parser.add_argument("--rounds", type=int, default=8)
    parser.add_argument("--no-step", action="store_true")
    args = parser.parse_args()
    torch.set_num_threads(1)
    dp.initialize(args.backend)
    index = dp.device()
    if index is None or not torch.cuda.is_available():
        raise SystemExit("benchmarks/gpu.py needs a CUDA device")
    device = torch.device("cuda", index)
    comm = MPI.COMM_WORLD
    if dp.is_main():
        print(
            f"{dp.size()} ranks on {torch.cuda.get_device_name(index)}, backend "
            f"{dp.get_backend().name}, torch {torch.__version__}"
        )
    tree_rows(comm, device)
    cupy_rows(comm)
    if not args.no_step:
        step_rows(device, [int(v) for v in args.d.split(",")], args.rounds)
    dp.finalize()


if __name__ == "__main__":
    main()

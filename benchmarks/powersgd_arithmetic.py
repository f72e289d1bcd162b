"""PowerSGD's arithmetic on one rank: what a compressed step costs the cores, without the wire.

Run: `OMP_NUM_THREADS=1 .venv/bin/python benchmarks/powersgd_arithmetic.py [--d 256,512]
[--ranks 1,2,4] [--before REF] [--gbit 1]` (one process, no engine: a world of one).

Three tables, each case against its reference in the same run, interleaved, in thread CPU time
(the machine's other work inflates wall time, not the time this thread runs):

- the budget: per width and rank, what the compressed step computes (the flops of its four
  products, the bytes its eight passes over the matrices move) beside what this core does in a
  second (measured here: a square product's flops, a copy's bytes), the phases' measured time,
  and what the link carries (fp16's whole gradient against PowerSGD's factors and uncompressed
  tensors, in float32) at `--gbit`: whether the arithmetic is bound by flops or by memory, and
  how it weighs against the link time it saves;

- `LowRank`'s three phases (`torch/_powersgd.py`: the `P`s with the residuals added, the
  orthonormalization and the `Q`s, then the gradients and the residuals) over the gradients of
  `train_step.transformer(d)`'s matrices, one bucket, fresh gradients every step (as backward
  leaves them), against the same phases in the `LowRank` of git revision `--before`
  (`network.low_rank_before`), when given;
- the orthonormalization of those `P`s, shape by shape: one batched QR per shape (today's),
  a QR per matrix, and torch's Gram-Schmidt (`powerSGD_hook._orthogonalize_gram_schmidt`, what
  its hook runs at rank 1 and 2).
"""

from __future__ import annotations

import argparse
import itertools
import statistics
import sys
import time
from collections.abc import Callable
from pathlib import Path

import torch

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))

import dataparallel as dp  # noqa: E402
from dataparallel.torch._powersgd import LowRank  # noqa: E402


def cpu_ms(step: Callable[[], float], times: int) -> list[float]:
    return [step() * 1e3 for _ in range(times)]


def phases(d: int, rank: int, arithmetic: type) -> Callable[[], float]:
    """One compressed step's phases of `arithmetic` (a `LowRank`) on `transformer(d)`'s
    gradients: returns its thread CPU seconds (the fresh gradients not counted)."""
    from train_step import transformer

    model = transformer(d)
    params = list(model.named_parameters())
    bucket = list(range(len(params)))[::-1]
    low = LowRank(dp.Compression.powersgd(rank=rank, start_iter=0))
    low.__class__ = arithmetic
    low.lay_out(params, [bucket])
    members = [i for i in bucket if i in low.matrices]
    g = torch.Generator().manual_seed(0)

    def step() -> float:
        for _, p in params:
            p.grad = torch.randn(p.shape, generator=g)
        began = time.thread_time()
        low.first(0, members, params, set(members))
        low.second(0)
        low.finish(0)
        low.discard()
        return time.thread_time() - began

    return step


def orthonormalizations(d: int, rank: int) -> dict[str, Callable[[], float]]:
    """The `P`s of `transformer(d)`'s matrices at `rank`, orthonormalized three ways."""
    from torch.distributed.algorithms.ddp_comm_hooks.powerSGD_hook import (
        _orthogonalize_gram_schmidt,
    )
    from train_step import transformer

    from dataparallel.torch._powersgd import _orthonormalize

    model = transformer(d)
    params = list(model.named_parameters())
    low = LowRank(dp.Compression.powersgd(rank=rank, start_iter=0))
    low.lay_out(params, [list(range(len(params)))])
    shapes = [(rows, r) for rows, r in map(low._shape, low.ordered(list(low.matrices)))]
    groups = [(shape, len(list(same))) for shape, same in itertools.groupby(shapes)]
    stacks = [torch.randn(k, r, rows) for (rows, r), k in groups]

    def timed(work: Callable[[], None]) -> Callable[[], float]:
        def step() -> float:
            began = time.thread_time()
            work()
            return time.thread_time() - began

        return step

    def batched() -> None:
        for stack in stacks:
            _orthonormalize(stack.clone())

    def each() -> None:
        for stack in stacks:
            for one in stack.clone():
                _orthonormalize(one.unsqueeze(0))

    def gram_schmidt() -> None:  # torch's layout: k x rows x rank
        for stack in stacks:
            _orthogonalize_gram_schmidt(stack.transpose(1, 2).contiguous())

    return {
        "batched QR per shape": timed(batched),
        "QR per matrix": timed(each),
        "Gram-Schmidt per shape (torch's)": timed(gram_schmidt),
    }


def core_rates() -> tuple[float, float]:
    """This core's float32 GFLOP/s (a 1024 x 1024 product) and its memory GB/s (a 64 MiB
    copy: read and write), medians of thread CPU time."""
    a, b, c = (torch.randn(1024, 1024) for _ in range(3))
    big, out = torch.randn(16 * 2**20), torch.empty(16 * 2**20)

    def product() -> float:
        began = time.thread_time()
        torch.matmul(a, b, out=c)
        return time.thread_time() - began

    def copy() -> float:
        began = time.thread_time()
        out.copy_(big)
        return time.thread_time() - began

    for step in (product, copy):
        step()
    flops = 2 * 1024**3 / statistics.median(step() for step in [product] * 20)
    moved = 2 * big.numel() * 4 / statistics.median(step() for step in [copy] * 20)
    return flops / 1e9, moved / 1e9


def budget(d: int, rank: int, gbit: float) -> dict[str, float]:
    """What a compressed step of `transformer(d)` at `rank` computes and sends (2 ranks: each
    sends about its buffer once, as a ring or recursive doubling does): compressed values,
    flops of `P = M Q`, `Q = M^T P`, the residual `M - P Q^T` and the gradient `P Q^T` (2 per
    value and rank each, and the residual's add), bytes of the eight matrix-sized passes
    (residual added: 3, the two products: 1 each, residual formed: 2, gradient written: 1),
    and the link's milliseconds for fp16's buffer and for PowerSGD's."""
    from train_step import transformer

    params = list(transformer(d).named_parameters())
    low = LowRank(dp.Compression.powersgd(rank=rank, start_iter=0))
    low.lay_out(params, [list(range(len(params)))])
    total = sum(p.numel() for _, p in params)
    compressed = sum(m.rows * m.cols for m in low.matrices.values())
    factors = sum((m.rows + m.cols) * m.rank for m in low.matrices.values())
    values = compressed * rank  # per value and rank: the four products' multiply-adds
    fp16_bytes, psgd_bytes = 2 * total, 4 * (factors + total - compressed)
    return {
        "compressed": compressed,
        "flops": 8 * values + 2 * compressed,
        "bytes": 8 * 4 * compressed,
        "fp16 bytes": fp16_bytes,
        "psgd bytes": psgd_bytes,
        "fp16 ms": fp16_bytes * 8 / (gbit * 1e9) * 1e3,
        "psgd ms": psgd_bytes * 8 / (gbit * 1e9) * 1e3,
    }


def compare(cases: dict[str, Callable[[], float]], steps: int) -> dict[str, float]:
    """Median thread CPU ms of each case, the cases interleaved step by step."""
    for step in cases.values():
        for _ in range(3):
            step()
    samples: dict[str, list[float]] = {name: [] for name in cases}
    for _ in range(steps):
        for name, step in cases.items():
            samples[name].append(step() * 1e3)
    return {name: statistics.median(values) for name, values in samples.items()}


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--d", default="256,512", help="transformer widths")
    parser.add_argument("--ranks", default="1,2,4", help="PowerSGD ranks")
    parser.add_argument("--before", default="", help="also time LowRank of this git revision")
    parser.add_argument("--steps", type=int, default=30, help="timed steps per case")
    parser.add_argument("--gbit", type=float, default=1.0, help="the link's rate (budget)")
    args = parser.parse_args()
    torch.set_num_threads(1)
    from network import low_rank_before

    gflops, gbps = core_rates()
    print(f"this core: {gflops:.1f} GFLOP/s (float32 product), {gbps:.1f} GB/s (copy)\n")
    print(
        f"| D | rank | compressed values | MFLOP | at {gflops:.0f} GFLOP/s | MB moved "
        f"| at {gbps:.1f} GB/s | phases (ms CPU) | link at {args.gbit:g} Gbit/s: fp16 "
        "| PowerSGD | saved |"
    )
    print("| --- " * 11 + "|")
    for d in (int(v) for v in args.d.split(",")):
        for rank in (int(v) for v in args.ranks.split(",")):
            b = budget(d, rank, args.gbit)
            measured = compare({"today": phases(d, rank, LowRank)}, args.steps)["today"]
            print(
                f"| {d} | {rank} | {b['compressed'] / 1e6:.2f} M | {b['flops'] / 1e6:.0f} "
                f"| {b['flops'] / gflops / 1e6:.1f} ms | {b['bytes'] / 1e6:.0f} "
                f"| {b['bytes'] / gbps / 1e6:.1f} ms | {measured:.1f} "
                f"| {b['fp16 bytes'] / 1e6:.2f} MB, {b['fp16 ms']:.1f} ms "
                f"| {b['psgd bytes'] / 1e6:.3f} MB, {b['psgd ms']:.2f} ms "
                f"| {b['fp16 ms'] - b['psgd ms']:.1f} ms |",
                flush=True,
            )
    print()

    before = low_rank_before(args.before) if args.before else None
    print("| D | rank | phases (ms CPU) | " + (f"{args.before}'s | ratio |" if before else ""))
    print("| --- | --- | --- |" + (" --- | --- |" if before else ""))
    for d in (int(v) for v in args.d.split(",")):
        for rank in (int(v) for v in args.ranks.split(",")):
            cases = {"today": phases(d, rank, LowRank)}
            if before is not None:
                cases["before"] = phases(d, rank, before)
            med = compare(cases, args.steps)
            row = f"| {d} | {rank} | {med['today']:.2f} |"
            if before is not None:
                row += f" {med['before']:.2f} | {med['today'] / med['before']:.2f}x |"
            print(row, flush=True)
    print("\n| D | rank | " + " | ".join(orthonormalizations(256, 1)) + " | (ms CPU a step)")
    print("| --- | --- |" + " --- |" * 3)
    for d in (int(v) for v in args.d.split(",")):
        for rank in (int(v) for v in args.ranks.split(",")):
            med = compare(orthonormalizations(d, rank), args.steps)
            first = next(iter(med.values()))
            cells = " | ".join(f"{v:.3f} ({v / first:.1f}x)" for v in med.values())
            print(f"| {d} | {rank} | {cells} |", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())

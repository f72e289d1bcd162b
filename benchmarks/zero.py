"""Sharded optimizer state: `dp.torch.ZeroRedundancyOptimizer` beside unsharded and torch's ZeRO.

Run: `OMP_NUM_THREADS=1 .venv/bin/dataparallel run -n 3 benchmarks/zero.py` (MPI), or with
`--backend gloo`. One process per rank, one torch thread each.

Model: an MLP of 1.59 M float32 parameters (512 -> 1024 -> 1024 -> 10), Adam, `--batch` samples
per rank. Cases, in the same processes, each on its own copy of the model:

- `dp.DistributedOptimizer` (unsharded: every rank holds the whole Adam state): the reference;
- `ZeRO stage 1 + DataParallelModel`: `ZeroRedundancyOptimizer(stage=1)` under the wrapper;
- `ZeRO stage 2`: `ZeroRedundancyOptimizer(stage=2)` on the bare model;
- `..., overlapped`: the same with `overlap_with_forward=model` (the updated slices' exchange
  started by `step()` and waited for per bucket in the next forward; 1 MiB buckets at stage 1);
- `ZeRO stage 1 + torch DDP`: `ZeroRedundancyOptimizer(stage=1)` under torch's DDP, the wrapper
  torch's class runs under (it tells our optimizer apart from our wrapper's per-step handshake);
- `torch ZeRO + DDP (gloo)`: torch's `ZeroRedundancyOptimizer` under `DistributedDataParallel`, on
  the Gloo group that `dataparallel run` sets up beside the engine (or one made here).
- extra stage-2 cases in the same run: `--unmerged` (one allgather per bucket, as on MPI, where
  Gloo merges them into one call) and `--stage2-also BYTES ...` (other bucket sizes);
  `--before FILE`: stage 2 with the gradient reducer (`GradientShards`) of FILE, another
  commit's `src/dataparallel/torch/_zero/gradients.py` (`git show REV:PATH > FILE`), beside this
  one's: a change to the reducer measured before and after in the same processes.

Printed: optimizer state bytes per rank and gradient bytes per rank between steps (each rank's,
the largest shown), the step times (median over interleaved batches of steps: the cases take turns,
so the machine's drifts spread over all of them) and their ratios, and the largest difference of
the parameters from the unsharded run's after `--steps` Adam steps from the same start.
"""

from __future__ import annotations

import argparse
import copy
import importlib.util
import statistics
import time
from collections.abc import Callable

import torch
from torch import nn
from torch.distributed.optim import ZeroRedundancyOptimizer as TorchZero
from train_step import init_gloo

import dataparallel as dp
from dataparallel.torch._zero import optimizer as zero_optimizer

Step = Callable[[], None]
UNSHARDED = "dp.DistributedOptimizer (unsharded)"
STAGE1 = "ZeRO stage 1 + DataParallelModel"
STAGE2 = "ZeRO stage 2"
GATHERED = ", one allgather a call"  # the extra cases of `--allgather`
UNMERGED = "ZeRO stage 2, allgather per bucket"
BEFORE = "ZeRO stage 2, reducer of --before"
TORCH = "torch ZeRO + DDP (gloo)"
OVERLAPPED = ", overlapped"
STAGE1_DDP = "ZeRO stage 1 + torch DDP"
WIDTHS = (11, 6, 11, 8, 12, 9)


def mlp() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(
        nn.Linear(512, 1024), nn.ReLU(), nn.Linear(1024, 1024), nn.ReLU(), nn.Linear(1024, 10)
    )


def batch(step: int, size: int) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(1000 * step + dp.rank())
    return torch.randn(size, 512, generator=g), torch.randint(0, 10, (size,), generator=g)


def reducer_of(path: str) -> type:
    """The `GradientShards` class of another commit's stage-2 module at `path`."""
    spec = importlib.util.spec_from_file_location("zero_gradients_before", path)
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module.GradientShards


def make(
    name: str, base: nn.Module, lr: float, bucket_bytes: int | None = None, before: type = object
) -> tuple[nn.Module, torch.optim.Optimizer]:
    """Return the module to call and the optimizer to step for case `name` (`before`: the
    stage-2 reducer of `--before`)."""
    if name == BEFORE:
        current = zero_optimizer.GradientShards
        zero_optimizer.GradientShards = before  # type: ignore[misc]
        try:
            return make(STAGE2, base, lr, bucket_bytes)
        finally:
            zero_optimizer.GradientShards = current  # type: ignore[misc]
    model = copy.deepcopy(base)
    overlap = model if OVERLAPPED in name else None
    if " @ " in name:  # an extra case: "<case> @ <bytes>"
        bucket_bytes = int(name.rsplit(" ", 1)[1])
    if name == UNSHARDED:
        return model, dp.DistributedOptimizer(torch.optim.Adam(model.parameters(), lr=lr))
    if name.startswith("ZeRO stage 1"):  # under DataParallelModel, or torch DDP
        opt = dp.torch.ZeroRedundancyOptimizer(
            model.parameters(),
            torch.optim.Adam,
            lr=lr,
            bucket_bytes=bucket_bytes,
            overlap_with_forward=overlap,
        )
        if name.startswith(STAGE1_DDP):
            return nn.parallel.DistributedDataParallel(model), opt
        wrapped = dp.torch.DataParallelModel(model)
        if name.endswith(GATHERED):
            opt._broadcasts = False
        return wrapped, opt
    if name.startswith(STAGE2):
        opt = dp.torch.ZeroRedundancyOptimizer(
            model.parameters(),
            torch.optim.Adam,
            stage=2,
            lr=lr,
            bucket_bytes=bucket_bytes,
            overlap_with_forward=overlap,
        )
        if name == UNMERGED:  # the extra case of `--unmerged`: no buckets merged
            opt._merge_bytes = 0
        if name.endswith(GATHERED):
            opt._broadcasts = False
        return model, opt
    ddp = nn.parallel.DistributedDataParallel(model)
    return ddp, TorchZero(ddp.parameters(), torch.optim.Adam, lr=lr)


def trainer(model: nn.Module, opt: torch.optim.Optimizer, size: int) -> Step:
    x, y = batch(0, size)
    loss_fn = nn.CrossEntropyLoss()

    def step() -> None:
        opt.zero_grad()
        loss_fn(model(x), y).backward()
        opt.step()

    return step


def state_bytes(opt: torch.optim.Optimizer) -> int:
    inner = getattr(opt, "optim", opt)  # the sharded ones keep their state in .optim
    return sum(
        v.nbytes for s in inner.state.values() for v in s.values() if isinstance(v, torch.Tensor)
    )


def grad_bytes(model: nn.Module, opt: torch.optim.Optimizer) -> int:
    if isinstance(opt, dp.torch.ZeroRedundancyOptimizer):
        return opt.gradient_bytes
    return sum(p.grad.nbytes for p in model.parameters() if p.grad is not None)


def mode(model: nn.Module, opt: torch.optim.Optimizer) -> str:
    """How a dp case's `GradientSync` reduces, after its mode trial (`torch/_buckets.py`)."""
    holder = model if isinstance(model, dp.torch.DataParallelModel) else opt
    sync = holder.gradient_sync  # type: ignore[union-attr]
    where = "on the communication thread" if sync.overlap else "after backward"
    return f"{where}, buckets of {sync.bucket_bytes / 2**20:g} MiB ({len(sync.buckets)} a step)"


def waits(made: dict[str, tuple[nn.Module, torch.optim.Optimizer]], steps: int) -> dict[str, float]:
    """Median milliseconds a step spends waiting for the updated slices (the largest over the
    ranks): in `step()` for the blocking cases (`SliceGather.finish` after the start), in the
    forward's hooks for the overlapped ones. Equal figures: the exchange did not move while the
    rank computed (no asynchronous progress); smaller overlapped ones: it did."""
    found: dict[str, float] = {}
    for name in (STAGE1, STAGE2, STAGE1 + OVERLAPPED, STAGE2 + OVERLAPPED):
        model, opt = made[name]
        assert isinstance(opt, dp.torch.ZeroRedundancyOptimizer)
        gather = opt._gather
        assert gather is not None
        spent = [0.0]
        finish = gather.finish

        def timed_finish(
            calls: list[int] | None = None, finish: Callable = finish, spent: list = spent
        ) -> None:
            start = time.perf_counter()
            finish(calls)
            spent[0] += time.perf_counter() - start

        gather.finish = timed_finish  # type: ignore[method-assign]
        step, per = trainer(model, opt, 32), []
        for _ in range(steps):  # overlapped: a step's forward lands the step before's exchange
            spent[0] = 0.0
            step()
            per.append(spent[0])
        gather.finish = finish  # type: ignore[method-assign]
        found[name] = 1e3 * float(dp.allreduce(statistics.median(per), op="max"))
    return found


def timed(steps: dict[str, Step], batches: int, budget: float) -> dict[str, float]:
    """Median seconds per step of each case, over `batches` batches taken in turn."""
    counts = {}
    for name, step in steps.items():
        step()
        dp.barrier()
        start = time.perf_counter()
        step()
        once = float(dp.allreduce(time.perf_counter() - start, op="max"))
        counts[name] = max(2, int(budget / max(once, 1e-6)))
    samples: dict[str, list[float]] = {name: [] for name in steps}
    for _ in range(batches):
        for name, step in steps.items():
            dp.barrier()
            start = time.perf_counter()
            for _ in range(counts[name]):
                step()
            elapsed = float(dp.allreduce(time.perf_counter() - start, op="max"))
            samples[name].append(elapsed / counts[name])
    return {name: statistics.median(v) for name, v in samples.items()}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--batch", type=int, default=32, help="samples per rank (default 32)")
    parser.add_argument("--batches", type=int, default=15, help="timed batches per case")
    parser.add_argument("--budget", type=float, default=0.3, help="seconds per timed batch")
    parser.add_argument("--steps", type=int, default=30, help="Adam steps of the parity check")
    parser.add_argument("--bucket-bytes", type=int, default=None, help="ZeRO's (default: its own)")
    parser.add_argument(
        "--unmerged",
        action="store_true",
        help="an extra stage-2 case with one allgather per bucket (none merged)",
    )
    parser.add_argument(
        "--allgather",
        action="store_true",
        help="extra stage-1 and stage-2 cases whose slices come back by allgathers, not "
        "broadcasts (Gloo)",
    )
    parser.add_argument(
        "--stage2-also",
        type=int,
        nargs="*",
        default=[],
        help="extra stage-2 cases with these bucket sizes (bytes), timed in the same run",
    )
    parser.add_argument(
        "--waits",
        action="store_true",
        help="also time the waits for the updated slices (blocking: in step(); overlapped: "
        "in the next forward)",
    )
    parser.add_argument(
        "--stage1-also",
        type=int,
        nargs="*",
        default=[],
        help="extra stage-1 cases (not overlapped) with these bucket sizes (bytes)",
    )
    parser.add_argument(
        "--overlap-also",
        type=int,
        nargs="*",
        default=[],
        help="extra overlapped stage-1 cases with these bucket sizes (bytes), in the same run",
    )
    parser.add_argument(
        "--before",
        metavar="FILE",
        help="an extra stage-2 case with the gradient reducer of FILE (another commit's "
        "src/dataparallel/torch/_zero/gradients.py), for a before/after in the same run",
    )
    args = parser.parse_args()
    before = reducer_of(args.before) if args.before else object
    torch.set_num_threads(1)
    dp.initialize()
    init_gloo()  # torch's case needs a default group (dp.initialize made one with torch)
    base = mlp()
    n = sum(p.numel() for p in base.parameters())
    gathered = [STAGE1 + GATHERED, STAGE2 + GATHERED] if args.allgather else []
    extra = [
        *gathered,
        *([UNMERGED] if args.unmerged else []),
        *([BEFORE] if args.before else []),
        *(f"{STAGE2} @ {b}" for b in args.stage2_also),
        *(f"{STAGE1} @ {b}" for b in args.stage1_also),
        *(f"{STAGE1}{OVERLAPPED} @ {b}" for b in args.overlap_also),
    ]
    overlapped = [STAGE1 + OVERLAPPED, STAGE2 + OVERLAPPED]
    ddp = [STAGE1_DDP, STAGE1_DDP + OVERLAPPED]
    names = [UNSHARDED, STAGE1, STAGE2, *overlapped, *ddp, *extra, TORCH]
    made = {name: make(name, base, 1e-3, args.bucket_bytes, before) for name in names}
    steps = {name: trainer(model, opt, args.batch) for name, (model, opt) in made.items()}
    for step in steps.values():
        step()  # state exists, buckets rebuilt
    memory = {}
    for name, (model, opt) in made.items():
        if name.startswith(STAGE2):  # between backward and step: what stage 2 holds at its peak
            opt.zero_grad()
            nn.CrossEntropyLoss()(
                model(batch(0, args.batch)[0]), batch(0, args.batch)[1]
            ).backward()
        mine = (state_bytes(opt), grad_bytes(model, opt))
        memory[name] = [max(v) for v in zip(*dp.allgather_object(mine), strict=True)]
        if name.startswith(STAGE2):
            opt.step()
    times = timed(steps, args.batches, args.budget)
    waited = waits(made, 40) if args.waits else {}

    # Parity: the same start, the same batches, `--steps` Adam steps.
    finals = {}
    checked = (STAGE1, STAGE2, *overlapped, *([BEFORE] if args.before else []))
    for name in (UNSHARDED, *checked):
        model, opt = make(name, base, 1e-3, args.bucket_bytes, before)
        for s in range(args.steps):
            x, y = batch(s + 1, args.batch)
            opt.zero_grad()
            nn.CrossEntropyLoss()(model(x), y).backward()
            opt.step()
        # The model's state dict: what the overlapped cases' hooks make current.
        finals[name] = [v.clone() for v in model.state_dict().values()]
    parity = {
        name: max(
            float((a - b).abs().max()) for a, b in zip(finals[name], finals[UNSHARDED], strict=True)
        )
        for name in checked
    }
    if not dp.is_main():
        return
    size, engine = dp.size(), dp.get_backend().name
    print(f"{size} ranks, engine {engine}, {n / 1e6:.2f} M float32 parameters, Adam, ", end="")
    print(f"batch {args.batch}/rank, ZeRO buckets {args.bucket_bytes or 'default'}")
    unsharded_state = memory[UNSHARDED][0]
    heads = ("state/rank", "x 1/N", "grads/rank", "step ms", "vs unsharded", "vs torch")
    print(f"{'case':50} " + " ".join(f"{h:>{w}}" for h, w in zip(heads, WIDTHS, strict=True)))
    for name in names:
        state, grads = memory[name]
        share = state / (unsharded_state / size)
        print(
            f"{name:50} {state / 2**20:9.2f}MB {share:6.2f} {grads / 2**20:9.2f}MB "
            f"{times[name] * 1e3:8.2f} {times[name] / times[UNSHARDED]:12.2f} "
            f"{times[name] / times[TORCH]:9.2f}"
        )
    print(f"unsharded state / N = {unsharded_state / size / 2**20:.2f} MB; ", end="")
    print(f"parameters {4 * n / 2**20:.2f} MB")
    for name in (UNSHARDED, STAGE1):
        sync = mode(*made[name])
        print(f"{name}: gradients reduced {sync}")
    for name, diff in parity.items():
        print(f"{name}: max |param - unsharded| after {args.steps} Adam steps = {diff:.2e}")
    if args.before:
        print(f"{STAGE2} / {BEFORE}: {times[STAGE2] / times[BEFORE]:.3f} (step time, this run)")
    for name, ms in waited.items():
        print(f"{name}: waited {ms:.2f} ms a step for the updated slices")


if __name__ == "__main__":
    main()

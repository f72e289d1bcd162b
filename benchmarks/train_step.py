"""Communication overhead of a training step: dataparallel beside Horovod, DDP and one process.

Run: `OMP_NUM_THREADS=1 .venv/bin/mpiexec -n 2 .venv/bin/python benchmarks/train_step.py`
(or `dataparallel run -n 2 benchmarks/train_step.py`). With Horovod 0.28.1 built in a venv of its
own (Horovod's source install with `HOROVOD_WITH_PYTORCH=1 HOROVOD_WITH_MPI=1`; it needs patches to
build against current torch), run that venv's mpiexec and python with `PYTHONPATH=src` to add
Horovod as a case in the same processes.

Models (`--models`, default both):
- `mlp`: an MLP of about 3.4 M parameters, SGD, batch `--mlp-batch` samples per rank;
- `transformer`: an encoder of 4 `nn.TransformerEncoderLayer` (4 heads, feed-forward 4d, no
  dropout) between an embedding and an output layer of a 1000-token vocabulary: 51 parameter
  tensors, 1.05 M / 3.67 M / 13.6 M / 52.4 M parameters at d = 128 / 256 / 512 / 1024 (`--d`),
  Adam, `--batch` sequences of `--seq` tokens per rank.

A step is `zero_grad`, forward, loss, backward and the optimizer's step. Cases, all in the same
processes, one torch thread per rank:
- `one process`: each rank trains its own copy, no communication (the floor);
- `dp.DistributedOptimizer` and `dp.torch.DataParallelModel` over MPI (hooks, buckets), in the
  mode chosen for this machine (the header says which: buckets during backward when a core is
  spare, else after it); `dp.DistributedOptimizer, comm thread` always during backward, on the
  communication thread (`DATAPARALLEL_OVERLAP=1`, buckets of `THREAD_BUCKET_BYTES`);
- `one 8-byte allreduce per step`: no gradient reduction, only the ranks meeting once per step:
  the floor of any synchronous data-parallel step (the slower rank's step sets everyone's);
- `dp.allreduce_gradients after backward`: one fused reduction after backward, no overlap;
- `Horovod DistributedOptimizer` (MPI), when `horovod.torch` imports and dp runs on MPI. Horovod
  is initialized only while its case runs (`hvd.init()` ... `hvd.shutdown()`): an idle, initialized
  Horovod keeps one core busy (a rank waits in a busy-polling MPI call for the coordinator's next
  cycle), which would slow every other case on a 2-core machine (`--hvd-throughout` keeps it
  initialized all along instead, to see that effect);
- `torch DDP (gloo)`: DistributedDataParallel on a Gloo group made in the same processes.

Timing: `--rounds` rounds; each round times the one process first and last and every other case
in between (the order rotates every round), each with one untimed step then as many steps as fit
in `--budget` seconds (the slowest rank's time). A round whose two one-process times differ by
more than `--tolerance` is dropped (the load of the machine changed during it). A case's overhead
in a round is its step time minus the round's one-process step time (the mean of the two). The
table gives the median and quartiles of that paired overhead over rounds, and `min - min` (the
case's fastest round minus the one process's fastest: the estimate least hit by neighbours'
bursts on a shared machine). Ratios compare overheads: below 1, dataparallel spends less time
communicating than the peer.
"""

from __future__ import annotations

import argparse
import copy
import faulthandler
import gc
import os
import statistics
import time
from collections.abc import Callable
from typing import Any

import torch
import torch.distributed as dist
from torch import nn

import dataparallel as dp
from dataparallel.launch.process import free_port
from dataparallel.torch._buckets import ModeTrial, overlaps
from dataparallel.world import current

Step = Callable[[], None]
VOCAB = 1000


class Horovod:
    """Horovod's torch frontend, initialized only while its case runs (or why it cannot run)."""

    def __init__(self) -> None:
        self.hvd: Any = None
        self.reason = self.version = ""
        self.throughout = False
        try:
            import horovod
            import horovod.torch as hvd
        except ImportError as exc:
            self.reason = f"horovod.torch is not importable here ({exc})"
            return
        if dp.get_backend().name != "mpi":
            self.reason = "Horovod (MPI) runs beside dataparallel only under mpiexec (backend mpi)"
            return
        self.hvd = hvd
        self.version = horovod.__version__

    def __enter__(self) -> None:
        if not self.throughout:
            self.hvd.init()  # MPI is already up (mpi4py): shutdown() leaves it up, so it repeats

    def __exit__(self, *exc: object) -> None:
        if not self.throughout:
            # Horovod's shutdown is collective: the first rank to call it stops every rank's
            # background thread. A rank still inside `init` then (past the C call, before its
            # Python side reads the global process set) returns with that set empty, and a
            # `DistributedOptimizer` made next registers no hooks: its steps never reduce, and
            # the other ranks wait for them for ever. No rank shuts down before all are past init.
            dp.barrier()
            self.hvd.shutdown()

    def optimizer(
        self, opt: torch.optim.Optimizer, model: nn.Module, **options: Any
    ) -> torch.optim.Optimizer:
        """Horovod's `DistributedOptimizer` over `opt`, made while Horovod is initialized (the
        constructor asks it for the world), checked on every rank: one that hooked no parameter
        (the race `__exit__` closes, or any other cause) would skip its reductions and leave the
        other ranks waiting, so it ends the run here instead."""
        with self:
            hopt = self.hvd.DistributedOptimizer(
                opt, named_parameters=model.named_parameters(), **options
            )
            alone = self.hvd.size() == 1  # Horovod hooks nothing in a world of one
        hooked = alone or len(getattr(hopt, "_requires_update", ())) > 0  # Horovod's own record
        unhooked = round(float(dp.allreduce(0.0 if hooked else 1.0)))
        if unhooked:
            raise SystemExit(
                f"Horovod's DistributedOptimizer registered no gradient hooks on {unhooked} "
                "rank(s): its steps would not reduce and the others would wait on them"
            )
        return hopt

    def keep_initialized(self) -> None:
        """Initialize Horovod for the rest of the run, every case included (`--hvd-throughout`)."""
        self.hvd.init()
        self.throughout = True


def mlp(width: int = 1024, depth: int = 3) -> nn.Module:
    torch.manual_seed(0)
    layers: list[nn.Module] = [nn.Linear(256, width), nn.ReLU()]
    for _ in range(depth):
        layers += [nn.Linear(width, width), nn.ReLU()]
    layers.append(nn.Linear(width, 10))
    return nn.Sequential(*layers)


def transformer(d: int, layers: int = 4) -> nn.Module:
    torch.manual_seed(0)
    layer = nn.TransformerEncoderLayer(d, 4, 4 * d, dropout=0.0, batch_first=True)
    encoder = nn.TransformerEncoder(layer, layers, enable_nested_tensor=False)
    return nn.Sequential(nn.Embedding(VOCAB, d), encoder, nn.Linear(d, VOCAB))


def init_gloo() -> None:
    if dist.is_initialized():  # dp.initialize() made torch's group alongside (torch imported)
        return
    port = dp.broadcast_object(free_port() if dp.rank() == 0 else None)
    dist.init_process_group(
        "gloo", init_method=f"tcp://127.0.0.1:{port}", rank=dp.rank(), world_size=dp.size()
    )


def trainer(
    model: nn.Module,
    opt: torch.optim.Optimizer,
    batch: tuple[torch.Tensor, torch.Tensor],
    after_backward: Callable[[], None] | None = None,
) -> Step:
    x, y = batch
    loss_fn = nn.CrossEntropyLoss()

    def step() -> None:
        opt.zero_grad()
        out = model(x)
        loss_fn(out.reshape(-1, out.shape[-1]), y.reshape(-1)).backward()
        if after_backward is not None:
            after_backward()
        opt.step()

    return step


def cases_for(
    base: nn.Module,
    make_opt: Callable[[nn.Module], torch.optim.Optimizer],
    batch: tuple[torch.Tensor, torch.Tensor],
    horovod: Horovod,
) -> dict[str, tuple[Step, Horovod | None]]:
    """Every case's step, on its own copy of `base`; the Horovod context where one is needed."""
    single, ours, plain, overlapped, floor = (copy.deepcopy(base) for _ in range(5))
    # What DATAPARALLEL_OVERLAP=1 gives: buckets of the thread's size, on the comm thread.
    forced = dp.DistributedOptimizer(
        make_opt(overlapped), bucket_bytes=current().settings.thread_bucket_bytes
    )
    forced.gradient_sync.overlap = True
    forced.gradient_sync._modes.trial = None  # as DATAPARALLEL_OVERLAP=1: no timed mode choice
    wrapped = dp.torch.DataParallelModel(copy.deepcopy(base))
    ddp = nn.parallel.DistributedDataParallel(copy.deepcopy(base))
    cases: dict[str, tuple[Step, Horovod | None]] = {
        ALONE: (trainer(single, make_opt(single), batch), None),
        "dp.DistributedOptimizer": (
            trainer(ours, dp.DistributedOptimizer(make_opt(ours)), batch),
            None,
        ),
        "dp.torch.DataParallelModel": (trainer(wrapped, make_opt(wrapped), batch), None),
        "dp.DistributedOptimizer, comm thread": (trainer(overlapped, forced, batch), None),
        SYNC_FLOOR: (trainer(floor, make_opt(floor), batch, lambda: dp.allreduce(0.0)), None),
        "dp.allreduce_gradients after backward": (
            trainer(
                plain,
                make_opt(plain),
                batch,
                lambda: dp.allreduce_gradients([p.grad for p in plain.parameters()]),
            ),
            None,
        ),
    }
    if horovod.hvd is not None:
        theirs = copy.deepcopy(base)
        opt = horovod.optimizer(make_opt(theirs), theirs)
        cases["Horovod DistributedOptimizer"] = (trainer(theirs, opt, batch), horovod)
    cases["torch DDP (gloo)"] = (trainer(ddp, make_opt(ddp), batch), None)
    return cases


def run_steps(step: Step, steps: int) -> float:
    """Return the slowest rank's seconds per step over `steps` steps (after one untimed step)."""
    step()
    dp.barrier()
    start = time.perf_counter()
    for _ in range(steps):
        step()
    elapsed = (time.perf_counter() - start) / steps
    return float(dp.allreduce(elapsed, op="max"))


ALONE = "one process (no communication)"
SYNC_FLOOR = "one 8-byte allreduce per step (the ranks wait for each other)"


def measure(
    cases: dict[str, tuple[Step, Horovod | None]],
    rounds: int,
    budget: float,
    tolerance: float = 0.1,
    warmup: int = ModeTrial.SKIP + 2 * ModeTrial.TRIALS + 1,
    warm: dict[str, int] | None = None,
    stall: float = 0.0,
) -> dict[str, list[float]]:
    """Time every case in interleaved rounds; return each case's seconds per step, per round.

    A round times the one-process case first and last, the others in between (their order
    rotates from round to round). A round whose two one-process times differ by more than
    `tolerance` (the machine's load changed during it) is dropped; rounds are run until `rounds`
    are kept, or three times as many were tried. The one-process time of a kept round is the
    mean of its two. Each case first runs `warmup` untimed steps (by default until dp's mode
    trial has chosen, `torch/_buckets.py`), or as many as `warm` names for it (a case with no
    trial needs only its first steps out of the way). With `stall` > 0, a rank whose next step
    has not started `stall` seconds after its last prints every thread's stack and exits: a
    collective that never completes ends the job at once, saying where each rank waits.
    """
    if stall > 0:
        cases = {name: (_watched(step, stall), ctx) for name, (step, ctx) in cases.items()}
    try:
        return _measure(cases, rounds, budget, tolerance, warmup, warm or {})
    finally:
        faulthandler.cancel_dump_traceback_later()


def _watched(step: Step, stall: float) -> Step:
    def watched() -> None:
        faulthandler.dump_traceback_later(stall, exit=True)  # replaces the last step's timer
        step()

    return watched


def _measure(
    cases: dict[str, tuple[Step, Horovod | None]],
    rounds: int,
    budget: float,
    tolerance: float,
    warmup: int,
    warm: dict[str, int],
) -> dict[str, list[float]]:
    counts: dict[str, int] = {}
    for name, (step, context) in cases.items():  # warm up; size each case's timing to `budget`
        with context or _null():
            for _ in range(warm.get(name, warmup)):
                step()
            counts[name] = max(1, min(50, round(budget / run_steps(step, 2))))
    others = [name for name in cases if name != ALONE]
    samples: dict[str, list[float]] = {name: [] for name in cases}
    tried = 0
    while len(samples[ALONE]) < rounds and tried < 3 * rounds:
        shift = tried % len(others)
        tried += 1
        first = run_steps(cases[ALONE][0], counts[ALONE])
        times = {}
        for name in others[shift:] + others[:shift]:
            step, context = cases[name]
            with context or _null():
                times[name] = run_steps(step, counts[name])
        last = run_steps(cases[ALONE][0], counts[ALONE])
        if abs(first - last) > tolerance * min(first, last):
            continue
        times[ALONE] = (first + last) / 2
        for name, seconds in times.items():
            samples[name].append(seconds)
    if dp.is_main():
        print(f"kept {len(samples[ALONE])} of {tried} rounds (load steady within {tolerance:.0%})")
    if not samples[ALONE]:
        raise SystemExit("no round was steady enough: the machine is too busy to measure now")
    return samples


class _null:
    def __enter__(self) -> None:
        return None

    def __exit__(self, *exc: object) -> None:
        return None


def quartiles(values: list[float]) -> tuple[float, float, float]:
    if len(values) < 2:
        return values[0], values[0], values[0]
    q1, q2, q3 = statistics.quantiles(values, n=4, method="inclusive")
    return q1, q2, q3


def report(title: str, samples: dict[str, list[float]]) -> None:
    alone = samples[ALONE]
    over = {n: [s - a for s, a in zip(v, alone, strict=True)] for n, v in samples.items()}
    med = {n: statistics.median(v) for n, v in over.items()}
    low = {n: min(v) - min(alone) for n, v in samples.items()}
    has_ddp = "torch DDP (gloo)" in samples
    ddp = statistics.median(samples["torch DDP (gloo)"] if has_ddp else alone)
    q1, q2, q3 = quartiles(alone)
    print(
        f"\n{title} (1-minute load average now {os.getloadavg()[0]:.1f} on {os.cpu_count()} cores)"
    )
    print(
        f"one-process step: median {q2 * 1e3:.1f} ms, quartiles {q1 * 1e3:.1f} to "
        f"{q3 * 1e3:.1f} ms, min {min(alone) * 1e3:.1f} ms over {len(alone)} rounds"
    )
    print(
        "| case | step (median) | overhead (median) | overhead quartiles | min - min "
        f"| {'DDP' if has_ddp else 'one-process'} step / this |"
    )
    print("| --- | --- | --- | --- | --- | --- |")
    for name, values in samples.items():
        step = statistics.median(values)
        o1, _, o3 = quartiles(over[name])
        print(
            f"| {name} | {step * 1e3:.1f} ms | {med[name] * 1e3:.1f} ms | {o1 * 1e3:.1f} to "
            f"{o3 * 1e3:.1f} ms | {low[name] * 1e3:.1f} ms | {ddp / step:.2f}x |"
        )
    peers = [p for p in ("Horovod DistributedOptimizer", "torch DDP (gloo)") if p in med]
    for ours in (n for n in samples if n.startswith(("dp.D", "dp.torch", "prototype"))):
        ratios = [
            f"{_ratio(med[ours], med[peer])} {peer}'s (min - min: {_ratio(low[ours], low[peer])})"
            for peer in peers
        ]
        if ratios:
            print(f"overhead of {ours}: " + "; ".join(ratios))


def _ratio(ours: float, peer: float) -> str:
    return f"{ours / peer:.2f}x" if peer > 0.5e-3 else f"n/a ({peer * 1e3:.1f} ms)"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--models", default="mlp,transformer", help="mlp, transformer or both")
    parser.add_argument("--d", default="128,256,512", help="transformer widths (1024: ~52 M)")
    parser.add_argument("--batch", type=int, default=8, help="sequences per rank per step")
    parser.add_argument("--seq", type=int, default=32, help="tokens per sequence")
    parser.add_argument("--mlp-batch", type=int, default=64, help="MLP samples per rank per step")
    parser.add_argument("--rounds", type=int, default=20)
    parser.add_argument("--budget", type=float, default=0.25, help="seconds per case per round")
    parser.add_argument("--tolerance", type=float, default=0.1, help="see the docstring")
    parser.add_argument(
        "--hvd-throughout",
        action="store_true",
        help="keep Horovod initialized during every case (its idle thread then loads a core)",
    )
    args = parser.parse_args()

    torch.set_num_threads(1)
    dp.initialize()
    init_gloo()
    horovod = Horovod()
    if dp.is_main():
        print(
            f"{dp.size()} ranks ({dp.get_backend().name}), torch {torch.__version__}, "
            f"{torch.get_num_threads()} torch thread per rank, {args.rounds} rounds"
        )
        mode = overlaps(dp.local_size(), current().settings.overlap)
        print(
            f"dp's gradient buckets go out {'during' if mode else 'after'} backward by the core "
            "count on one node; across nodes, where both can run, dp times both in its first "
            "steps and keeps the faster"
        )
        if horovod.hvd is None:
            print(f"Horovod case skipped: {horovod.reason}")
        else:
            when = "throughout" if args.hvd_throughout else "only during its own case"
            print(f"Horovod {horovod.version} (MPI built: {horovod.hvd.mpi_built()}), on {when}")
    if args.hvd_throughout and horovod.hvd is not None:
        horovod.keep_initialized()

    g = torch.Generator().manual_seed(dp.rank())
    models = args.models.split(",")
    if "mlp" in models:
        x = torch.randn(args.mlp_batch, 256, generator=g)
        y = torch.randint(0, 10, (args.mlp_batch,), generator=g)
        base = mlp()

        def sgd(m: nn.Module) -> torch.optim.Optimizer:
            return torch.optim.SGD(m.parameters(), lr=0.01)

        n = sum(p.numel() for p in base.parameters())
        samples = measure(
            cases_for(base, sgd, (x, y), horovod), args.rounds, args.budget, args.tolerance
        )
        if dp.is_main():
            report(f"MLP, {n / 1e6:.2f} M parameters, SGD, batch {args.mlp_batch}", samples)
    if "transformer" in models:
        tokens = torch.randint(0, VOCAB, (args.batch, args.seq + 1), generator=g)
        batch = (tokens[:, :-1], tokens[:, 1:])

        def adam(m: nn.Module) -> torch.optim.Optimizer:
            return torch.optim.Adam(m.parameters(), lr=1e-4)

        for d in (int(v) for v in args.d.split(",")):
            base = transformer(d)
            n = sum(p.numel() for p in base.parameters())
            tensors = len(list(base.parameters()))
            samples = measure(
                cases_for(base, adam, batch, horovod), args.rounds, args.budget, args.tolerance
            )
            if dp.is_main():
                report(
                    f"Transformer d={d}, {n / 1e6:.2f} M parameters in {tensors} tensors, Adam, "
                    f"{args.batch}x{args.seq} tokens",
                    samples,
                )
            gc.collect()
    if horovod.throughout:
        horovod.hvd.shutdown()
    dist.destroy_process_group()
    dp.finalize()


if __name__ == "__main__":
    main()

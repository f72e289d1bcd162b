"""Prototype for issue 9: a communication thread that takes buckets from the gradient hooks.

Run (Horovod's venv, as `train_step.py`):
`OMP_NUM_THREADS=1 mpiexec -n 2 python benchmarks/comm_thread.py --d 128,256,512`

Nothing here is in `src/`: `ThreadedSync` is a standalone sketch of the design, timed beside
`dp.DistributedOptimizer` and Horovod in the same processes (`train_step.py`'s rounds and table).

- The gradient hooks (post-accumulate-grad, on the autograd thread) only count: when a bucket's
  last gradient is in, and every bucket before it has been queued, it is put on a `SimpleQueue`.
  Buckets have fixed members (reverse registration order, cut at `bucket_bytes`; rebuilt once in
  the order rank 0's gradients arrived at the first step, as DDP), so every rank queues the same
  buckets in the same order.
- One thread per sync object owns its communicator (a duplicate of COMM_WORLD; no other thread
  calls MPI on it). Per bucket it packs (`torch.cat(out=)`, which releases the GIL), runs the
  blocking `comm.Allreduce` (mpi4py releases the GIL; MPICH was initialized with
  MPI_THREAD_MULTIPLE), scales by 1/size, unpacks (`torch._foreach_copy_`), and counts it done.
  A bucket of one contiguous gradient is reduced in place, with no copy.
- `step()` waits (a `threading.Condition`) until every bucket is done, then runs the inner step.
- `--poll-us N`: a variant whose thread does not block in MPI (where MPICH busy-polls) but calls
  `Iallreduce`, then `Test` and `time.sleep(N us)` in turn.
Also timed: one process, dp.DistributedOptimizer, dp.allreduce_gradients after backward, Horovod.

Left out of the sketch, needed in the real thing: unused parameters (zeros at the end of the pass),
timeouts (poll `Iallreduce`+`Test` against a deadline in the thread), errors raised in the thread
handed to the main thread at `wait()`, mismatch checks, non-CPU devices.
"""

from __future__ import annotations

import argparse
import copy
import gc
import queue
import threading
import time
from typing import Any

import numpy as np
import torch
from _timing import compare
from mpi4py import MPI
from torch import nn
from train_step import VOCAB, Horovod, init_gloo, measure, report, trainer, transformer

import dataparallel as dp

KiB = 1 << 10
MiB = 1 << 20


class ThreadedSync:
    """Average the gradients of `params` across ranks on a communication thread."""

    def __init__(
        self, params: list[torch.Tensor], bucket_bytes: int, poll: float | None = None
    ) -> None:
        self.params, self.bucket_bytes, self.poll = params, bucket_bytes, poll
        self.comm = MPI.COMM_WORLD.Dup()
        self.scale = 1.0 / self.comm.size
        self.queue: queue.SimpleQueue[int | None] = queue.SimpleQueue()
        self.cond = threading.Condition()
        self.error: BaseException | None = None
        self.arrival: list[int] | None = []
        self.assign(list(range(len(params)))[::-1])
        for i, p in enumerate(params):
            p.register_post_accumulate_grad_hook(lambda _, i=i: self.ready(i))
        self.thread = threading.Thread(target=self.run, name="dp-comm", daemon=True)
        self.thread.start()

    def assign(self, order: list[int]) -> None:
        self.buckets: list[list[int]] = [[]]
        size = 0
        for i in order:
            nbytes = self.params[i].numel() * 4
            if self.buckets[-1] and size + nbytes > self.bucket_bytes:
                self.buckets.append([])
                size = 0
            self.buckets[-1].append(i)
            size += nbytes
        self.bucket_of = {i: b for b, members in enumerate(self.buckets) for i in members}
        self.flat = [
            torch.empty(sum(self.params[i].numel() for i in m)) if len(m) > 1 else None
            for m in self.buckets
        ]
        self.reset()

    def reset(self) -> None:
        self.pending = [len(m) for m in self.buckets]
        self.next = 0
        self.done = 0

    def ready(self, i: int) -> None:  # on the autograd thread: count, maybe enqueue
        if self.arrival is not None:
            self.arrival.append(i)
        b = self.bucket_of[i]
        self.pending[b] -= 1
        while self.next < len(self.buckets) and self.pending[self.next] == 0:
            self.queue.put(self.next)
            self.next += 1

    def run(self) -> None:  # the communication thread
        while (b := self.queue.get()) is not None:
            try:
                self.reduce(b)
            except BaseException as exc:  # handed to the main thread at wait()
                self.error = exc
            with self.cond:
                self.done += 1
                self.cond.notify()

    def reduce(self, b: int) -> None:
        grads = [self.params[i].grad for i in self.buckets[b]]
        flat = self.flat[b]
        if flat is None:
            buf = grads[0]
            assert buf is not None and buf.is_contiguous()
        else:
            buf = torch.cat([g.view(-1) for g in grads], out=flat)  # type: ignore[union-attr]
        if self.poll is None:
            self.comm.Allreduce(MPI.IN_PLACE, buf.numpy(), MPI.SUM)
        else:  # no busy-polling in MPI: test, then sleep (MPICH progresses only inside Test)
            request = self.comm.Iallreduce(MPI.IN_PLACE, buf.numpy(), MPI.SUM)
            while not request.Test():
                time.sleep(self.poll)
        buf.mul_(self.scale)
        if flat is not None:
            parts = flat.split([g.numel() for g in grads])  # type: ignore[union-attr]
            views = [v.view_as(g) for v, g in zip(parts, grads, strict=True)]  # type: ignore[union-attr]
            torch._foreach_copy_(grads, views)  # type: ignore[arg-type]

    def wait(self) -> None:
        with self.cond:
            self.cond.wait_for(lambda: self.done == len(self.buckets))
        if self.error is not None:
            raise self.error
        if self.arrival is not None:  # rebucket once, in rank 0's arrival order (as DDP)
            order = self.comm.bcast(self.arrival, 0)
            self.arrival = None
            self.assign(order)
        self.reset()

    def close(self) -> None:
        self.queue.put(None)
        self.thread.join()
        self.comm.Free()


class ThreadedOptimizer:
    """A minimal `DistributedOptimizer` on `ThreadedSync`: `step()` waits, then steps."""

    def __init__(
        self, opt: torch.optim.Optimizer, bucket_bytes: int, poll: float | None = None
    ) -> None:
        self.opt = opt
        params = [p for group in opt.param_groups for p in group["params"]]
        self.sync = ThreadedSync(params, bucket_bytes, poll)

    def zero_grad(self) -> None:
        self.opt.zero_grad()

    def step(self) -> Any:
        self.sync.wait()
        return self.opt.step()


def parse_size(label: str) -> int:
    """`256K` or `4M` in bytes."""
    return int(label[:-1]) * (KiB if label.endswith("K") else MiB)


def handoff_cost() -> dict[str, float]:
    """A 4-byte Allreduce made directly, and handed to a thread and waited for (the round trip)."""
    comm = MPI.COMM_WORLD.Dup()
    tiny = np.ones(1, np.float32)
    jobs: queue.SimpleQueue[Any] = queue.SimpleQueue()

    def worker() -> None:
        while (job := jobs.get()) is not None:
            comm.Allreduce(MPI.IN_PLACE, tiny, MPI.SUM)
            job.set()

    thread = threading.Thread(target=worker, daemon=True)
    thread.start()

    def through_thread() -> None:
        done = threading.Event()
        jobs.put(done)
        done.wait()

    best = compare(
        {
            "direct": lambda: comm.Allreduce(MPI.IN_PLACE, tiny, MPI.SUM),
            "via thread": through_thread,
        },
        comm,
    )
    jobs.put(None)
    thread.join()
    comm.Free()
    return best


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--d", default="128,256,512", help="widths; none: skip")
    parser.add_argument("--buckets", default="256K,4M,25M", help="prototype bucket sizes")
    parser.add_argument("--batch", type=int, default=8)
    parser.add_argument("--seq", type=int, default=32)
    parser.add_argument("--rounds", type=int, default=20)
    parser.add_argument("--budget", type=float, default=0.25)
    parser.add_argument("--tolerance", type=float, default=0.1)
    parser.add_argument(
        "--poll-us",
        type=float,
        default=0.0,
        help="also run --poll-buckets with Iallreduce + Test + sleep(this) instead of Allreduce",
    )
    parser.add_argument("--poll-buckets", default="25M")
    parser.add_argument("--handoff", action="store_true", help="time a thread hand-off")
    parser.add_argument("--ddp", action="store_true", help="also time DDP over Gloo")
    args = parser.parse_args()
    torch.set_num_threads(1)
    dp.initialize()
    if args.ddp:
        init_gloo()
    horovod = Horovod()
    g = torch.Generator().manual_seed(dp.rank())
    tokens = torch.randint(0, VOCAB, (args.batch, args.seq + 1), generator=g)
    batch = (tokens[:, :-1], tokens[:, 1:])
    sizes = {s: parse_size(s) for s in args.buckets.split(",")}

    def adam(m: nn.Module) -> torch.optim.Optimizer:
        return torch.optim.Adam(m.parameters(), lr=1e-4)

    if dp.is_main():
        print(f"{dp.size()} ranks, MPI thread level {MPI.Query_thread()} (3 = MULTIPLE)")
        if horovod.hvd is None:
            print(f"Horovod case skipped: {horovod.reason}")
    if args.handoff:
        best = handoff_cost()
        if dp.is_main():
            direct, thread = best["direct"] * 1e6, best["via thread"] * 1e6
            print(
                f"4-byte Allreduce: direct {direct:.1f} us, handed to a thread and waited for "
                f"{thread:.1f} us (+{thread - direct:.1f} us per hand-off)"
            )
    for d in (int(v) for v in args.d.split(",") if v):
        base = transformer(d)
        polled = [label for label in args.poll_buckets.split(",") if label] if args.poll_us else []
        models = [copy.deepcopy(base) for _ in range(4 + len(sizes) + len(polled))]
        cases: dict[str, Any] = {
            "one process (no communication)": (trainer(models[0], adam(models[0]), batch), None),
            "dp.DistributedOptimizer": (
                trainer(models[1], dp.DistributedOptimizer(adam(models[1])), batch),
                None,
            ),
            "dp.allreduce_gradients after backward": (
                trainer(
                    models[3],
                    adam(models[3]),
                    batch,
                    lambda m=models[3]: dp.allreduce_gradients([p.grad for p in m.parameters()]),
                ),
                None,
            ),
        }
        protos = []
        variants = [(label, sizes[label], None) for label in sizes]
        variants += [(label, parse_size(label), args.poll_us * 1e-6) for label in polled]
        for (label, nbytes, poll), model in zip(variants, models[4:], strict=True):
            opt = ThreadedOptimizer(adam(model), nbytes, poll)
            protos.append(opt)
            name = f"prototype thread, {label} buckets" + (", polling" if poll else "")
            cases[name] = (trainer(model, opt, batch), None)  # type: ignore[arg-type]
        if horovod.hvd is not None:
            with horovod:
                opt = horovod.hvd.DistributedOptimizer(
                    adam(models[2]), named_parameters=models[2].named_parameters()
                )
            cases["Horovod DistributedOptimizer"] = (trainer(models[2], opt, batch), horovod)
        if args.ddp:
            ddp = nn.parallel.DistributedDataParallel(copy.deepcopy(base))
            cases["torch DDP (gloo)"] = (trainer(ddp, adam(ddp), batch), None)
        samples = measure(cases, args.rounds, args.budget, args.tolerance)
        if dp.is_main():
            n = sum(p.numel() for p in base.parameters())
            report(f"Transformer d={d}, {n / 1e6:.2f} M parameters, Adam", samples)
        for opt in protos:
            opt.sync.close()
        gc.collect()
    if args.ddp:
        torch.distributed.destroy_process_group()
    dp.finalize()


if __name__ == "__main__":
    main()

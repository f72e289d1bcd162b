"""One rank of a Gloo job started by `tests/test_gloo.py` or `tests/test_multihost.py`.

usage: gloo_worker.py SCENARIO [--init-method URL] [--rank R] [--world-size N] [--no-finalize]
                      [--meet DIR]

Without --init-method, `dp.initialize()` finds the rendezvous in the environment (env://).
Scenarios:
  basic    allreduce (sum of rank + 1), broadcast (from the last rank), an allreduce of 4 MiB;
           prints `RESULT {json}`
  abort    the last rank calls `abort(3)`; the others report what their next allreduce raised
  timeout  the last rank sleeps past the timeout; the others report what their allreduce raised
  leave    every rank starts a non-blocking allreduce; the last rank keeps its handle without
           waiting, calls `dp.finalize()` and stays; the others report what their next
           allreduce raised (its closed engine must close the connections, held handle or not)
  existing torch.distributed is initialized first (by "the user"); dp works beside it, and
           `dp.finalize()` leaves the user's group usable; prints `RESULT {json}`
  train    3 steps of a DistributedOptimizer on the communication thread (run it with
           DATAPARALLEL_OVERLAP=1), checked against one model trained on every rank's batch;
           prints `RESULT {json}` with the largest difference and the thread's pause
  hierarchy allreduces of every op, several dtypes, blocking and not, compressed, gradients and
           one small buffer; prints `RESULT {json}` with the distinct values of each result and
           how many went through the hierarchy's three steps (`backends/gloo/hierarchy.py`)
  lost     local rank 1 of the first host dies inside a hierarchical allreduce, in the middle of
           its steps through shared memory; the others report what their allreduce raised and
           the token of their host's shared memory files (`backends/gloo/shared.py`)
  stuck    as lost, but local rank 1 hangs instead, until every other rank has raised (each
           notes it in $STUCK_DIR), then exits 5
  full     on one host, /dev/shm full for rank 1's big files: its big calls fall back on every
           rank, its small ones still go through shared memory; prints `RESULT {json}` with
           their values, the files rank 1 asked for and the calls through shared memory
  busy     a hierarchical allreduce (where the world has a hierarchy: its lanes run), then a job
           left running on the communication thread, torch calls that each let the GIL go until
           the world is finalized; run with --no-finalize: the program ends as it is and
           prints `LEFT` first

With --meet DIR (and --rank, --world-size), each rank imports torch.distributed, notes DIR/R, and
waits for every rank's note before `dp.initialize()`: a short DATAPARALLEL_TIMEOUT then covers
the rendezvous alone, never one rank's slower start.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import os
import sys
import time
from pathlib import Path

import numpy as np

import dataparallel as dp
from dataparallel.backends.base import ReduceOp
from dataparallel.backends.gloo.shared import SHARED_DIR

BULK = 1 << 20  # float32 values of the basic scenario's large allreduce
SCENARIOS = (
    "basic",
    "abort",
    "timeout",
    "leave",
    "existing",
    "train",
    "hierarchy",
    "lost",
    "busy",
    "full",
    "stuck",
)


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("scenario", choices=SCENARIOS)
    parser.add_argument("--init-method")
    parser.add_argument("--rank", type=int)
    parser.add_argument("--world-size", type=int)
    parser.add_argument("--no-finalize", action="store_true")
    parser.add_argument("--meet")
    args = parser.parse_args()
    if args.meet is not None:
        meet(args.meet, args.rank, args.world_size)
    if args.scenario == "existing":
        existing(args.init_method, args.rank, args.world_size)
        return
    backend = dp.initialize(
        init_method=args.init_method, rank=args.rank, world_size=args.world_size
    )
    last = backend.size - 1
    if args.scenario == "basic":
        total = dp.allreduce(np.full(3, backend.rank + 1.0))
        shared = dp.broadcast(np.arange(4) * backend.rank, root=last)
        bulk = dp.allreduce(np.ones(BULK, np.float32))  # 4 MiB: a link must carry it
        result = {
            "backend": backend.name,
            "rank": backend.rank,
            "size": backend.size,
            "local": [backend.local_rank, backend.local_size],
            "allreduce": total.tolist(),
            "broadcast": shared.tolist(),
            "bulk": [float(bulk.min()), float(bulk.max())],
        }
        sys.stdout.write(f"RESULT {json.dumps(result)}\n")  # one write: launchers may interleave
        sys.stdout.flush()
    elif args.scenario == "train":
        sys.stdout.write(f"RESULT {json.dumps(train(backend.rank, backend.size))}\n")
        sys.stdout.flush()
    elif args.scenario == "hierarchy":
        sys.stdout.write(f"RESULT {json.dumps(hierarchy(backend))}\n")
        sys.stdout.flush()
    elif args.scenario in ("lost", "stuck"):
        lost(backend, stuck=args.scenario == "stuck")
    elif args.scenario == "busy":
        busy()
    elif args.scenario == "full":
        sys.stdout.write(f"RESULT {json.dumps(full(backend))}\n")
        sys.stdout.flush()
    else:
        dp.barrier()
        held = backend.iallreduce(np.ones(3), ReduceOp.SUM) if args.scenario == "leave" else None
        if backend.rank == last:
            if args.scenario == "abort":
                backend.abort(3)
            if held is not None:
                dp.finalize()  # the handle, never waited, still refers to a Gloo work object
            time.sleep(600)  # past the others' timeout: the test ends this rank once they report
            os._exit(0)
        if held is not None:
            held.wait()
        start = time.monotonic()
        try:
            dp.allreduce(np.ones(3))
        except dp.DataParallelError as exc:
            elapsed = time.monotonic() - start
            print(f"RAISED {type(exc).__name__} after {elapsed:.1f}s: {exc}", flush=True)
            os._exit(0)  # the peer is gone or stuck: nothing left to tear down cleanly
        print("NOTHING RAISED", flush=True)
        os._exit(1)
    if not args.no_finalize:
        dp.finalize()


def hierarchy(backend: object) -> dict[str, object]:
    """Every kind of allreduce a training job makes, each rank giving rank + 1 (exact sums)."""
    import torch

    from dataparallel.backends.gloo.backend import GlooBackend
    from dataparallel.backends.gloo.hierarchy import Hierarchy

    assert isinstance(backend, GlooBackend)
    # The steps' results at every kind of call, on buffers that keep the test quick: from 64 KiB
    # (the threshold below which the ring is kept is a matter of speed, not of results).
    engine_module = sys.modules[GlooBackend.__module__]
    engine_module.MIN_BYTES = 64 * 1024  # type: ignore[attr-defined]
    staged = 0
    start = Hierarchy.start  # counted on every engine: the thread's has a hierarchy of its own

    def counted(self: Hierarchy, *args: object, **kwargs: object) -> object:
        nonlocal staged
        staged += 1
        return start(self, *args, **kwargs)  # type: ignore[arg-type]

    Hierarchy.start = counted  # type: ignore[method-assign, assignment]
    hier = backend.hierarchy
    r = backend.rank + 1.0
    odd = 100_003  # no multiple of a host's ranks: the buffer is padded

    def values(x: object) -> list[float]:
        return sorted({float(v) for v in np.asarray(x, dtype=np.float64).ravel()})

    result: dict[str, object] = {
        "hierarchical": hier is not None,
        "groups": None if hier is None else [hier.local_rank, hier.local_size],
        "local": [backend.local_rank, backend.local_size],
        "shares memory": hier is not None and hier.shares_memory,
    }
    if hier is not None and hier.shares_memory:
        # Floats whose sum rounds: the same bits on every rank, through shared memory and sends.
        noisy = np.random.default_rng(backend.rank).standard_normal(odd).astype(np.float32)
        through = dp.allreduce(noisy.copy())
        shared, hier._shared = hier._shared, None  # the sends, at the same call on every rank
        by_sends = dp.allreduce(noisy.copy())
        hier._shared = shared
        result["noisy"] = hashlib.sha256(through.tobytes()).hexdigest()
        result["noisy by sends"] = hashlib.sha256(by_sends.tobytes()).hexdigest()
    for op in ("sum", "avg", "min", "max", "prod"):
        result[op] = values(dp.allreduce(np.full(odd, r, np.float32), op))
    result["int64"] = values(dp.allreduce(np.full(odd, int(r), np.int64)))
    result["float16"] = values(dp.allreduce(np.full(odd, r, np.float16)))
    result["nonblocking"] = values(dp.iallreduce(np.full(odd, r)).wait())
    result["bf16 wire"] = values(
        dp.allreduce(np.full(odd, r, np.float32), compression=dp.Compression.bf16)
    )
    grads = [torch.full((300, 301), r), torch.full((7,), r)]
    result["gradients"] = [values(g.numpy()) for g in dp.allreduce_gradients(grads)]
    result["small"] = values(dp.allreduce(np.full(8, r)))
    result["pieces"] = values(dp.allreduce(np.full(600_001, r, np.float32)))  # padded
    # Several in flight at once, each its own values, waited for in reverse: the lanes carry
    # one call's step across beside the next one's steps inside the host.
    flying = [dp.iallreduce(np.full(odd, r * (k + 1), np.float32)) for k in range(4)]
    result["in flight"] = [values(h.wait()) for h in reversed(flying)][::-1]
    result["staged"] = staged
    if hier is not None and hier.shares_memory:
        dp.barrier()  # every rank's calls ended: each file's name went once its peers mapped it
        result["files left"] = [p.name for p in SHARED_DIR.glob(f"{hier._shared.prefix}*")]
    # Training on the communication thread (DATAPARALLEL_OVERLAP=1): its engine's own groups.
    torch.manual_seed(0)
    ours, whole = torch.nn.Linear(256, 256), torch.nn.Linear(256, 256)
    whole.load_state_dict(ours.state_dict())
    opt = dp.DistributedOptimizer(torch.optim.SGD(ours.parameters(), lr=0.1))
    reference = torch.optim.SGD(whole.parameters(), lr=0.1)
    size = backend.size
    for step in range(3):
        g = torch.Generator().manual_seed(step)
        x, y = torch.randn(2 * size, 256, generator=g), torch.randn(2 * size, 256, generator=g)
        mine = slice(2 * backend.rank, 2 * backend.rank + 2)
        for m, o, xs, ys in ((ours, opt, x[mine], y[mine]), (whole, reference, x, y)):
            o.zero_grad()
            torch.nn.functional.mse_loss(m(xs), ys).backward()
            o.step()
    pairs = zip(ours.parameters(), whole.parameters(), strict=True)
    result["train diff"] = max(float((a - b).abs().max()) for a, b in pairs)
    result["train overlap"] = opt.gradient_sync.overlap
    result["train staged"] = staged - result["staged"]  # type: ignore[operator]
    return result


def busy() -> None:
    """Leave the lanes started and the communication thread inside torch's calls, as a program
    that ends right after its last step may: each call lets the GIL go and takes it back, which
    aborts the process once the interpreter finalizes, unless the library ends the thread first
    (its exit hook). The job ends when the world is finalized, and only then."""
    import threading

    import torch

    from dataparallel import world
    from dataparallel.backends.gloo import hierarchy

    dp.allreduce(np.ones(2 * hierarchy.MIN_BYTES // 4, np.float32))  # over the threshold
    x = torch.ones(64, 64)
    started = threading.Event()

    def job() -> None:
        started.set()
        while dp.initialized():
            torch.mm(x, x)

    world.current().comm_thread.submit(job)
    started.wait()
    print("LEFT", flush=True)


def full(backend: object) -> dict[str, object]:
    """Rank 1 can have no shared memory file of 1 MiB or more (as where /dev/shm is full): each
    call of that size falls back to Gloo's ring on every rank (rank 1 asks for such a file
    once), while calls of 64 KiB to 1 MiB still go through shared memory."""
    from dataparallel.backends.gloo import shared
    from dataparallel.backends.gloo.backend import GlooBackend

    assert isinstance(backend, GlooBackend) and backend.hierarchy is not None
    assert backend.hierarchy.shares_memory and not backend.hierarchy.spans_hosts
    engine_module = sys.modules[GlooBackend.__module__]
    engine_module.MIN_BYTES = 64 * 1024  # type: ignore[attr-defined]
    made = shared._map
    asked: list[int] = []

    def refusing(path: object, create: int = 0) -> object:
        if create:
            asked.append(create)
            if create >= 1 << 20:
                raise OSError(28, "No space left on device")  # what posix_fallocate raises
        return made(path, create)  # type: ignore[arg-type]

    if backend.rank == 1:
        shared._map = refusing  # type: ignore[assignment]
    through = 0
    combine = sys.modules[type(backend.hierarchy).__module__]._combiner

    def counted(*args: object) -> object:
        nonlocal through
        through += 1
        return combine(*args)

    sys.modules[type(backend.hierarchy).__module__]._combiner = counted
    r = backend.rank + 1.0
    big = [dp.allreduce(np.full(400_000, r * k, np.float32)) for k in (1, 2, 3)]
    small = dp.allreduce(np.full(30_000, r, np.float32))
    return {
        "big": [sorted({float(v) for v in b}) for b in big],
        "small": sorted({float(v) for v in small}),
        "asked": asked,
        "through shared memory": through,
    }


def lost(backend: object, stuck: bool) -> None:
    """Local rank 1 of host a (rank 1) dies in its second call (or hangs there, `stuck`), its
    shared file for the call made and written, before telling its peer; every other rank
    reports what its allreduce raised, and its host's token."""
    from dataparallel.backends.gloo import hierarchy
    from dataparallel.backends.gloo.backend import GlooBackend

    assert isinstance(backend, GlooBackend) and backend.hierarchy is not None
    assert backend.hierarchy.shares_memory
    engine_module = sys.modules[GlooBackend.__module__]
    engine_module.MIN_BYTES = 64 * 1024  # type: ignore[attr-defined]
    token = backend.hierarchy._shared.prefix  # type: ignore[union-attr]
    meet = hierarchy.Hierarchy._meet

    def dying(self: hierarchy.Hierarchy, carried: hierarchy.Carried, *args: int) -> list[int]:
        if carried.seq == 1 and stuck:  # alive, silent, until every other rank has raised
            notes = Path(os.environ["STUCK_DIR"])
            while len(list(notes.glob("raised-*"))) < backend.size - 1:
                time.sleep(0.05)
            os._exit(5)
        if carried.seq == 1:
            os._exit(7)  # its bigger file made and written, its peer waiting for its word
        return meet(self, carried, *args)

    if backend.rank == 1:
        hierarchy.Hierarchy._meet = dying  # type: ignore[method-assign]
    dp.allreduce(np.ones(100_000, np.float32))
    start = time.monotonic()
    try:
        dp.allreduce(np.ones(400_000, np.float32))
    except dp.DataParallelError as exc:
        elapsed = time.monotonic() - start
        print(f"RAISED {type(exc).__name__} after {elapsed:.1f}s: {exc}", flush=True)
        print(f"TOKEN {token}", flush=True)
        if stuck:
            (Path(os.environ["STUCK_DIR"]) / f"raised-{backend.rank}").touch()
        os._exit(0)  # the world is broken: nothing left to tear down cleanly
    print("NOTHING RAISED", flush=True)
    os._exit(1)


def train(rank: int, size: int) -> dict[str, object]:
    """Train one model on this rank's batches and one on all ranks' batches; compare them."""
    import torch

    def model() -> torch.nn.Module:
        torch.manual_seed(0)
        layers = [torch.nn.Linear(32, 512), torch.nn.Tanh(), torch.nn.Linear(512, 4)]
        return torch.nn.Sequential(*layers)

    ours, whole = model(), model()
    opt = dp.DistributedOptimizer(torch.optim.SGD(ours.parameters(), lr=0.1), bucket_bytes=1 << 14)
    reference = torch.optim.SGD(whole.parameters(), lr=0.1)
    for step in range(3):
        g = torch.Generator().manual_seed(step)
        x, y = torch.randn(4 * size, 32, generator=g), torch.randn(4 * size, 4, generator=g)
        mine = slice(4 * rank, 4 * rank + 4)
        for m, o, xs, ys in ((ours, opt, x[mine], y[mine]), (whole, reference, x, y)):
            o.zero_grad()
            torch.nn.functional.mse_loss(m(xs), ys).backward()
            o.step()
    pairs = zip(ours.parameters(), whole.parameters(), strict=True)
    diff = max(float((a - b).abs().max()) for a, b in pairs)
    sync = opt.gradient_sync
    return {"rank": rank, "diff": diff, "overlap": sync.overlap, "pause": sync._router.fusion.pause}


def meet(folder: str, rank: int, world_size: int) -> None:
    """Wait until every rank has started and imported torch.distributed (`--meet`)."""
    import torch.distributed  # noqa: F401 - the slow part of a start, done before meeting

    notes = [os.path.join(folder, str(r)) for r in range(world_size)]
    open(notes[rank], "w").close()
    while not all(os.path.exists(note) for note in notes):  # the test's time limit guards it
        time.sleep(0.01)


def existing(init_method: str, rank: int, world_size: int) -> None:
    """Initialize torch.distributed as a user would, then use dp beside it."""
    import torch
    import torch.distributed as dist

    dist.init_process_group("gloo", init_method=init_method, rank=rank, world_size=world_size)
    backend = dp.initialize("gloo")
    total = dp.allreduce(np.full(3, backend.rank + 1.0))
    shared = dp.broadcast(np.arange(4) * backend.rank, root=backend.size - 1)
    bulk = dp.allreduce(np.ones(BULK, np.float32))
    private = backend.group is not None  # type: ignore[attr-defined]
    dp.finalize()
    mine = torch.ones(2)
    dist.all_reduce(mine)  # the user's group still works
    result = {
        "backend": backend.name,
        "rank": backend.rank,
        "size": backend.size,
        "local": [backend.local_rank, backend.local_size],
        "allreduce": total.tolist(),
        "broadcast": shared.tolist(),
        "bulk": [float(bulk.min()), float(bulk.max())],
        "private group": private,
        "user allreduce": mine.tolist(),
    }
    sys.stdout.write(f"RESULT {json.dumps(result)}\n")
    sys.stdout.flush()
    dist.destroy_process_group()


if __name__ == "__main__":
    main()

"""Initialize, finalize and initialize again in one process; started by `tests/test_reinit.py`.

usage: reinit.py BACKEND [--rounds N] [--init-method URL ... [--rank R --world-size N]]

`gloo`, `mpi` and `single`: N (default 2) worlds one after the other, each with an
allreduce, a broadcast, a `DistributedOptimizer` step (summing) whose buckets go to the
communication thread (`DATAPARALLEL_OVERLAP=1`) on the private duplicate of the engine. The model
is the same in every round, and each round's optimizer is kept alive: a new world's optimizer
takes the parameters over, and the old ones, of worlds ended, reduce nothing (a gradient reduced
twice, or on a closed engine, shows). After each `dp.finalize()`,
what it must have undone: the duplicate closed, the thread stopped, `sys.excepthook` restored, the
registered caches cleared. Prints one `RESULT {json}` line per round. Gloo meets through the
launcher's variables (env://), or through `--init-method` (tcp://, file://); several
`--init-method`s are taken in turn, round by round (`env`: the launcher's variables), and the
rank and world size are the launcher's (`RANK`, `WORLD_SIZE`) unless given.

`mpi-finalized`: N MPI worlds as `mpi` makes them, then `MPI.Finalize()` (the program's own),
then `dp.initialize("mpi")` again; prints `REFUSED {type}: {message}` with what it raised.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import threading

import numpy as np

import dataparallel as dp
from dataparallel import world
from dataparallel.arrays import dtypes, tree
from dataparallel.backends import half

_kept: list[object] = []  # the model, then every round's optimizer


def one_world(backend: str, round_: int, meeting: dict[str, object]) -> dict[str, object]:
    import torch

    hook_before = sys.excepthook
    made = dp.initialize(backend, **meeting)  # type: ignore[arg-type]
    rank, size = made.rank, made.size
    total = dp.allreduce(np.full(3, rank + 1.0))
    shared = dp.broadcast(np.arange(4) * (rank + 1), root=size - 1)
    group = dp.new_group(range(size))  # freed with the world
    in_group = dp.allreduce(np.ones(1), group=group).tolist()

    if not _kept:
        torch.manual_seed(0)
        _kept.append(torch.nn.Linear(4, 2))
    model = _kept[0]
    assert isinstance(model, torch.nn.Linear)
    sgd = torch.optim.SGD(model.parameters(), lr=1.0)
    opt = dp.DistributedOptimizer(sgd, op="sum", bucket_bytes=32)
    _kept.append(opt)
    opt.zero_grad()
    before = [p.detach().clone() for p in model.parameters()]
    model(torch.full((1, 4), float(rank + 1))).sum().backward()
    opt.step()
    # SGD with lr 1 moves each parameter by minus its gradient summed over the ranks, once.
    sum_x = size * (size + 1) / 2
    weight_step = (before[0] - model.weight.detach()).tolist()
    bias_step = (before[1] - model.bias.detach()).tolist()
    active = world.current()
    private = active.private(made)
    thread_ran = any(t.name == active.comm_thread.name for t in threading.enumerate())
    hooked = sys.excepthook is not hook_before
    dp.finalize()
    try:
        group.backend  # noqa: B018 (raises once freed)
        group_freed = False
    except ValueError:
        group_freed = True
    comm_alive = any(t.name == active.comm_thread.name for t in threading.enumerate())
    return {
        "round": round_,
        "way": str(meeting.get("init_method", "env")).partition(":")[0],  # env, tcp or file
        "backend": made.name,
        "rank": rank,
        "size": size,
        "allreduce": total.tolist(),
        "broadcast": shared.tolist(),
        "group": in_group,
        "group_freed": group_freed,
        "weight_ok": bool(np.allclose(weight_step, sum_x)),
        "bias_ok": bool(np.allclose(bias_step, size)),
        "duplicate": private is not made,
        "duplicate_closed": bool(getattr(private, "_closed", True)),
        "thread_ran": thread_ran,
        "thread_stopped": not comm_alive,
        "hooked": hooked,
        "hook_restored": sys.excepthook is hook_before,
        "caches_cleared": caches_cleared(),
    }


def caches_cleared() -> bool:
    """Whether the caches registered in `dataparallel.caches` are empty (a sample of them)."""
    from dataparallel.torch import _hooks

    return not (dtypes._DTYPE_NAMES or tree._known.types or len(half._SCRATCH) or _hooks._owners)


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("backend", choices=("gloo", "mpi", "single", "mpi-finalized"))
    parser.add_argument("--rounds", type=int, default=2)
    parser.add_argument("--init-method", action="append", default=[])
    parser.add_argument("--rank", type=int)
    parser.add_argument("--world-size", type=int)
    args = parser.parse_args()
    meetings: list[dict[str, object]] = [
        {}
        if url == "env"
        else {
            "init_method": url,
            "rank": int(os.environ["RANK"]) if args.rank is None else args.rank,
            "world_size": (
                int(os.environ["WORLD_SIZE"]) if args.world_size is None else args.world_size
            ),
        }
        for url in args.init_method or ["env"]
    ]
    backend = args.backend
    for round_ in range(args.rounds):
        meeting = meetings[round_ % len(meetings)]
        result = one_world(backend.removesuffix("-finalized"), round_, meeting)
        sys.stdout.write(f"RESULT {json.dumps(result)}\n")  # one write: launchers interleave
        sys.stdout.flush()
    if backend == "mpi-finalized":
        from mpi4py import MPI

        MPI.Finalize()
        try:
            dp.initialize("mpi")
        except Exception as error:  # what the test checks
            sys.stdout.write(f"REFUSED {type(error).__name__}: {error}\n")
        else:
            sys.stdout.write("ACCEPTED\n")
        sys.stdout.flush()


if __name__ == "__main__":
    main()

"""Does MPICH reduce hierarchically? Bytes across the link of 2 hosts x 2 ranks, flat or not.

Run as root: `.venv/bin/python benchmarks/hierarchy.py [--mib 16] [--calls 10] [--pairs 2]`

When ranks share hosts, a hierarchical allreduce reduces inside each host first, so only one
host's worth of data crosses the link (Horovod's `HOROVOD_HIERARCHICAL_ALLREDUCE`). MPICH's CH4
device composes `MPI_Allreduce` from a step inside each host and one across hosts where it
chooses to (`MPIR_CVAR_ALLREDUCE_COMPOSITION`; `MPIR_CVAR_ENABLE_SMP_*` belong to the older
device and change nothing here). This measures what the `mpich` wheel does between two emulated
hosts: two network namespaces joined by a veth pair (benchmarks/
network.py's `Link`, `UCX_TLS=tcp,self`), two ranks in each, `--calls` float32 Allreduces of
`--mib` MiB a rank by raw mpi4py, by `dp.allreduce`, by torch's Gloo (a ring), and by dp's Gloo
engine as one ring and by host (`backends/gloo/hierarchy.py`), the Gloo cases the same in every
job, in jobs with MPICH's own composition and
with the flat one, the ranks numbered by host (a0 a1 b0 b1) and alternating (a0 b0 a1 b1), the
four jobs taken in turn `--pairs` times, over the link as it is or shaped (`--rate`, tc's
syntax). Printed per job: the bytes the link carried in each direction per call (the veth's
counters, read around the timed calls from inside host a), against what each algorithm
predicts, and the time per call.

`--sweep` asks the second question, for dp's Gloo engine: at which sizes and over which links do
its three steps by host beat its one ring? `--sizes` (KiB a rank) over each of `--rates` (`none`
for the link as it is, else tc's syntax), ranks numbered by host and alternating, one job per link
and layout taken in turn `--pairs` times; inside a job the two engines alternate call by call at
every size. Printed: the median time per call of each, and the ring's over the steps' (above 1:
the steps pay).

`--train` times the transformer step of `network.py` (`--d`, Adam) with each way of reducing its
gradients, ranks by host, across the link shaped to `--rate`, in one 4-rank job per `--jobs`
entry (`JOBS`), taken in turn: `dp` holds dp's `DistributedOptimizer` on a Gloo engine by host
and as one ring, on MPI (with `--modes`, also held in each mode), and DDP over Gloo; `sleep`
holds dp on MPI as the topology makes MPICH wait (sleeping between polls where the 4 ranks
outnumber the machine's cores) beside MPICH's default wait, which only yields; `hvd1` and
`hvd0` hold Horovod's `DistributedOptimizer` with `HOROVOD_HIERARCHICAL_ALLREDUCE=1` / `=0`
(from `--hvd-venv`, initialized once for the job; MPICH's waits sleeping from the start where
the ranks outnumber the cores, `horovod_waits`) beside every case of `dp`: the whole table in
one job, each row against every other in the same processes; `inside` holds dp by host with
its steps inside the hosts through shared memory and by sends (`by_sends`). Every job
also times one process alone (the floor) and dp's ring (the reference): each case's overhead is
its step minus the floor, and its ratio is to the ring measured in the same job. After each job
the link's loss counters are printed (the shaper's drops, TCP's retransmits and timeouts, the
worst socket's retransmission timeout seen): a step made slow by lost packets shows there.
`--tbf` sets the shaper's queue (tbf's options after the rate).
"""

from __future__ import annotations

import argparse
import contextlib
import dataclasses
import faulthandler
import json
import os
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))

from network import DEVICE, PORT, SHAPER, Link, described, variants, why_not  # noqa: E402

# MPICH's CH4 device picks how an Allreduce is composed: `auto` (its own choice), or 2, "NM
# only": the network module's algorithm over every rank, no step inside the hosts (flat).
COMPOSITIONS = {"auto": {}, "flat": {"MPIR_CVAR_ALLREDUCE_COMPOSITION": "2"}}
# Hydra's slots a host: 2 fills host a first (ranks by host), 1 alternates the hosts.
LAYOUTS = {"by host": 2, "alternating": 1}
# --train's dp cases, and the modes `--modes` holds dp MPI in (`network.variants`' names).
HIERARCHICAL = "dp Gloo, hierarchical (DATAPARALLEL_HIERARCHICAL=1)"
FLAT = "dp Gloo, flat (DATAPARALLEL_HIERARCHICAL=0)"
# The hierarchical case with its steps inside the hosts by sends over TCP, not shared memory
SENDS = "dp Gloo, hierarchical, sends inside the hosts"
MPI_CASE = "dp MPI (MPICH's own allreduce)"
# dp MPI with MPICH's waits only yielding (spinning) where the topology makes them sleep.
MPI_SPIN = "dp MPI, MPICH's waits only yield (DATAPARALLEL_MPI_SLEEP=0)"
DDP = "torch DDP (Gloo)"
FLAG = "HOROVOD_HIERARCHICAL_ALLREDUCE"
MODES = ("thread", "after backward")


def counters() -> tuple[int, int]:
    """This namespace's link counters: bytes sent, bytes received."""
    stats = Path("/sys/class/net") / DEVICE / "statistics"
    return int((stats / "tx_bytes").read_text()), int((stats / "rx_bytes").read_text())


@contextlib.contextmanager
def gloo_world() -> Iterator[tuple[Any, Any, Any]]:
    """A worker's world: dp over MPI (ranks, barriers, maxima), torch's Gloo group over the same
    processes, and dp's two Gloo engines over it (one ring, and by host where the ranks span
    hosts); yields (MPI's world communicator, ring, by host), and ends them all afterwards."""
    import torch.distributed as dist
    from mpi4py import MPI

    import dataparallel as dp
    from dataparallel.backends.gloo.backend import GlooBackend
    from dataparallel.config import Settings

    dp.initialize("mpi")
    comm = MPI.COMM_WORLD
    if not dist.is_initialized():  # torch's own Gloo group: DDP's, and what dp's engines run over
        url = f"tcp://{os.environ['MASTER_ADDR']}:{PORT}"
        dist.init_process_group("gloo", init_method=url, rank=comm.rank, world_size=comm.size)
    settings = Settings.from_env()
    ring = GlooBackend.create(settings=dataclasses.replace(settings, hierarchical=False))
    by_host = GlooBackend.create(settings=dataclasses.replace(settings, hierarchical=True))
    try:
        yield comm, ring, by_host
    finally:
        by_host.close()
        ring.close()
        dist.destroy_process_group()
        dp.finalize()


@contextlib.contextmanager
def by_sends() -> Iterator[Any]:
    """dp's Gloo engine by host with the steps inside the hosts by sends (`Hierarchy.scatter`),
    its communication thread's twin too: shared memory's reference in the same processes."""
    from dataparallel.backends.gloo.backend import GlooBackend
    from dataparallel.config import Settings

    def sending(engine: Any) -> Any:
        if engine.hierarchy is not None and engine.hierarchy._shared is not None:
            engine.hierarchy._shared.close()  # every rank at once: the host agrees
            engine.hierarchy._shared = None
        return engine

    settings = dataclasses.replace(Settings.from_env(), hierarchical=True)
    engine = sending(GlooBackend.create(settings=settings))
    duplicate = engine.duplicate
    engine.duplicate = lambda: sending(duplicate())
    try:
        yield engine
    finally:
        engine.close()


def report(comm: Any, result: dict[str, Any]) -> None:
    """Print a worker's figures as the one RESULT line the launching side reads (`Job`)."""
    if comm.rank == 0:
        print("RESULT " + json.dumps(result), flush=True)


def work(args: argparse.Namespace) -> None:
    """A rank: `--calls` Allreduces of each kind, the link's bytes read around each kind by the
    host's first rank (the counters are the namespace's: both of its ranks' traffic)."""
    import numpy as np
    import torch
    import torch.distributed as dist
    from mpi4py import MPI

    import dataparallel as dp
    from dataparallel.backends.base import ReduceOp

    with gloo_world() as (comm, ring, by_host):
        assert by_host.hierarchy is not None and ring.hierarchy is None
        n = args.mib * 2**20 // 4
        x = np.full(n, comm.rank + 1.0, np.float32)
        out = np.empty_like(x)
        t = torch.from_numpy(x.copy())
        result: dict[str, dict[str, float]] = {}
        kinds = {
            "MPI_Allreduce": lambda: comm.Allreduce(x, out, MPI.SUM),
            "dp.allreduce (MPI)": lambda: dp.allreduce(x),
            "torch Gloo all_reduce": lambda: dist.all_reduce(t),
            "dp Gloo, one ring": lambda: ring.allreduce(x, ReduceOp.SUM),
            "dp Gloo, by host": lambda: by_host.allreduce(x, ReduceOp.SUM),
        }
        for name, call in kinds.items():
            call()  # warm: connections made, buffers pooled
            comm.Barrier()
            before = counters()
            start = time.perf_counter()
            for _ in range(args.calls):
                call()
            comm.Barrier()
            took = (time.perf_counter() - start) / args.calls
            after = counters()
            result[name] = {
                "tx": (after[0] - before[0]) / args.calls,
                "rx": (after[1] - before[1]) / args.calls,
                "ms": took * 1e3,
            }
        check = np.full(1024, comm.rank + 1.0, np.float32)
        assert float(dp.allreduce(check)[0]) == sum(range(1, comm.size + 1)), "wrong sum"
        report(comm, result)


def sweep_work(args: argparse.Namespace) -> None:
    """A rank of `--sweep`: dp's Gloo engine as one ring and by host, alternating call by call
    at every size, so both see the same machine; each call's time is the slowest rank's."""
    import numpy as np
    from mpi4py import MPI

    from dataparallel.backends.base import ReduceOp

    with gloo_world() as (comm, ring, by_host):
        engines = {"ring": ring, "by host": by_host}
        assert engines["by host"].hierarchy is not None and engines["ring"].hierarchy is None
        result: dict[str, dict[str, float]] = {}
        for kib in (int(k) for k in args.sizes.split(",")):
            x = np.full(kib * 256, comm.rank + 1.0, np.float32)
            calls = max(args.calls, min(100, (64 * 1024) // kib))  # small sizes: more calls
            times: dict[str, list[float]] = {name: [] for name in engines}
            for engine in engines.values():  # warm: connections made, buffers pooled
                engine.allreduce(x.copy(), ReduceOp.SUM)
            for i in range(calls):
                for name in sorted(engines, reverse=bool(i % 2)):  # each goes first half the time
                    y = x.copy()
                    comm.Barrier()
                    start = time.perf_counter()
                    engines[name].allreduce(y, ReduceOp.SUM)
                    took = comm.allreduce(time.perf_counter() - start, MPI.MAX)
                    times[name].append(took)
                    assert float(y[-1]) == sum(range(1, comm.size + 1)), f"{name}: wrong sum"
            result[str(kib)] = {name: statistics.median(t) * 1e3 for name, t in times.items()}
        report(comm, result)


# --train's jobs: each is one 4-rank job of its own, with one process alone and dp's ring (the
# reference every ratio is taken against, measured in the same job) among its cases. Horovod
# reads HOROVOD_HIERARCHICAL_ALLREDUCE once, at init, and initializing it again in one process
# is not reliable (NOTES.md): each setting gets a job, initialized once for the whole of it.
JOBS: dict[str, tuple[str, ...]] = {
    "dp": (HIERARCHICAL, FLAT, MPI_CASE, DDP),
    "hvd1": (FLAT, HIERARCHICAL, MPI_CASE, DDP, "Horovod:1"),
    "hvd0": (FLAT, HIERARCHICAL, MPI_CASE, DDP, "Horovod:0"),
    "flat": (FLAT,),
    "mpi": (MPI_CASE,),
    "sleep": (FLAT, MPI_CASE, MPI_SPIN),
    "inside": (HIERARCHICAL, SENDS, FLAT),
}


def train_work(args: argparse.Namespace) -> None:
    """A rank of `--train`: the transformer step of `network.py` with each way of reducing its
    gradients that job `--job` names (`JOBS`), in interleaved rounds (`train_step.measure`), in
    the same 4 processes."""
    import copy

    import torch
    from mpi4py import MPI
    from torch import nn
    from train_step import ALONE, Horovod, measure, trainer, transformer

    import dataparallel as dp
    from dataparallel.backends.mpi.backend import SLEEP_VARIABLE
    from dataparallel.backends.mpi.library import control

    if args.stacks_after > 0:  # a job that hangs shows where each rank waits before it is killed
        faulthandler.dump_traceback_later(args.stacks_after, exit=False)
    torch.set_num_threads(1)
    wanted = JOBS[args.job]
    flags = [c.split(":")[1] for c in wanted if c.startswith("Horovod:")]
    # dp over MPI (Horovod, also MPI, runs beside it), torch's Gloo group for DDP, dp's Gloo engines
    with gloo_world() as (comm, ring, by_host), contextlib.ExitStack() as stack:
        engines = {HIERARCHICAL: by_host, FLAT: ring}
        if SENDS in wanted:
            engines[SENDS] = stack.enter_context(by_sends())
        horovod = Horovod()
        if flags and horovod.hvd is None:
            raise SystemExit(f"job {args.job} needs Horovod: {horovod.reason}")
        if flags:  # read at init; initialized once, for the whole job (its idle thread included)
            os.environ[FLAG] = flags[0]
            horovod.keep_initialized()
        g = torch.Generator().manual_seed(comm.rank)
        tokens = torch.randint(0, 1000, (args.batch, args.seq + 1), generator=g)
        batch = (tokens[:, :-1], tokens[:, 1:])

        def adam(m: nn.Module) -> torch.optim.Optimizer:
            return torch.optim.Adam(m.parameters(), lr=1e-4)

        # MPICH's wait as the cases run, Horovod's background loop's included (the process's)
        waits = f"{SLEEP_VARIABLE}={control(MPI, SLEEP_VARIABLE)}"
        result: dict[str, Any] = {"horovod": horovod.version or horovod.reason, "waits": waits}
        for d in (int(v) for v in args.d.split(",")):
            base = transformer(d)
            single = copy.deepcopy(base)
            cases: dict[str, tuple[Any, Any]] = {
                ALONE: (trainer(single, adam(single), batch), None)
            }
            syncs = {}  # each dp case's reduction: the mode its trial chose
            probed: tuple[Any, Any] | None = None  # the hierarchical case's model, optimizer
            for name in wanted:
                model = copy.deepcopy(base)
                if name in engines or name in (MPI_CASE, MPI_SPIN):
                    opt = dp.DistributedOptimizer(adam(model), backend=engines.get(name))
                    step = trainer(model, opt, batch)
                    probed = (model, opt) if name == HIERARCHICAL else probed
                    cases[name] = (spinning(step) if name == MPI_SPIN else step, None)
                    syncs[name] = opt.gradient_sync
                    if name == MPI_CASE and args.modes:  # dp MPI held in each mode: no trial
                        cases.update(variants(base, adam, batch, None, "MPI"))
                    if name == HIERARCHICAL:  # the same with bigger buckets (`--buckets`)
                        for mib in (int(v) for v in args.buckets.split(",") if v):
                            model = copy.deepcopy(base)
                            sized = dp.DistributedOptimizer(
                                adam(model), backend=by_host, bucket_bytes=mib << 20
                            )
                            label = f"{HIERARCHICAL}, {mib} MiB buckets"
                            cases[label] = (trainer(model, sized, batch), None)
                            syncs[label] = sized.gradient_sync
                elif name == DDP:
                    ddp = nn.parallel.DistributedDataParallel(model)
                    cases[name] = (trainer(ddp, adam(ddp), batch), None)
                else:
                    hopt = horovod.optimizer(adam(model), model)
                    label = f"Horovod {horovod.version} MPI, {FLAG}={flags[0]}"
                    cases[label] = (trainer(model, hopt, batch), None)
            if comm.rank == 0:
                print(f"job {args.job}, D={d}: {len(cases)} cases made; timing", flush=True)
            # Only the cases that run dp's mode trial need its steps before timing; the others
            # need their first steps (buckets made, Horovod's names negotiated) out of the way.
            warm = {name: 2 for name in cases if name not in syncs}
            samples = measure(
                cases, args.rounds, args.budget, args.tolerance, warm=warm, stall=args.stall
            )
            n = sum(p.numel() for p in base.parameters())
            chosen = {name: described(sync) for name, sync in syncs.items()}
            result[str(d)] = {"parameters": n, "samples": samples, "chosen": chosen}
            if args.phases and probed is not None:
                result[str(d)]["phases"] = phases(comm, *probed, batch, args.phases)
        if flags:  # collective: no rank shuts Horovod down while another still reduces
            comm.Barrier()
            horovod.hvd.shutdown()
        report(comm, result)


def phases(comm: Any, model: Any, opt: Any, batch: Any, steps: int) -> dict[str, float]:
    """Where the hierarchical case's step goes: `steps` more steps on rank 0, each call's
    steps timed in the hierarchy's lanes (`Hierarchy.scatter`: inside the host and the start
    across; the wait for the step across; `Hierarchy.gather`: inside the host again), against
    the end of backward and of the step. Medians over the steps, ms from each step's start;
    busy times are summed over a step's calls."""
    import torch
    from torch import nn

    from dataparallel.backends.gloo.hierarchy import Hierarchy

    spans: list[tuple[str, float, float]] = []
    scatter, gather = Hierarchy.scatter, Hierarchy.gather

    def scattered(self: Hierarchy, carried: Any) -> None:
        start = time.perf_counter()
        scatter(self, carried)
        spans.append(("inside", start, time.perf_counter()))

    def gathered(self: Hierarchy, carried: Any) -> None:
        start = time.perf_counter()
        if carried.work is not None:  # the step across, started by `scatter`
            carried.work.wait()
        crossed = time.perf_counter()
        gather(self, carried)
        spans.extend(
            [("across wait", start, crossed), ("inside again", crossed, time.perf_counter())]
        )

    x, y = batch
    loss_fn = nn.CrossEntropyLoss()
    rows: list[dict[str, float]] = []
    Hierarchy.scatter, Hierarchy.gather = scattered, gathered  # type: ignore[method-assign]
    try:
        for _ in range(steps):
            comm.Barrier()
            spans.clear()
            begin = time.perf_counter()
            opt.zero_grad()
            out = model(x)
            loss_fn(out.reshape(-1, out.shape[-1]), y.reshape(-1)).backward()
            backward = time.perf_counter()
            opt.step()
            end = time.perf_counter()
            row = {"backward ends": backward - begin, "step ends": end - begin, "calls": 0.0}
            for kind in ("inside", "across wait", "inside again"):
                mine = [(a, b) for k, a, b in spans if k == kind]
                row[f"{kind}, busy"] = sum(b - a for a, b in mine)
                if kind == "inside" and mine:
                    row["calls"] = float(len(mine))
                    row["first call starts"] = min(a for a, _ in mine) - begin
                if kind == "inside again" and mine:
                    row["last call ends"] = max(b for _, b in mine) - begin
            rows.append(row)
    finally:
        Hierarchy.scatter, Hierarchy.gather = scatter, gather  # type: ignore[method-assign]
    torch.distributed.barrier()
    keys = rows[0].keys() if rows else ()
    return {k: statistics.median(r.get(k, 0.0) for r in rows) * (1 if k == "calls" else 1e3)
            for k in keys}  # fmt: skip


def spinning(step: Any) -> Any:
    """`step`, made with MPICH's waits only yielding (`MPIR_CVAR_ENABLE_HEAVY_YIELD=0`, its
    default) whatever the topology chose (`DATAPARALLEL_MPI_SLEEP`)."""
    from mpi4py import MPI

    from dataparallel.backends.mpi.backend import SLEEP_VARIABLE
    from dataparallel.backends.mpi.library import control

    def spun() -> None:
        kept = control(MPI, SLEEP_VARIABLE, 0)
        try:
            step()
        finally:
            if kept is not None:
                control(MPI, SLEEP_VARIABLE, kept)

    return spun


class Watch:
    """The link's loss counters around a job, and the worst TCP socket state sampled during it
    (`network.Link.statistics`, `Link.sockets`): what says whether a slow step was the shaper
    dropping packets and TCP backing off."""

    def __init__(self, link: Link, every: float = 2.0) -> None:
        self.link, self.every = link, every
        self.worst = {"rto ms": 0, "backoff": 0, "retrans": 0}
        self.done = threading.Event()
        self.thread = threading.Thread(target=self._sample, daemon=True)

    def _sample(self) -> None:
        while not self.done.wait(self.every):
            for key, value in self.link.sockets().items():
                self.worst[key] = max(self.worst[key], value)

    def __enter__(self) -> Watch:
        self.before = self.link.statistics()
        self.thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self.done.set()
        self.thread.join()
        after = self.link.statistics()
        counts = {
            host: {k: after[host][k] - v for k, v in self.before[host].items()} for host in after
        }
        print(f"link during the job: {json.dumps(counts)}; worst socket seen: "
              f"{json.dumps(self.worst)}", flush=True)  # fmt: skip


def train(args: argparse.Namespace, link: Link, launcher: Path) -> int:
    """`--train`: one 4-rank job (ranks by host) per `--jobs` entry, in turn, across the link
    shaped to `--rate`; each job's table printed as it ends."""
    hvd = Path(args.hvd_venv) / "bin"
    bindir = hvd if args.hvd_venv and (hvd / "python").exists() else Path(sys.executable).parent
    worker = [str(bindir / "python"), str(HERE / "hierarchy.py"), "--worker", "--train"]
    worker += ["--d", args.d, "--rounds", str(args.rounds), "--budget", str(args.budget)]
    worker += ["--tolerance", str(args.tolerance), "--batch", str(args.batch)]
    worker += ["--seq", str(args.seq), "--stacks-after", str(max(1.0, args.timeout - 20))]
    worker += ["--stall", str(args.stall)]
    worker += ["--modes"] if args.modes else []
    worker += ["--phases", str(args.phases), "--buckets", args.buckets]
    link.shape(args.rate, args.tbf)
    if args.rate:
        print(f"link: tbf rate {args.rate} {args.tbf}", flush=True)
    for name in args.jobs.split(","):
        if name not in JOBS:
            raise SystemExit(f"--jobs: no job {name!r}; the jobs are {', '.join(JOBS)}")
        start = time.strftime("%H:%M:%S", time.gmtime())
        print(f"\n## job {name} ({', '.join(JOBS[name])}), started {start} UTC", flush=True)
        env = {**link.environment(), **horovod_waits(JOBS[name])}
        with Watch(link):
            job = Job(link, launcher, bindir, [*worker, "--job", name], args.timeout)
            result = job.result("by host", env)
        table(args, name, result)
    return 0


def horovod_waits(cases: tuple[str, ...]) -> dict[str, str]:
    """The environment a job's ranks get for Horovod: MPICH's waits sleep between polls from
    `MPI_Init` on where the job's 4 ranks outnumber the machine's cores, the rule dp's MPI world
    applies to itself (`backends/mpi/backend.crowded`). Horovod's background loop coordinates
    over MPI every cycle (1 ms) on every rank; with waits that only yield, 4 ranks on 2 cores
    spin in it and starve the steps. Nothing for jobs without Horovod."""
    from dataparallel.backends.mpi.backend import SLEEP_VARIABLE

    horovod = any(case.startswith("Horovod:") for case in cases)
    cores = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count()
    return {SLEEP_VARIABLE: "1"} if horovod and (cores or 1) < 4 else {}


def table(args: argparse.Namespace, job: str, result: dict[str, Any]) -> None:
    """Print one `--train` job's figures: each case's overhead above one process alone, and its
    ratio to dp's ring measured in the same job; the goal's ratios; the mode choice's check."""
    from train_step import ALONE

    print(f"Horovod: {result.pop('horovod')}; MPICH's waits on rank 0: {result.pop('waits')}")
    for d, figures in result.items():
        samples = figures["samples"]
        alone = samples[ALONE]
        over = {
            name: statistics.median(s - a for s, a in zip(values, alone, strict=True))
            for name, values in samples.items()
            if name != ALONE
        }
        flat = over.get(FLAT)
        print(
            f"\n2 hosts x 2 ranks (by host), link {args.rate or 'not shaped'}, D={d}, "
            f"{figures['parameters'] / 1e6:.2f} M parameters, job {job}; one process alone "
            f"{statistics.median(alone) * 1e3:.1f} ms a step, {len(alone)} rounds"
        )
        print("| case | overhead (median) | range | / dp flat |")
        print("| --- | --- | --- | --- |")
        for name, median in over.items():
            values = [(s - a) * 1e3 for s, a in zip(samples[name], alone, strict=True)]
            ratio = f"{median / flat:.2f}" if flat else "n/a"
            print(
                f"| {name} | {median * 1e3:.1f} ms | {min(values):.0f}..{max(values):.0f} ms "
                f"| {ratio} |"
            )
        if "phases" in figures:
            print(f"{HIERARCHICAL}, rank 0, ms from a step's start (medians): " + ", ".join(
                f"{k} {v:.1f}" for k, v in figures["phases"].items()))  # fmt: skip
        chosen = figures.get("chosen", {})
        for name, mode in chosen.items():
            print(f"{name}: {mode}")
        peers = [n for n in over if n.startswith(("Horovod", DDP))]
        for ours in (n for n in (HIERARCHICAL, MPI_CASE) if n in over):
            ratios = [f"{over[ours] / over[peer]:.2f}x {peer}'s" for peer in peers]
            if flat:
                ratios.insert(0, f"{over[ours] / flat:.2f}x dp flat's (goal 0.6x)")
            print(f"goal, {ours}: " + "; ".join(ratios))
        held = {mode: over.get(f"dp DistributedOptimizer MPI ({mode})") for mode in MODES}
        if MPI_CASE in chosen and None not in held.values():
            kept = next(mode for mode in MODES if chosen[MPI_CASE].startswith(mode))
            faster = min(MODES, key=lambda mode: held[mode] or 0.0)
            print(
                f"mode choice, {MPI_CASE}: kept {kept}; held, "
                + ", ".join(f"{mode} {(held[mode] or 0.0) * 1e3:.1f} ms" for mode in MODES)
                + f": the faster is {faster}, so the choice "
                + ("holds" if kept == faster else "does not hold")
            )
    sys.stdout.flush()


@dataclasses.dataclass
class Job:
    """One 4-rank MPI job of this file's worker across the link, started over ssh from host 0."""

    link: Link
    launcher: Path
    bindir: Path
    worker: list[str]
    timeout: float

    def result(self, layout: str, env: dict[str, str]) -> dict[str, dict[str, float]]:
        """Run it with ranks laid out as `layout`; return its RESULT line's figures. A job that
        fails prints what it wrote and ends this benchmark with its status."""
        hosts = ",".join(f"{a}:{LAYOUTS[layout]}" for a in self.link.addresses)
        job = [str(self.bindir / "mpiexec"), "-hosts", hosts, "-launcher", "ssh",
               "-launcher-exec", str(self.launcher), "-n", "4", *self.worker]  # fmt: skip
        try:
            done = subprocess.run(
                self.link.command(0, job), env=env, timeout=self.timeout,
                capture_output=True, text=True,
            )  # fmt: skip
        except subprocess.TimeoutExpired as late:  # say what it had done (bytes, even so)
            said = [b.decode(errors="replace") if b else "" for b in (late.stdout, late.stderr)]
            print(f"the job ran past {self.timeout:.0f} s:", *said, sep="\n")
            raise SystemExit(1) from None
        lines = [ln for ln in done.stdout.splitlines() if ln.startswith("RESULT ")]
        if done.returncode != 0 or not lines:
            print(done.stdout, done.stderr, sep="\n")
            raise SystemExit(done.returncode or 1)
        return json.loads(lines[0][len("RESULT ") :])


def sweep(args: argparse.Namespace, link: Link, launcher: Path) -> int:
    """`--sweep`: one job per link and layout, in turn, `--pairs` times."""
    bindir = Path(sys.executable).parent
    env = link.environment()
    rates = args.rates.split(",")
    cases = [(rate, layout) for rate in rates for layout in LAYOUTS]
    runs: dict[tuple[str, str], list[dict[str, dict[str, float]]]] = {c: [] for c in cases}
    worker = [str(bindir / "python"), str(HERE / "hierarchy.py"), "--worker", "--sweep"]
    worker += ["--sizes", args.sizes, "--calls", str(args.calls)]
    job = Job(link, launcher, bindir, worker, args.timeout)
    for _ in range(args.pairs):
        for rate, layout in cases:
            link.shape(None if rate == "none" else rate)
            runs[rate, layout].append(job.result(layout, env))
    print(f"2 hosts x 2 ranks, dp's Gloo engine, float32 allreduce, median ms per call "
          f"(slowest rank), {args.pairs} jobs each")  # fmt: skip
    print("| link | ranks | KiB a rank | one ring | by host | ring / by host |")
    print("| --- | --- | --- | --- | --- | --- |")
    for (rate, layout), results in runs.items():
        for kib in results[0]:
            ring = statistics.median(r[kib]["ring"] for r in results)
            steps = statistics.median(r[kib]["by host"] for r in results)
            print(f"| {rate} | {layout} | {kib} | {ring:.2f} | {steps:.2f} | {ring / steps:.2f} |")
    return 0


def launch(args: argparse.Namespace, link: Link, launcher: Path) -> int:
    """The default mode: MPICH's compositions and the Gloo engines, bytes across the link."""
    bindir = Path(sys.executable).parent
    base = link.environment()
    size = args.mib * 2**20
    cases = [(layout, how) for layout in LAYOUTS for how in COMPOSITIONS]
    runs: dict[tuple[str, str], list[dict[str, dict[str, float]]]] = {c: [] for c in cases}
    link.shape(args.rate)
    worker = [str(bindir / "python"), str(HERE / "hierarchy.py"), "--worker"]
    worker += ["--mib", str(args.mib), "--calls", str(args.calls)]
    job = Job(link, launcher, bindir, worker, args.timeout)
    for _ in range(args.pairs):
        for layout, how in cases:
            runs[layout, how].append(job.result(layout, {**base, **COMPOSITIONS[how]}))
    print(
        f"2 hosts x 2 ranks, MPI_Allreduce of {args.mib} MiB float32 a rank, {args.calls} calls, "
        f"link {args.rate or 'not shaped'}"
    )
    print("bytes across the link per call and direction, in units of the message (S)")
    print("| ranks | MPICH's composition | call | tx / S | rx / S | ms per call |")
    print("| --- | --- | --- | --- | --- | --- |")
    for (layout, how), results in runs.items():
        for kind in results[0]:
            tx = statistics.median(r[kind]["tx"] for r in results) / size
            rx = statistics.median(r[kind]["rx"] for r in results) / size
            ms = statistics.median(r[kind]["ms"] for r in results)
            print(f"| {layout} | {how} | {kind} | {tx:.2f} | {rx:.2f} | {ms:.1f} |")
    print(
        "predicted per direction: hierarchical 1.0 S (the hosts' leaders exchange halves, "
        "then the halves' sums); recursive halving (MPICH's flat algorithm for large messages) "
        "with ranks by host (a0 a1 b0 b1) 1.0 S (its first and last exchanges stay in the host), "
        "with ranks alternating (a0 b0 a1 b1) 2.0 S; a ring (Gloo's) 1.5 S by host, 3.0 S "
        "alternating"
    )
    return 0


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--mib", type=int, default=16, help="MiB a rank per Allreduce")
    parser.add_argument("--calls", type=int, default=10)
    parser.add_argument("--pairs", type=int, default=2, help="rounds of the four jobs")
    parser.add_argument("--rate", default=None, help="shape the link to this rate (1gbit)")
    parser.add_argument("--timeout", type=float, default=300, help="seconds per job")
    parser.add_argument("--sweep", action="store_true", help="dp Gloo: ring against by host")
    parser.add_argument("--sizes", default="64,256,1024,4096,16384", help="--sweep: KiB a rank")
    parser.add_argument("--rates", default="none,10gbit,1gbit", help="--sweep: links")
    parser.add_argument("--train", action="store_true", help="the transformer step, each way")
    parser.add_argument("--d", default="256", help="--train: transformer widths")
    parser.add_argument("--rounds", type=int, default=5, help="--train: rounds kept")
    parser.add_argument("--budget", type=float, default=0.3, help="--train: s per case a round")
    parser.add_argument("--tolerance", type=float, default=0.25, help="see train_step.measure")
    parser.add_argument("--batch", type=int, default=8, help="--train: sequences per rank")
    parser.add_argument("--seq", type=int, default=32, help="--train: tokens per sequence")
    parser.add_argument("--hvd-venv", default="", help="--train: Horovod's own venv, if any")
    parser.add_argument(
        "--jobs", default="dp,hvd1,hvd0", help=f"--train: the jobs, in turn ({', '.join(JOBS)})"
    )
    parser.add_argument("--job", default="dp", help=argparse.SUPPRESS)
    parser.add_argument(
        "--tbf", default=SHAPER, help="--train: tbf's options after the rate (its queue)"
    )
    parser.add_argument(
        "--modes", action="store_true", help="--train: also dp MPI held in each mode, no trial"
    )
    parser.add_argument(
        "--phases", type=int, default=0, help="--train: steps of the hierarchical case timed by "
        "phase after the rounds (rank 0)",
    )  # fmt: skip
    parser.add_argument(
        "--buckets", default="", help="--train: the hierarchical case also with buckets of "
        "these MiB (comma-separated)",
    )  # fmt: skip
    parser.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    parser.add_argument("--stacks-after", type=float, default=0.0, help=argparse.SUPPRESS)
    parser.add_argument(
        "--stall",
        type=float,
        default=120.0,
        help="--train: a rank whose next step has not begun this many s after its last prints "
        "its stacks and ends the job",
    )
    args = parser.parse_args()
    if args.worker:
        if args.train:
            train_work(args)
        else:
            sweep_work(args) if args.sweep else work(args)
        return 0
    reason = why_not()
    if reason is not None:
        print(f"skipped: {reason}")
        return 0
    mode = train if args.train else sweep if args.sweep else launch
    # One link for whichever mode runs: unshaped and removed however the mode ends.
    with Link() as link, tempfile.TemporaryDirectory() as folder:
        return mode(args, link, link.launcher(Path(folder)))


if __name__ == "__main__":
    sys.exit(main())

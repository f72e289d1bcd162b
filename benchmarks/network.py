"""Training across a real, shaped link: dataparallel beside Horovod and DDP, one rank per host.

Run as root: `.venv/bin/python benchmarks/network.py [--rates none,10,2.5,1] [--d 256,512]`
(`--backend gloo`: dataparallel on Gloo instead of MPI; Horovod then cannot run beside it;
`--script thread_wait.py`: another MPI benchmark of this folder, run across the link instead).

Builds two network namespaces joined by a veth pair (as `tests/test_multihost.py`), each with its
own hostname, and shapes both directions with `tc qdisc add dev X root tbf rate R burst 1mb latency
50ms` (no netem in this kernel); skips, saying why, without root, iproute2 or tc. One rank runs in
each namespace: under MPI, mpiexec runs in the first and MPICH's Hydra starts the second rank
through a `-launcher ssh -launcher-exec` script that runs the command in the other namespace;
`UCX_TLS=tcp,self`, else UCX finds shared memory between the namespaces and MPI's data never
crosses the shaped link (the `raw` rows show it does: they follow the rate). Under Gloo, each
rank is started in its namespace with a tcp:// rendezvous on the first one's address.

Every case runs in the same processes, in interleaved rounds (`train_step.measure`): a transformer
step (4 layers, width D, Adam, `train_step.transformer`) with one process alone (the floor), the
raw allreduce of the same bytes (one `Allreduce` of the gradients' float32, and of their 16 bits
with `half_sum`'s op on MPI; `torch.distributed.all_reduce` of a float32 and a float16 tensor on
Gloo), `dp.DistributedOptimizer` and `dp.torch.DataParallelModel`, Horovod 0.28.1's
`DistributedOptimizer` (MPI build, from the venv `--hvd-venv`, initialized only while its cases
run), and torch DDP over Gloo (fp16: `fp16_compress_hook`), each in fp32 and with fp16 compression.
Printed per case: the step's overhead (step minus one process alone, median over rounds), the raw
allreduce of the same bytes, and the share of it the case hides (1 - overhead / raw).
dataparallel's cases first run until their mode trial has chosen (`torch/_buckets.py`).

`--powersgd 1,2,4`: also dp's `DistributedOptimizer` with `dp.Compression.powersgd(rank=r)` and
DDP with torch's `powerSGD_hook` at the same ranks (both `start_iter` 10, run past it before they
are timed), and a second table: the held-out loss after `--loss-steps` steps of each case from
the same model, each step on fresh batches of a fixed Markov chain (`markov_batch`, each rank its
own, the same for every case), against the uncompressed loss (`--loss-only`: that table alone;
the link does not change it, so `mpiexec -n 2 python benchmarks/network.py --worker --loss-only
--powersgd 1,2,4 --master 127.0.0.1` gives it on one host). `--psgd-buckets auto,0.25,64` also
times dp's PowerSGD with those bucket sizes (MiB; auto: dp's own). `--psgd-before REF` also
times dp's PowerSGD with the arithmetic (`torch/_powersgd.py`'s `LowRank`) of git revision REF,
in the same processes and rounds, and prints each rank's ratio to it (a change's before and
after); `--psgd-mode after` (or `thread`) holds dp's PowerSGD cases in that mode instead of
their trial's choice, so that cases compared run alike. The loss table's run is set by
`--loss-steps`, `--loss-start` (PowerSGD's and the hook's `start_iter`), `--optimizer` (`adam`,
torch's Adam; `sgd-momentum`, SGD with Nesterov momentum, the optimizer of PowerSGD's paper, whose
momentum acts on the reduced, decompressed gradient), `--loss-lr` (its lr), `--loss-momentum`,
`--loss-every` (also the held-out loss every so many steps: the curves, each printed as its case
ends, and the mean of the run's last fifth against the uncompressed one's), `--psgd-seed` (both
PowerSGDs' `random_seed`: how far another first `Q` moves a curve) and `--loss-causal` (a causal
mask: without it each position sees its own target, the next token, `causal`). Over Gloo, torch's
hook issues a bucket's P and Q allreduces from its futures' callbacks (Gloo's thread) while the
main thread starts the next bucket's: on one process group the ranks can then number their calls
differently and crash (`group_per_bucket` says how). Running each DDP model in a job of its own, or
in a group of its own, leaves that race in place (it is inside one model's backward); so each of
the hook's buckets gets a group of its own, which keeps what users of the hook get where it works
(NCCL): its arithmetic, one state, its overlap with backward.
"""

from __future__ import annotations

import argparse
import copy
import json
import os
import re
import shutil
import statistics
import subprocess
import sys
import tempfile
from collections.abc import Callable
from pathlib import Path
from typing import Any

HERE = Path(__file__).resolve().parent
ROOT = HERE.parent
SUBNET = "10.213.78"
PORT = 29511
DEVICE = "dpnet0"  # each namespace's end of the veth pair (Gloo is told to bind to it)
RATES = {"none": None, "10": "10gbit", "2.5": "2500mbit", "1": "1gbit"}
# tbf's options after the rate: a 1 MB bucket, and as many bytes queued as 50 ms of the rate
# (tc adds the bucket to that); beyond them tbf drops.
SHAPER = "burst 1mb latency 50ms"
# TCP's counters (nstat's names) that rise when the link loses packets.
TCP_COUNTERS = ("TcpRetransSegs", "TcpExtTCPTimeouts", "TcpExtTCPLostRetransmit")


# -- the launcher: namespaces, the link, the jobs ----------------------------------------------


def _run(*argv: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(argv, capture_output=True, text=True, timeout=30, check=False)


def why_not() -> str | None:
    """Why namespaces and shaping cannot be made here (None: they can)."""
    if os.geteuid() != 0:
        return "network namespaces and tc need root"
    for tool in ("ip", "tc", "unshare"):
        if shutil.which(tool) is None:
            return f"`{tool}` is not installed (iproute2, util-linux)"
    return None


class Link:
    """Two namespaces, `<tag>a` and `<tag>b`, joined by a veth pair; removed by `close()`, or
    at the end of a `with Link() as link:` block. With `count` above 2, that many hosts joined
    by a bridge in a namespace of its own (a switch), each by a veth pair to it."""

    def __init__(self, count: int = 2) -> None:
        tag = f"dpn{os.getpid() % 10000}"
        letters = "abcdefgh"[:count]
        self.spaces = [f"{tag}{x}" for x in letters]
        self.addresses = [f"{SUBNET}.{i + 1}" for i in range(count)]
        self.hosts = [f"{tag}-host-{x}" for x in letters]
        self.made: list[str] = []
        steps: list[tuple[str, ...]] = []
        if count == 2:
            pair = [f"{tag}va", f"{tag}vb"]  # unique in the root namespace; renamed inside
            steps.append(("link", "add", pair[0], "type", "veth", "peer", "name", pair[1]))
            ends = pair
        else:
            switch = f"{tag}sw"
            self.spaces.append(switch)  # made and removed with the hosts; not a host
            steps += [("-n", switch, "link", "add", "br0", "type", "bridge"),
                      ("-n", switch, "link", "set", "br0", "up")]  # fmt: skip
            ends = [f"{tag}v{x}" for x in letters]
            for end, x in zip(ends, letters, strict=True):
                port = f"{tag}p{x}"
                steps += [
                    ("link", "add", end, "type", "veth", "peer", "name", port),
                    ("link", "set", port, "netns", switch),
                    ("-n", switch, "link", "set", port, "master", "br0"),
                    ("-n", switch, "link", "set", port, "up"),
                ]
        for space, end, address in zip(self.spaces, ends, self.addresses, strict=False):
            steps += [
                ("link", "set", end, "netns", space),
                ("-n", space, "link", "set", end, "name", DEVICE),
                ("-n", space, "addr", "add", f"{address}/24", "dev", DEVICE),
                ("-n", space, "link", "set", DEVICE, "up"),
                ("-n", space, "link", "set", "lo", "up"),
            ]
        for space in self.spaces:
            self._ip("netns", "add", space)
            self.made.append(space)
        if count > 2:
            self.spaces.pop()  # the switch
        for args in steps:
            self._ip(*args)

    def _ip(self, *args: str) -> None:
        done = _run("ip", *args)
        if done.returncode != 0:
            raise RuntimeError(f"ip {' '.join(args)}: {done.stderr.strip()}")

    def shape(self, rate: str | None, queue: str = SHAPER) -> None:
        """Limit both directions to `rate` (tc's syntax), or remove the limit (None); `queue` is
        the rest of tbf's options (its bucket and how much it queues before it drops)."""
        for space in self.spaces:
            _run("ip", "netns", "exec", space, "tc", "qdisc", "del", "dev", DEVICE, "root")
            if rate is not None:
                done = _run(
                    "ip", "netns", "exec", space, "tc", "qdisc", "add", "dev", DEVICE, "root",
                    "tbf", "rate", rate, *queue.split(),
                )  # fmt: skip
                if done.returncode != 0:
                    raise RuntimeError(f"tc in {space}: {done.stderr.strip()}")

    def statistics(self) -> dict[str, dict[str, int]]:
        """Each host's counters that say whether the link lost packets: the shaper's drops and
        overlimits (tc), and TCP's retransmitted segments and retransmission timeouts (nstat).
        They count from the link's making: compare two readings."""
        figures: dict[str, dict[str, int]] = {}
        for host, space in zip(self.hosts, self.spaces, strict=True):
            inside = ("ip", "netns", "exec", space)
            qdisc = json.loads(
                _run(*inside, "tc", "-s", "-j", "qdisc", "show", "dev", DEVICE).stdout
            )
            tcp = json.loads(_run(*inside, "nstat", "-asjz", *TCP_COUNTERS).stdout)["kernel"]
            root = qdisc[0] if qdisc else {}
            figures[host] = {
                "drops": int(root.get("drops", 0)),
                "overlimits": int(root.get("overlimits", 0)),
                **{name: int(tcp.get(name, 0)) for name in TCP_COUNTERS},
            }
        return figures

    def sockets(self) -> dict[str, int]:
        """The worst TCP state on the link now, over both hosts' sockets (`ss -ti`): the
        largest retransmission timeout (ms), its back-off count and unacknowledged retransmits."""
        worst = {"rto ms": 0, "backoff": 0, "retrans": 0}
        for space in self.spaces:
            text = _run("ip", "netns", "exec", space, "ss", "-tin").stdout
            for key, pattern in (("rto ms", r"rto:([0-9.]+)"), ("backoff", r"backoff:(\d+)"),
                                 ("retrans", r"retrans:(\d+)/")):  # fmt: skip
                for value in re.findall(pattern, text):
                    worst[key] = max(worst[key], round(float(value)))
        return worst

    def command(self, host: int, argv: list[str]) -> list[str]:
        """`argv` run in namespace `host`, under its own hostname."""
        script = f'hostname {self.hosts[host]} && exec "$@"'
        return ["ip", "netns", "exec", self.spaces[host], "unshare", "--uts", "sh", "-c", script,
                "sh", *argv]  # fmt: skip

    def environment(self) -> dict[str, str]:
        """The environment of a job across the link: this checkout's source, one thread a rank."""
        return {
            **os.environ,
            "PYTHONPATH": str(ROOT / "src"),
            "OMP_NUM_THREADS": "1",
            "UCX_TLS": "tcp,self",  # else UCX's shared memory bypasses the link
            "GLOO_SOCKET_IFNAME": DEVICE,  # the hostnames resolve to nothing: Gloo would use lo
            # ... nor can torch.distributed's store, which dp makes beside MPI on rank 0's
            # hostname unless told an address (without it rank 0 retried its own hostname for
            # 30 minutes)
            "MASTER_ADDR": self.addresses[0],
            "PYTHONUNBUFFERED": "1",
        }

    def launcher(self, folder: Path) -> Path:
        """Hydra's `-launcher-exec`: it is called as ssh would be; run the command in HOST."""
        path = folder / "netns-launcher"
        cases = "\n".join(
            f"  {a}) ns={s}; name={h};;"
            for a, s, h in zip(self.addresses, self.spaces, self.hosts, strict=True)
        )
        path.write_text(
            "#!/bin/sh\n"
            'while [ "${1#-}" != "$1" ]; do shift; done\n'
            "host=$1; shift\n"
            f'case $host in\n{cases}\n  *) echo "unknown host $host" >&2; exit 1;;\nesac\n'
            'exec ip netns exec "$ns" unshare --uts sh -c "hostname $name; exec $*"\n'
        )
        path.chmod(0o755)
        return path

    def close(self) -> None:
        for space in self.made:  # deleting a namespace deletes its end of the veth pair
            _run("ip", "netns", "delete", space)

    def __enter__(self) -> Link:
        return self

    def __exit__(self, *exc: object) -> None:
        """Unshape and remove the link, whatever happened inside the block."""
        self.shape(None)
        self.close()


def launch(args: argparse.Namespace, worker: list[str]) -> int:
    reason = why_not()
    if reason is not None:
        print(f"skipped: {reason}")
        return 0
    hvd = Path(args.hvd_venv) / "bin"
    use_hvd = args.backend == "mpi" and bool(args.hvd_venv) and (hvd / "python").exists()
    bindir = hvd if use_hvd else Path(sys.executable).parent
    python = str(bindir / "python")
    link = Link()
    env = link.environment()
    if args.backend != "mpi":
        print("Horovod not run: it runs beside dataparallel only when both use MPI")
    elif not use_hvd:
        print(f"Horovod not run: no venv at {args.hvd_venv} (../shared/peers/horovod/README.md)")
    try:
        with tempfile.TemporaryDirectory() as folder:
            launcher = link.launcher(Path(folder))
            for name in args.rates.split(","):
                link.shape(RATES[name])
                print(f"\n## link: {RATES[name] or 'not shaped'}", flush=True)
                script = [python, *worker]
                if args.backend == "mpi":
                    job = [str(bindir / "mpiexec"), "-hosts", ",".join(link.addresses),
                           "-launcher", "ssh", "-launcher-exec", str(launcher),
                           "-n", "2", "-ppn", "1", *script]  # fmt: skip
                    done = subprocess.run(link.command(0, job), env=env, timeout=args.timeout)
                else:
                    url = f"tcp://{link.addresses[0]}:{PORT}"
                    ranks = [
                        subprocess.Popen(
                            link.command(r, [*script, "--init", url, "--rank", str(r)]), env=env
                        )
                        for r in range(2)
                    ]
                    codes = [p.wait(timeout=args.timeout) for p in ranks]
                    done = subprocess.CompletedProcess([], max(codes))
                if done.returncode != 0:
                    return done.returncode
    finally:
        link.shape(None)
        link.close()
    return 0


# -- a rank: the cases -------------------------------------------------------------------------


def work(args: argparse.Namespace) -> None:
    import torch
    import torch.distributed as dist
    from torch import nn
    from torch.distributed.algorithms.ddp_comm_hooks.default_hooks import fp16_compress_hook
    from train_step import ALONE, Horovod, measure, trainer, transformer

    import dataparallel as dp

    torch.set_num_threads(1)
    if args.init:
        dp.initialize("gloo", init_method=args.init, rank=args.rank, world_size=2)
    else:
        dp.initialize("mpi")
    master = args.master or f"{SUBNET}.1"
    if not dist.is_initialized():  # dp on Gloo made torch's default group: DDP shares it
        dist.init_process_group(
            "gloo", init_method=f"tcp://{master}:{PORT + 1}", rank=dp.rank(), world_size=dp.size()
        )
    horovod = Horovod()
    mpi = dp.get_backend().name == "mpi"
    g = torch.Generator().manual_seed(dp.rank())
    tokens = torch.randint(0, 1000, (args.batch, args.seq + 1), generator=g)
    batch = (tokens[:, :-1], tokens[:, 1:])

    def adam(m: nn.Module) -> torch.optim.Optimizer:
        return torch.optim.Adam(m.parameters(), lr=1e-4)

    ranks = [int(v) for v in args.powersgd.split(",") if v]
    for d in (int(v) for v in args.d.split(",")):
        base = transformer(d)
        n = sum(p.numel() for p in base.parameters())
        if args.loss_only:
            loss_table(args, base, ranks, d)
            continue
        cases: dict[str, tuple[Callable[[], None], Any]] = {}
        single = copy.deepcopy(base)
        cases[ALONE] = (trainer(single, adam(single), batch), None)
        cases |= raw_cases(n, mpi)
        warm = []
        widths = [("fp16", dp.Compression.fp16)]
        widths = widths if args.lean else [("fp32", None), *widths]
        for bits, compression in widths:
            ours = copy.deepcopy(base)
            opt = dp.DistributedOptimizer(adam(ours), compression=compression)
            cases[f"dp DistributedOptimizer {bits}"] = (trainer(ours, opt, batch), None)
            warm += [(f"dp DistributedOptimizer {bits}", opt.gradient_sync)]
            if not args.lean:
                wrapped = dp.torch.DataParallelModel(copy.deepcopy(base), compression=compression)
                cases[f"dp DataParallelModel {bits}"] = (
                    trainer(wrapped, adam(wrapped), batch),
                    None,
                )
                warm += [(f"dp DataParallelModel {bits}", wrapped.gradient_sync)]
            if args.variants:
                cases |= variants(base, adam, batch, compression, bits)
            if horovod.hvd is not None:
                theirs = copy.deepcopy(base)
                with horovod:
                    hopt = horovod.hvd.DistributedOptimizer(
                        adam(theirs),
                        named_parameters=theirs.named_parameters(),
                        compression=getattr(
                            horovod.hvd.Compression, "fp16" if compression else "none"
                        ),
                    )
                cases[f"Horovod {bits}"] = (trainer(theirs, hopt, batch), horovod)
            ddp = nn.parallel.DistributedDataParallel(copy.deepcopy(base))
            if compression is not None:
                ddp.register_comm_hook(None, fp16_compress_hook)
            cases[f"DDP gloo {bits}"] = (trainer(ddp, adam(ddp), batch), None)
        sizes = tuple(args.psgd_buckets.split(","))
        before = low_rank_before(args.psgd_before) if args.psgd_before else None
        made = low_rank_cases(base, adam, batch, ranks, sizes, before, args.psgd_mode)
        for name, (step, sync) in made.items():
            for _ in range(LOW_RANK_START + 2):  # past start_iter: timed compressed
                step()
            cases[name] = (step, None)
            warm += [(name, sync)] if sync is not None else []
        # measure warms every case up until dp's mode trial has chosen
        samples = measure(cases, args.rounds, args.budget, args.tolerance)
        if dp.is_main():
            chosen = {name: described(s) for name, s in warm}
            report(d, n, samples, chosen, dp.get_backend().name, args.psgd_before)
        if ranks and args.loss_steps > 0:
            loss_table(args, base, ranks, d)
    if mpi:
        dist.destroy_process_group()
    dp.finalize()


# Steps reduced exactly before PowerSGD compresses (torch's hook needs more than 1).
LOW_RANK_START = 10


def low_rank_makers(
    base: Any,
    make_opt: Callable[[Any], Any],
    ranks: list[int],
    sizes: tuple[str, ...] = ("auto",),
    before: type | None = None,
    start: int = 10,
    mode: str = "auto",
    seed: int = 0,
) -> dict[str, Callable[[], tuple[Any, Any]]]:
    """Each case's maker of (what runs the model, its optimizer), fresh from `base`: dp
    uncompressed, fp16 and PowerSGD at each rank (and each bucket size of `sizes`, in MiB;
    "auto": dp's own; and with `before`'s arithmetic, `low_rank_before`); DDP uncompressed, fp16
    and its PowerSGD hook. PowerSGD (dp's and the hook) compresses from step `start`; dp's
    PowerSGD cases are held on the communication thread or after backward (`mode`: "thread",
    "after"; "auto": their trial chooses); `seed` is both PowerSGDs' `random_seed` (their
    first `Q`s)."""
    from torch import nn
    from torch.distributed.algorithms.ddp_comm_hooks import powerSGD_hook as psgd
    from torch.distributed.algorithms.ddp_comm_hooks.default_hooks import fp16_compress_hook

    import dataparallel as dp

    def ours(
        compression: Any, size: str = "auto", arithmetic: type | None = None
    ) -> Callable[[], tuple[Any, Any]]:
        def make() -> tuple[Any, Any]:
            model = copy.deepcopy(base)
            given = None if size == "auto" else int(float(size) * 2**20)
            opt = dp.DistributedOptimizer(
                make_opt(model), compression=compression, bucket_bytes=given
            )
            sync = opt.gradient_sync
            if arithmetic is not None:  # before any step: no Q, no residual yet
                sync._low.__class__ = arithmetic
            if sync._low is not None and mode != "auto":
                sync._modes.trial = None  # no trial: this mode at every step
                sync._switch(mode == "thread")
            return model, opt

        return make

    def theirs(rank: int | None, fp16: bool = False) -> Callable[[], tuple[Any, Any]]:
        def make() -> tuple[Any, Any]:
            ddp = nn.parallel.DistributedDataParallel(copy.deepcopy(base))
            if fp16:
                ddp.register_comm_hook(None, fp16_compress_hook)
            elif rank is not None:
                state = psgd.PowerSGDState(
                    None,
                    matrix_approximation_rank=rank,
                    start_powerSGD_iter=max(start, 2),
                    random_seed=seed,
                )
                ddp.register_comm_hook(state, group_per_bucket(psgd.powerSGD_hook))
            return ddp, make_opt(ddp)

        return make

    makers = {"dp fp32": ours(None), "dp fp16": ours(dp.Compression.fp16)}
    for r in ranks:
        compression = dp.Compression.powersgd(rank=r, start_iter=start, random_seed=seed)
        for size in sizes:
            name = f"dp PowerSGD rank {r}" + ("" if size == "auto" else f" ({size} MiB buckets)")
            makers[name] = ours(compression, size)
        if before is not None:
            makers[f"dp PowerSGD rank {r} (before)"] = ours(compression, "auto", before)
    makers |= {"DDP fp32": theirs(None), "DDP fp16 hook": theirs(None, fp16=True)}
    for r in ranks:
        makers[f"DDP powerSGD_hook rank {r}"] = theirs(r)
    return makers


def group_per_bucket(hook: Callable[[Any, Any], Any]) -> Callable[[Any, Any], Any]:
    """DDP's `hook`, each bucket's collectives on a process group of that bucket's own.

    torch's `powerSGD_hook` issues a bucket's P and Q allreduces from the callbacks of the
    bucket's futures, which over Gloo run on Gloo's worker thread, while the main thread goes on
    with backward and starts the next bucket's first allreduce. On one group the two threads take
    the group's sequence numbers in an order that differs from rank to rank whenever the link is
    slow enough, and the ranks then pair unlike messages (Gloo's "op.preamble.length <=
    op.nbytes", or a segfault): 4 of 8 runs of this benchmark died so. One DDP model per group
    does not avoid it: the race is between the buckets of one model's backward. A group per bucket
    does: each bucket's three calls follow one another on its group, started by one thread at a
    time, in the same order on every rank, as on NCCL; the hook's arithmetic, its one state (its
    step count, error feedback and Q's per bucket) and its overlap with backward are torch's.
    The groups are made the first time each bucket is reduced (the untimed first steps), in
    bucket order, which is the same on every rank."""
    import torch.distributed as dist

    groups: dict[int, Any] = {}

    def each_on_its_own(state, bucket):  # type: ignore[no-untyped-def]  # DDP reads annotations
        index = bucket.index()
        if index not in groups:
            groups[index] = dist.new_group(backend="gloo")
        state.process_group = groups[index]  # the hook reads it once, on this thread
        return hook(state, bucket)

    return each_on_its_own


def low_rank_before(ref: str) -> type:
    """dp's PowerSGD arithmetic (`LowRank`) as git revision `ref` of this checkout had it, for
    the cases that time a change's before beside its after: `torch/_powersgd.py` of `ref`,
    loaded as a module of its own, with what `GradientSync` now calls that `ref` lacked taken
    from today's."""
    import importlib.util

    from dataparallel.torch import _powersgd

    source = subprocess.run(
        ["git", "-C", str(ROOT), "show", f"{ref}:src/dataparallel/torch/_powersgd.py"],
        capture_output=True,
        text=True,
        check=True,
    ).stdout
    name = "_powersgd_before"
    spec = importlib.util.spec_from_loader(name, loader=None)
    assert spec is not None
    module = importlib.util.module_from_spec(spec)
    sys.modules[name] = module  # dataclasses look their module up
    exec(compile(source, f"{ref}:_powersgd.py", "exec"), module.__dict__)
    then = module.LowRank
    missing = {k: v for k, v in vars(_powersgd.LowRank).items() if not hasattr(then, k)}
    return type("LowRankBefore", (then,), missing)


def low_rank_cases(
    base: Any,
    adam: Callable[[Any], Any],
    batch: Any,
    ranks: list[int],
    sizes: tuple[str, ...],
    before: type | None = None,
    mode: str = "auto",
) -> dict[str, tuple[Callable[[], None], Any]]:
    """The PowerSGD cases to time (the fp16 and fp32 ones are timed already), each with dp's
    `GradientSync` (None for DDP's), whose mode and bucket size the table names."""
    from train_step import trainer

    makers = low_rank_makers(base, adam, ranks, sizes, before, LOW_RANK_START, mode)
    cases = {}
    for name, make in makers.items():
        if "PowerSGD" in name or "powerSGD" in name:
            net, opt = make()
            cases[name] = (trainer(net, opt, batch), getattr(opt, "gradient_sync", None))
    return cases


def markov_batch(rank: int, step: int, batch: int, seq: int) -> tuple[Any, Any]:
    """A fresh batch of a fixed Markov chain, for rank `rank` at step `step` (-1: held out):
    each token is a fixed successor of the one before it (a permutation drawn once) three times
    in four, else uniform. There is something to learn (a table) that no number of steps can
    memorize from one batch. The loss measures fitting the chain only under a causal mask
    (`--loss-causal`, `causal`): without one, each position sees its own target."""
    import torch
    from train_step import VOCAB

    successor = torch.randperm(VOCAB, generator=torch.Generator().manual_seed(7))
    g = torch.Generator().manual_seed(1_000_003 * (step + 2) + rank)
    tokens = torch.empty(batch, seq + 1, dtype=torch.long)
    tokens[:, 0] = torch.randint(0, VOCAB, (batch,), generator=g)
    for t in range(seq):
        follow = torch.rand(batch, generator=g) < 0.75
        noise = torch.randint(0, VOCAB, (batch,), generator=g)
        tokens[:, t + 1] = torch.where(follow, successor[tokens[:, t]], noise)
    return tokens[:, :-1], tokens[:, 1:]


def loss_table(args: argparse.Namespace, base: Any, ranks: list[int], d: int) -> None:
    """The loss table of `--loss-*`'s run (collective), printed by the main rank."""
    import torch

    import dataparallel as dp

    def optimizer(m: Any) -> Any:
        if args.optimizer == "sgd-momentum":
            return torch.optim.SGD(
                m.parameters(), lr=args.loss_lr, momentum=args.loss_momentum, nesterov=True
            )
        return torch.optim.Adam(m.parameters(), lr=args.loss_lr)

    names = [v for v in args.loss_cases.split(",") if v]
    if args.loss_causal:
        base = causal(base)
    curves = losses(
        base, optimizer, (args.batch, args.seq), ranks, args.loss_steps, args.loss_start,
        args.loss_every, names, args.psgd_seed,
    )  # fmt: skip
    if dp.is_main():
        report_losses(d, curves, args)


def causal(base: Any) -> Any:
    """`base` (`train_step.transformer`'s model, its very parameters) with a causal mask.

    Without one every position attends to the next, whose token is its own target: the loss
    then falls toward what the last position alone cannot know, as fast as the model learns to
    copy, and says little about the chain. With the mask a position sees only itself and those
    before it, and the loss is bounded below by the chain's entropy (about 2.287 nats)."""
    from torch import nn

    class Causal(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.embed, self.encoder, self.head = base[0], base[1], base[2]

        def forward(self, x: Any) -> Any:
            mask = nn.Transformer.generate_square_subsequent_mask(x.shape[1])
            return self.head(self.encoder(self.embed(x), mask=mask, is_causal=True))

    return Causal()


def losses(
    base: Any,
    make_opt: Callable[[Any], Any],
    shape: tuple[int, int],
    ranks: list[int],
    steps: int,
    start: int = LOW_RANK_START,
    every: int = 0,
    names: list[str] | None = None,
    seed: int = 0,
) -> dict[str, dict[int, float]]:
    """Each case's loss on held-out batches (every rank's) after `steps` steps from `base` (and
    every `every` steps before), each step on fresh batches (`markov_batch`, the same for every
    case), PowerSGD from step `start`; only the cases `names` (all: None or empty): collective."""
    import torch
    from torch import nn

    import dataparallel as dp

    loss_fn = nn.CrossEntropyLoss()
    held_x, held_y = markov_batch(dp.rank(), -1, 4 * shape[0], shape[1])
    curves: dict[str, dict[int, float]] = {}
    for name, make in low_rank_makers(base, make_opt, ranks, start=start, seed=seed).items():
        if names and name not in names:
            continue
        net, opt = make()
        curve = curves[name] = {}
        for s in range(steps + 1):
            if s == steps or (every and s and s % every == 0):
                with torch.no_grad():
                    out = net.module(held_x) if hasattr(net, "module") else net(held_x)
                    mine = loss_fn(out.reshape(-1, out.shape[-1]), held_y.reshape(-1))
                curve[s] = float(dp.allreduce(mine.reshape(1), op="avg")[0])
            if s == steps:
                break
            x, y = markov_batch(dp.rank(), s, *shape)
            opt.zero_grad()
            out = net(x)
            loss_fn(out.reshape(-1, out.shape[-1]), y.reshape(-1)).backward()
            opt.step()
        if dp.is_main():  # as it goes: a long run cut short keeps its finished cases
            print(f"loss curve, {name}: " + ", ".join(f"{s}: {v:.4f}" for s, v in curve.items()))
            sys.stdout.flush()
    return curves


def described_optimizer(args: argparse.Namespace) -> str:
    """The loss run's optimizer and its settings, as the table's heading names them."""
    if args.optimizer == "sgd-momentum":
        return f"SGD lr {args.loss_lr:g} Nesterov momentum {args.loss_momentum:g}"
    return f"Adam lr {args.loss_lr:g}"


def report_losses(d: int, curves: dict[str, dict[int, float]], args: argparse.Namespace) -> None:
    steps, start = args.loss_steps, args.loss_start
    print(
        f"\nD={d}: held-out loss after {steps} steps of fresh batches (`markov_batch`), "
        f"{described_optimizer(args)}, PowerSGD (dp's, DDP's hook) from step {start}, "
        f"seed {args.psgd_seed}" + (", causal mask" if args.loss_causal else "")
    )
    at = sorted({s for curve in curves.values() for s in curve})
    # Held-out losses of Adam move by a percent or two from one point to the next: the mean of
    # the last fifth of the run's points says more than its last point alone.
    tail = [s for s in at if s >= 0.8 * steps]
    print(
        "| case | " + " | ".join(f"step {s}" for s in at) + " | vs uncompressed "
        f"| mean of steps {tail[0]}-{steps} vs uncompressed |"
    )
    print("| --- " * (len(at) + 3) + "|")
    for name, curve in curves.items():
        ddp = name.startswith("DDP") and "DDP fp32" in curves
        reference = curves.get("DDP fp32" if ddp else "dp fp32", {})
        values = " | ".join(f"{curve[s]:.4f}" if s in curve else "" for s in at)
        versus = f"{curve[steps] / reference[steps] - 1:+.2%}" if steps in reference else "-"
        if all(s in reference and s in curve for s in tail):
            mean = sum(curve[s] for s in tail) / sum(reference[s] for s in tail) - 1
            print(f"| {name} | {values} | {versus} | {mean:+.2%} |")
        else:
            print(f"| {name} | {values} | {versus} | - |")
    sys.stdout.flush()


def variants(
    base: Any, adam: Callable[[Any], Any], batch: Any, compression: Any, bits: str
) -> dict[str, tuple[Callable[[], None], None]]:
    """dp's `DistributedOptimizer` held in each mode, with no trial: on the communication thread,
    and reduced after backward (what the trial chooses between, side by side)."""
    from train_step import trainer

    import dataparallel as dp
    from dataparallel.torch._buckets import bucket_bytes_for

    cases: dict[str, tuple[Callable[[], None], None]] = {}
    held = [("thread", True, 1), ("after backward", False, 1)]
    if compression is not None:  # buckets of as many wire bytes as float32's (twice the values)
        held.append(("thread, 2x buckets", True, 2))
    for name, overlap, times in held:
        model = copy.deepcopy(base)
        total = sum(p.numel() * p.element_size() for p in model.parameters())
        size = times * bucket_bytes_for(overlap, total, dp.world.current().settings)
        opt = dp.DistributedOptimizer(adam(model), compression=compression, bucket_bytes=size)
        sync = opt.gradient_sync
        sync._modes.trial = None  # no trial: this mode at every step
        sync._switch(overlap)
        cases[f"dp DistributedOptimizer {bits} ({name})"] = (trainer(model, opt, batch), None)
    return cases


def described(sync: Any) -> str:
    """What a `GradientSync`'s trial chose, and the medians it chose from (slowest rank)."""
    text = f"{'thread' if sync.overlap else 'after backward'}, {sync.bucket_bytes / 2**20:.2f} MiB"
    medians = sync._trial.medians if sync._trial is not None else None
    if medians is not None:
        text += f"; trial: after {medians[0] * 1e3:.1f} / thread {medians[1] * 1e3:.1f} ms"
    return text


def raw_cases(n: int, mpi: bool) -> dict[str, tuple[Callable[[], None], None]]:
    """The raw allreduce of `n` gradients' bytes, in float32 and in 16 bits, by the engine."""
    import numpy as np
    import torch
    import torch.distributed as dist

    wide, half = np.zeros(n, np.float32), torch.zeros(n, dtype=torch.float16)
    if not mpi:
        return {
            "raw allreduce fp32": (lambda: dist.all_reduce(torch.from_numpy(wide)), None),
            "raw allreduce fp16": (lambda: dist.all_reduce(half), None),
        }
    from mpi4py import MPI

    from dataparallel.backends.mpi.backend import half_sum

    comm, op16, bits = MPI.COMM_WORLD, half_sum(MPI, "float16"), half.numpy()
    return {
        "raw allreduce fp32": (lambda: comm.Allreduce(MPI.IN_PLACE, wide), None),
        "raw allreduce fp16": (
            lambda: comm.Allreduce(MPI.IN_PLACE, [bits, MPI.UINT16_T], op16),
            None,
        ),
    }


def report(
    d: int,
    n: int,
    samples: dict[str, list[float]],
    chosen: dict[str, str],
    backend: str,
    before: str = "",
) -> None:
    from train_step import ALONE

    import dataparallel as dp

    alone = samples[ALONE]
    over = {}  # a step's overhead over the one process; a raw allreduce's own time
    for name, values in samples.items():
        raw = name.startswith("raw")
        over[name] = [s if raw else s - a for s, a in zip(values, alone, strict=True)]
    med = {name: statistics.median(values) for name, values in over.items()}
    print(
        f"\nD={d}, {n / 1e6:.2f} M parameters, dp on {backend} ({dp.local_size()} rank a "
        f"node); one process alone: "
        f"{statistics.median(alone) * 1e3:.1f} ms a step, {len(alone)} rounds"
    )
    print("| case | overhead (median) | raw allreduce | hidden | rounds |")
    print("| --- | --- | --- | --- | --- |")
    for name in samples:
        if name == ALONE:
            continue
        raw = med["raw allreduce fp16" if "fp16" in name else "raw allreduce fp32"]
        low, high = min(over[name]) * 1e3, max(over[name]) * 1e3
        hidden = "" if name.startswith("raw") else f"{1 - med[name] / raw:.0%}"
        note = f" ({chosen[name]})" if name in chosen else ""
        print(
            f"| {name}{note} | {med[name] * 1e3:.1f} ms | {raw * 1e3:.1f} ms | {hidden} | "
            f"{low:.0f}..{high:.0f} ms |"
        )
    for name in (n for n in med if n.startswith("dp PowerSGD rank ")):
        peer = f"DDP powerSGD_hook rank {name.split()[3]}"
        print(
            f"{name}: overhead {med[name] / med['dp DistributedOptimizer fp16']:.2f}x dp fp16's, "
            f"{med[name] / med[peer]:.2f}x {peer}'s"
            + (
                f", {med[name] / med[then]:.2f}x {before}'s"
                if (then := f"{name} (before)") in med and not name.endswith("(before)")
                else ""
            )
        )
    sys.stdout.flush()


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rates", default="none,10,2.5,1", help=f"of {sorted(RATES)}, Gbit/s")
    parser.add_argument("--d", default="256,512", help="transformer widths")
    parser.add_argument("--backend", default="mpi", choices=("mpi", "gloo"))
    parser.add_argument("--batch", type=int, default=8, help="sequences per rank per step")
    parser.add_argument("--seq", type=int, default=32, help="tokens per sequence")
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--budget", type=float, default=0.3, help="seconds per case per round")
    parser.add_argument("--tolerance", type=float, default=0.25, help="see train_step.measure")
    parser.add_argument(
        "--variants", action="store_true", help="dp held on the thread and after backward"
    )
    parser.add_argument(
        "--script", default="", help="run this benchmark of benchmarks/ (MPI) across the link"
    )
    parser.add_argument(
        "--powersgd", default="", help="PowerSGD ranks to run (dp and DDP's hook), e.g. 1,2,4"
    )
    parser.add_argument(
        "--psgd-buckets",
        default="auto",
        help="bucket sizes of dp's PowerSGD cases, MiB (auto: dp's own), e.g. auto,4,16",
    )
    parser.add_argument(
        "--psgd-mode",
        default="auto",
        choices=("auto", "thread", "after"),
        help="hold dp's PowerSGD cases in this mode (auto: their trial chooses)",
    )
    parser.add_argument(
        "--psgd-seed", type=int, default=0, help="both PowerSGDs' random_seed (loss run)"
    )
    parser.add_argument(
        "--psgd-before", default="", help="also time dp's PowerSGD arithmetic of this git revision"
    )
    parser.add_argument(
        "--loss-steps", type=int, default=40, help="steps before the loss (0: no loss table)"
    )
    parser.add_argument(
        "--loss-start", type=int, default=LOW_RANK_START, help="PowerSGD's start_iter (loss run)"
    )
    parser.add_argument(
        "--optimizer",
        default="adam",
        choices=("adam", "sgd-momentum"),
        help="the loss run's optimizer (torch's Adam, or SGD with Nesterov momentum)",
    )
    parser.add_argument("--loss-lr", type=float, default=1e-4, help="the optimizer's lr (loss run)")
    parser.add_argument(
        "--loss-momentum", type=float, default=0.9, help="SGD's momentum (loss run, sgd-momentum)"
    )
    parser.add_argument("--loss-every", type=int, default=0, help="also the loss every N steps")
    parser.add_argument(
        "--loss-causal", action="store_true", help="a causal mask in the loss run's model"
    )
    parser.add_argument(
        "--loss-cases", default="", help="only these cases in the loss run (comma-separated)"
    )
    parser.add_argument(
        "--lean", action="store_true", help="time only fp16 beside PowerSGD (no fp32, no model)"
    )
    parser.add_argument(
        "--loss-only", action="store_true", help="only the loss table (with --powersgd)"
    )
    parser.add_argument("--hvd-venv", default="", help="Horovod's own venv, if any")
    parser.add_argument("--timeout", type=float, default=1800, help="seconds per link rate")
    parser.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    parser.add_argument("--init", default="", help=argparse.SUPPRESS)
    parser.add_argument("--rank", type=int, default=0, help=argparse.SUPPRESS)
    parser.add_argument("--master", default="", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.worker:
        sys.path.insert(0, str(HERE))
        work(args)
        return 0
    if args.script:  # another benchmark across the link (MPI), given the width
        if args.backend != "mpi":
            parser.error("--script runs an MPI benchmark: leave --backend at mpi")
        return launch(args, [str(HERE / args.script), "--d", args.d])
    worker = [str(HERE / "network.py"), "--worker", "--d", args.d]
    worker += ["--batch", str(args.batch), "--seq", str(args.seq)]
    worker += ["--rounds", str(args.rounds), "--budget", str(args.budget)]
    worker += ["--tolerance", str(args.tolerance), "--master", f"{SUBNET}.1"]
    worker += ["--variants"] if args.variants else []
    worker += ["--lean"] if args.lean else []
    worker += ["--loss-only"] if args.loss_only else []
    worker += ["--powersgd", args.powersgd, "--loss-steps", str(args.loss_steps)]
    worker += ["--psgd-buckets", args.psgd_buckets, "--psgd-before", args.psgd_before]
    worker += ["--psgd-mode", args.psgd_mode, "--psgd-seed", str(args.psgd_seed)]
    worker += ["--loss-start", str(args.loss_start), "--loss-lr", str(args.loss_lr)]
    worker += ["--loss-every", str(args.loss_every), "--loss-cases", args.loss_cases]
    worker += ["--optimizer", args.optimizer, "--loss-momentum", str(args.loss_momentum)]
    worker += ["--loss-causal"] if args.loss_causal else []
    return launch(args, worker)


if __name__ == "__main__":
    sys.exit(main())

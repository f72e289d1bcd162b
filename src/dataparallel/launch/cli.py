"""The `dataparallel` command: `run` launches a job, `info` describes what is installed.

`python -m dataparallel ...` is the same command.
"""

from __future__ import annotations

import argparse
import importlib.util
import os
import sys
from collections.abc import Sequence
from typing import TYPE_CHECKING

from dataparallel.config import DEFAULT_LINK_TIMEOUT, MIN_LINK_TIMEOUT, Settings
from dataparallel.errors import DataParallelError

if TYPE_CHECKING:
    from dataparallel.launch.hosts import HostSlots, Ssh
    from dataparallel.launch.spawn import ElasticOptions

__all__ = ["main"]

_DESCRIPTION = """\
Data-parallel training across processes and machines, for NumPy, PyTorch, JAX and CuPy.
"""

_EPILOG = """\
`dataparallel run --help` shows how to launch a job; `python -m dataparallel` is the same command.
"""

_RUN_DESCRIPTION = """\
Start SCRIPT (or -m MODULE) on N processes, each one rank of the job, with SCRIPT's ARGS in its
sys.argv. Inside, `dp.initialize()` finds the backend by itself.

--backend mpi (default) runs `mpiexec -n N python -m dataparallel.launch.runner SCRIPT ARGS`, with
the mpiexec installed beside this Python (the mpich wheel's) and this Python. --backend gloo spawns
the N processes itself with torchrun's variables (RANK, WORLD_SIZE, LOCAL_RANK, LOCAL_WORLD_SIZE,
MASTER_ADDR, MASTER_PORT) and prefixes every output line with `[rank R] `. Under MPI every rank
gets torchrun's variables too, so an unchanged torchrun script runs.

With -H a:2,b:2 or --hostfile FILE (Horovod's formats: host:slots, or host slots=N lines) the
ranks fill the hosts in order and -n defaults to their slots. Under MPI, mpiexec starts them
over ssh; under Gloo, the launcher starts those of the other hosts over ssh (-p, -i), with this
environment, in this working directory and with this interpreter, which every host must have at
the same path; their output lines are prefixed `[rank R on HOST] `.

In a Slurm allocation (salloc, sbatch) -n defaults to its tasks and may not exceed them, and Gloo
ranks start through srun on the allocated nodes; inside `srun -n 1` the ranks start in the step
(docs/slurm.md).

When a rank raises, its traceback is printed once, prefixed with its rank, and the whole job ends
at once instead of hanging. The exit status is 0 only if every rank finished its script; otherwise
the failing rank's status, 128+N for a rank killed by signal N, 1 for a rank that ended without
finishing (os._exit), 124 after --timeout, or 128+N when the launcher is stopped by signal N
(130 on Ctrl-C, which reaches every rank as KeyboardInterrupt).
"""

_RUN_EPILOG = """\
examples:
  dataparallel run -n 4 train.py --epochs 10
  dataparallel run -n 2 -m pytest -q tests/
  dataparallel run -n 2 --backend gloo --timeout 600 train.py
  dataparallel run -H node0:4,node1:4 --backend gloo train.py   # two machines, over ssh
  dataparallel run -n 16 --hostfile hosts.txt train.py     # MPI over several machines
  # two machines, 4 processes each, started by hand (run on both; node 0 has the rendezvous):
  dataparallel run -n 4 --backend gloo --nnodes 2 --node-rank 0 --master-addr node0 train.py
  dataparallel run -n 3 --min-np 2 --max-np 4 --backend gloo train.py   # elastic (Gloo)
"""

# Options of `run` that take a value: everything after the first other word is the target's.
_RUN_VALUE_OPTIONS = frozenset(
    (
        "-n",
        "--np",
        "--backend",
        "--timeout",
        "--hostfile",
        "-H",
        "--hosts",
        "-p",
        "--ssh-port",
        "-i",
        "--ssh-identity-file",
        "--link-timeout",
        "--nnodes",
        "--node-rank",
        "--master-addr",
        "--master-port",
        "--min-np",
        "--max-np",
        "--host-discovery-script",
        "--elastic-timeout",
        "--reset-limit",
    )
)
# ... and those that take two.
_RUN_PAIR_OPTIONS = frozenset(("--blacklist-cooldown-range",))


def _parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="dataparallel",
        description=_DESCRIPTION,
        epilog=_EPILOG,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    parser.add_argument("--version", action="version", version=f"%(prog)s {_version()}")
    commands = parser.add_subparsers(dest="command", metavar="{run,info}", required=True)
    run = commands.add_parser(
        "run",
        help="start a script (or -m module) on N processes, under MPI (default) or Gloo",
        description=_RUN_DESCRIPTION,
        epilog=_RUN_EPILOG,
        formatter_class=argparse.RawDescriptionHelpFormatter,
        usage="dataparallel run -n N [options] (SCRIPT | -m MODULE) [ARGS ...]",
    )
    run.add_argument(
        "-n",
        "--np",
        dest="n",
        type=int,
        help="processes to start (in a Slurm allocation: default and most, its tasks)",
    )
    run.add_argument(
        "--backend",
        choices=("mpi", "gloo"),
        default="mpi",
        help="how to start them: mpi (mpiexec, default) or gloo (local processes, torchrun-style)",
    )
    run.add_argument(
        "--timeout",
        type=float,
        metavar="S",
        help="stop the whole job after S seconds (exit status 124); sets MPIEXEC_TIMEOUT too",
    )
    run.add_argument(
        "-m",
        dest="module",
        action="store_true",
        help="run the library module MODULE as a script, as `python -m` does (e.g. -m pytest)",
    )
    hosts = run.add_argument_group("several machines (MPI, Gloo), as horovodrun")
    hosts.add_argument(
        "-H",
        "--hosts",
        metavar="H:S,...",
        help="the machines and their slots, e.g. node0:4,node1:4 (ranks fill them in order)",
    )
    hosts.add_argument(
        "--hostfile",
        metavar="FILE",
        help="the machines, one `host:slots` or `host slots=N` a line",
    )
    hosts.add_argument(
        "-p", "--ssh-port", type=int, metavar="PORT", help="Gloo: ssh to the hosts on this port"
    )
    hosts.add_argument(
        "-i",
        "--ssh-identity-file",
        metavar="FILE",
        help="Gloo: ssh to the hosts with this private key",
    )
    hosts.add_argument(
        "--link-timeout",
        type=float,
        metavar="S",
        help="a host silent for S seconds is gone (an elastic run drops it and goes on, "
        "and its workers leave; a fixed job ends, under MPI too); at least "
        f"{MIN_LINK_TIMEOUT:g}, default: {DEFAULT_LINK_TIMEOUT}",
    )
    gloo = run.add_argument_group("Gloo across machines (torchrun's numbering)")
    gloo.add_argument("--nnodes", type=int, default=1, metavar="K", help="machines (default: 1)")
    gloo.add_argument(
        "--node-rank", type=int, default=0, metavar="I", help="this machine's index, 0..K-1"
    )
    gloo.add_argument(
        "--master-addr",
        metavar="A",
        help="address of node 0, where rank 0 listens (default: 127.0.0.1; needed when K > 1)",
    )
    gloo.add_argument(
        "--master-port",
        type=int,
        metavar="P",
        help="its port (default: a free port with one machine, 29500 with several)",
    )
    _add_elastic_options(run)
    run.add_argument("script", metavar="SCRIPT", help="the Python file (or, with -m, the module)")
    run.add_argument("args", metavar="ARGS", nargs="*", help="arguments passed on to SCRIPT")
    commands.add_parser(
        "info",
        help="show what is installed here and which backends are usable",
        description="Show Python, NumPy, the MPI library and mpiexec, CUDA-awareness, the "
        "frameworks, Gloo, NCCL and GPUs found here, and for each backend whether it is usable.",
    )
    return parser


def _add_elastic_options(run: argparse.ArgumentParser) -> None:
    """Add Horovod's elastic options (`horovodrun --min-np ...`) to `run`."""
    group = run.add_argument_group(
        "elastic (Gloo): lose workers and go on, add workers (docs/elastic.md)"
    )
    group.add_argument(
        "--min-np",
        type=int,
        metavar="M",
        help="run elastically: go on while at least M workers remain (the script uses "
        "dp.elastic.run)",
    )
    group.add_argument(
        "--max-np", type=int, metavar="K", help="never more than K workers (default: -n)"
    )
    group.add_argument(
        "--host-discovery-script",
        metavar="S",
        help="an executable printing HOST:SLOTS lines (Horovod's format), run every second; "
        "new slots get new workers, over ssh on other hosts",
    )
    group.add_argument(
        "--blacklist-cooldown-range",
        type=float,
        nargs=2,
        metavar=("LOW", "HIGH"),
        help="set a host where a worker was lost aside for LOW..HIGH seconds, doubling each "
        "time (horovodrun's), instead of never using the lost slot again",
    )
    group.add_argument(
        "--elastic-timeout",
        type=float,
        default=600.0,
        metavar="S",
        help="end the run after S seconds below --min-np (default: 600, Horovod's)",
    )
    group.add_argument(
        "--reset-limit", type=int, metavar="R", help="end the run once re-formed more than R times"
    )


def _check_elastic_options(parser: argparse.ArgumentParser, ns: argparse.Namespace) -> None:
    """Reject bad elastic options with argparse's usage error (exit status 2)."""
    others = [
        flag
        for flag, value in (
            ("--max-np", ns.max_np),
            ("--host-discovery-script", ns.host_discovery_script),
            ("--reset-limit", ns.reset_limit),
            ("--blacklist-cooldown-range", ns.blacklist_cooldown_range),
        )
        if value is not None
    ]
    if ns.min_np is None:
        if others or ns.elastic_timeout != 600.0:
            parser.error(f"{', '.join(others) or '--elastic-timeout'} needs --min-np M.")
        return
    if ns.backend != "gloo":
        parser.error(
            f"--min-np with --backend {ns.backend}: MPI cannot go on without a lost rank (the "
            "mpich wheel's MPI has no ULFM, so no communicator can shrink). Elastic runs use "
            "Gloo: add --backend gloo."
        )
    if ns.nnodes != 1:
        parser.error(
            "--min-np with --nnodes: an elastic run has one launcher, which starts the workers "
            "of every host itself: give the hosts with -H or --host-discovery-script."
        )
    cooldown = ns.blacklist_cooldown_range
    if cooldown is not None and not 0 < cooldown[0] <= cooldown[1]:
        parser.error(
            "--blacklist-cooldown-range LOW HIGH needs 0 < LOW <= HIGH (seconds), got "
            f"{cooldown[0]:g} {cooldown[1]:g}."
        )
    max_np = ns.n if ns.max_np is None else ns.max_np
    if not 1 <= ns.min_np <= ns.n:
        parser.error(f"--min-np must be in 1..{ns.n} (-n), got {ns.min_np}.")
    if max_np < ns.n:
        parser.error(f"--max-np must be at least -n {ns.n}, got {max_np}.")
    if not ns.elastic_timeout > 0:
        parser.error(f"--elastic-timeout must be positive, got {ns.elastic_timeout:g}.")
    if ns.reset_limit is not None and ns.reset_limit < 0:
        parser.error(f"--reset-limit must be at least 0, got {ns.reset_limit}.")
    script = ns.host_discovery_script
    if script is not None and not (os.path.isfile(script) and os.access(script, os.X_OK)):
        parser.error(f"--host-discovery-script {script!r} is not an executable file.")


def _elastic_options(
    ns: argparse.Namespace, hosts: list[HostSlots] | None = None
) -> ElasticOptions:
    """Return the checked elastic options of `ns`, with the host list if one was given."""
    from dataparallel.launch.spawn import ElasticOptions

    cooldown = ns.blacklist_cooldown_range
    return ElasticOptions(
        min_np=ns.min_np,
        max_np=ns.n if ns.max_np is None else ns.max_np,
        discovery=ns.host_discovery_script,
        elastic_timeout=ns.elastic_timeout,
        reset_limit=ns.reset_limit,
        hosts=None if hosts is None else tuple(hosts),
        cooldown=None if cooldown is None else (cooldown[0], cooldown[1]),
    )


def _version() -> str:
    import importlib.metadata

    try:
        return importlib.metadata.version("dataparallel")
    except importlib.metadata.PackageNotFoundError:
        return "unknown"


def _split_target(argv: list[str]) -> tuple[list[str], list[str]]:
    """Split `run`'s arguments into the launcher's own and the target's (from SCRIPT on).

    argparse would read options placed after SCRIPT as the launcher's, and drops a `--` meant for
    the script, so the split is done by hand: the target starts at the first word that is neither
    an option nor an option's value (after `-m`, at the word after it), or after a lone `--`.
    """
    i = 0
    while i < len(argv):
        word = argv[i]
        if word == "--":
            return argv[:i], argv[i + 1 :]
        if word == "-m":
            return argv[: i + 1], argv[i + 1 :]
        if not word.startswith("-") or word == "-":
            return argv[:i], argv[i:]
        i += 1 + (word in _RUN_VALUE_OPTIONS) + 2 * (word in _RUN_PAIR_OPTIONS)
    return argv, []


def _module_exists(name: str) -> bool:
    """Return whether the ranks (`python -m` in this directory) can find module `name`.

    Only the top-level package is looked up, so no user code is imported into the launcher.
    """
    top = name.partition(".")[0]
    if not top.isidentifier():
        return False
    saved = list(sys.path)
    sys.path.insert(0, os.getcwd())  # the ranks run `python -m`, which puts it first
    try:
        return importlib.util.find_spec(top) is not None
    except (ImportError, ValueError):
        return False
    finally:
        sys.path[:] = saved


def _host_list(parser: argparse.ArgumentParser, ns: argparse.Namespace) -> list[HostSlots] | None:
    """Return the hosts of `-H` or `--hostfile` (None without either), rejecting bad ones."""
    from dataparallel.launch.hosts import HostError, parse_hosts, read_hostfile

    if ns.hosts is not None and ns.hostfile is not None:
        parser.error("give -H or --hostfile, not both.")
    try:
        if ns.hosts is not None:
            return parse_hosts(ns.hosts)
        if ns.hostfile is not None:
            if not os.path.isfile(ns.hostfile):
                parser.error(f"--hostfile {ns.hostfile!r} is not a file.")
            return read_hostfile(ns.hostfile)
    except HostError as exc:
        parser.error(str(exc))
    for flag, value in (
        ("-p/--ssh-port", ns.ssh_port),
        ("-i", ns.ssh_identity_file),
        ("--link-timeout", ns.link_timeout),
    ):
        if value is not None:
            parser.error(f"{flag} is for ranks started over ssh: give the hosts with -H.")
    return None


def _check_hosts(
    parser: argparse.ArgumentParser, ns: argparse.Namespace, hosts: list[HostSlots]
) -> None:
    """Reject options that do not go with a host list."""
    torchrun = [
        flag
        for flag, value, default in (("--nnodes", ns.nnodes, 1), ("--node-rank", ns.node_rank, 0))
        if value != default
    ]
    if torchrun:
        parser.error(
            f"{', '.join(torchrun)} number the machines of a job started by hand on each; with "
            "-H or --hostfile the launcher starts every machine's ranks itself: drop them."
        )
    if ns.backend == "mpi":
        ssh = [f for f, v in (("-p", ns.ssh_port), ("-i", ns.ssh_identity_file)) if v is not None]
        if ssh:
            parser.error(
                f"{', '.join(ssh)} with --backend mpi: mpiexec runs ssh itself; put Port and "
                "IdentityFile in ~/.ssh/config, or add --backend gloo."
            )
    if ns.link_timeout is not None and not ns.link_timeout >= MIN_LINK_TIMEOUT:
        parser.error(
            f"--link-timeout must be at least {MIN_LINK_TIMEOUT:g} (seconds), got "
            f"{ns.link_timeout:g}: a shorter silence may be a busy machine, not a lost link."
        )
    if ns.ssh_port is not None and not 0 < ns.ssh_port < 65536:
        parser.error(f"--ssh-port must be in 1..65535, got {ns.ssh_port}.")
    if ns.ssh_identity_file is not None and not os.path.isfile(ns.ssh_identity_file):
        parser.error(f"--ssh-identity-file {ns.ssh_identity_file!r} is not a file.")
    slots = sum(entry.slots for entry in hosts)
    if ns.n is None:
        ns.n = slots
    elif ns.n > slots:
        parser.error(f"-n {ns.n} is more than the {slots} slot(s) of the hosts.")


def _check_run(parser: argparse.ArgumentParser, ns: argparse.Namespace) -> None:
    """Reject bad `run` arguments with argparse's usage error (exit status 2)."""
    if ns.n is None:
        parser.error("-n N is required: the number of processes to start (or -H's slots).")
    if ns.n < 1:
        parser.error(f"-n must be at least 1, got {ns.n}.")
    if ns.timeout is not None and ns.timeout <= 0:
        parser.error(f"--timeout must be a positive number of seconds, got {ns.timeout:g}.")
    if ns.module:
        if not _module_exists(ns.script):
            parser.error(
                f"no module named {ns.script!r}: -m runs a module that this Python can import "
                "(from the current directory or its sys.path)."
            )
    elif not os.path.isfile(ns.script):
        parser.error(
            f"script {ns.script!r} not found: give the path of a Python file, or -m MODULE."
        )
    _check_elastic_options(parser, ns)
    if ns.backend == "mpi":
        gloo_only = [
            flag
            for flag, value, default in (
                ("--nnodes", ns.nnodes, 1),
                ("--node-rank", ns.node_rank, 0),
                ("--master-addr", ns.master_addr, None),
                ("--master-port", ns.master_port, None),
            )
            if value != default
        ]
        if gloo_only:
            parser.error(
                f"{', '.join(gloo_only)} set the Gloo rendezvous; with MPI use -H or "
                "--hostfile, or add --backend gloo."
            )
        return
    if ns.nnodes < 1 or not 0 <= ns.node_rank < ns.nnodes:
        parser.error(
            f"--node-rank must be in 0..{ns.nnodes - 1} and --nnodes at least 1, "
            f"got --nnodes {ns.nnodes} --node-rank {ns.node_rank}."
        )
    if ns.nnodes > 1 and ns.master_addr is None:
        parser.error("--nnodes > 1 needs --master-addr: the address of node 0, reachable by all.")
    if ns.master_port is not None and not 0 < ns.master_port < 65536:
        parser.error(f"--master-port must be in 1..65535, got {ns.master_port}.")


def _run(parser: argparse.ArgumentParser, argv: list[str]) -> int:
    own, target = _split_target(argv)
    # SCRIPT goes after `--` so that argparse takes it as the positional whatever it looks like;
    # without one, argparse says that SCRIPT is required.
    ns = parser.parse_args(["run", *own, *(["--", target[0]] if target else [])])
    hosts = _host_list(parser, ns)
    slurm = Settings.from_env().slurm
    if hosts is not None:  # the host list decides, not an allocation around the launcher
        _check_hosts(parser, ns, hosts)
        slurm = None
    elif slurm is not None:  # the allocation decides -n (launch/slurm.py)
        from dataparallel.launch import slurm as in_slurm

        ns.n = in_slurm.ranks(ns.n, slurm, parser.error)
    _check_run(parser, ns)
    runner_target = (["-m"] if ns.module else []) + target
    if slurm is not None and slurm.in_step and ns.backend == "mpi":
        in_slurm.leave_step()
    elif slurm is not None and not slurm.in_step and ns.backend == "gloo" and ns.nnodes == 1:
        return in_slurm.run_srun(ns.n, runner_target, timeout=ns.timeout)
    if ns.backend == "mpi":
        from dataparallel.launch.mpi import run_mpi

        link = DEFAULT_LINK_TIMEOUT if ns.link_timeout is None else ns.link_timeout
        return run_mpi(ns.n, runner_target, timeout=ns.timeout, hosts=hosts, link_timeout=link)
    if hosts is not None and ns.min_np is None:
        return _run_gloo_on_hosts(parser, ns, hosts, runner_target)
    from dataparallel.launch.spawn import Topology, run_gloo

    port = ns.master_port
    if port is None and ns.nnodes > 1:
        port = 29500  # torchrun's default: every node must agree on it without talking
    topology = Topology(
        nproc_per_node=ns.n,
        nnodes=ns.nnodes,
        node_rank=ns.node_rank,
        master_addr=ns.master_addr or "127.0.0.1",
        master_port=port,
    )
    elastic = None if ns.min_np is None else _elastic_options(ns, hosts)
    ssh = _ssh(ns)
    return run_gloo(runner_target, topology, elastic=elastic, timeout=ns.timeout, ssh=ssh)


def _ssh(ns: argparse.Namespace) -> Ssh:
    """How the launcher reaches other hosts: `-p`, `-i`, `--link-timeout`."""
    from dataparallel.launch.hosts import Ssh

    link = DEFAULT_LINK_TIMEOUT if ns.link_timeout is None else ns.link_timeout
    return Ssh(port=ns.ssh_port, identity_file=ns.ssh_identity_file, link_timeout=link)


def _run_gloo_on_hosts(
    parser: argparse.ArgumentParser,
    ns: argparse.Namespace,
    hosts: list[HostSlots],
    target: list[str],
) -> int:
    """Run a Gloo job over the machines of `hosts`: rank 0's host holds the rendezvous."""
    from dataparallel.launch.hosts import is_local, place
    from dataparallel.launch.spawn import Topology, run_gloo

    slots = place(hosts, ns.n)
    master = ns.master_addr or slots[0].host
    remote = any(not is_local(host) for host in {slot.host for slot in slots})
    if remote and master in ("localhost", "127.0.0.1", "::1"):
        parser.error(
            f"rank 0's host {master!r} is this machine's loopback, which the other hosts cannot "
            "reach: name it by an address they reach (-H), or give --master-addr."
        )
    port = ns.master_port
    if port is None and not is_local(master):
        port = 29500  # torchrun's default: the launcher cannot look for a free port there
    topology = Topology(nproc_per_node=ns.n, master_addr=master, master_port=port)
    ssh = _ssh(ns)
    return run_gloo(target, topology, timeout=ns.timeout, slots=slots, ssh=ssh)


def main(argv: Sequence[str] | None = None) -> int:
    """Run the `dataparallel` command line and return its exit status.

    Args:
        argv: the arguments after the program name (default: `sys.argv[1:]`).

    Returns:
        The exit status: the job's for `run` (0 only if every rank succeeded), 0 for `info`,
        2 for bad arguments or when the job cannot be started.
    """
    args = list(sys.argv[1:] if argv is None else argv)
    parser = _parser()
    try:
        if args and args[0] == "run":
            return _run(parser, args[1:])
        parser.parse_args(args)  # only `info` comes back: --help, --version and errors exit
        from dataparallel.launch.info import main as info

        return info()
    except DataParallelError as exc:
        print(f"dataparallel: error: {exc}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        return 130

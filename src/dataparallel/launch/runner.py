"""Run one rank of a job: `python -m dataparallel.launch.runner [options] (script | -m module) ...`.

`dataparallel run` starts every rank through this wrapper, as `python -m mpi4py` does for MPI
programs, so that a failure on one rank ends the whole job instead of leaving the others waiting
in a collective for ever. It runs the script as `__main__` with `sys.argv` set; an uncaught
exception prints its traceback once, prefixed with the rank, and aborts the job
(`MPI.COMM_WORLD.Abort`, or a non-zero exit on which the launcher stops the others); Ctrl-C
prints `[rank R] KeyboardInterrupt` and leaves with 130 without aborting (the launcher signalled
every rank), even for a rank blocked in an engine's C code where Python sees no signal
(`_Interrupts`); a normal exit runs `dp.finalize()`, and at the interpreter's exit destroys
torch's default process group where the script left it (`_destroy_torch_group`). torchrun's
variables are set before the script runs, under MPI too, so a torchrun script runs unchanged; the
run folder gets notes of how each rank ended (`dataparallel.runnotes`). Exit statuses:
docs/launching.md.

Under an MPI launcher MPI is initialized *before* the script runs (mpi4py's defaults, so
`MPI_THREAD_MULTIPLE`): a rank that fails before its own `dp.initialize()` could not abort the job
otherwise. `python -m mpi4py` differs: it lets the script set `mpi4py.rc` first.

Options (before the script):
    --prefixed     the launcher already prefixes every output line with the rank (Gloo).
    --parent PID   exit when process PID (the launcher) dies, so no rank outlives it.
    --remote       started over ssh on another host (`dataparallel.launch.hosts`): standard
                   input is the launcher's line, where it writes the name of a signal to raise
                   here (INT, TERM); its end, the launcher gone, kills this rank and its
                   process group, as does its silence for several DATAPARALLEL_LINK_TIMEOUTs
                   (where that is set, the launcher beats on it: silence is a link gone).
"""

from __future__ import annotations

import atexit
import contextlib
import ctypes
import gc
import os
import runpy
import select
import signal
import socket
import sys
import threading
import time
import traceback
from collections.abc import Callable
from dataclasses import dataclass, field
from types import ModuleType, TracebackType
from typing import BinaryIO, NoReturn

from dataparallel.config import (
    BEACON_VARIABLE,
    ELASTIC_WORKER_VARIABLE,
    LINK_TIMEOUT_VARIABLE,
    Settings,
    beat_interval,
    silence_limit,
)
from dataparallel.launch.hosts import CONTROL_SIGNALS
from dataparallel.launch.process import TORCHRUN_VARIABLES, free_port, torchrun_environment
from dataparallel.runnotes import DONE, PEER_GONE, hold_alive, note_end, note_start, running_here

__all__ = ["main", "set_torchrun_variables", "torchrun_variables"]

# `os._exit` itself, before `_watch_os_exit` wraps it.
_exit = os._exit

_USAGE = (
    "usage: python -m dataparallel.launch.runner [--prefixed] [--parent PID]"
    " [--remote] (script | -m module) [args ...]"
)


@dataclass
class _Options:
    prefixed: bool = False
    parent: int | None = None
    remote: bool = False
    module: bool = False
    target: list[str] = field(default_factory=list)


_ABORT_GRACE_S = 0.3

# The launcher's own six of torchrun's variables, in `torchrun_environment`'s order.
_LAYOUT = TORCHRUN_VARIABLES[:6]

# The status of a rank stopped by Ctrl-C, as shells give it (128 + SIGINT).
_INTERRUPTED = 128 + int(signal.SIGINT)

# After Ctrl-C, how long a rank waits for the others of its machine to note their end: less than
# the launchers' grace (`process.GRACE_SECONDS`), so that the ranks leave by themselves.
_PEERS_GRACE_S = 3.0
# How a rank blocked in an engine's C code is told from one about to see the signal: its main
# thread found at the same instruction of the same frame this many times, so far apart.
_STUCK_LOOKS, _LOOK_S = 5, 0.02
# The engines' modules: a main thread blocked under one of their frames is inside a collective.
_ENGINES = os.path.join(os.path.dirname(os.path.dirname(os.path.realpath(__file__))), "backends")


def torchrun_variables(settings: Settings, mpi: ModuleType | None) -> dict[str, str]:
    """Return torchrun's variables for this rank (empty when nothing knows them).

    An unchanged torchrun script reads them and calls `dist.init_process_group()` itself
    (env://), and libraries such as Lightning take the rank, the node and the job's layout from
    them (`process.torchrun_environment` says which and how they are valued). Under Gloo the
    launcher sets them already, under Slurm `config` derives them from the step; under MPI they
    are asked of MPI, once, before the script runs: rank and size, the rank among the processes
    of its node (`COMM_TYPE_SHARED`), the node's index among the nodes (ordered by their first
    rank) and their number, and rank 0's host name and a free port there.

    Args:
        settings: what the launcher set (torchrun's own variables, or Slurm's step).
        mpi: `mpi4py.MPI`, initialized, when an MPI launcher started this rank (collective then).
    """
    if mpi is not None:
        world = mpi.COMM_WORLD
        node = world.Split_type(mpi.COMM_TYPE_SHARED)
        local_rank, local_size = node.Get_rank(), node.Get_size()
        first = node.bcast(world.Get_rank(), root=0)  # the node's first rank names it
        node.Free()
        master = None
        if world.Get_rank() == 0:
            host = settings.master_addr or socket.gethostname()
            master = (host, settings.master_port or free_port(""))
        every = world.allgather((first, master))
        nodes = sorted({named for named, _ in every})
        host, port = every[0][1]
        return torchrun_environment(
            rank=world.Get_rank(),
            world_size=world.Get_size(),
            local_rank=local_rank,
            local_world_size=local_size,
            group_rank=nodes.index(first),
            group_world_size=len(nodes),
            master_addr=host,
            master_port=port,
        )
    return _from_settings(settings)


def _from_settings(settings: Settings) -> dict[str, str]:
    """torchrun's variables from what the launcher set (or Slurm's step): all of them where the
    layout and the rendezvous are known, else those known."""
    rank, size = settings.rank, settings.world_size
    local_rank, local_size = settings.local_rank, settings.local_world_size
    addr, port = settings.master_addr, settings.master_port
    if None in (rank, size, local_rank, local_size, addr, port):
        known = (rank, size, local_rank, local_size, addr, port)
        return {name: str(v) for name, v in zip(_LAYOUT, known, strict=True) if v is not None}
    assert rank is not None and size is not None and local_rank is not None
    assert local_size is not None and addr is not None and port is not None
    slurm = settings.slurm if settings.ranks_from_slurm else None
    if slurm is not None and slurm.nodeid is not None and slurm.nodes:
        group, groups = slurm.nodeid, len(slurm.nodes)
    else:  # torchrun's layout: each node runs `local_size` ranks, in node order
        group, groups = rank // local_size, max(1, size // local_size)
    return torchrun_environment(
        rank=rank,
        world_size=size,
        local_rank=local_rank,
        local_world_size=local_size,
        group_rank=group,
        group_world_size=groups,
        master_addr=addr,
        master_port=port,
    )


def set_torchrun_variables(mpi: ModuleType | None) -> None:
    """Put torchrun's variables into this rank's environment, keeping any already set."""
    for name, value in torchrun_variables(Settings.from_env(), mpi).items():
        os.environ.setdefault(name, value)


def _parse(argv: list[str]) -> _Options:
    options = _Options()
    args = list(argv)
    while args and args[0].startswith("-") and args[0] != "-m":
        flag = args.pop(0)
        if flag == "--prefixed":
            options.prefixed = True
        elif flag == "--parent":
            if not args or not args[0].isdigit():
                _usage_error("--parent needs the launcher's process id")
            options.parent = int(args.pop(0))
        elif flag == "--remote":
            options.remote = True
        else:
            _usage_error(f"unknown option {flag!r}")
    if args and args[0] == "-m":
        options.module = True
        args.pop(0)
    if not args:
        _usage_error("expected a script path or -m module to run")
    options.target = args
    return options


def _usage_error(message: str) -> NoReturn:
    print(f"{_USAGE}\nerror: {message}", file=sys.stderr)
    raise SystemExit(2)


def _die_with_parent(parent: int) -> None:
    """Make the kernel kill this process when `parent` dies (Linux), or watch for it elsewhere."""
    if sys.platform.startswith("linux"):
        with contextlib.suppress(OSError, AttributeError):
            pr_set_pdeathsig = 1
            ctypes.CDLL(None, use_errno=True).prctl(pr_set_pdeathsig, int(signal.SIGKILL))
    if os.getppid() != parent:  # it died before we could ask
        _exit(1)
    if not sys.platform.startswith("linux"):

        def watch() -> None:
            while os.getppid() == parent:
                time.sleep(1.0)
            _exit(1)

        threading.Thread(target=watch, name="dataparallel-parent-watch", daemon=True).start()


def _follow_launcher() -> None:
    """Take signals from the launcher on standard input, and die with the line's end.

    A rank on another host cannot be signalled by the launcher, nor see it die: the launcher
    writes a signal's name on the rank's ssh channel instead, and a channel that ends means the
    launcher (or the link to it) is gone. The rank gets a process group of its own, so that its
    children (data loader workers) die with it; the script's own standard input is /dev/null.
    """
    control = os.dup(0)
    devnull = os.open(os.devnull, os.O_RDONLY)
    os.dup2(devnull, 0)
    os.close(devnull)
    with contextlib.suppress(OSError):
        os.setpgid(0, 0)

    limit = None  # set where the launcher beats: its silence, for that long, is a link gone
    if LINK_TIMEOUT_VARIABLE in os.environ and sys.platform != "win32":
        limit = silence_limit(Settings.from_env().link_timeout)
    line = os.fdopen(control, "rb", buffering=0)
    threading.Thread(
        target=_follow, args=(line, limit), name="dataparallel-launcher-line", daemon=True
    ).start()


def _follow_beacon(address: str, rank: int) -> None:
    """Keep a line to the launcher's beacon (`launch/beacon.py`), from a rank that mpiexec
    started on another host than the launcher's: beat on it, and leave with this rank's process
    group (the host's proxy and ranks) once the launcher is silent for `silence_limit`, or gone.
    Watch this rank's connections to other hosts (MPI's, `connections.watch_every`), and report
    on the line one whose peer stopped answering for the link timeout (a split: the launcher
    hears both hosts, they do not hear each other; MPI would wait for ever). A rank on the
    launcher's machine, or one that cannot reach the beacon, is not watched."""
    from dataparallel.backends.connections import watch_every
    from dataparallel.backends.rendezvous import is_here
    from dataparallel.launch.beacon import hello, parse_address, report

    try:
        secret, host, port = parse_address(address)
        if is_here(host):
            return
        beacon = socket.create_connection((host, port), timeout=_BEACON_CONNECT)
        beacon.settimeout(None)
        beacon.sendall(hello(secret, rank))
    except (OSError, ValueError):  # unresolved, unreachable, or not an address: unwatched
        return
    link_timeout = Settings.from_env().link_timeout

    def beat() -> None:
        with contextlib.suppress(OSError):
            beacon.send(b"\n")

    def lost(peer: tuple[str, int]) -> None:
        with contextlib.suppress(OSError):
            beacon.sendall(report(peer[0]))

    watch_every(link_timeout, lost, ignore={str(os.fstat(beacon.fileno()).st_ino)})

    line = beacon.makefile("rb", buffering=0)
    threading.Thread(
        target=_follow,
        args=(line, silence_limit(link_timeout), beat, beat_interval(link_timeout)),
        name="dataparallel-beacon-line",
        daemon=True,
    ).start()


# How long a rank tries to reach the launcher's beacon (seconds): a route that does not answer
# within it leaves the rank unwatched, as it was before beacons.
_BEACON_CONNECT = 10.0


def _follow(
    line: BinaryIO,
    limit: float | None,
    beat: Callable[[], None] | None = None,
    interval: float = 1.0,
) -> None:
    """Read the launcher's `line` (a binary stream) until it ends, or until it has been silent
    for `limit` seconds (None: no limit), raising in this process the signals named on it and
    calling `beat` every `interval` seconds; then kill this process's group and leave."""
    heard = beaten = time.monotonic()
    with line:
        while True:
            if beat is not None and time.monotonic() - beaten >= interval:
                beat()
                beaten = time.monotonic()
            if limit is not None and not select.select([line], [], [], 0.1)[0]:
                silent = time.monotonic() - heard
                if silent >= limit:
                    _cut_off(silent)
                    break
                continue
            word = line.readline()
            if not word:
                break
            heard = time.monotonic()
            signum = CONTROL_SIGNALS.get(word.strip().decode(errors="replace"))
            if signum is not None:
                os.kill(os.getpid(), signum)
    with contextlib.suppress(OSError):
        os.killpg(os.getpgid(0), signal.SIGKILL)
    _exit(1)


def _cut_off(silent: float) -> None:
    """Say that this rank heard nothing from the launcher for `silent` seconds (its ssh line
    is there to see if the link comes back; the launcher has ended the job by then)."""
    who = os.environ.get("RANK") or os.environ.get(ELASTIC_WORKER_VARIABLE, "?")
    print(
        f"dataparallel: rank {who} on {socket.gethostname()} has heard nothing from the "
        f"launcher for {silent:.1f} s ({LINK_TIMEOUT_VARIABLE}, `dataparallel run "
        "--link-timeout`): the link to it is down, or it is gone; leaving with this rank's "
        "processes.",
        file=sys.stderr,
        flush=True,
    )


def _init_mpi() -> None:
    """Initialize MPI if an MPI launcher started this process and mpi4py is installed."""
    if Settings.from_env().mpi_launched:
        with contextlib.suppress(ImportError):
            from mpi4py import MPI  # noqa: F401 - importing it initializes MPI


def _live_mpi() -> ModuleType | None:
    """Return `mpi4py.MPI` if MPI is initialized and not yet finalized, else None."""
    mpi = sys.modules.get("mpi4py.MPI")
    if mpi is not None and mpi.Is_initialized() and not mpi.Is_finalized():
        return mpi
    return None


def _rank() -> str:
    mpi = _live_mpi()
    if mpi is not None:
        return str(mpi.COMM_WORLD.Get_rank())
    world = sys.modules.get("dataparallel.world")
    if world is not None and world.initialized():
        return str(world.rank())
    settings = Settings.from_env()
    rank = settings.rank if settings.rank is not None else settings.mpi_rank
    return "0" if rank is None else str(rank)  # no launcher: a world of one


def _run(options: _Options) -> None:
    sys.argv[:] = options.target
    if options.module:
        runpy.run_module(options.target[0], run_name="__main__", alter_sys=True)
        return
    script = options.target[0]
    # As `python script.py` does: the script's directory comes first on the import path.
    sys.path[0] = os.path.dirname(os.path.realpath(script))
    runpy.run_path(script, run_name="__main__")


# This wrapper's and runpy's frames (runpy is frozen in Python 3.11+, named "<frozen runpy>").
_OWN_FILES = frozenset(
    (__file__, os.path.realpath(__file__), runpy.__file__, os.path.realpath(runpy.__file__))
)


def _user_traceback(tb: TracebackType | None) -> TracebackType | None:
    """Drop the frames of this wrapper and of runpy, so the traceback starts in the user's code."""
    while tb is not None and (
        tb.tb_frame.f_code.co_filename in _OWN_FILES
        or tb.tb_frame.f_code.co_filename == "<frozen runpy>"
    ):
        tb = tb.tb_next
    return tb


def _report(text: str, prefixed: bool, rank: int | None = None) -> None:
    """Write `text` to stderr in one piece, each line prefixed with the rank (unless `prefixed`)."""
    if not prefixed:
        prefix = f"[rank {_rank() if rank is None else rank}] "
        text = "".join(prefix + line for line in text.splitlines(keepends=True))
    if not text.endswith("\n"):
        text += "\n"
    sys.stderr.write(text)


def _fail(code: int, *, abort: bool = True) -> NoReturn:
    """End this rank with `code` and, under MPI with `abort`, the whole job with it."""
    for stream in (sys.stdout, sys.stderr):
        with contextlib.suppress(Exception):
            stream.flush()
    mpi = _live_mpi()
    if mpi is not None and abort:
        # Hydra forwards a rank's output through its proxy, which stops reading once the abort
        # lands: give it a moment to forward the traceback (benchmarks/NOTES.md, "Launchers").
        time.sleep(_ABORT_GRACE_S)
        mpi.COMM_WORLD.Abort(code)
    # Not `sys.exit`: threads or atexit hooks of a failed program must not keep the rank alive.
    _exit(code)


def _exit_code(code: object, prefixed: bool) -> int:
    """Turn a `SystemExit.code` into an exit status, printing a message code as Python does."""
    if code is None:
        return 0
    if isinstance(code, int):
        return code % 256 or (1 if code else 0)  # 256 must not read as success
    _report(str(code), prefixed)
    return 1


def _guarded(call: Callable[[], object], prefixed: bool) -> tuple[int, bool]:
    """Run `call`; return the exit status it amounts to, and whether it failed because another
    rank failed or exited while this one waited on it (`RankFailedError`, alone or as a cause).
    Any failure is reported on stderr."""
    try:
        call()
    except SystemExit as exc:
        return _exit_code(exc.code, prefixed), False
    except KeyboardInterrupt:
        _report("KeyboardInterrupt", prefixed)
        return _INTERRUPTED, False
    except BaseException as exc:  # whatever the failure, it must end the job
        tb = _user_traceback(exc.__traceback__)
        _report("".join(traceback.format_exception(type(exc), exc, tb)), prefixed)
        return 1, _peer_gone(exc)
    return 0, False


def _peer_gone(exc: BaseException) -> bool:
    """Whether `exc`, or an exception it was raised from or during, is `RankFailedError`."""
    from dataparallel.errors import RankFailedError

    seen: set[int] = set()
    current: BaseException | None = exc
    while current is not None and id(current) not in seen:
        if isinstance(current, RankFailedError):
            return True
        seen.add(id(current))
        current = current.__cause__ or current.__context__
    return False


class _Interrupts:
    """Ctrl-C for a rank whose main thread is blocked inside a collective.

    Python runs a signal's handler in the main thread, between two instructions: one blocked in an
    engine's C code (`MPI_Allreduce` for a peer that never comes) never gets its
    `KeyboardInterrupt`, and under MPI mpiexec kills it once another rank has left. So the signal
    also wakes a thread here (`signal.set_wakeup_fd`). While SIGINT keeps Python's own handler,
    and the main thread stays at one instruction of a frame under an engine's module
    (`_STUCK_LOOKS` looks), that thread reports the rank's `KeyboardInterrupt` for it and ends the
    rank with status 130 (`_await_peers` first). The collective could not finish: the others got the
    same Ctrl-C. Wherever else the main thread is, it raises `KeyboardInterrupt` itself.
    """

    def __init__(self, rank: int, prefixed: bool, run_dir: str | None) -> None:
        self.rank, self.prefixed, self.run_dir = rank, prefixed, run_dir
        self._main = threading.main_thread().ident

    def start(self) -> None:
        """Be woken by every signal from now on (call from the main thread)."""
        read, write = os.pipe()
        os.set_blocking(write, False)
        try:
            signal.set_wakeup_fd(write, warn_on_full_buffer=False)
        except (ValueError, OSError):  # not the main thread: leave Ctrl-C as Python has it
            os.close(read)
            os.close(write)
            return
        # A forked child (a data loader's worker) must not wake this process's thread.
        os.register_at_fork(after_in_child=_no_wakeup)
        threading.Thread(
            target=self._watch, args=(read,), name="dataparallel-ctrl-c", daemon=True
        ).start()

    def _watch(self, read: int) -> None:
        while True:
            try:
                woken = os.read(read, 512)
            except OSError:
                return
            if not woken:
                return
            if int(signal.SIGINT) not in woken:
                continue
            if signal.getsignal(signal.SIGINT) is signal.default_int_handler and self._stuck():
                _report("KeyboardInterrupt", self.prefixed, self.rank)
                if self.run_dir is not None:
                    note_end(self.run_dir, self.rank, f"failed {_INTERRUPTED}")
                _await_peers(self.run_dir, self.rank)
                _fail(_INTERRUPTED, abort=False)

    def _stuck(self) -> bool:
        """Whether the main thread stays blocked under an engine's frame (`_STUCK_LOOKS`)."""
        seen = None
        for look in range(_STUCK_LOOKS):
            if look:
                time.sleep(_LOOK_S)  # lets the main thread take the signal, if it can
            frame = sys._current_frames().get(self._main or -1)
            if frame is None or (seen is not None and (frame, frame.f_lasti) != seen):
                return False
            seen = (frame, frame.f_lasti)
        while frame is not None:
            if os.path.realpath(frame.f_code.co_filename).startswith(_ENGINES + os.sep):
                return True
            frame = frame.f_back
        return False


def _no_wakeup() -> None:
    with contextlib.suppress(ValueError, OSError):
        signal.set_wakeup_fd(-1)


def _await_peers(run_dir: str | None, rank: int) -> None:
    """After Ctrl-C, wait (at most `_PEERS_GRACE_S`) until the other ranks of this machine have
    noted their end or ended: the first rank to exit an MPI job makes mpiexec kill the rest."""
    if run_dir is None:
        return
    deadline = time.monotonic() + _PEERS_GRACE_S
    while running_here(run_dir, rank) and time.monotonic() < deadline:
        time.sleep(0.01)


def _finalize_world() -> None:
    world = sys.modules.get("dataparallel.world")
    if world is not None and world.initialized():
        world.finalize()


def _destroy_torch_group() -> None:
    """Destroy torch's default process group where the script left it (a plain torch or
    Lightning script: `destroy_process_group()` is torch's documented shutdown), and collect
    it, while the interpreter is whole; an exit hook registered before the script runs, so it
    comes after the script's own.

    A Gloo group's worker threads free each finished call's work object, whose thread-local
    state holds a Python object: freeing it takes the GIL. Once the interpreter finalizes,
    CPython (3.11, 3.12) ends a thread that takes the GIL with `pthread_exit`, and its unwinding
    through torch's destructors calls `std::terminate` ("terminate called without an active
    exception", status 134): a rank whose last collective's work a worker had not freed yet
    aborted after its script succeeded. The group destroyed, its last reference gone (the
    collection), its threads are joined here."""
    dist = sys.modules.get("torch.distributed")
    if dist is None or not dist.is_available() or not dist.is_initialized():
        return
    dist.destroy_process_group()
    gc.collect()


def _watch_os_exit(run_dir: str, rank: int) -> None:
    """Make `os._exit` in this process note that the rank left before its script finished."""
    pid = os.getpid()

    def leave(status: int) -> NoReturn:
        if os.getpid() == pid:  # not in a forked child (a data loader's worker, ...)
            with contextlib.suppress(Exception):
                note_end(run_dir, rank, f"os._exit {status}")
        _exit(status)

    os._exit = leave


def main(argv: list[str] | None = None) -> int:
    """Run the target given on the command line as one rank; return 0 or end the job on failure.

    Args:
        argv: the runner's arguments (default: `sys.argv[1:]`).

    Returns:
        0 when the script succeeded and the world (if any) was finalized. On failure this does not
        return: it aborts the job (MPI) or exits with the failure's code.
    """
    options = _parse(sys.argv[1:] if argv is None else argv)
    if options.parent is not None:
        _die_with_parent(options.parent)
    if options.remote:
        _follow_launcher()
    run_dir = Settings.from_env().run_dir
    if run_dir is not None:  # the MPI launcher blocks SIGINT in mpiexec, which passes it on
        with contextlib.suppress(AttributeError, OSError, ValueError):
            signal.pthread_sigmask(signal.SIG_UNBLOCK, {signal.SIGINT})
    _init_mpi()
    elastic = Settings.from_env().elastic_store is not None
    if elastic:  # `dataparallel run --min-np`: join the launcher's newest round (elastic/rounds.py)
        from dataparallel import world
        from dataparallel.elastic.rounds import join, rejoin

        join(-1)
        world.on_lost_member(rejoin)  # a member lost in `dp.initialize()`: the next round
    set_torchrun_variables(_live_mpi())
    rank = int(_rank())
    beacon = os.environ.get(BEACON_VARIABLE)
    if beacon is not None and not options.remote and sys.platform != "win32":
        _follow_beacon(beacon, rank)  # mpiexec's rank across hosts: the launcher's own line
    if run_dir is not None:
        note_start(run_dir, rank)
        hold_alive(run_dir, rank)  # open until this process ends
        _watch_os_exit(run_dir, rank)
    _Interrupts(rank, options.prefixed, run_dir).start()
    atexit.register(_destroy_torch_group)
    code, peer_gone = _guarded(lambda: _run(options), options.prefixed)
    interrupted = code == _INTERRUPTED
    if code == 0:
        code, peer_gone = _guarded(_finalize_world, options.prefixed)
    if elastic and code == 0:
        from dataparallel.elastic.rounds import leave

        code, peer_gone = _guarded(leave, options.prefixed)
    if run_dir is not None:
        how = DONE if code == 0 else f"failed {code}" + (f" {PEER_GONE}" if peer_gone else "")
        note_end(run_dir, rank, how)
    if interrupted:
        _await_peers(run_dir, rank)
    if code != 0:
        _fail(code, abort=not interrupted)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())

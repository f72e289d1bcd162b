"""What a launcher does with the processes it starts: their output, notes, signals and statuses.

Every launcher (`mpi`, `spawn`, `slurm`) starts its ranks through `runner` and shares this: each
rank's output streamed to the launcher's own, every line prefixed with who wrote it (`Output`,
`pump`); the run folder where each rank notes how it ended (`RunDir`, the launcher's side of
`dataparallel.runnotes`), so that status 0 means every rank finished its script; the signals that
end a job caught instead of obeyed (`Signals`), children stopped in two steps (`stop`) or, after
Ctrl-C, given time to leave (`let_leave`); and exit statuses as shells give them.
"""

from __future__ import annotations

import contextlib
import os
import re
import select
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Callable, Iterable
from pathlib import Path
from types import FrameType
from typing import BinaryIO, TextIO

from dataparallel.config import MPI_LAUNCHER_VARIABLES, MPI_RANK_VARIABLES
from dataparallel.runnotes import DONE, INITIALIZING, PEER_GONE, READY, parse_world

__all__ = [
    "EXIT_TIMEOUT",
    "GRACE_SECONDS",
    "PARTIAL_LINE_SECONDS",
    "RUNNER",
    "TORCHRUN_VARIABLES",
    "Output",
    "RunDir",
    "Signals",
    "child_environment",
    "exit_status",
    "free_port",
    "let_leave",
    "name_ranks",
    "pump",
    "signal_name",
    "stop",
    "torchrun_environment",
    "warn",
]

# What every launcher starts on each rank: the runner, with the rank's script after it.
RUNNER = "dataparallel.launch.runner"

# torchrun's variables, as its agent gives them to each worker (torch.distributed.elastic's
# `LocalElasticAgent`): set for every rank (`torchrun_environment`), and dropped where Slurm must
# decide. The layout first, then the role (torchrun's one role, "default", is the whole job), then
# the elastic run's: no restarts, torchrun's default run id, and no store served by an agent (rank
# 0 serves it, as torch's env:// does without torchrun).
TORCHRUN_VARIABLES = (
    "RANK",
    "WORLD_SIZE",
    "LOCAL_RANK",
    "LOCAL_WORLD_SIZE",
    "MASTER_ADDR",
    "MASTER_PORT",
    "GROUP_RANK",
    "GROUP_WORLD_SIZE",
    "ROLE_RANK",
    "ROLE_NAME",
    "ROLE_WORLD_SIZE",
    "TORCHELASTIC_RESTART_COUNT",
    "TORCHELASTIC_MAX_RESTARTS",
    "TORCHELASTIC_RUN_ID",
    "TORCHELASTIC_USE_AGENT_STORE",
)


def torchrun_environment(
    *,
    rank: int,
    world_size: int,
    local_rank: int,
    local_world_size: int,
    group_rank: int,
    group_world_size: int,
    master_addr: str,
    master_port: int,
) -> dict[str, str]:
    """Return the variables torchrun gives the process `rank` of this layout, valued as torchrun
    values them (`TORCHRUN_VARIABLES`, and `TORCH_NCCL_ASYNC_ERROR_HANDLING` unless set).

    `group_rank` is the node's index (torchrun's `--node-rank`), `group_world_size` the number of
    nodes. Libraries read more than the rank: Lightning takes `TORCHELASTIC_RUN_ID` for "started
    by torchrun", and then the node from `GROUP_RANK`; torch's env:// reads
    `TORCHELASTIC_USE_AGENT_STORE`. Not set: torchrun's error file and signal list, which only its
    agent reads.
    """
    values: tuple[object, ...] = (
        *(rank, world_size, local_rank, local_world_size, master_addr, master_port),
        *(group_rank, group_world_size, rank, "default", world_size),
        *(0, 0, "none", False),
    )
    env = {name: str(value) for name, value in zip(TORCHRUN_VARIABLES, values, strict=True)}
    env["TORCH_NCCL_ASYNC_ERROR_HANDLING"] = os.environ.get("TORCH_NCCL_ASYNC_ERROR_HANDLING", "1")
    return env


# The exit status of a job that ran past `--timeout`, as coreutils' `timeout` uses.
EXIT_TIMEOUT = 124

# Seconds a child gets to exit after SIGTERM before it is killed.
GRACE_SECONDS = 5.0

# The signals that end a job; SIGHUP (a closed terminal) does not exist on Windows.
_FORWARDED = tuple(
    getattr(signal, name) for name in ("SIGINT", "SIGTERM", "SIGHUP") if hasattr(signal, name)
)


def warn(message: str) -> None:
    """Print a launcher message to stderr, flushed, so it sorts well among the ranks' output."""
    sys.stdout.flush()
    print(f"dataparallel run: {message}", file=sys.stderr, flush=True)


def exit_status(returncode: int) -> int:
    """Map a `Popen.returncode` to a shell exit status: a death by signal N becomes 128 + N."""
    return 128 - returncode if returncode < 0 else returncode


def child_environment(*, drop: Iterable[str] = ()) -> dict[str, str]:
    """Return this process's environment for a child, less the variables of an outer MPI job.

    A launcher started inside an MPI job must not make `dp.initialize()` pick MPI in its children;
    the names in `drop` go too. Output is streamed as it is printed (`PYTHONUNBUFFERED`).
    """
    hidden = {*MPI_LAUNCHER_VARIABLES, *MPI_RANK_VARIABLES, *drop}
    env = {name: value for name, value in os.environ.items() if name not in hidden}
    env.setdefault("PYTHONUNBUFFERED", "1")
    return env


def free_port(host: str = "127.0.0.1") -> int:
    """Return a TCP port on `host` that was free a moment ago (bind to port 0, read, release)."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        sock.bind((host, 0))
        port: int = sock.getsockname()[1]
        return port


def let_leave(procs: Iterable[subprocess.Popen[bytes]], grace: float = GRACE_SECONDS) -> None:
    """After Ctrl-C, wait up to `grace` seconds for `procs` to exit by themselves.

    A terminal's Ctrl-C reaches the children with the launcher (one process group): each rank
    prints `[rank R] KeyboardInterrupt` and exits 130. Stopping them at once (`stop`) would lose
    what a rank slow to get there had yet to print.
    """
    deadline = time.monotonic() + grace
    with contextlib.suppress(subprocess.TimeoutExpired):
        for proc in procs:
            proc.wait(timeout=max(0.0, deadline - time.monotonic()))


def stop(procs: Iterable[subprocess.Popen[bytes]], grace: float = GRACE_SECONDS) -> None:
    """End every process still running: SIGTERM now, SIGKILL to any alive `grace` seconds later."""
    alive = [p for p in procs if p.poll() is None]
    for proc in alive:
        with contextlib.suppress(ProcessLookupError):
            proc.terminate()
    deadline = time.monotonic() + grace
    for proc in alive:
        try:
            proc.wait(timeout=max(0.0, deadline - time.monotonic()))
        except subprocess.TimeoutExpired:
            with contextlib.suppress(ProcessLookupError):
                proc.kill()
            proc.wait()


class Signals:
    """Record SIGINT, SIGTERM and SIGHUP instead of dying, so the launcher can end its children.

    Use as a context manager around the children's lifetime; `received` is the first signal number
    caught, or None. The previous handlers come back on exit.
    """

    def __init__(self) -> None:
        self.received: int | None = None
        self._previous: dict[int, object] = {}

    def _handle(self, signum: int, frame: FrameType | None) -> None:
        if self.received is None:
            self.received = signum

    def __enter__(self) -> Signals:
        for signum in _FORWARDED:
            with contextlib.suppress(ValueError, OSError):  # not the main thread, or no such signal
                self._previous[signum] = signal.signal(signum, self._handle)
        return self

    def __exit__(self, *exc: object) -> None:
        for signum, handler in self._previous.items():
            signal.signal(signum, handler)  # type: ignore[arg-type]


# Seconds a partial line (a prompt, a progress bar being redrawn) waits before it is shown anyway.
PARTIAL_LINE_SECONDS = 0.5

# A line ends at "\n", or at a "\r" not starting "\r\n" (progress bars redraw with "\r").
_LINE_END = re.compile(rb"\n|\r(?=[^\n])")


class Output:
    """One of the launcher's streams (stdout or stderr), shared by the pumps of every rank.

    It writes whole lines at once, and remembers whose line is unfinished: a partial line shown
    early is continued without a new prefix, or closed with a newline if another rank writes first.
    """

    def __init__(self, stream: TextIO) -> None:
        self._stream = stream
        self._buffer: BinaryIO | None = getattr(stream, "buffer", None)
        self._lock = threading.Lock()
        self._open: bytes | None = None  # prefix of the rank whose line is unfinished

    def write(self, prefix: bytes, data: bytes, complete: bool) -> None:
        """Write `data` from the rank of `prefix`; `complete` when it ends its line."""
        with self._lock:
            head = b""
            if self._open != prefix:
                head = (b"\n" if self._open is not None else b"") + prefix
            self._emit(head + data)
            self._open = None if complete else prefix

    def end(self, prefix: bytes, data: bytes) -> None:
        """Write what the rank of `prefix` left without a final newline, and close its line."""
        with self._lock:
            unfinished = self._open == prefix
        if data or unfinished:
            self.write(prefix, data + b"\n", complete=True)

    def _emit(self, data: bytes) -> None:
        if self._buffer is not None:
            self._buffer.write(data)
            self._buffer.flush()
        else:
            self._stream.write(data.decode(errors="replace"))
            self._stream.flush()


def pump(
    source: BinaryIO,
    output: Output,
    prefix: bytes,
    tap: Callable[[bytes], None] | None = None,
) -> None:
    """Copy `source` to `output` until end of file, line by line, each line prefixed.

    A partial line that stays partial for `PARTIAL_LINE_SECONDS` (an `input()` prompt, a progress
    bar) is shown anyway. `tap`, if given, sees every complete line too (the MPI launcher reads
    mpiexec's report of a rank's death there).
    """
    fd = source.fileno()
    pending = b""
    while True:
        ready, _, _ = select.select([fd], [], [], PARTIAL_LINE_SECONDS)
        if not ready:
            if pending:
                output.write(prefix, pending, complete=False)
                pending = b""
            continue
        chunk = os.read(fd, 65536)
        if not chunk:
            break
        pending += chunk
        start = 0
        for match in _LINE_END.finditer(pending):
            line = pending[start : match.end()]
            output.write(prefix, line, complete=True)
            if tap is not None:
                tap(line)
            start = match.end()
        pending = pending[start:]
    output.end(prefix, pending)
    source.close()


class RunDir:
    """The run folder: a fresh one per job, read once the ranks have written their notes.

    A rank with no `end` note died outside the runner's hands: killed by a signal, or stopped by
    its launcher when another rank ended.
    """

    def __init__(self) -> None:
        self.path = tempfile.mkdtemp(prefix="dataparallel-run-")

    def _read(self, suffix: str) -> dict[int, str]:
        notes = {}
        for path in Path(self.path).glob(f"rank-*.{suffix}"):
            rank = path.name[len("rank-") : -len(suffix) - 1]
            with contextlib.suppress(OSError, ValueError):
                notes[int(rank)] = path.read_text(encoding="utf-8").strip()
        return notes

    def ends(self) -> dict[int, str]:
        """Return how each rank that noted its end ended, by rank."""
        return self._read("end")

    def alive_pipes(self, n: int) -> dict[int, int]:
        """Make the `rank-R.alive` FIFO of each of `n` ranks; return their reading ends, by fd.

        A reading end reports a hang-up once its rank has opened the FIFO and closed it (died).
        Where FIFOs cannot be made, fewer (or none) are returned.
        """
        pipes: dict[int, int] = {}
        for rank in range(n):
            path = os.path.join(self.path, f"rank-{rank}.alive")
            with contextlib.suppress(OSError, AttributeError):
                os.mkfifo(path)
                pipes[os.open(path, os.O_RDONLY | os.O_NONBLOCK)] = rank
        return pipes

    def local_pids(self) -> dict[int, int]:
        """Return the process id of each rank that runs on this machine, by rank."""
        host, pids = socket.gethostname(), {}
        for rank, text in self._read("pid").items():
            where, _, pid = text.rpartition(" ")
            if where == host and pid.isdigit():
                pids[rank] = int(pid)
        return pids

    def signal_ranks(self, n: int, signum: int) -> bool:
        """Send `signum` to every rank of `n` if all run here and are known; return whether sent."""
        pids = self.local_pids()
        if sorted(pids) != list(range(n)):
            return False
        ended = self.ends()
        for rank, pid in pids.items():
            if rank not in ended:  # a pid noted by a rank that ended may be another process now
                with contextlib.suppress(ProcessLookupError, PermissionError):
                    os.kill(pid, signum)
        return True

    def failed_for_peer(self, rank: int) -> bool:
        """Return whether rank `rank` failed because another rank failed or exited while it
        waited on it (`RankFailedError`): the other one is the job's failure, not this one."""
        return self.ends().get(rank, "").endswith(" " + PEER_GONE)

    def failed_otherwise(self, but: list[int]) -> bool:
        """Return whether a rank not in `but` noted a failure of its own (not `failed_for_peer`)."""
        return any(
            how.startswith("failed") and not how.endswith(" " + PEER_GONE)
            for rank, how in self.ends().items()
            if rank not in but
        )

    def finished(self) -> list[int]:
        """Return the ranks that noted they finished their script (whether or not gone yet)."""
        return sorted(rank for rank, how in self.ends().items() if how == DONE)

    def left_early(self) -> bool:
        """Return whether a rank left through `os._exit(0)` before its script finished."""
        return any(how == "os._exit 0" for how in self.ends().values())

    def unfinished_rank(self, rank: int) -> str | None:
        """Return why rank `rank`, which exited with status 0, did not finish, or None if it did."""
        how = self.ends().get(rank)
        if how == DONE:
            return None
        if how is not None and how.startswith("os._exit"):
            return _left(rank, how)
        return f"rank {rank} exited with status 0 before its script finished"

    def unfinished(self, n: int) -> str | None:
        """Return why the job of `n` ranks did not succeed on every rank, or None if it did.

        Meant for a job whose launcher reports success: each rank must have noted `done`.
        """
        ends = self.ends()
        missing = [r for r in range(n) if ends.get(r) != DONE]
        if not missing:
            return None
        left = [r for r in missing if ends.get(r, "").startswith("os._exit")]
        silent = [r for r in missing if r not in left]
        parts = [_left(r, ends[r]) for r in left]
        if silent:
            parts.append(
                f"{name_ranks(silent)} ended without finishing "
                + (
                    "(stopped when another rank ended)"
                    if left
                    else "(left early, e.g. through os._exit, a crash, or stopped by the launcher)"
                )
            )
        return "; ".join(parts) + ". Status 0 means that every rank finished its script."

    def stranded(self) -> str | None:
        """Return why a rank waits for ever in `dp.initialize`, or None.

        A world needs every rank: a rank that entered its G-th `initialize` waits for ever once
        another rank has ended without having had that world (it never called `initialize` so
        many times).
        """
        ends = self.ends()
        if not ends:
            return None
        worlds: dict[int, tuple[str, int]] = {}
        for rank, text in self._read("world").items():
            with contextlib.suppress(ValueError):
                worlds[rank] = parse_world(text)
        for rank, (state, generation) in sorted(worlds.items()):
            if state != INITIALIZING or rank in ends:
                continue
            for other, how in sorted(ends.items()):
                if how != DONE:
                    continue  # a failure, or os._exit: the launchers end those jobs already
                other_state, had = worlds.get(other, (READY, 0))
                if other_state != READY:
                    had -= 1  # it ended while entering that world: it never had it
                if had < generation:
                    return (
                        f"rank {rank} waits in dp.initialize() for rank {other}, which finished "
                        "its script without calling it: a world needs every rank"
                    )
        return None

    def remove(self) -> None:
        """Delete the folder and its notes."""
        shutil.rmtree(self.path, ignore_errors=True)


def _left(rank: int, how: str) -> str:
    """Say that `rank` left through what its note `how` (`os._exit CODE`) names."""
    call, _, code = how.partition(" ")
    return f"rank {rank} left through {call}({code}) before its script finished"


def name_ranks(ranks: list[int]) -> str:
    """Return `rank 1`, `ranks 1 and 2`, `ranks 1, 2 and 3`: for the launchers' messages."""
    if len(ranks) == 1:
        return f"rank {ranks[0]}"
    return "ranks " + ", ".join(map(str, ranks[:-1])) + f" and {ranks[-1]}"


def signal_name(signum: int) -> str:
    """Return `SIGKILL` for 9, and so on (`signal N` for a number Python does not name)."""
    try:
        return signal.Signals(signum).name
    except ValueError:
        return f"signal {signum}"

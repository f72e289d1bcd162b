"""`dataparallel run --backend mpi`: start the ranks with the `mpiexec` of mpi4py's MPI.

The command is `mpiexec -n N [-f hostfile] python -m dataparallel.launch.runner script args...`,
where `python` is this interpreter (`sys.executable`) and `mpiexec` is the one installed beside it:
the `mpich` wheel (`pip install 'dataparallel[mpi]'`) puts it in the environment's `bin`, next to
the interpreter. An `mpiexec` from another MPI would start N unrelated worlds of one, so one found
only on `PATH` is used with a warning.

The launcher streams mpiexec's output through itself, to read Hydra's report of a rank killed by
signal N (whose status is then 128 + N, as under Gloo and in shells), and gives the ranks a run
folder (`process.RunDir`) where each notes how it ended: a job that mpiexec reports as a success
while a rank did not finish its script (it left through `os._exit(0)`, and mpiexec quietly killed
the others) fails with status 1, naming that rank. Ctrl-C goes to the ranks, not through mpiexec.
Which rank a signal killed is told by the launcher's own watch of the ranks (`FirstDeaths`) when
every rank runs on its machine, since Hydra's report may name a rank it killed itself. Across
hosts the launcher also keeps a line of its own to each rank (`beacon.py`): neither mpiexec nor
MPI notices a host whose link went down, nor two hosts that stopped reaching each other (a
split), and the job would wait for `--timeout`.
"""

from __future__ import annotations

import contextlib
import ctypes
import functools
import importlib.util
import math
import os
import re
import select
import shutil
import signal
import subprocess
import sys
import sysconfig
import threading
import time
from collections.abc import Callable, Sequence
from pathlib import Path

from dataparallel.backends.rendezvous import is_here
from dataparallel.config import (
    BEACON_VARIABLE,
    DEFAULT_LINK_TIMEOUT,
    LINK_TIMEOUT_VARIABLE,
    RUN_DIR_VARIABLE,
)
from dataparallel.errors import BackendUnavailableError
from dataparallel.launch.beacon import Beacon
from dataparallel.launch.hosts import HostSlots
from dataparallel.launch.process import (
    EXIT_TIMEOUT,
    GRACE_SECONDS,
    RUNNER,
    Output,
    RunDir,
    Signals,
    exit_status,
    pump,
    signal_name,
    warn,
)

__all__ = ["FirstDeaths", "find_mpiexec", "mpi_command", "require_mpi4py", "run_mpi"]

# The status of a job stopped because a rank was out of reach: ssh's, for a host gone, as a Gloo
# rank's ssh reports it.
EXIT_LOST = 255
# The launcher's own deadline trails mpiexec's MPIEXEC_TIMEOUT by this much, so that mpiexec,
# which knows its processes best, normally does the cleanup and the launcher is only the backstop.
_BACKSTOP_SECONDS = 3.0
# Hydra's `-prepend-pattern` for a launch across hosts: %r is the rank, %h its host as listed.
_HYDRA_PREFIX = "[rank %r on %h] "


def require_mpi4py() -> None:
    """Raise `BackendUnavailableError` with the install command if mpi4py is missing."""
    if importlib.util.find_spec("mpi4py") is None:
        raise BackendUnavailableError(
            "--backend mpi needs mpi4py, which is not installed in "
            f"{sys.executable}: pip install 'dataparallel[mpi]' (mpi4py plus the mpich wheel, "
            "which brings a matching mpiexec), or use --backend gloo (needs torch)."
        )


def find_mpiexec() -> tuple[str, str | None]:
    """Return the `mpiexec` to use and a warning to show (None when it is the expected one).

    Looks next to `sys.executable` first, then in this environment's scripts directory, then on
    `PATH` (with a warning, since that one may belong to another MPI than mpi4py's).

    Raises:
        BackendUnavailableError: when no `mpiexec` can be found at all.
    """
    candidates = [Path(sys.executable).parent, Path(sysconfig.get_path("scripts"))]
    for folder in candidates:
        path = folder / "mpiexec"
        if path.is_file() and os.access(path, os.X_OK):
            return str(path), None
    found = shutil.which("mpiexec") or shutil.which("mpirun")
    if found is None:
        raise BackendUnavailableError(
            f"No mpiexec next to {sys.executable} nor on PATH: pip install 'dataparallel[mpi]' "
            "(the mpich wheel brings one), or use --backend gloo."
        )
    return found, (
        f"no mpiexec next to {sys.executable}; using {found} from PATH. It must belong to the MPI "
        "that mpi4py was built with, or every rank will see a world of one. "
        "To be sure: pip install 'dataparallel[mpi]' (the mpich wheel brings a matching mpiexec)."
    )


@functools.cache
def _hostfile_flag(mpiexec: str) -> str:
    """Return how this `mpiexec` takes a host file: `--hostfile` (Open MPI), `-f` (Hydra)."""
    try:
        probe = subprocess.run(
            [mpiexec, "--version"], capture_output=True, text=True, timeout=20, check=False
        )
    except (OSError, subprocess.TimeoutExpired):
        return "-f"
    text = (probe.stdout + probe.stderr).lower()
    return "--hostfile" if any(k in text for k in ("open mpi", "openrte", "prte")) else "-f"


def mpi_command(mpiexec: str, n: int, target: list[str], hostfile: str | None = None) -> list[str]:
    """Return the `mpiexec` command line that runs `target` (runner arguments) on `n` ranks.

    With a host file, Hydra prefixes every line of a rank's output with its rank and host, as
    the Gloo launch across hosts does (`[rank R on HOST] `), and the runner then leaves its own
    lines unprefixed; Open MPI's output is passed on as it is."""
    if hostfile is None:
        return [mpiexec, "-n", str(n), sys.executable, "-m", RUNNER, *target]
    flag = _hostfile_flag(mpiexec)
    prefix = ["-prepend-pattern", _HYDRA_PREFIX] if flag == "-f" else []
    runner = [RUNNER, "--prefixed"] if prefix else [RUNNER]
    return [mpiexec, "-n", str(n), flag, hostfile, *prefix, sys.executable, "-m", *runner, *target]


def _hostfile_text(hosts: Sequence[HostSlots], flag: str) -> str:
    """Return `hosts` as the host file of the mpiexec that takes it with `flag`."""
    if flag == "--hostfile":  # Open MPI
        return "".join(f"{entry.host} slots={entry.slots}\n" for entry in hosts)
    return "".join(f"{entry.host}:{entry.slots}\n" for entry in hosts)


def run_mpi(
    n: int,
    target: list[str],
    *,
    timeout: float | None = None,
    hosts: Sequence[HostSlots] | None = None,
    link_timeout: float = DEFAULT_LINK_TIMEOUT,
) -> int:
    """Run `target` on `n` MPI ranks and return the job's exit status.

    Args:
        n: number of ranks.
        target: what the runner runs: `[script, *args]` or `["-m", module, *args]`.
        timeout: seconds before the job is stopped (exit status 124); also set as `MPIEXEC_TIMEOUT`.
        hosts: the machines and their slots, written to a host file in this mpiexec's format
            (`host:N` for Hydra, `host slots=N` for Open MPI) and passed as `-f` or `--hostfile`.
            Where one is another machine, the launcher keeps a line to each rank of its own
            (`beacon.py`), and ends the job when one is silent for `link_timeout` seconds,
            or says its connection to another host was (a split: status 1).
        link_timeout: seconds of silence after which a rank's host, or its link, is gone.

    Returns:
        0 when every rank succeeded; else the failing rank's code, 128 + N for a rank killed by
        signal N, 1 for a rank that ended without finishing (`os._exit(0)`) or a split, 124 on
        timeout,
        255 for a rank out of reach (its host or its link gone), or 128 + N when the launcher
        was stopped by signal N.
    """
    require_mpi4py()
    mpiexec, warning = find_mpiexec()
    if warning is not None:
        warn(f"warning: {warning}")
    env = dict(os.environ)
    if timeout is not None:
        env["MPIEXEC_TIMEOUT"] = str(max(1, math.ceil(timeout)))
    run_dir = RunDir()
    env[RUN_DIR_VARIABLE] = run_dir.path
    try:
        hostfile = None
        if hosts is not None:
            hostfile = os.path.join(run_dir.path, "hostfile")
            with open(hostfile, "w", encoding="utf-8") as file:
                file.write(_hostfile_text(hosts, _hostfile_flag(mpiexec)))
        job = _Job(mpi_command(mpiexec, n, target, hostfile), env, n, run_dir)
        elsewhere = [entry.host for entry in hosts or () if _elsewhere(entry.host)]
        with contextlib.ExitStack() as stack:
            if elsewhere:
                job.beacon = stack.enter_context(Beacon(link_timeout, toward=elsewhere[0]))
                if job.beacon.address is not None:
                    env[BEACON_VARIABLE] = job.beacon.address
                    env[LINK_TIMEOUT_VARIABLE] = f"{link_timeout:g}"
            deaths = stack.enter_context(FirstDeaths(run_dir, n))
            status = job.run(timeout)
        if job.stopped:
            return status
        # Every rank's note can be read only when every rank ran on this machine.
        if status == 0 and hostfile is not None and len(run_dir.local_pids()) < n:
            return 0
        signalled = status == job.killed_by
        # mpiexec may report the ranks it killed itself after one left through os._exit(0).
        if status == 0 or (signalled and run_dir.left_early()):
            problem = run_dir.unfinished(n)
            if problem is not None:
                warn(problem)
                return 1
            return status
        return job.killed(status, deaths.first) if signalled else status
    finally:
        run_dir.remove()


def _elsewhere(host: str) -> bool:
    """Whether `host` is another machine than this one; one that resolves to no address here is
    taken for another (mpiexec, which starts its ranks, then says what is wrong with it)."""
    try:
        return not is_here(host)
    except OSError:
        return True


class _Job:
    """mpiexec and the threads that stream its output, watching for its report of a death."""

    def __init__(self, command: list[str], env: dict[str, str], n: int, run_dir: RunDir) -> None:
        self.command, self.env, self.n, self.run_dir = command, env, n, run_dir
        self.killed_by: int | None = None  # the signal mpiexec says ended a rank
        self.killed_pids: list[int] = []
        self.stopped = False  # by the launcher (a signal, --timeout): its status is final
        # Stopped by the launcher because ranks waited for one that ended, or for one whose
        # host they could no longer reach (a split): status 1, as a rank's failure.
        self.failed = False
        self.beacon: Beacon | None = None  # the launcher's line to ranks on other hosts
        self.lost = False  # stopped by the launcher because a rank was out of reach

    def _see(self, line: bytes) -> None:
        """Read mpiexec's (Hydra's) report of a rank that died: its pid, and the signal."""
        found = _HYDRA_SIGNAL.search(line)
        if found is not None:
            self.killed_by = int(found.group(1))
        found = _HYDRA_PID.search(line)
        if found is not None:
            self.killed_pids.append(int(found.group(1)))

    def run(self, timeout: float | None) -> int:
        start = time.monotonic()
        deadline = None if timeout is None else start + timeout + _BACKSTOP_SECONDS
        pumps: list[threading.Thread] = []
        with Signals() as signals:
            proc = subprocess.Popen(
                self.command,
                env=self.env,
                preexec_fn=_child_setup(),
                stdout=subprocess.PIPE,
                stderr=subprocess.PIPE,
            )
            assert proc.stdout is not None and proc.stderr is not None
            for source, stream in ((proc.stdout, sys.stdout), (proc.stderr, sys.stderr)):
                thread = threading.Thread(
                    target=pump, args=(source, Output(stream), b"", self._see), daemon=True
                )
                thread.start()
                pumps.append(thread)
            try:
                returncode = self._wait(proc, signals, deadline, timeout)
            finally:
                for thread in pumps:
                    thread.join(timeout=5.0)
        self.stopped = True
        if returncode is None:  # stopped by the launcher: the status is decided already
            if self.lost:
                return EXIT_LOST
            if self.failed:
                return 1
            return 128 + signals.received if signals.received is not None else EXIT_TIMEOUT
        status = exit_status(returncode)
        if status != 0 and timeout is not None and time.monotonic() - start >= timeout:
            warn(f"the job ran past --timeout {timeout:g}s and was stopped.")
            return EXIT_TIMEOUT
        self.stopped = False
        return status

    def _wait(
        self,
        proc: subprocess.Popen[bytes],
        signals: Signals,
        deadline: float | None,
        timeout: float | None,
    ) -> int | None:
        """Return mpiexec's return code, or None when the launcher had to stop the job."""
        while True:
            try:
                return proc.wait(timeout=0.1)
            except subprocess.TimeoutExpired:
                pass
            if signals.received is not None:
                self._stop(proc, signals.received)
                return None
            if deadline is not None and time.monotonic() >= deadline:
                warn(f"the job ran past --timeout {timeout:g}s; stopping it.")
                self._stop(proc, None)
                return None
            cut = self.beacon.cut() if self.beacon is not None else None
            if cut is not None:
                warn(f"{cut}; stopping the job.")
                self.failed = True
                self._stop(proc, None)
                return None
            lost = self.beacon.lost() if self.beacon is not None else None
            if lost is not None:
                warn(f"{lost}; stopping the job.")
                self.lost = True
                self._stop(proc, None)
                return None
            stranded = self.run_dir.stranded()
            if stranded is not None:
                warn(f"{stranded}; stopping the job.")
                self.failed = True
                self._stop(proc, None)
                return None

    def killed(self, signum: int, first: list[int]) -> int:
        """Name the rank that a signal killed and return 128 + the signal.

        `first` are the ranks the launcher saw dead or dying at the first death (`FirstDeaths`):
        the one killed, and any that mpiexec ended before the launcher looked. Without them, or
        with ranks on other machines, the pid in mpiexec's report names the rank (it may name one
        it killed itself).
        """
        pids = self.run_dir.local_pids()
        if len(pids) < self.n:  # ranks elsewhere: the first death may be one the launcher can't see
            first = []
        ranks = {pid: rank for rank, pid in pids.items()}
        named = first or sorted({ranks[pid] for pid in self.killed_pids if pid in ranks})
        how = f"was killed by signal {signum} ({signal_name(signum)})"
        if len(named) > 1 and len(named) < len(pids):
            listed = ", ".join(map(str, named))
            warn(f"one of ranks {listed} {how}; mpiexec ended the others at the same moment.")
        elif len(named) > 1:
            warn(f"a rank {how}; mpiexec ended the others before the launcher could tell which.")
        else:
            warn(f"{f'rank {named[0]}' if named else 'a rank'} {how}.")
        return 128 + signum

    def _stop(self, proc: subprocess.Popen[bytes], signum: int | None) -> None:
        """End the job: Ctrl-C goes to the ranks themselves, other signals through mpiexec.

        mpiexec never sees SIGINT (`_child_setup`), so it prints nothing of its own on Ctrl-C:
        each rank raises `KeyboardInterrupt` and leaves with status 130, and mpiexec ends the
        rest. Past a grace period, mpiexec and the ranks of this machine are killed.
        """
        try:
            if signum == signal.SIGINT and self.run_dir.signal_ranks(self.n, signum):
                pass
            elif signum is None or signum == signal.SIGINT:  # ranks elsewhere: via mpiexec
                proc.terminate()
            else:
                proc.send_signal(signum)
            proc.wait(timeout=GRACE_SECONDS)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()
            self.run_dir.signal_ranks(self.n, signal.SIGKILL)
        except ProcessLookupError:
            pass


# Hydra's report of a rank that died: "=   PID 1234 RUNNING AT host" and, once every rank has
# ended, "YOUR APPLICATION TERMINATED WITH THE EXIT STRING: Killed (signal 9)".
_HYDRA_PID = re.compile(rb"^=\s+PID (\d+) RUNNING AT ")
_HYDRA_SIGNAL = re.compile(rb"TERMINATED WITH THE EXIT STRING: .*\(signal (\d+)\)")


def _child_setup() -> Callable[[], None]:
    """Return what mpiexec runs before `exec`: SIGINT blocked, and death with the launcher.

    SIGINT stays blocked in mpiexec (a blocked signal stays blocked across `exec`), so a Ctrl-C
    at the terminal reaches the launcher but not mpiexec, which would print its own messages and
    take a second Ctrl-C as "abort"; the launcher passes it on to the ranks (`_Job._stop`), and
    the runner unblocks it there. On Linux, the kernel also sends mpiexec SIGTERM if the launcher
    dies, and mpiexec then ends its ranks, so killing the launcher (`kill -9`) leaves nothing.
    """
    prctl = None
    if sys.platform.startswith("linux"):
        try:
            prctl = ctypes.CDLL(None, use_errno=True).prctl
        except (OSError, AttributeError):
            prctl = None
    pr_set_pdeathsig = 1

    def hook() -> None:
        signal.pthread_sigmask(signal.SIG_BLOCK, {signal.SIGINT})
        if prctl is not None:
            prctl(pr_set_pdeathsig, int(signal.SIGTERM))

    return hook


_POLL_MS = 20  # how often the run folder is read for ranks that just started
_IDLE_MS = 500  # how often the watcher looks when every rank is watched


_PROC = os.path.isdir("/proc/self")
_PF_EXITING = 0x4  # the kernel's flag of a task that has begun to exit (include/linux/sched.h)


def _alive(pid: int) -> bool:
    """Whether `pid` runs: a zombie, or one that has begun to exit, is dead (Linux: /proc)."""
    if not _PROC:
        try:
            os.kill(pid, 0)
        except ProcessLookupError:
            return False
        except PermissionError:
            pass
        return True
    try:
        with open(f"/proc/{pid}/stat", "rb") as file:
            fields = file.read().rpartition(b")")[2].split()
    except OSError:
        return False
    if len(fields) < 7:
        return False
    return fields[0] not in (b"Z", b"X") and not int(fields[6]) & _PF_EXITING


class FirstDeaths:
    """A daemon thread watching the ranks of this machine until one dies unexplained.

    When a rank is killed, Hydra kills the others too, and its report names one pid: not always
    the first to die (two ranks may both show status 9). So the launcher watches the ranks of its
    machine itself, two ways:

    - each rank holds the writing end of a FIFO the launcher reads (`dataparallel.runnotes`). The
      kernel closes it as the rank dies, the moment Hydra's pipes close too, and before the others,
      which Hydra kills only then, have closed theirs. The FIFOs that hang up first, without an
      `end` note, are the ranks that died first;
    - for a rank without one (it died before opening it), its pidfd: at its death, the ranks dead
      or *dying* (the kernel's PF_EXITING flag, set at the start of exit, so before Hydra can
      know) without an `end` note are noted, which always includes the first.

    Several ranks noted are named as the candidates.
    """

    def __init__(self, run_dir: RunDir, n: int) -> None:
        self.run_dir, self.n = run_dir, n
        self.first: list[int] = []  # the ranks that died first, when the watcher could tell
        self.seen: set[int] = set()  # every rank whose death the watcher has judged, blamed or not
        self._pipes: dict[int, int] = {}  # the reading end of each rank's FIFO -> its rank
        self._stop = threading.Event()
        self._wake_read, self._wake = -1, -1  # a pipe written at exit: the watcher stops at once
        self._thread = threading.Thread(target=self._watch, name="dataparallel-deaths", daemon=True)

    def __enter__(self) -> FirstDeaths:
        self._pipes = self.run_dir.alive_pipes(self.n)  # before the ranks start
        self._wake_read, self._wake = os.pipe()
        self._thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self._stop.set()
        os.write(self._wake, b"x")
        self._thread.join(timeout=1.0)
        for fd in (*self._pipes, self._wake_read, self._wake):
            os.close(fd)

    def _watch(self) -> None:
        watched: dict[int, int] = {}  # rank -> pid
        poller = select.poll()
        for fd in self._pipes:
            poller.register(fd, select.POLLHUP)
        poller.register(self._wake_read, select.POLLIN)
        pidfds: list[int] = []
        try:
            while not self._stop.is_set():
                for rank, pid in self.run_dir.local_pids().items():
                    if rank not in watched:
                        watched[rank] = pid
                        with contextlib.suppress(OSError, AttributeError):
                            pidfds.append(os.pidfd_open(pid))
                            poller.register(pidfds[-1], select.POLLIN)
                # Every rank of the job seen here: only deaths can wake the watcher now.
                wait = _POLL_MS if len(watched) < self.n else _IDLE_MS
                closed = []
                for fd, events in poller.poll(wait):
                    if fd == self._wake_read:  # told to stop: this round is the last
                        poller.unregister(fd)
                        continue
                    if fd in self._pipes and not events & select.POLLHUP:
                        continue
                    poller.unregister(fd)  # a dead rank's fds stay ready: once is enough
                    if fd in self._pipes:
                        closed.append(self._pipes[fd])
                if self._note_unexplained(closed) or self._judge(watched):
                    return
        finally:
            for fd in pidfds:
                os.close(fd)

    def _judge(self, watched: dict[int, int]) -> bool:
        """Note the ranks dead or dying without an `end` note; True once some are."""
        return self._note_unexplained([r for r, pid in watched.items() if not _alive(pid)])

    def _note_unexplained(self, dead: list[int]) -> bool:
        """Note the ranks of `dead` that left no `end` note; True if any (the others finished,
        or failed in the runner's hands)."""
        if not dead:
            return False
        ended = self.run_dir.ends()
        self.first = sorted(rank for rank in dead if rank not in ended)
        self.seen.update(dead)  # after `first`: a reader that sees a rank here sees its verdict
        return bool(self.first)

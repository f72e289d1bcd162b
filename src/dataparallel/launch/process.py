"""Process plumbing shared by the launchers: signals, stopping children, exit codes, free ports."""

from __future__ import annotations

import contextlib
import signal
import socket
import subprocess
import sys
import time
from collections.abc import Iterable
from types import FrameType

__all__ = [
    "EXIT_TIMEOUT",
    "GRACE_SECONDS",
    "Signals",
    "exit_status",
    "free_port",
    "let_leave",
    "stop",
    "warn",
]

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

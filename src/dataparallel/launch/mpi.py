"""`dataparallel run --backend mpi`: start the ranks with the `mpiexec` of mpi4py's MPI.

The command is `mpiexec -n N [-f hostfile] python -m dataparallel.launch.runner script args...`,
where `python` is this interpreter (`sys.executable`) and `mpiexec` is the one installed beside it:
the `mpich` wheel (`pip install 'dataparallel[mpi]'`) puts it in the environment's `bin`, next to
the interpreter. An `mpiexec` from another MPI would start N unrelated worlds of one, so one found
only on `PATH` is used with a warning.
"""

from __future__ import annotations

import ctypes
import importlib.util
import math
import os
import shutil
import signal
import subprocess
import sys
import sysconfig
import time
from collections.abc import Callable
from pathlib import Path

from dataparallel.errors import BackendUnavailableError
from dataparallel.launch._process import EXIT_TIMEOUT, GRACE_SECONDS, Signals, exit_status, warn

__all__ = ["find_mpiexec", "mpi_command", "require_mpi4py", "run_mpi"]

RUNNER = "dataparallel.launch.runner"

# The launcher's own deadline trails mpiexec's MPIEXEC_TIMEOUT by this much, so that mpiexec,
# which knows its processes best, normally does the cleanup and the launcher is only the backstop.
_BACKSTOP_SECONDS = 3.0


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
    """Return the `mpiexec` command line that runs `target` (runner arguments) on `n` ranks."""
    hosts = [_hostfile_flag(mpiexec), hostfile] if hostfile is not None else []
    return [mpiexec, "-n", str(n), *hosts, sys.executable, "-m", RUNNER, *target]


def run_mpi(
    n: int, target: list[str], *, timeout: float | None = None, hostfile: str | None = None
) -> int:
    """Run `target` on `n` MPI ranks and return the job's exit status.

    Args:
        n: number of ranks.
        target: what the runner runs: `[script, *args]` or `["-m", module, *args]`.
        timeout: seconds before the job is stopped (exit status 124); also set as `MPIEXEC_TIMEOUT`.
        hostfile: an MPI host file, passed as `-f` (Hydra) or `--hostfile` (Open MPI).

    Returns:
        mpiexec's exit status (the failing rank's code when one aborts), 124 on timeout, or
        128 + N when the launcher was stopped by signal N.
    """
    require_mpi4py()
    mpiexec, warning = find_mpiexec()
    if warning is not None:
        warn(f"warning: {warning}")
    env = dict(os.environ)
    if timeout is not None:
        env["MPIEXEC_TIMEOUT"] = str(max(1, math.ceil(timeout)))
    command = mpi_command(mpiexec, n, target, hostfile)
    start = time.monotonic()
    deadline = None if timeout is None else start + timeout + _BACKSTOP_SECONDS
    with Signals() as signals:
        proc = subprocess.Popen(command, env=env, preexec_fn=_end_with_launcher())
        while True:
            try:
                returncode = proc.wait(timeout=0.1)
                break
            except subprocess.TimeoutExpired:
                pass
            if signals.received is not None:
                _end(proc, signals.received)
                return 128 + signals.received
            if deadline is not None and time.monotonic() >= deadline:
                warn(f"the job ran past --timeout {timeout:g}s; stopping it.")
                _end(proc, None)
                return EXIT_TIMEOUT
    status = exit_status(returncode)
    if status != 0 and timeout is not None and time.monotonic() - start >= timeout:
        warn(f"the job ran past --timeout {timeout:g}s and was stopped.")
        return EXIT_TIMEOUT
    return status


def _end_with_launcher() -> Callable[[], None] | None:
    """Return a hook that has the kernel send mpiexec SIGTERM if the launcher dies (Linux only).

    mpiexec then ends its ranks, so killing the launcher (`kill -9`) leaves nothing behind.
    """
    if not sys.platform.startswith("linux"):
        return None
    try:
        prctl = ctypes.CDLL(None, use_errno=True).prctl
    except (OSError, AttributeError):
        return None
    pr_set_pdeathsig = 1

    def hook() -> None:
        prctl(pr_set_pdeathsig, int(signal.SIGTERM))

    return hook


def _end(proc: subprocess.Popen[bytes], signum: int | None) -> None:
    """Ask mpiexec to end the job (it forwards to the ranks), then kill it after a grace period."""
    try:
        if signum is None:
            proc.terminate()
        else:
            proc.send_signal(signum)
        proc.wait(timeout=GRACE_SECONDS)
    except subprocess.TimeoutExpired:
        proc.kill()
        proc.wait()
    except ProcessLookupError:
        pass

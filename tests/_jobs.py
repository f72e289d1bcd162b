"""Launching jobs from the tests: one command line, one environment and one time limit for all.

Every test that starts processes goes through here:

- `run_job(target, ...)` runs a job to its end and returns its `CompletedProcess` (text output);
- `spawn(target, ...)` starts a job and hands over its `Popen`, for a test that signals it;
- `run_ranks(commands, ...)` starts one process per rank at once, ranks that meet by themselves
  (at a `free_port()`, the launcher's own: `dataparallel.launch.process.free_port`).

`launcher` says how `target` (a script or `-m module`, and its arguments) is started:

- `"run"`: `python -m dataparallel run -n RANKS [--backend B] [--timeout S] [OPTIONS] TARGET`;
- `"mpiexec"`: `mpiexec -n RANKS python TARGET`, with the mpiexec beside this Python (the test is
  skipped without one);
- `"python"`: `python TARGET`, one process;
- `None`: `TARGET` is the whole command line (torchrun, a console script, a network namespace).

Each job has a hard limit, `timeout` seconds: past it, the job and every process in its process
group (each job gets its own session) are killed, and the test fails with what the job printed.
Its environment is this process's with the variables of any outer job removed (see `_job_env`).
Standard input is /dev/null: no job reads it.
"""

from __future__ import annotations

import contextlib
import math
import os
import shlex
import signal
import subprocess
import sys
import time
from collections.abc import Iterator, Mapping, Sequence
from pathlib import Path
from typing import Literal

import pytest

from dataparallel.launch.process import free_port as free_port  # for ranks that meet

Arg = str | os.PathLike[str]
Launcher = Literal["run", "mpiexec", "python"]

# Generous: a job of 3 Python processes on 2 busy cores takes a few seconds, rarely more than 20.
LIMIT = 120.0
MPIEXEC = Path(sys.executable).with_name("mpiexec")

# What an outer job puts in its processes' environment, which would make a launched job join it
# or take its rank: MPI launchers (MPICH/Hydra, Open MPI, PMIx) by prefix, torchrun (and
# `dataparallel run --backend gloo`) by name. DATAPARALLEL_* settings go too: a job sees only
# those its test gives it, and so do pytest-xdist's (a pytest the job runs is no worker of ours).
_OUTER_PREFIXES = (
    "PMI",
    "HYD",
    "OMPI_",
    "MPI_LOCAL",
    "TORCHELASTIC_",
    "DATAPARALLEL_",
    "PYTEST_XDIST_",
)
_OUTER_NAMES = frozenset(
    {
        "RANK",
        "WORLD_SIZE",
        "LOCAL_RANK",
        "LOCAL_WORLD_SIZE",
        "GROUP_RANK",
        "GROUP_WORLD_SIZE",
        "ROLE_RANK",
        "ROLE_WORLD_SIZE",
        "ROLE_NAME",
        "MASTER_ADDR",
        "MASTER_PORT",
        "PYTEST_RANK_TRAIL",  # the outer suite's notes of its ranks' tests (conftest.py)
    }
)


def outer_world_size() -> int:
    """Return the size of the job (MPI, or torchrun-style) running this file (1 outside any)."""
    for name in ("PMI_SIZE", "OMPI_COMM_WORLD_SIZE", "WORLD_SIZE"):
        if os.environ.get(name, "").isdigit():
            return int(os.environ[name])
    mpi = sys.modules.get("mpi4py.MPI")
    if mpi is not None and mpi.Is_initialized() and not mpi.Is_finalized():
        return int(mpi.COMM_WORLD.Get_size())
    return 1


def require_mpiexec() -> Path:
    """Return the mpiexec beside this Python (the mpich wheel's); skip the test without one."""
    if not MPIEXEC.exists():
        pytest.skip(f"no mpiexec beside {sys.executable} (pip install 'dataparallel[mpi]')")
    return MPIEXEC


def run_job(
    target: Sequence[Arg],
    *,
    launcher: Launcher | None = "run",
    ranks: int = 2,
    backend: str | None = None,
    job_timeout: float | None = None,
    options: Sequence[Arg] = (),
    env: Mapping[str, str] | None = None,
    timeout: float = LIMIT,
    cwd: Arg | None = None,
) -> subprocess.CompletedProcess[str]:
    """Run `target` as a job to its end and return its exit status and output.

    Args:
        target: the script (or `-m module`) and its arguments; the whole command line when
            `launcher` is None.
        launcher: how to start it (see the module's docstring).
        ranks: the number of ranks, for `"run"` and `"mpiexec"`.
        backend: `dataparallel run --backend` (`"mpi"`, `"gloo"`); None: its default (MPI).
        job_timeout: `dataparallel run --timeout`, the launcher's own limit.
        options: further `dataparallel run` options (`--hostfile`, `--nnodes`, ...).
        env: variables to set in the job's environment, over `_job_env`'s.
        timeout: the hard limit in seconds; past it the test fails.
        cwd: the job's working directory (default: this one).
    """
    with spawn(
        target,
        launcher=launcher,
        ranks=ranks,
        backend=backend,
        job_timeout=job_timeout,
        options=options,
        env=env,
        timeout=timeout,
        cwd=cwd,
        capture=True,
    ) as job:
        try:
            stdout, stderr = job.communicate(timeout=timeout)
        except subprocess.TimeoutExpired:
            stdout, stderr = _end(job)
            pytest.fail(
                f"`{shlex.join(job.args)}` ran past {timeout:g} s and was killed.\n"
                f"stdout:\n{stdout}\nstderr:\n{stderr}"
            )
    return subprocess.CompletedProcess(job.args, job.returncode, stdout, stderr)


@contextlib.contextmanager
def spawn(
    target: Sequence[Arg],
    *,
    launcher: Launcher | None = "run",
    ranks: int = 2,
    backend: str | None = None,
    job_timeout: float | None = None,
    options: Sequence[Arg] = (),
    env: Mapping[str, str] | None = None,
    timeout: float = LIMIT,
    cwd: Arg | None = None,
    capture: bool = False,
) -> Iterator[subprocess.Popen[str]]:
    """Start `target` as a job (arguments as `run_job`'s) and hand over its `Popen`.

    The test waits for it, with its own time limits; `timeout` only sets the job's
    `MPIEXEC_TIMEOUT`. Output goes to /dev/null unless `capture` (then to pipes, which the test
    must read). On leaving the block, a job still running is killed with its process group; one
    that has ended is left as it is, so the test can still check that its ranks ended with it.
    """
    command = _command(target, launcher, ranks, backend, job_timeout, options)
    output = subprocess.PIPE if capture else subprocess.DEVNULL
    job = subprocess.Popen(
        command,
        env=_job_env(env, timeout),
        cwd=cwd,
        stdin=subprocess.DEVNULL,
        stdout=output,
        stderr=output,
        text=True,
        start_new_session=True,
    )
    try:
        yield job
    finally:
        if job.poll() is None:
            _end(job)
        for pipe in (job.stdout, job.stderr):
            if pipe is not None:
                pipe.close()


def run_ranks(
    commands: Sequence[Sequence[Arg]],
    envs: Sequence[Mapping[str, str]] | None = None,
    *,
    timeout: float = LIMIT,
    wait_for: int | None = None,
) -> list[tuple[int, str, str]]:
    """Run one command per rank at once; return (status, stdout, stderr) per rank, in rank order.

    Each command is a whole command line, started with `PYTHONUNBUFFERED=1` and `envs[rank]` over
    `_job_env`'s. With `wait_for=k`, only the first k ranks are waited for; the others are then
    killed. Past `timeout` every rank is killed and the test fails with their output.
    """
    extras: Sequence[Mapping[str, str]] = [{}] * len(commands) if envs is None else envs
    with contextlib.ExitStack() as stack:
        jobs = [
            stack.enter_context(
                spawn(
                    command,
                    launcher=None,
                    env={"PYTHONUNBUFFERED": "1", **extra},
                    timeout=timeout,
                    capture=True,
                )
            )
            for command, extra in zip(commands, extras, strict=True)
        ]
        deadline = time.monotonic() + timeout
        results = []
        try:
            for rank, job in enumerate(jobs):
                if wait_for is not None and rank >= wait_for:
                    stdout, stderr = _end(job)
                else:
                    stdout, stderr = job.communicate(timeout=max(1.0, deadline - time.monotonic()))
                results.append((job.returncode, stdout, stderr))
        except subprocess.TimeoutExpired:
            outputs = [_end(job) for job in jobs]
            pytest.fail(f"the job did not finish within {timeout:g} s: {outputs}")
    return results


def _command(
    target: Sequence[Arg],
    launcher: Launcher | None,
    ranks: int,
    backend: str | None,
    job_timeout: float | None,
    options: Sequence[Arg],
) -> list[str]:
    """Return the command line that starts `target` with `launcher` (see the module docstring)."""
    args = [os.fspath(arg) for arg in target]
    if launcher != "run" and (backend is not None or job_timeout is not None or options):
        raise ValueError("backend, job_timeout and options are for launcher='run'")
    if launcher is None:
        return args
    if launcher == "python":
        return [sys.executable, *args]
    if launcher == "mpiexec":
        return [str(require_mpiexec()), "-n", str(ranks), sys.executable, *args]
    command = [sys.executable, "-m", "dataparallel", "run", "-n", str(ranks)]
    if backend is not None:
        command += ["--backend", backend]
    if job_timeout is not None:
        command += ["--timeout", f"{job_timeout:g}"]
    return [*command, *(os.fspath(option) for option in options), *args]


def _job_env(extra: Mapping[str, str] | None, timeout: float) -> dict[str, str]:
    """Return the environment of a job: this process's, less any outer job's, plus `extra`.

    Removed: the variables of an outer MPI or torchrun-style job and DATAPARALLEL_* settings
    (`_OUTER_PREFIXES`, `_OUTER_NAMES`). Kept: everything else, PYTHONPATH included, so the job
    imports the same dataparallel as the tests. Set: `OMP_NUM_THREADS=1` and `JAX_PLATFORMS=cpu`
    (the ranks share the machine's cores), and `MPIEXEC_TIMEOUT` a little under `timeout`, so
    that an mpiexec ends its own ranks before the hard limit (`dataparallel run --timeout` sets
    its own). `extra` comes last and wins.
    """
    env = {
        name: value
        for name, value in os.environ.items()
        if name not in _OUTER_NAMES and not name.startswith(_OUTER_PREFIXES)
    }
    env.update(
        OMP_NUM_THREADS="1",
        JAX_PLATFORMS="cpu",
        MPIEXEC_TIMEOUT=str(max(1, math.ceil(timeout - min(30.0, timeout / 4)))),
    )
    env.update(extra or {})
    return env


def _end(job: subprocess.Popen[str]) -> tuple[str, str]:
    """Kill `job` and every process in its process group; return what it printed, if captured."""
    if job.returncode is None:  # not reaped yet, so its pid is still its process group's id
        with contextlib.suppress(ProcessLookupError):
            os.killpg(job.pid, signal.SIGKILL)  # its own session: the group's id is its pid
    try:
        stdout, stderr = job.communicate(timeout=10)
    except subprocess.TimeoutExpired:  # a process that left the group still holds the pipes
        job.kill()
        job.wait()
        return "", "(output lost: a process outside the job's process group holds its pipes)"
    return stdout or "", stderr or ""

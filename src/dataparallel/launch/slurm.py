"""`dataparallel run` inside Slurm: the allocation decides how many ranks, and where they run.

- In an allocation (an salloc shell, an sbatch script; no srun step yet): `-n` defaults to the
  allocation's tasks (`SLURM_NTASKS`) and may not exceed them. Under MPI, mpiexec (Hydra) finds
  the allocation itself and starts its proxies through srun on the allocated nodes. Under Gloo the
  ranks are the tasks of one `srun` step (`run_srun`): each reads Slurm's variables and they meet
  on the step's first node (`dataparallel.slurm`); output lines get the `[rank R] ` prefix.
- Inside an srun step of one task (`srun -n 1 dataparallel run -n 2 ...`): the ranks are started
  here, within the step's resources. A second srun would wait for the resources the step holds
  (Hydra's srun bootstrap hung exactly so), so mpiexec is told to start them by fork.
- Inside a step of several tasks each task would launch a job of its own: refused.
"""

from __future__ import annotations

import os
import re
import subprocess
import sys
import threading
import time
from collections.abc import Callable
from typing import BinaryIO, NoReturn, TextIO

from dataparallel.config import PREFIXED_VARIABLE
from dataparallel.launch.process import (
    EXIT_TIMEOUT,
    GRACE_SECONDS,
    RUNNER,
    TORCHRUN_VARIABLES,
    Signals,
    child_environment,
    exit_status,
    warn,
)
from dataparallel.slurm import SlurmJob

__all__ = ["leave_step", "ranks", "run_srun", "srun_command"]


def ranks(n: int | None, slurm: SlurmJob, error: Callable[[str], NoReturn]) -> int:
    """Return how many ranks to start in `slurm`'s job, or call `error` (argparse's) with why not.

    Args:
        n: `-n` as given (None: not given).
        slurm: the job the launcher runs in.
        error: reports a usage error and exits (status 2).
    """
    if slurm.in_step:
        tasks = slurm.ntasks or 1
        if tasks > 1:
            error(
                f"dataparallel run was started by srun as one of {tasks} tasks: each task would "
                "launch a job of its own. Run the script itself under srun (`srun -n N python "
                "SCRIPT`: each task a rank), or start one launcher: `srun -n 1 dataparallel run "
                "-n N SCRIPT`, or `dataparallel run SCRIPT` in the allocation (salloc/sbatch)."
            )
        if n is None:
            error(
                "-n N is needed inside an srun step: the ranks are started within this step's "
                "resources (or run `dataparallel run` in the allocation, where -n defaults to "
                "its tasks)."
            )
        return n
    if slurm.ntasks is None:
        if n is None:
            error(
                f"Slurm job {slurm.job_id} does not say how many tasks it has (SLURM_NTASKS is "
                "unset: allocate with -n/--ntasks), so give -n N."
            )
        return n
    if n is None:
        return slurm.ntasks
    if n > slurm.ntasks:
        error(
            f"-n {n} exceeds the {slurm.ntasks} tasks of Slurm job {slurm.job_id} "
            f"(SLURM_NTASKS={slurm.ntasks}): the job would oversubscribe its allocation. Give "
            f"-n {slurm.ntasks} or fewer, or allocate more tasks (salloc/sbatch -n {n})."
        )
    return n


def leave_step() -> None:
    """Make the MPI launcher start its ranks on this node by fork, not through srun.

    Inside a step, Hydra would bootstrap through srun, which waits for resources the step holds;
    without Slurm's variables it forks the ranks locally (they belong to this step's task).
    """
    for name in [name for name in os.environ if name.startswith("SLURM_")]:
        del os.environ[name]


def srun_command(n: int, target: list[str]) -> list[str]:
    """Return the srun command line that starts `target` (runner arguments) as `n` Gloo ranks.

    `--kill-on-bad-exit` ends the step when a rank fails; `--label` tells each line's rank, which
    the launcher turns into the `[rank R] ` prefix; `--mpi=none`: Gloo needs no PMI.
    """
    return [
        "srun",
        f"--ntasks={n}",
        "--kill-on-bad-exit=1",
        "--label",
        "--mpi=none",
        sys.executable,
        "-m",
        RUNNER,
        "--prefixed",
        *target,
    ]


_LABEL = re.compile(rb"^\s*(\d+): ")


def _relabel(source: BinaryIO, stream: TextIO) -> None:
    """Copy srun's labelled output (`3: text`) to `stream` as `[rank 3] text`, line by line."""
    out = getattr(stream, "buffer", None)
    for line in iter(source.readline, b""):
        line = _LABEL.sub(lambda found: b"[rank " + found.group(1) + b"] ", line, count=1)
        if out is not None:
            out.write(line)
            out.flush()
        else:
            stream.write(line.decode(errors="replace"))
            stream.flush()
    source.close()


def run_srun(n: int, target: list[str], *, timeout: float | None = None) -> int:
    """Run `target` as the `n` tasks of one srun step (Gloo) and return the job's exit status.

    Returns:
        srun's status (the worst rank's; 128 + N for a rank killed by signal N), 124 after
        `timeout`, or 128 + N when the launcher was stopped by signal N.
    """
    # torchrun's variables, which an outer job may have left here, would make a task take their
    # rank instead of Slurm's.
    env = child_environment(drop=TORCHRUN_VARIABLES)
    env[PREFIXED_VARIABLE] = "1"
    deadline = None if timeout is None else time.monotonic() + timeout
    with Signals() as signals:
        proc = subprocess.Popen(
            srun_command(n, target),
            env=env,
            stdin=subprocess.DEVNULL,
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
        )
        assert proc.stdout is not None and proc.stderr is not None
        pumps = [
            threading.Thread(target=_relabel, args=(source, stream), daemon=True)
            for source, stream in ((proc.stdout, sys.stdout), (proc.stderr, sys.stderr))
        ]
        for thread in pumps:
            thread.start()
        status: int | None = None
        while status is None:
            try:
                status = exit_status(proc.wait(timeout=0.1))
            except subprocess.TimeoutExpired:
                if signals.received is not None:
                    _stop(proc)
                    status = 128 + signals.received
                elif deadline is not None and time.monotonic() >= deadline:
                    warn(f"the job ran past --timeout {timeout:g}s; stopping every rank.")
                    _stop(proc)
                    status = EXIT_TIMEOUT
        for thread in pumps:
            thread.join(timeout=5.0)
    return status


def _stop(proc: subprocess.Popen[bytes]) -> None:
    """End the step: srun passes SIGTERM on to every task; SIGKILL after a grace period."""
    proc.terminate()
    try:
        proc.wait(timeout=GRACE_SECONDS)
    except subprocess.TimeoutExpired:
        proc.kill()
        proc.wait()

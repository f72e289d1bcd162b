"""A rank that fails or dies ends the whole job quickly, never leaving the others hanging.

`dp.initialize()` in a world of several makes an uncaught exception abort the job after printing
its traceback once, even under a plain `mpiexec` or `torchrun`; a rank killed outright (SIGKILL,
the OOM killer) is noticed by the launcher, which ends the rest. Each case launches its own job
(`spawns`), with a timeout far above the time it must take.
"""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
import time
from pathlib import Path

import pytest

SCRIPT = Path(__file__).parent / "scripts" / "uncaught_plain.py"
BIN = Path(sys.executable).parent


def finished(command: list[str]) -> tuple[subprocess.CompletedProcess[str], float]:
    env = {**os.environ, "OMP_NUM_THREADS": "1", "MPIEXEC_TIMEOUT": "120"}
    started = time.monotonic()
    job = subprocess.run(command, capture_output=True, text=True, timeout=150, env=env)
    return job, time.monotonic() - started


@pytest.mark.spawns
def test_an_uncaught_exception_ends_a_plain_mpiexec_job() -> None:
    mpiexec = BIN / "mpiexec"
    if not mpiexec.exists():
        pytest.skip("the mpich wheel's mpiexec is not installed beside this Python")
    job, elapsed = finished([str(mpiexec), "-n", "3", sys.executable, str(SCRIPT)])
    output = job.stdout + job.stderr
    assert job.returncode != 0, output
    assert output.count("RuntimeError: rank 1 fails on purpose") == 1, output
    assert "[rank 1] uncaught RuntimeError: ending the job" in output
    assert elapsed < 60, f"the job took {elapsed:.0f} s to end"


@pytest.mark.spawns
def test_an_uncaught_exception_ends_a_torchrun_job() -> None:
    torchrun = shutil.which("torchrun", path=str(BIN))
    if torchrun is None:
        pytest.skip("torchrun is not installed beside this Python")
    job, elapsed = finished([torchrun, "--nproc-per-node", "3", str(SCRIPT)])
    output = job.stdout + job.stderr
    assert job.returncode != 0, output
    assert "RuntimeError: rank 1 fails on purpose" in output
    assert elapsed < 60, f"the job took {elapsed:.0f} s to end"


KILLED = Path(__file__).parent / "scripts" / "killed_rank.py"


@pytest.mark.spawns
@pytest.mark.parametrize("backend", ["mpi", "gloo"])
def test_a_killed_rank_ends_the_job(backend: str) -> None:
    job, elapsed = finished(
        [
            sys.executable,
            "-m",
            "dataparallel",
            "run",
            "-n",
            "3",
            "--backend",
            backend,
            "--timeout",
            "100",
            str(KILLED),
        ]
    )
    output = job.stdout + job.stderr
    assert job.returncode not in (0, 124), output  # failed, and not by the launcher's timeout
    assert "UNREACHABLE" not in output
    assert elapsed < 60, f"the job took {elapsed:.0f} s to end"

"""A rank that fails or dies ends the whole job quickly, never leaving the others hanging.

`dp.initialize()` in a world of several makes an uncaught exception abort the job after printing
its traceback once, even under a plain `mpiexec` or `torchrun`; a rank killed outright (SIGKILL,
the OOM killer) is noticed by the launcher, which ends the rest. Each case launches its own job
(`spawns`), with a timeout far above the time it must take.
"""

from __future__ import annotations

import shutil
import sys
import time
from pathlib import Path

import pytest
from _jobs import run_job

SCRIPT = Path(__file__).parent / "scripts" / "uncaught_plain.py"
BIN = Path(sys.executable).parent
LIMIT = 150  # seconds; every case must end in under 60


@pytest.mark.spawns
def test_an_uncaught_exception_ends_a_plain_mpiexec_job() -> None:
    started = time.monotonic()
    job = run_job([SCRIPT], launcher="mpiexec", ranks=3, timeout=LIMIT)
    elapsed = time.monotonic() - started
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
    started = time.monotonic()
    job = run_job([torchrun, "--nproc-per-node", "3", SCRIPT], launcher=None, timeout=LIMIT)
    elapsed = time.monotonic() - started
    output = job.stdout + job.stderr
    assert job.returncode != 0, output
    assert "RuntimeError: rank 1 fails on purpose" in output
    assert elapsed < 60, f"the job took {elapsed:.0f} s to end"


KILLED = Path(__file__).parent / "scripts" / "killed_rank.py"


@pytest.mark.spawns
@pytest.mark.parametrize("backend", ["mpi", "gloo"])
def test_a_killed_rank_ends_the_job(backend: str) -> None:
    started = time.monotonic()
    job = run_job([KILLED], ranks=3, backend=backend, job_timeout=100, timeout=LIMIT)
    elapsed = time.monotonic() - started
    output = job.stdout + job.stderr
    assert job.returncode not in (0, 124), output  # failed, and not by the launcher's timeout
    assert "UNREACHABLE" not in output
    assert elapsed < 60, f"the job took {elapsed:.0f} s to end"

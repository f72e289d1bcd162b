"""`DATAPARALLEL_TIMEOUT` / `initialize(timeout=)`: a collective whose peer never comes fails.

Each case launches its own 2-rank MPI job in which rank 1 never joins; rank 0's call must end with
`CollectiveTimeoutError` within the limit, and the launcher must end the job (exit code non-zero).
"""

from __future__ import annotations

import time
from pathlib import Path

import pytest
from _jobs import run_job

SCRIPT = Path(__file__).parent / "scripts" / "timeout_job.py"


@pytest.mark.spawns
@pytest.mark.parametrize(
    "call",
    [
        "allreduce",
        "iallreduce",
        "broadcast",
        "barrier",
        "allgather_object",
        "reducescatter",
        "alltoall",
    ],
)
def test_a_collective_whose_peer_never_comes_times_out(call: str) -> None:
    started = time.monotonic()
    job = run_job([SCRIPT, call], ranks=2, job_timeout=60, env={"DATAPARALLEL_CHECK": "0"})
    elapsed = time.monotonic() - started
    assert job.returncode != 0, job.stdout + job.stderr
    assert "TIMEOUT rank 0:" in job.stdout, job.stdout + job.stderr
    assert "did not complete within 1 s" in job.stdout
    assert elapsed < 45, f"the job took {elapsed:.0f} s to end"

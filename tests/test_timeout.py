"""`DATAPARALLEL_TIMEOUT` / `initialize(timeout=)`: a collective whose peer never comes fails.

Each case launches its own 2-rank MPI job in which rank 1 never joins; rank 0's call must end with
`CollectiveTimeoutError`, and the launcher must end the job with rank 0's code, not by its own
`--timeout` (a hang guard only).
"""

from __future__ import annotations

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
    job = run_job([SCRIPT, call], ranks=2, job_timeout=100, env={"DATAPARALLEL_CHECK": "0"})
    output = job.stdout + job.stderr
    assert job.returncode == 3, output  # rank 0's, after its error: not the launcher's 124
    assert "TIMEOUT rank 0:" in job.stdout, output
    assert "did not complete within 1 s" in job.stdout

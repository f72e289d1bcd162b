"""`DATAPARALLEL_TIMEOUT` / `initialize(timeout=)`: a collective whose peer never comes fails.

One 2-rank MPI job in which rank 1 joins no call; each of rank 0's calls must end with
`CollectiveTimeoutError`, and the launcher must end the job with rank 0's code, not by its own
`--timeout` (a hang guard only).
"""

from __future__ import annotations

from pathlib import Path

import pytest
from _jobs import run_job

SCRIPT = Path(__file__).parent / "scripts" / "timeout_job.py"


CALLS = [
    "allreduce",
    "iallreduce",
    "broadcast",
    "barrier",
    "allgather_object",
    "reducescatter",
    "alltoall",
]


@pytest.mark.spawns
def test_a_collective_whose_peer_never_comes_times_out() -> None:
    """One job: rank 0 makes every call in turn, each left unmatched by rank 1, so each one's
    own wait must time out (a call that timed out leaves the next ones nothing to match)."""
    job = run_job(
        [SCRIPT, "--timeout", "0.25", *CALLS],
        ranks=2,
        job_timeout=100,
        env={"DATAPARALLEL_CHECK": "0"},
    )
    output = job.stdout + job.stderr
    assert job.returncode == 3, output  # rank 0's, after its errors: not the launcher's 124
    verdicts = [line for line in job.stdout.splitlines() if "TIMEOUT" in line]
    assert len(verdicts) == len(CALLS), output
    for call, line in zip(CALLS, verdicts, strict=True):
        assert line.startswith("TIMEOUT rank 0:"), (call, output)
        assert "did not complete within 0.25 s" in line, (call, output)

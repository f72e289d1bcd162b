"""A world wider than every threshold on the number of ranks in the code, on this machine.

`protocol.GATHER_LIMIT` (64) is the one NumPy's paths have: past it the handshake is an
allreduce of `protocol.BOUNDS` instead of a gather of records, without payload. The tests that
run at 2 and 3 ranks reach that path by lowering the limit (`test_faults.py`, `test_join.py`);
here a real world of `GATHER_LIMIT + 1` MPI ranks, oversubscribed, runs `scripts/wide_world.py`:
allreduce (sum, avg, min, max with a NaN, several dtypes, a tree with numbers), broadcast and
allgather from and of ranks past the limit, non-blocking calls, two mismatches raised on every
rank with the ranks named, and `dp.join`. Its ranks import NumPy and dataparallel only (torch
or JAX in 65 processes would not fit a small machine); JAX's own threshold (`CHECK_LIMIT`, 256
ranks, in its jitted order check) is not reached here.
"""

from __future__ import annotations

import importlib.util
import re
from pathlib import Path

import pytest
from _jobs import run_job

from dataparallel.protocol import GATHER_LIMIT

WIDE = Path(__file__).parent / "scripts" / "wide_world.py"
RANKS = GATHER_LIMIT + 1
# What a rank holds (Python, NumPy, mpi4py and MPICH's shared-memory segments): 60-70 MB each.
NEEDED_BYTES = RANKS * (100 << 20)
LIMIT = 400  # seconds: a hang guard; the job takes 20 s on a quiet 2-core machine


def _available_bytes() -> int | None:
    """Return the memory the kernel says is available (Linux), or None where it cannot say."""
    try:
        with open("/proc/meminfo", encoding="ascii") as file:
            for line in file:
                if line.startswith("MemAvailable:"):
                    return int(line.split()[1]) * 1024
    except OSError:
        pass
    return None


@pytest.mark.spawns
@pytest.mark.skipif(importlib.util.find_spec("mpi4py") is None, reason="needs mpi4py")
def test_a_world_past_the_gather_limit_runs_the_collectives_and_names_a_mismatch() -> None:
    available = _available_bytes()
    if available is not None and available < NEEDED_BYTES:
        pytest.skip(f"{RANKS} ranks need about {NEEDED_BYTES >> 20} MiB; {available >> 20} free")
    job = run_job([WIDE], launcher="mpiexec", ranks=RANKS, timeout=LIMIT)
    output = job.stdout + job.stderr
    assert job.returncode == 0, output
    assert "APPLICATION TIMED OUT" not in output, output
    assert re.search(rf"^WIDE OK {RANKS} \d+\.\d+$", job.stdout, re.MULTILINE), output
    named = f"x: float64[3] on ranks 0-{RANKS - 2}; float64[4] on rank {RANKS - 1}"
    assert f"MISMATCH Ranks called allreduce with different arguments: |   {named}" in job.stdout

"""A rank that joins (`dp.join`) while the others run jitted `DistributedOptimizer` steps.

A jitted step cannot answer a rank that has joined: every rank raises `RankJoinedError` (the
working ranks from the step, the joined rank from `dp.join`) instead of hanging, and the world
stays usable; ranks that all join after their last jitted step (an eager uneven tail between)
join as usual (`collectives/_jitted.py`). Each case is a job (`scripts/jax_join.py`) under a
hard limit, on MPI and Gloo, at 2 and 3 ranks, on each route.
"""

from __future__ import annotations

import importlib.util
from pathlib import Path

import pytest

pytest.importorskip("jax")
pytest.importorskip("optax")

from _jobs import run_job

SCRIPT = Path(__file__).parent / "scripts" / "jax_join.py"
CASES = [
    ("mpi", 2, "ffi"),
    ("mpi", 3, "callback"),
    ("mpi", 3, "mpi4jax"),
    ("gloo", 2, "callback"),
    ("gloo", 3, "ffi"),
]


@pytest.mark.spawns
@pytest.mark.parametrize(("backend", "ranks", "route"), CASES)
def test_a_rank_that_joins_during_jitted_steps_fails_them_cleanly(
    backend: str, ranks: int, route: str
) -> None:
    if route == "mpi4jax" and importlib.util.find_spec("mpi4jax") is None:
        pytest.skip("mpi4jax is not installed")
    job = run_job(
        [SCRIPT, route],
        ranks=ranks,
        backend=backend,
        job_timeout=240,
        env={"JAX_PLATFORMS": "cpu"},
        timeout=300,
    )
    out = job.stdout + job.stderr
    assert job.returncode == 0, out
    assert "rank 0: case 1: RankJoinedError: rank 0 has joined (dp.join)" in out, out
    for rank in range(1, ranks):
        line = next(x for x in job.stdout.splitlines() if f"rank {rank}: case 1: " in x)
        assert f"RankJoinedError: 1 of the {ranks} ranks have joined (dp.join)" in line, out
        assert "dp.join() only after the last jitted step" in line, out
    for rank in range(ranks):
        assert f"rank {rank}: case 1: usable after" in job.stdout, out
        assert f"rank {rank}: case 2: joined and stepped" in job.stdout, out

"""A rank that joins (`dp.join`) while the others run jitted `DistributedOptimizer` steps.

A jitted step cannot answer a rank that has joined: every rank raises `RankJoinedError` (the
working ranks from the step, the joined rank from `dp.join`) instead of hanging, and the world
stays usable; ranks that all join after their last jitted step (an eager uneven tail between)
join as usual (`collectives/jitted.py`). Each case is a job (`scripts/jax_join.py`) under a
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
# (engine, ranks, route, script options, DATAPARALLEL_TIMEOUT or ""): "big" adds a leaf that is
# a buffer of its own (the step stops before it); mpi4jax's steps of one buffer only (docs/jax.md).
CASES = [
    ("mpi", 2, "ffi", ["big"], ""),
    ("mpi", 3, "callback", [], ""),
    ("mpi", 3, "mpi4jax", [], ""),
    ("mpi", 2, "callback", ["big"], "120"),
    ("gloo", 2, "callback", ["big"], ""),
    ("gloo", 3, "ffi", [], ""),
    ("mpi", 3, "ffi", ["powersgd"], ""),
    ("gloo", 2, "callback", ["powersgd"], ""),
]


@pytest.mark.spawns
@pytest.mark.parametrize(("backend", "ranks", "route", "options", "limit"), CASES)
def test_a_rank_that_joins_during_jitted_steps_fails_them_cleanly(
    backend: str, ranks: int, route: str, options: list[str], limit: str
) -> None:
    if route == "mpi4jax" and importlib.util.find_spec("mpi4jax") is None:
        pytest.skip("mpi4jax is not installed")
    env = {"JAX_PLATFORMS": "cpu"} | ({"DATAPARALLEL_TIMEOUT": limit} if limit else {})
    job = run_job(
        [SCRIPT, route, *options],
        ranks=ranks,
        backend=backend,
        job_timeout=240,
        env=env,
        timeout=300,
    )
    out = job.stdout + job.stderr
    assert job.returncode == 0, out
    assert "rank 0: case 2: RankJoinedError: rank 0 has joined (dp.join)" in out, out
    for rank in range(1, ranks):
        line = next(x for x in job.stdout.splitlines() if f"rank {rank}: case 2: " in x)
        assert f"RankJoinedError: 1 of the {ranks} ranks have joined (dp.join)" in line, out
        assert "dp.join() only after the last jitted step" in line, out
    for rank in range(ranks):
        assert f"rank {rank}: case 1: joined and stepped" in job.stdout, out
        assert f"rank {rank}: case 2: usable after" in job.stdout, out

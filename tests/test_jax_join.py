"""A rank that joins (`dp.join`) while the others run jitted `DistributedOptimizer` steps.

A jitted step cannot answer a rank that has joined: every rank raises `RankJoinedError` (the
working ranks from the step, the joined rank from `dp.join`) instead of hanging, and the world
stays usable; ranks that all join after their last jitted step (an eager uneven tail between)
join as usual (`collectives/jitted.py`). Each job (`scripts/jax_join.py`, under a hard limit, on
MPI and Gloo, at 2 and 3 ranks) runs several cases one after the other in one process, each with a
new optimizer and step on its route: a case after the first joins after a join that returned and
after a `RankJoinedError`, with the steps of the cases before still traced (steps whose first
calls differ: the ranks answer the step run since, `collectives/jitted.py`).
"""

from __future__ import annotations

import importlib.util
from pathlib import Path

import pytest

pytest.importorskip("jax")
pytest.importorskip("optax")

from _jobs import run_job

SCRIPT = Path(__file__).parent / "scripts" / "jax_join.py"
# (engine, ranks, cases, DATAPARALLEL_TIMEOUT or ""), each case ROUTE[:OPTION]: "big" adds a leaf
# that is a buffer of its own (the step stops before it), "powersgd" compresses (two reductions).
# On the FFI route JAX keeps a failed step's effect token (docs/jax.md): an FFI case comes last.
# mpi4jax's steps of one buffer only (docs/jax.md), in a job of their own: their runs never reach
# the host, so steps of another first call beside them are not answered.
JOBS = [
    ("mpi", 2, ["callback:big", "ffi:big"], "120"),
    ("mpi", 3, ["callback", "ffi:powersgd"], ""),
    ("mpi", 3, ["mpi4jax"], ""),
    ("gloo", 2, ["callback:big", "callback:powersgd"], ""),
    ("gloo", 3, ["callback:powersgd", "ffi"], ""),
]


@pytest.mark.spawns
@pytest.mark.parametrize(("backend", "ranks", "cases", "limit"), JOBS)
def test_a_rank_that_joins_during_jitted_steps_fails_them_cleanly(
    backend: str, ranks: int, cases: list[str], limit: str
) -> None:
    if cases == ["mpi4jax"] and importlib.util.find_spec("mpi4jax") is None:
        pytest.skip("mpi4jax is not installed")
    env = {"JAX_PLATFORMS": "cpu"} | ({"DATAPARALLEL_TIMEOUT": limit} if limit else {})
    job = run_job(
        [SCRIPT, *cases],
        ranks=ranks,
        backend=backend,
        job_timeout=240,
        env=env,
        timeout=300,
    )
    out = job.stdout + job.stderr
    assert job.returncode == 0, out
    lines = job.stdout.splitlines()
    for case in range(1, len(cases) + 1):
        part = f"case {case}.2: "
        assert f"rank 0: {part}RankJoinedError: rank 0 has joined (dp.join)" in out, out
        for rank in range(1, ranks):
            line = next(x for x in lines if f"rank {rank}: {part}" in x)
            assert f"RankJoinedError: 1 of the {ranks} ranks have joined (dp.join)" in line, out
            assert "dp.join() only after the last jitted step" in line, out
        for rank in range(ranks):
            assert f"rank {rank}: case {case}.1: joined and stepped" in job.stdout, out
            assert f"rank {rank}: {part}usable after" in job.stdout, out

"""A rank that joins (`dp.join`) while the others run jitted `DistributedOptimizer` steps.

A jitted step cannot answer a rank that has joined: every rank raises `RankJoinedError` (the
working ranks from the step, the joined rank from `dp.join`) instead of hanging, and the world
stays usable; ranks that all join after their last jitted step (an eager uneven tail between)
join as usual (`collectives/jitted.py`). Each job (`scripts/jax_join.py`, under a hard limit,
on MPI at 2 and 3 ranks, on Gloo at 2) runs several cases one after the other in one process,
each with a new optimizer and step on its route: a case after the first joins after a join that
returned and after a `RankJoinedError`, with the steps of the cases before still traced (steps
whose first calls differ: the ranks answer the step run since, `collectives/jitted.py`).
"""

from __future__ import annotations

import importlib.util
from pathlib import Path

import pytest

pytest.importorskip("jax")
pytest.importorskip("optax")

from _jobs import run_job

from dataparallel.backends.single import SingleBackend
from dataparallel.collectives import jitted

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
    ("gloo", 2, ["callback:big", "callback:powersgd", "ffi"], ""),
]


def test_the_answer_is_the_step_traced_or_else_the_step_run_since_the_ranks_agreed(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """Which first call a rank that joins answers (`jitted.step_of`), on an engine of its own."""
    monkeypatch.setattr(jitted, "_traced", {})
    engine, private = SingleBackend(), SingleBackend()
    settled: list[bool] = []

    def step(length: int, dtype: str = "float32") -> jitted.JittedStep:
        return jitted.JittedStep(private, length, dtype, lambda buf: None)

    def trace(first: jitted.JittedStep, *, seen: bool = True) -> None:
        jitted.register_step(engine, first, seen=seen, settle=lambda: settled.append(True))

    a, b, a_in_f64 = step(16), step(20), step(16, "float64")
    assert jitted.step_of(engine) is None  # nothing traced
    trace(a)
    jitted.ran(engine, a)
    trace(step(16))  # the same first call again (a step of another tree, of the same size)
    assert jitted.step_of(engine) == a and settled  # the steps dispatched ran first
    trace(b)  # a second first call: the steps run since the ranks last agreed tell
    assert jitted.step_of(engine) == a  # only `a` ran since
    jitted.ran(engine, b)
    assert jitted.step_of(engine) is None  # both ran: the next one cannot be told
    jitted.agreed(engine)  # a join returned on every rank
    assert jitted.step_of(engine) is None  # nothing ran since
    jitted.ran(engine, b)
    jitted.ran(engine, b)
    assert jitted.step_of(engine) == b
    trace(a_in_f64)  # another dtype is another first call
    jitted.agreed(engine)
    jitted.ran(engine, a_in_f64)
    assert jitted.step_of(engine) == a_in_f64
    trace(step(20), seen=False)  # an mpi4jax step beginning as `b`: its runs are not noted
    assert jitted.step_of(engine) is None  # `b` may be what runs next
    jitted.agreed(engine)
    jitted.ran(engine, b)
    assert jitted.step_of(engine) == b  # the unseen step begins as `b` does
    assert jitted.step_of(SingleBackend()) is None  # another engine: nothing traced there


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

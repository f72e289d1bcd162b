"""`dataparallel.horovod.run` and the version names, with real jobs under MPI and Gloo.

`horovod.run` launches its own jobs, so these tests run in the world of one (marked `spawns`) and
go through `_jobs.run_job`, whose time limit ends a hung job as a failure.
"""

from __future__ import annotations

import importlib.util
import json
from pathlib import Path

import pytest
from _jobs import outer_world_size, run_job
from packaging.version import Version

import dataparallel as dp
import dataparallel.horovod as horovod

SCRIPT = Path(__file__).parent / "scripts" / "horovod_run.py"

alone = pytest.mark.skipif(
    outer_world_size() > 1,
    reason="launches its own multi-process jobs: run this file in a world of one",
)
needs_torch = pytest.mark.skipif(importlib.util.find_spec("torch") is None, reason="needs torch")
ENGINES = [
    pytest.param(
        "mpi",
        marks=pytest.mark.skipif(importlib.util.find_spec("mpi4py") is None, reason="needs mpi4py"),
    ),
    pytest.param("gloo", marks=needs_torch),  # Gloo is torch's
]


def test_versions_say_what_they_are() -> None:
    import importlib.metadata

    assert dp.__version__ == importlib.metadata.version("dataparallel")
    assert horovod.__version__ == f"0.28.1+dataparallel.{dp.__version__}"
    # Code that gates on Horovod's release sees the API version it gets.
    assert Version(horovod.__version__).release == (0, 28, 1)
    assert Version(horovod.__version__) >= Version("0.28")


@pytest.mark.spawns
@alone
@pytest.mark.parametrize("engine", ENGINES)
def test_run_returns_each_ranks_result_then_raises_naming_the_rank_that_raised(
    engine: str,
) -> None:
    """Two `run`s from one process: one that returns, one that raises."""
    job = run_job([SCRIPT, engine, "2", "ok", "fail"], launcher="python")
    assert job.returncode == 3, job.stdout + job.stderr
    (line,) = [line for line in job.stdout.splitlines() if line.startswith("[{")]
    results = json.loads(line)
    # Each rank's own return value, in rank order; the allreduce ran across both ranks.
    assert results == [{"rank": r, "size": 2, "sum": 1.0 + 100} for r in range(2)]
    message = job.stdout[job.stdout.index("RuntimeError:") :]
    assert "horovod.run: rank 1 raised ValueError: rank 1 cannot train" in message
    assert "rank 1's traceback:" in message and "in train" in message
    # The launcher printed the rank's traceback too, once, with its rank.
    assert job.stderr.count("ValueError: rank 1 cannot train") == 1, job.stderr


def test_run_refuses_what_it_cannot_do() -> None:
    def noop() -> None:
        return None

    with pytest.raises(ValueError, match="elastic mode, which dataparallel does not have"):
        horovod.run(noop, num_proc=2, min_num_proc=1)
    with pytest.raises(ValueError, match="use_gloo and use_mpi cannot both be True"):
        horovod.run(noop, use_gloo=True, use_mpi=True)
    with pytest.raises(ValueError, match="with Gloo, dataparallel starts ranks on this machine"):
        horovod.run(noop, num_proc=2, hosts="node7:1,node8:1", use_gloo=True)
    with pytest.raises(ValueError, match="expected 'host:slots' items"):
        horovod.run(noop, hosts="node7", use_mpi=True)
    with pytest.raises(ValueError, match="num_proc must be a positive int, got 0"):
        horovod.run(noop, num_proc=0)
    with pytest.warns(DeprecationWarning, match="np is deprecated"), pytest.raises(ValueError):
        horovod.run(noop, np=0)

"""Quiet by default: a successful launch prints nothing that reads like an error, and what does
go wrong is named in the user's words.

- under torchrun, no `[E ... TCPStore] The server socket ... has failed to bind` (dataparallel
  joins torchrun's agent store instead of binding MASTER_PORT again);
- a collective that times out is named as the user called it, not by the engine's exchange;
- under `dataparallel run --backend gloo`, one rank prefix per line (dp.print leaves out its own).

The Gloo job whose calls time out also prints a line from every rank (`timeout_job.py`): one job
serves both Gloo tests (`gloo_timeouts`, made once; the file goes whole to one pytest-xdist
worker, `ONE_WORKER` in tests/conftest.py), since a Gloo job's start is most of its cost.
"""

from __future__ import annotations

import importlib.util
import re
import subprocess
import sys
from pathlib import Path

import pytest
from _jobs import run_job

pytestmark = pytest.mark.spawns

SCRIPTS = Path(__file__).parent / "scripts"
TORCHRUN = Path(sys.executable).with_name("torchrun")
needs_torch = pytest.mark.skipif(importlib.util.find_spec("torch") is None, reason="needs torch")


@needs_torch
@pytest.mark.parametrize("n", [3])  # two ranks that could bind MASTER_PORT again
def test_a_launch_under_torchrun_prints_no_error_line(n: int) -> None:
    if not TORCHRUN.exists():
        pytest.skip(f"no torchrun beside {sys.executable}")
    command = [TORCHRUN, f"--nproc-per-node={n}", SCRIPTS / "slurm_world.py"]
    done = run_job(command, launcher=None)
    assert done.returncode == 0, done.stdout + done.stderr
    assert done.stdout.count(f"backend=gloo sum={n * (n + 1) // 2}") == n, done.stdout
    assert "failed to bind" not in done.stderr, done.stderr
    errors = [line for line in done.stderr.splitlines() if re.match(r"\[?E\d{4} ", line)]
    assert not errors, done.stderr


# Each engine names two calls, one blocking and one not or one reduction and one not, in one
# job: the name comes from the collective's own layer, above the engine (each call's timeout on
# MPI alone, with no handshake: test_timeout.py). MPI's calls wait their timeout polling: a
# short one there.
CALLS = {"gloo": (("allreduce", "reducescatter"), "1"), "mpi": (("iallreduce", "barrier"), "0.25")}


def timeouts_job(backend: str) -> subprocess.CompletedProcess[str]:
    """Run `timeout_job.py` at 2 ranks of `backend` with its two calls (`CALLS`)."""
    calls, timeout = CALLS[backend]
    target = [SCRIPTS / "timeout_job.py", "--timeout", timeout, *calls]
    return run_job(target, ranks=2, backend=backend, job_timeout=100)


@pytest.fixture(scope="module")
def gloo_timeouts() -> subprocess.CompletedProcess[str]:
    """The Gloo job of `timeouts_job`, run once for the two tests that read it."""
    return timeouts_job("gloo")


@pytest.mark.parametrize("backend", [pytest.param("gloo", marks=needs_torch), "mpi"])
def test_timed_out_collectives_are_named_as_called(
    backend: str, request: pytest.FixtureRequest
) -> None:
    if backend == "mpi" and importlib.util.find_spec("mpi4py") is None:
        pytest.skip("needs mpi4py")
    done = request.getfixturevalue("gloo_timeouts") if backend == "gloo" else timeouts_job("mpi")
    assert done.returncode == 3, done.stdout + done.stderr
    for call in CALLS[backend][0]:
        assert f"TIMEOUT rank 0: {call} timed out" in done.stdout, done.stdout
    assert "allgather" not in done.stdout, done.stdout  # the handshake's exchange is not named


@needs_torch
def test_one_prefix_per_line_under_gloo(gloo_timeouts: subprocess.CompletedProcess[str]) -> None:
    done = gloo_timeouts
    for r in range(2):
        line = rf"^\[rank {r}\] \[\d\d:\d\d:\d\d\.\d{{3}}\] hello from {r}$"
        assert re.search(line, done.stdout, flags=re.MULTILINE), done.stdout
    assert "/2]" not in done.stdout, done.stdout

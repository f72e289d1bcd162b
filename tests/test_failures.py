"""A rank that fails or dies ends the whole job quickly, never leaving the others hanging.

`dp.initialize()` in a world of several makes an uncaught exception abort the job after printing
its traceback once, even under a plain `mpiexec` or `torchrun`; a rank killed outright (SIGKILL,
the OOM killer) is noticed by the launcher, which ends the rest, with status 128 + the signal; a
rank that ends early without an error (`os._exit(0)`, `sys.exit(0)`, a skipped call) fails the
job instead of hanging it or passing for a success. Each case launches its own job (`spawns`),
whose other ranks would wait for ever: it must end by the way the test checks, never by a time
limit (the launcher's `--timeout`, `MPIEXEC_TIMEOUT`, or `run_job`'s), each only a hang guard.
"""

from __future__ import annotations

import re
import shutil
import signal
import socket
import subprocess
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
from _jobs import run_job

from dataparallel.launch.mpi import FirstDeaths
from dataparallel.launch.process import RunDir
from dataparallel.runnotes import note_end

SCRIPT = Path(__file__).parent / "scripts" / "uncaught_plain.py"
BIN = Path(sys.executable).parent
LIMIT = 150  # seconds: a hang guard (`run_job`'s limit; the launchers' own are 100)
JOB_TIMEOUT = 100


def ended_job(*args: Any, **kwargs: Any) -> tuple[subprocess.CompletedProcess[str], str]:
    """`run_job(*args, **kwargs)`; return the job and its output, failing if a time limit ended
    it (`dataparallel run --timeout`, or Hydra's `MPIEXEC_TIMEOUT`) rather than the failure."""
    job = run_job(*args, **kwargs)
    output = job.stdout + job.stderr
    assert "ran past --timeout" not in output, output
    assert "APPLICATION TIMED OUT" not in output, output
    return job, output


@pytest.mark.spawns
def test_an_uncaught_exception_ends_a_plain_mpiexec_job() -> None:
    job, output = ended_job([SCRIPT], launcher="mpiexec", ranks=3, timeout=LIMIT)
    assert job.returncode != 0, output
    assert output.count("RuntimeError: rank 1 fails on purpose") == 1, output
    assert "[rank 1] uncaught RuntimeError: ending the job" in output


@pytest.mark.spawns
def test_an_uncaught_exception_ends_a_torchrun_job() -> None:
    torchrun = shutil.which("torchrun", path=str(BIN))
    if torchrun is None:
        pytest.skip("torchrun is not installed beside this Python")
    job, output = ended_job(
        [torchrun, "--nproc-per-node", "3", SCRIPT], launcher=None, timeout=LIMIT
    )
    assert job.returncode != 0, output
    assert "RuntimeError: rank 1 fails on purpose" in output


KILLED = Path(__file__).parent / "scripts" / "killed_rank.py"


@pytest.mark.spawns
# MPI at 3 ranks, where mpiexec may see another rank go before rank 1 (named or not, below);
# Gloo's launcher ends the others alike however many they are.
@pytest.mark.parametrize(("backend", "ranks"), [("mpi", 3), ("gloo", 2)])
def test_a_killed_rank_ends_the_job(backend: str, ranks: int) -> None:
    job, output = ended_job(
        [KILLED], ranks=ranks, backend=backend, job_timeout=JOB_TIMEOUT, timeout=LIMIT
    )
    assert job.returncode == 128 + signal.SIGKILL, output  # as shells report it, both launchers
    assert "UNREACHABLE" not in output
    if backend == "gloo":
        assert "status 137" in output, output
    else:  # the ranks the launcher saw dying first: rank 1, and any mpiexec killed before it looked
        assert "was killed by signal 9 (SIGKILL)" in output, output
        named = re.search(r"ranks? ([0-9, ]+) was killed by signal 9 \(SIGKILL\)", output)
        assert named is None or "1" in named.group(1).split(", "), output


def _note(run_dir: RunDir, rank: int, kind: str, text: str) -> None:
    """Write a rank's `kind` note by hand, as the runner would (`runnotes.py`)."""
    Path(run_dir.path, f"rank-{rank}.{kind}").write_text(text + "\n")


# A rank as the watcher sees it: a process that holds its FIFO open (or not), and forks a child
# that outlives it (a data loader's worker, say), which must not keep the FIFO open: the child
# lives until the run folder is removed. The rank notes `rank-R.ready` once both are set up.
_RANK = """
import os, pathlib, sys, time
from dataparallel.runnotes import hold_alive
folder, rank = sys.argv[1], sys.argv[2]
if sys.argv[3] == "fifo":
    hold_alive(folder, int(rank))
if os.fork() == 0:
    while os.path.isdir(folder):
        time.sleep(0.05)
    os._exit(0)
pathlib.Path(folder, f"rank-{rank}.ready").touch()
time.sleep(600)  # until the test kills it
"""


def _wait_until(condition: Callable[[], bool], what: str, limit: float = LIMIT) -> None:
    """Wait until `condition()` holds; fail after `limit` seconds (a hang guard, never reached)."""
    deadline = time.monotonic() + limit
    while not condition():
        assert time.monotonic() < deadline, f"{what}: not after {limit:g} s"
        time.sleep(0.01)


@pytest.mark.spawns
@pytest.mark.parametrize("how", ["fifo", "pidfd"])
def test_the_launcher_sees_which_rank_died_first_and_not_one_that_finished(how: str) -> None:
    run_dir = RunDir()
    sleepers: list[subprocess.Popen[bytes]] = []
    try:
        with FirstDeaths(run_dir, 3) as deaths:  # makes the FIFOs before the ranks start
            for rank in range(3):
                command = [sys.executable, "-c", _RANK, run_dir.path, str(rank), how]
                sleepers.append(subprocess.Popen(command))
                if how == "pidfd":  # else the FIFOs alone can tell
                    _note(run_dir, rank, "pid", f"{socket.gethostname()} {sleepers[-1].pid}")
            ready = [Path(run_dir.path, f"rank-{rank}.ready") for rank in range(3)]
            _wait_until(lambda: all(path.exists() for path in ready), "the ranks set up")
            note_end(run_dir.path, 0, "done")  # rank 0 finished its script: not to blame
            sleepers[0].kill()
            sleepers[0].wait()
            # Its child still lives, and holds no FIFO: the watcher sees rank 0 go, and blames none.
            _wait_until(lambda: 0 in deaths.seen, "the watcher saw rank 0 end")
            assert deaths.first == []
            sleepers[2].kill()
            sleepers[2].wait()
            _wait_until(lambda: 2 in deaths.seen, "the watcher saw rank 2 die")
        assert deaths.first == [2]
    finally:
        for proc in sleepers:
            proc.kill()
            proc.wait()
        run_dir.remove()


NEVER = Path(__file__).parent / "scripts" / "never_initializes.py"


@pytest.mark.spawns
@pytest.mark.parametrize("backend", ["mpi", "gloo"])
def test_a_rank_that_never_initializes_ends_the_job(backend: str) -> None:
    """Its peers would wait in dp.initialize() for ever: the launcher ends the job, naming both."""
    job, output = ended_job(
        [NEVER], ranks=3, backend=backend, job_timeout=JOB_TIMEOUT, timeout=LIMIT
    )
    assert job.returncode == 1, output
    assert "UNREACHABLE" not in output
    assert "waits in dp.initialize() for rank 1, which finished its script without calling it" in (
        output
    )


@pytest.mark.parametrize(
    ("notes", "stranded"),
    [
        ({0: "initializing 1"}, None),  # nobody has ended
        ({0: "initializing 1", 1: None}, 0),  # rank 1 never called initialize
        ({0: "ready 1", 1: "ready 1"}, None),  # both had the world; rank 1 finished first
        ({0: "initializing 2", 1: "ready 1"}, 0),  # rank 0 makes a second world alone
        ({0: "initializing 1", 1: "initializing 1"}, 0),  # rank 1 ended while entering it
        ({0: "initializing 1", 1: "failed 1"}, 0),  # its initialize raised, it finished anyway
    ],
)
def test_the_launcher_sees_a_rank_wait_in_initialize_for_one_that_ended(
    notes: dict[int, str | None], stranded: int | None
) -> None:
    run_dir = RunDir()
    try:
        for rank, world in notes.items():
            if world is not None:
                _note(run_dir, rank, "world", world)
        if 1 in notes:
            note_end(run_dir.path, 1, "done")
        problem = run_dir.stranded()
        if stranded is None:
            assert problem is None
        else:
            assert problem is not None and problem.startswith(f"rank {stranded} waits")
        note_end(run_dir.path, 1, "failed 3")  # a failure ends the job by its own way
        assert run_dir.stranded() is None
    finally:
        run_dir.remove()


# --- a rank that ends early, without an error, while the others wait for it -----------------

EARLY = Path(__file__).parent / "scripts" / "leaves_early.py"
# How each job is started: `dataparallel run` under MPI or Gloo, or a plain mpiexec.
LAUNCHES = {
    "run-mpi": {"backend": "mpi"},
    "run-gloo": {"backend": "gloo"},
    "mpiexec": {"launcher": "mpiexec"},
}


def _launch(
    how: str, launch: str, ranks: int, *extra: Path
) -> tuple[subprocess.CompletedProcess[str], str]:
    kind = dict(LAUNCHES[launch])
    if launch.startswith("run"):
        kind["job_timeout"] = JOB_TIMEOUT
    return ended_job([EARLY, how, *extra], ranks=ranks, timeout=LIMIT, **kind)


@pytest.mark.spawns
@pytest.mark.parametrize(
    ("how", "launch", "ranks"),
    [
        # Each launch at 2 ranks (rank 1 the only other) and at 3 (two ranks wait for it),
        # across the ways of ending: no way depends on how many wait. Gloo at 3 once, where
        # the launcher names the two that waited (a Gloo rank's start, torch's import, costs
        # the most).
        ("os._exit", "run-mpi", 3),
        ("os._exit", "run-gloo", 2),
        # A plain mpiexec reports 0 for a rank's os._exit(0): only `dataparallel run` can tell.
        ("sys.exit", "run-mpi", 3),
        ("sys.exit", "run-gloo", 2),
        ("sys.exit", "mpiexec", 3),
        ("skip", "run-mpi", 2),
        ("skip", "run-gloo", 3),
        ("skip", "mpiexec", 2),
    ],
)
def test_a_rank_that_ends_early_fails_the_job(how: str, launch: str, ranks: int) -> None:
    job, output = _launch(how, launch, ranks)
    assert job.returncode == 1, output  # not 0, and not the launcher's 124
    assert "UNREACHABLE" not in output
    if how == "os._exit":
        assert "rank 1 left through os._exit(0) before its script finished" in output, output
    elif launch == "run-gloo":
        assert "RankFailedError" in output, output  # the waiting ranks see rank 1 go
        # ... and the launcher names rank 1, not a rank that waited for it
        named = r"rank 1 finished its script while ranks? [0-9, and]+ still waited in a collective"
        assert re.search(named, output), output
        assert not re.search(r"rank [02] exited with status", output), output
    else:  # MPI: rank 1, on its way out, sees the others wait for it and ends the job
        pattern = r"rank 1 has finished .* but rank \d has started call number \d+, which rank 1"
        assert re.search(pattern, output), output


@pytest.mark.spawns
@pytest.mark.parametrize("ranks", [2, 3])
def test_a_rank_that_fails_is_named_rather_than_those_that_waited_for_it(ranks: int) -> None:
    """Gloo: the ranks waiting for rank 1 fail too (`RankFailedError`), maybe before the launcher
    sees rank 1's own exit; the job's failure is rank 1's, with its status."""
    job, output = _launch("raise", "run-gloo", ranks)
    assert job.returncode == 1, output
    assert "rank 1 exited with status 1" in output, output
    assert not re.search(r"rank [02] exited with status", output), output
    assert "RuntimeError: rank 1 fails on purpose" in output, output


@pytest.mark.spawns
@pytest.mark.parametrize(("launch", "ranks"), [("run-mpi", 3), ("run-gloo", 2), ("mpiexec", 3)])
def test_a_rank_that_finishes_later_is_waited_for(launch: str, ranks: int, tmp_path: Path) -> None:
    job, output = _launch("late", launch, ranks, tmp_path)
    assert job.returncode == 0, output
    for rank in range(ranks):
        assert f"rank {rank} finished" in job.stdout, output


ALONE = Path(__file__).parent / "scripts" / "alone.py"


@pytest.mark.spawns
def test_an_engine_alone_under_a_launcher_of_several_fails() -> None:
    # --backend gloo starts 2 processes with torchrun's variables; MPI there is a world of one.
    job, output = ended_job(
        [ALONE, "mpi"], ranks=2, backend="gloo", job_timeout=JOB_TIMEOUT, timeout=LIMIT
    )
    assert job.returncode == 1, output
    assert "UNREACHABLE" not in output
    message = "BackendUnavailableError: The 'mpi' engine formed a world of one, but the launcher"
    assert message in output, output
    assert "started 2 processes (WORLD_SIZE=2)" in output

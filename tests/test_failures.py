"""A rank that fails or dies ends the whole job quickly, never leaving the others hanging.

`dp.initialize()` in a world of several makes an uncaught exception abort the job after printing
its traceback once, even under a plain `mpiexec` or `torchrun`; a rank killed outright (SIGKILL,
the OOM killer) is noticed by the launcher, which ends the rest, with status 128 + the signal; a
rank that ends early without an error (`os._exit(0)`, `sys.exit(0)`, a skipped call) fails the
job instead of hanging it or passing for a success. Each case launches its own job (`spawns`),
with a timeout far above the time it must take.
"""

from __future__ import annotations

import re
import shutil
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import pytest
from _jobs import run_job

from dataparallel.launch._deaths import FirstDeaths
from dataparallel.launch._rundir import RunDir
from dataparallel.runnotes import note_end

SCRIPT = Path(__file__).parent / "scripts" / "uncaught_plain.py"
BIN = Path(sys.executable).parent
LIMIT = 150  # seconds; every case must end in under 60


def timed_job(*args: Any, **kwargs: Any) -> tuple[subprocess.CompletedProcess[str], float, str]:
    """`run_job(*args, **kwargs)`; return the job, the seconds it took, and its output."""
    started = time.monotonic()
    job = run_job(*args, **kwargs)
    return job, time.monotonic() - started, job.stdout + job.stderr


@pytest.mark.spawns
def test_an_uncaught_exception_ends_a_plain_mpiexec_job() -> None:
    job, elapsed, output = timed_job([SCRIPT], launcher="mpiexec", ranks=3, timeout=LIMIT)
    assert job.returncode != 0, output
    assert output.count("RuntimeError: rank 1 fails on purpose") == 1, output
    assert "[rank 1] uncaught RuntimeError: ending the job" in output
    assert elapsed < 60, f"the job took {elapsed:.0f} s to end"


@pytest.mark.spawns
def test_an_uncaught_exception_ends_a_torchrun_job() -> None:
    torchrun = shutil.which("torchrun", path=str(BIN))
    if torchrun is None:
        pytest.skip("torchrun is not installed beside this Python")
    job, elapsed, output = timed_job(
        [torchrun, "--nproc-per-node", "3", SCRIPT], launcher=None, timeout=LIMIT
    )
    assert job.returncode != 0, output
    assert "RuntimeError: rank 1 fails on purpose" in output
    assert elapsed < 60, f"the job took {elapsed:.0f} s to end"


KILLED = Path(__file__).parent / "scripts" / "killed_rank.py"


@pytest.mark.spawns
@pytest.mark.parametrize("backend", ["mpi", "gloo"])
def test_a_killed_rank_ends_the_job(backend: str) -> None:
    job, elapsed, output = timed_job(
        [KILLED], ranks=3, backend=backend, job_timeout=100, timeout=LIMIT
    )
    assert job.returncode == 128 + signal.SIGKILL, output  # as shells report it, both launchers
    assert "UNREACHABLE" not in output
    if backend == "gloo":
        assert "status 137" in output, output
    else:  # the ranks the launcher saw dying first: rank 1, and any mpiexec killed before it looked
        assert "was killed by signal 9 (SIGKILL)" in output, output
        named = re.search(r"ranks? ([0-9, ]+) was killed by signal 9 \(SIGKILL\)", output)
        assert named is None or "1" in named.group(1).split(", "), output
    assert elapsed < 60, f"the job took {elapsed:.0f} s to end"


def _note(run_dir: RunDir, rank: int, kind: str, text: str) -> None:
    """Write a rank's `kind` note by hand, as the runner would (`runnotes.py`)."""
    Path(run_dir.path, f"rank-{rank}.{kind}").write_text(text + "\n")


# A rank as the watcher sees it: a process that holds its FIFO open (or not), and forks a child
# that outlives it by 3 s (a data loader's worker, say), which must not keep the FIFO open.
_RANK = """
import os, sys, time
from dataparallel.runnotes import hold_alive
if sys.argv[3] == "fifo":
    hold_alive(sys.argv[1], int(sys.argv[2]))
if os.fork() == 0:
    parent = os.getppid()
    while os.getppid() == parent:
        time.sleep(0.05)
    time.sleep(3)
    os._exit(0)
time.sleep(60)
"""


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
            time.sleep(1.0)  # each holds its FIFO now
            note_end(run_dir.path, 0, "done")  # rank 0 finished its script: not to blame
            sleepers[0].kill()
            sleepers[0].wait()
            time.sleep(0.2)
            assert deaths.first == []
            sleepers[2].kill()
            sleepers[2].wait()
            for _ in range(100):  # 2 s at most: the child still lives, and holds no FIFO
                if deaths.first:
                    break
                time.sleep(0.02)
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
    job, elapsed, output = timed_job(
        [NEVER], ranks=3, backend=backend, job_timeout=100, timeout=LIMIT
    )
    assert job.returncode == 1, output
    assert "UNREACHABLE" not in output
    assert "waits in dp.initialize() for rank 1, which finished its script without calling it" in (
        output
    )
    assert elapsed < 60, f"the job took {elapsed:.0f} s to end"


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


def _launch(how: str, launch: str, ranks: int) -> tuple[subprocess.CompletedProcess[str], float]:
    started = time.monotonic()
    kind = dict(LAUNCHES[launch])
    if launch.startswith("run"):
        kind["job_timeout"] = 100
    job = run_job([EARLY, how], ranks=ranks, timeout=LIMIT, **kind)  # type: ignore[arg-type]
    return job, time.monotonic() - started


@pytest.mark.spawns
@pytest.mark.parametrize("ranks", [2, 3])
@pytest.mark.parametrize(
    ("how", "launch"),
    [
        ("os._exit", "run-mpi"),
        ("os._exit", "run-gloo"),
        # A plain mpiexec reports 0 for a rank's os._exit(0): only `dataparallel run` can tell.
        ("sys.exit", "run-mpi"),
        ("sys.exit", "run-gloo"),
        ("sys.exit", "mpiexec"),
        ("skip", "run-mpi"),
        ("skip", "run-gloo"),
        ("skip", "mpiexec"),
    ],
)
def test_a_rank_that_ends_early_fails_the_job(how: str, launch: str, ranks: int) -> None:
    job, elapsed = _launch(how, launch, ranks)
    output = job.stdout + job.stderr
    assert job.returncode == 1, output  # not 0, and not the launcher's 124
    assert "UNREACHABLE" not in output
    if how == "os._exit":
        assert "rank 1 left through os._exit(0) before its script finished" in output, output
    elif launch == "run-gloo":
        assert "RankFailedError" in output, output  # the waiting ranks see rank 1 go
    else:  # MPI: rank 1, on its way out, sees the others wait for it and ends the job
        pattern = r"rank 1 has finished .* but rank \d has started call number \d+, which rank 1"
        assert re.search(pattern, output), output
    assert elapsed < 60, f"the job took {elapsed:.0f} s to end"


@pytest.mark.spawns
@pytest.mark.parametrize("launch", list(LAUNCHES))
def test_a_rank_that_finishes_later_is_waited_for(launch: str) -> None:
    job, _ = _launch("late", launch, 3)
    output = job.stdout + job.stderr
    assert job.returncode == 0, output
    for rank in range(3):
        assert f"rank {rank} finished" in job.stdout, output


ALONE = Path(__file__).parent / "scripts" / "alone.py"


@pytest.mark.spawns
def test_an_engine_alone_under_a_launcher_of_several_fails() -> None:
    # --backend gloo starts 2 processes with torchrun's variables; MPI there is a world of one.
    job = run_job([ALONE, "mpi"], ranks=2, backend="gloo", job_timeout=100, timeout=LIMIT)
    output = job.stdout + job.stderr
    assert job.returncode == 1, output
    assert "UNREACHABLE" not in output
    message = "BackendUnavailableError: The 'mpi' engine formed a world of one, but the launcher"
    assert message in output, output
    assert "started 2 processes (WORLD_SIZE=2)" in output

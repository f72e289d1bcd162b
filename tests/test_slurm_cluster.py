"""dataparallel under a real Slurm: srun steps, salloc and sbatch allocations, `dataparallel run`.

A single-node cluster (munge, slurmctld, slurmd from Debian's packages; the node declares 4 CPUs)
is started once by `tools/slurm/start.sh` (`.ci/run` installs the packages); where it cannot be,
every test here is skipped with the script's reason. Every job has the hard limit of
`_jobs.run_job`, and the tests run in the world-of-one pass only (`spawns`).
"""

from __future__ import annotations

import os
import re
import shutil
import subprocess
import sys
import time
from pathlib import Path

import pytest
from _jobs import run_job, run_ranks

pytestmark = pytest.mark.spawns

ROOT = Path(__file__).resolve().parent.parent
START = ROOT / "tools" / "slurm" / "start.sh"
WORLD = Path(__file__).parent / "scripts" / "slurm_world.py"
PYTHON = sys.executable
LIMIT = 180.0  # a job may queue while the one before it completes (a few seconds)


@pytest.fixture(scope="module", autouse=True)
def cluster() -> None:
    """Start the single-node cluster (idempotent), or skip with why it cannot be."""
    if shutil.which("srun") is None:
        pytest.skip("Slurm is not installed (apt-get install slurmctld slurmd slurm-client munge)")
    try:
        started = subprocess.run(
            ["bash", str(START)], capture_output=True, text=True, timeout=120, check=False
        )
    except subprocess.TimeoutExpired:
        pytest.skip("tools/slurm/start.sh did not finish within 120 s")
    if started.returncode != 0:
        pytest.skip(f"Slurm could not be started here: {started.stderr.strip()}")


def _sbatch(
    script: Path | str, output: Path, cwd: Path | None = None, env: dict[str, str] | None = None
) -> str:
    """Submit `script` with `sbatch`, wait for the job to end and return its `JobState`
    (COMPLETED, FAILED, ...) and `ExitCode` (`status:signal`), as `"STATE status:signal"`.

    The wait is on the job's state, asked every 0.1 s: `sbatch --wait` sleeps 2 s, then 8 s,
    then 32 s between its own looks, so that a job of 3 s would have been seen at 10 s.
    """
    submit = ["sbatch", "--parsable", f"--output={output}", str(script)]
    done = run_job(submit, launcher=None, timeout=LIMIT, cwd=cwd, env=env)
    assert done.returncode == 0, done.stdout + done.stderr
    job_id = done.stdout.strip().split(";")[0]
    deadline = time.monotonic() + LIMIT
    while time.monotonic() < deadline:
        shown = subprocess.run(
            ["scontrol", "-o", "show", "job", job_id],
            capture_output=True, text=True, timeout=30, check=False,
        )  # fmt: skip
        fields = dict(f.split("=", 1) for f in shown.stdout.split() if "=" in f)
        if fields.get("JobState") in _ENDED:
            return f"{fields['JobState']} {fields.get('ExitCode')}"
        time.sleep(0.1)
    subprocess.run(["scancel", job_id], capture_output=True, timeout=30, check=False)
    pytest.fail(f"Slurm job {job_id} did not end within {LIMIT:g} s")


# The states of a job that has ended (`squeue --help`, JOB STATE CODES), COMPLETING not yet.
_ENDED = frozenset(
    {
        "BOOT_FAIL", "CANCELLED", "COMPLETED", "DEADLINE", "FAILED", "NODE_FAIL",
        "OUT_OF_MEMORY", "PREEMPTED", "TIMEOUT",
    }
)  # fmt: skip


def _worlds(stdout: str) -> list[dict[str, str]]:
    """Parse the `world rank=.. size=..` lines of `slurm_world.py`, with their launcher prefix."""
    lines = re.findall(r"^(\[rank \d+\] )?world (.*)$", stdout, flags=re.MULTILINE)
    return [
        {"prefix": prefix, **dict(field.split("=") for field in fields.split())}
        for prefix, fields in lines
    ]


def _one_world(stdout: str, n: int, backend: str) -> list[dict[str, str]]:
    worlds = _worlds(stdout)
    assert sorted(int(w["rank"]) for w in worlds) == list(range(n)), stdout
    for w in worlds:
        assert (w["size"], w["backend"]) == (str(n), backend), stdout
        assert w["sum"] == str(n * (n + 1) // 2), stdout  # every rank's number, in one world
        assert w["local"] == f"{w['rank']}/{n}", stdout  # one node
    return worlds


# 3 tasks: Gloo worlds of 2 under Slurm are `dataparallel run -n 2` in one task, below.
@pytest.mark.parametrize("n", [3])
def test_srun_tasks_form_one_gloo_world(n: int) -> None:
    done = run_job(["srun", "-n", str(n), PYTHON, WORLD], launcher=None, timeout=LIMIT)
    assert done.returncode == 0, done.stdout + done.stderr
    _one_world(done.stdout, n, "gloo")


def test_srun_with_pmi2_forms_one_mpi_world() -> None:
    pytest.importorskip("mpi4py")
    command = ["srun", "-n", "3", "--mpi=pmi2", PYTHON, WORLD]
    done = run_job(command, launcher=None, timeout=LIMIT)
    assert done.returncode == 0, done.stdout + done.stderr
    _one_world(done.stdout, 3, "mpi")


def test_srun_with_pmix_is_answered_before_mpi_init() -> None:
    pytest.importorskip("mpi4py")
    kinds = subprocess.run(["srun", "--mpi=list"], capture_output=True, text=True, check=False)
    if "pmix" not in kinds.stdout + kinds.stderr:
        pytest.skip("this Slurm has no PMIx plugin (apt-get install libpmix-dev)")
    # `--mpi=list` names the plugins whose files are installed; one whose library (libpmix) is
    # missing is listed all the same, and srun refuses it only when a step starts: try one.
    probe = run_job(["srun", "-n", "1", "--mpi=pmix", "true"], launcher=None, timeout=LIMIT)
    if probe.returncode != 0:
        reason = (probe.stderr.strip() or probe.stdout.strip()).splitlines()[-1:]
        pytest.skip(f"srun cannot start a step with --mpi=pmix here: {' '.join(reason)}")
    command = ["srun", "-n", "2", "--mpi=pmix", PYTHON, WORLD]
    done = run_job(command, launcher=None, timeout=LIMIT)
    assert done.returncode == 1, done.stdout + done.stderr
    assert "BackendUnavailableError: srun started this task with PMIx" in done.stderr
    assert "`srun --mpi=pmi2 ...`" in done.stderr
    assert "unsupported PMI version" not in done.stderr  # MPICH's own abort never came


def test_run_in_an_allocation_uses_its_tasks() -> None:
    pytest.importorskip("mpi4py")
    command = ["salloc", "-n", "3", PYTHON, "-m", "dataparallel", "run", WORLD]
    done = run_job(command, launcher=None, timeout=LIMIT)
    assert done.returncode == 0, done.stdout + done.stderr
    _one_world(done.stdout, 3, "mpi")


def test_run_in_an_allocation_refuses_more_ranks_than_tasks() -> None:
    command = ["salloc", "-n", "2", PYTHON, "-m", "dataparallel", "run", "-n", "3", WORLD]
    done = run_job(command, launcher=None, timeout=LIMIT)
    assert done.returncode == 2, done.stdout + done.stderr
    assert "-n 3 exceeds the 2 tasks of Slurm job" in done.stderr
    assert "world rank" not in done.stdout


def test_run_gloo_in_an_allocation_starts_the_ranks_through_srun() -> None:
    pytest.importorskip("torch")
    run = [PYTHON, "-m", "dataparallel", "run", "--backend", "gloo", "--timeout", "150", WORLD]
    done = run_job(["salloc", "-n", "3", *run], launcher=None, timeout=LIMIT)
    assert done.returncode == 0, done.stdout + done.stderr
    for w in _one_world(done.stdout, 3, "gloo"):
        assert w["prefix"] == f"[rank {w['rank']}] "  # srun's labels, turned into one prefix


@pytest.mark.parametrize("backend", ["mpi", "gloo"])
def test_srun_one_task_running_dataparallel_run(backend: str) -> None:
    pytest.importorskip("mpi4py" if backend == "mpi" else "torch")
    run = [PYTHON, "-m", "dataparallel", "run", "-n", "2", "--backend", backend, WORLD]
    done = run_job(["srun", "-n", "1", *run], launcher=None, timeout=LIMIT)
    assert done.returncode == 0, done.stdout + done.stderr
    _one_world(done.stdout, 2, backend)


def test_srun_tasks_each_running_dataparallel_run_are_refused() -> None:
    run = [PYTHON, "-m", "dataparallel", "run", "-n", "2", WORLD]
    done = run_job(["srun", "-n", "2", *run], launcher=None, timeout=LIMIT)
    assert done.returncode == 2, done.stdout + done.stderr
    assert "started by srun as one of 2 tasks: each task would launch a job" in done.stderr


def test_python_alone_in_an_allocation_of_several_tasks_is_refused() -> None:
    done = run_job(["salloc", "-n", "2", PYTHON, WORLD], launcher=None, timeout=LIMIT)
    assert done.returncode == 1, done.stdout + done.stderr
    assert "of 2 tasks (SLURM_NTASKS=2) but was not started as one of them" in done.stderr


def test_the_sbatch_example_of_the_docs_runs_as_written(tmp_path: Path) -> None:
    pytest.importorskip("mpi4py")
    output = tmp_path / "tour.out"
    path = f"{Path(PYTHON).parent}:{os.environ.get('PATH', '')}"  # the `dataparallel` command
    ended = _sbatch("examples/slurm_job.sh", output, cwd=ROOT, env={"PATH": path})
    text = output.read_text() if output.exists() else ""
    assert ended == "COMPLETED 0:0", f"{ended}\n{text}"
    for r in range(2):
        assert f"[{r}/2] allreduce sum: [3. 3. 3.] (expected 3.0)" in text, text


def test_an_sbatch_script_runs_dataparallel_run_without_n(tmp_path: Path) -> None:
    pytest.importorskip("mpi4py")
    script = tmp_path / "job.sh"
    output = tmp_path / "job.out"
    script.write_text(
        "#!/bin/bash\n#SBATCH --ntasks=2\n"
        f"{PYTHON} -m dataparallel run {WORLD}\n"  # docs/slurm.md's example, in short
    )
    ended = _sbatch(script, output)
    text = output.read_text() if output.exists() else ""
    assert ended == "COMPLETED 0:0", f"{ended}\n{text}"
    _one_world(text, 2, "mpi")


def test_info_reports_the_job_and_the_task() -> None:
    """`dataparallel info` in a step of 2 tasks, and in one under `--mpi=pmi2`: both steps at
    once (the cluster has the CPUs), each task's report its own."""
    command = ["srun", "-n", "2", PYTHON, "-m", "dataparallel", "info"]
    under_mpi = [*command[:3], "--mpi=pmi2", *command[3:]]
    (status, out, err), (mpi_status, mpi_out, mpi_err) = run_ranks(
        [command, under_mpi], timeout=LIMIT
    )
    assert status == 0, out + err
    slurm = re.findall(
        r"^  Slurm +job \d+, 2 task\(s\) on \S+; step \d+, this is task (\d) ", out, re.M
    )
    assert sorted(slurm) == ["0", "1"], out
    ranks = re.findall(r"^  this process +rank (\d) of 2, from Slurm's step$", out, re.M)
    assert sorted(ranks) == ["0", "1"], out
    assert mpi_status == 0, mpi_out + mpi_err
    assert mpi_out.count("(PMI: pmi2)") == 2, mpi_out
    assert mpi_out.count("started by an MPI launcher") == 2, mpi_out

"""The `dataparallel` command, run as real jobs: `run` under MPI and Gloo, failures, exits, `info`.

These tests start their own jobs of several processes, so they run in the world of one and skip
under an outer `mpiexec -n N` (N > 1). They launch through `_jobs.run_job`, which gives every job
a time limit (and every mpiexec `MPIEXEC_TIMEOUT`), so a regression shows up as a failure, never as
a hang.
"""

from __future__ import annotations

import argparse
import importlib.util
import io
import json
import os
import re
import signal
import subprocess
import sys
import sysconfig
import threading
import time
from pathlib import Path

import pytest
from _jobs import LIMIT, free_port, outer_world_size, run_job, run_ranks, spawn
from _lightning import assert_fits_like_one_process, needs_lightning

from dataparallel.errors import BackendUnavailableError
from dataparallel.launch.cli import (
    _RUN_PAIR_OPTIONS,
    _RUN_VALUE_OPTIONS,
    _parser,
    _split_target,
)
from dataparallel.launch.mpi import find_mpiexec, mpi_command, require_mpi4py
from dataparallel.launch.process import PARTIAL_LINE_SECONDS, Output, pump

SCRIPTS = Path(__file__).parent / "scripts"
CLI = ["-m", "dataparallel"]  # `python -m dataparallel ...`, with any arguments
# A failing job's other ranks sleep 600 s: it must end by the failure, never by a time limit.
# `run_job`'s own (LIMIT) is a hang guard, far below that sleep.


pytestmark = [
    pytest.mark.spawns,
    pytest.mark.skipif(
        outer_world_size() > 1,
        reason="launches its own multi-process jobs: run this file in a world of one",
    ),
]

needs_mpi = pytest.mark.skipif(
    importlib.util.find_spec("mpi4py") is None,
    reason="needs mpi4py: pip install 'dataparallel[mpi]'",
)
needs_torch = pytest.mark.skipif(
    importlib.util.find_spec("torch") is None, reason="needs torch for --backend gloo"
)
BACKENDS = [pytest.param("mpi", marks=needs_mpi), pytest.param("gloo", marks=needs_torch)]


def _json_lines(text: str, prefixed: bool = False) -> dict[int, dict[str, object]]:
    """Parse the JSON line of each rank, keyed by the rank (from the prefix when `prefixed`)."""
    found: dict[int, dict[str, object]] = {}
    for line in text.splitlines():
        match = re.fullmatch(r"\[rank (\d+)\] (\{.*\})" if prefixed else r"(\{.*\})", line)
        if match is None:
            continue
        data = json.loads(match.group(match.lastindex or 1))
        key = int(match.group(1)) if prefixed else int(data["rank"])
        assert key not in found, f"rank {key} printed twice:\n{text}"
        found[key] = data
    return found


# --- run: every rank runs, arguments reach the script ---------------------------------------


@needs_mpi
@pytest.mark.parametrize("n", [2])  # 3 ranks: test_run_mpi_with_a_hostfile
def test_run_mpi_starts_every_rank_in_one_world(n: int) -> None:
    done = run_job(["cli_hello.py", "x", "-n", "5", "--", "y"], ranks=n, cwd=SCRIPTS)
    assert done.returncode == 0, done.stderr
    ranks = _json_lines(done.stdout)
    assert sorted(ranks) == list(range(n)), done.stdout
    for data in ranks.values():
        assert data["size"] == n
        assert data["sum"] == n * (n - 1) // 2
        # Options after the script are the script's, even those the launcher also has, and `--`.
        assert data["argv"] == ["x", "-n", "5", "--", "y"]


@needs_mpi
def test_run_console_script_and_module_target() -> None:
    console = Path(sys.executable).parent / "dataparallel"
    if not console.exists():
        pytest.skip("the `dataparallel` console script is not installed next to this Python")
    done = run_job(
        [console, "run", "-n", "2", "-m", "cli_hello", "--flag"], launcher=None, cwd=SCRIPTS
    )
    assert done.returncode == 0, done.stderr
    ranks = _json_lines(done.stdout)
    assert sorted(ranks) == [0, 1]
    assert all(data["argv"] == ["--flag"] for data in ranks.values())


@needs_mpi
def test_run_m_pytest_runs_the_tests_on_every_rank() -> None:
    options = ["-q", "-p", "no:cacheprovider", "--noconftest", "-o", "addopts="]
    done = run_job(["-m", "pytest", *options, "cli_pytest_target.py"], ranks=2, cwd=SCRIPTS)
    assert done.returncode == 0, done.stdout + done.stderr
    assert done.stdout.count("1 passed") == 2, done.stdout


@needs_torch
@pytest.mark.parametrize("n", [3])  # 2 ranks: test_run_gloo_numbers_ranks_across_nodes_...
def test_run_gloo_gives_torchrun_variables_and_prefixes_output(n: int) -> None:
    done = run_job(["cli_env.py"], ranks=n, backend="gloo", cwd=SCRIPTS)
    assert done.returncode == 0, done.stderr
    ranks = _json_lines(done.stdout, prefixed=True)
    assert sorted(ranks) == list(range(n)), done.stdout
    ports = {data["MASTER_PORT"] for data in ranks.values()}
    assert len(ports) == 1 and str(ports.pop()).isdigit()
    for r, data in ranks.items():
        assert data["RANK"] == str(r)
        assert data["LOCAL_RANK"] == str(r)
        assert data["WORLD_SIZE"] == data["LOCAL_WORLD_SIZE"] == str(n)
        assert data["MASTER_ADDR"] == "127.0.0.1"
    for r in range(n):  # stderr is streamed too, prefixed the same way
        assert f"[rank {r}] stderr of rank {r}\n" in done.stderr


@needs_torch
def test_run_gloo_numbers_ranks_across_nodes_as_torchrun() -> None:
    done = run_job(
        ["cli_env.py"],
        ranks=2,
        backend="gloo",
        options=[
            *("--nnodes", "3", "--node-rank", "2"),
            *("--master-addr", "127.0.0.1", "--master-port", "29999"),
        ],
        cwd=SCRIPTS,
    )
    assert done.returncode == 0, done.stderr
    ranks = _json_lines(done.stdout, prefixed=True)
    assert sorted(ranks) == [4, 5]
    for r, data in ranks.items():
        assert data["RANK"] == str(r)
        assert data["LOCAL_RANK"] == str(r - 4)
        assert data["WORLD_SIZE"] == "6"
        assert data["LOCAL_WORLD_SIZE"] == "2"
        assert data["MASTER_PORT"] == "29999"
        assert (data["GROUP_RANK"], data["GROUP_WORLD_SIZE"]) == ("2", "3")
        assert (data["ROLE_RANK"], data["ROLE_WORLD_SIZE"]) == (str(r), "6")


def _two_nodes(target: list[str], port: int, *, torchrun: bool = False) -> list[list[str]]:
    """The command lines of a two-node launch on this machine, one process per node, as
    `dataparallel run --backend gloo` (or torchrun) is run on each node."""
    script = [str(SCRIPTS / target[0]), *target[1:]]
    layout = ["--nnodes", "2", "--master-addr", "127.0.0.1", "--master-port", str(port)]
    if torchrun:
        launcher = [sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", "1"]
    else:
        launcher = [sys.executable, "-m", "dataparallel", "run", "-n", "1", "--backend", "gloo"]
        launcher += ["--timeout", str(LIMIT)]
    return [[*launcher, *layout, "--node-rank", str(i), *script] for i in range(2)]


@needs_torch
def test_two_nodes_get_torchruns_variables() -> None:
    """Two nodes of one process each, launched by `dataparallel run` and by torchrun: every
    variable torchrun sets is set alike, but the store's (torchrun's agent serves it, here rank
    0 does). Node 1 once had no GROUP_RANK, and Lightning took it for global rank 0."""
    ours, theirs = free_port(), free_port()
    commands = [
        *_two_nodes(["cli_env.py"], ours),
        *_two_nodes(["cli_env.py"], theirs, torchrun=True),
    ]
    results = run_ranks(commands)
    for status, stdout, stderr in results:
        assert status == 0, stdout + stderr
    nodes = [_json_lines(out, prefixed=True) for _, out, _ in results[:2]]
    torchrun = [json.loads(out.strip().splitlines()[-1]) for _, out, _ in results[2:]]
    for i in range(2):
        assert list(nodes[i]) == [i], nodes
        mine = nodes[i][i]
        assert mine["MASTER_PORT"] == str(ours) and torchrun[i]["MASTER_PORT"] == str(theirs)
        assert mine["TORCHELASTIC_USE_AGENT_STORE"] == "False"
        assert torchrun[i]["TORCHELASTIC_USE_AGENT_STORE"] == "True"
        alike = {"MASTER_PORT", "TORCHELASTIC_USE_AGENT_STORE"}
        assert {k: v for k, v in mine.items() if k not in alike} == {
            k: v for k, v in torchrun[i].items() if k not in alike
        }
        assert mine["GROUP_RANK"] == mine["RANK"] == str(i), mine


@needs_lightning
def test_lightning_across_two_nodes_finds_distinct_ranks() -> None:
    """A plain Lightning script, `Trainer(strategy="ddp", num_nodes=2, devices=1)`, on two
    nodes of `dataparallel run`: each node knows its rank, and they fit as one process does."""
    results = run_ranks(_two_nodes(["lightning_fit.py", "ddp", "2", "1"], free_port()))
    for status, stdout, stderr in results:
        assert status == 0, stdout + stderr
    output = "".join(out for _, out, _ in results)
    seen = re.findall(r"LIGHTNING rank=(\d) global_rank=(\d) node_rank=(\d) world_size=2", output)
    assert sorted(seen) == [("0", "0", "0"), ("1", "1", "1")], output
    assert_fits_like_one_process(output, 2)


# torch.distributed's own `init_process_group("gloo")` (env://) from the variables of
# `dataparallel run --backend gloo`: test_torch_distributed.py's
# `test_a_torchrun_script_runs_under_dataparallel_run` (a Gloo job's ranks cost a torch import
# each: one job for it).


# --- failures end the job, with one traceback -----------------------------------------------


@pytest.mark.parametrize(
    ("backend", "wait"),
    [
        pytest.param("mpi", "sleep", marks=needs_mpi),
        # The classic MPI deadlock: the others wait in a collective that rank 1 never joins.
        pytest.param("mpi", "barrier", marks=needs_mpi),
        pytest.param("gloo", "sleep", marks=needs_torch),
    ],
)
def test_a_raising_rank_ends_the_job_with_its_traceback_once(backend: str, wait: str) -> None:
    done = run_job(["cli_fail.py", wait], ranks=3, backend=backend, cwd=SCRIPTS)
    assert done.returncode == 1, done.stderr
    err = done.stderr
    assert err.count("Traceback (most recent call last):") == 1, err
    assert err.count("RuntimeError: rank 1 fails on purpose") == 1, err
    assert "[rank 1] Traceback (most recent call last):" in err
    assert "[rank 1] RuntimeError: rank 1 fails on purpose" in err
    assert 'cli_fail.py", line' in err
    # The traceback starts in the user's script, not in the runner or runpy.
    assert "runpy" not in err and "runner.py" not in err, err


@pytest.mark.parametrize("backend", BACKENDS)
def test_sys_exit_zero_on_every_rank_is_success(backend: str) -> None:
    done = run_job(["cli_exit.py", "0", "all"], ranks=2, backend=backend, cwd=SCRIPTS)
    assert done.returncode == 0, done.stderr
    assert "Traceback" not in done.stderr


@pytest.mark.parametrize("backend", BACKENDS)
def test_sys_exit_nonzero_on_one_rank_fails_the_job_with_its_code(backend: str) -> None:
    done = run_job(["cli_exit.py", "3", "1"], ranks=3, backend=backend, cwd=SCRIPTS)
    assert done.returncode == 3, done.stderr
    assert "Traceback" not in done.stderr


@pytest.mark.parametrize("backend", BACKENDS)
def test_sys_exit_with_a_message_prints_it_with_the_rank(backend: str) -> None:
    done = run_job(["cli_exit.py", "bad config", "1"], ranks=2, backend=backend, cwd=SCRIPTS)
    assert done.returncode == 1, done.stderr
    assert "[rank 1] bad config\n" in done.stderr


@pytest.mark.parametrize("backend", BACKENDS)
def test_timeout_stops_the_job_with_status_124(backend: str, tmp_path: Path) -> None:
    # The ranks sleep 600 s: run_job's hard limit (LIMIT) is the only other way this job ends.
    done = run_job(["cli_sleep.py", tmp_path], ranks=2, backend=backend, job_timeout=3, cwd=SCRIPTS)
    assert done.returncode == 124, done.stderr
    assert "ran past --timeout 3s" in done.stderr
    _assert_gone(tmp_path)


@pytest.mark.parametrize("backend", BACKENDS)
def test_sigterm_on_the_launcher_ends_every_rank(backend: str, tmp_path: Path) -> None:
    # Leaving the block kills the launcher (and its process group) only if it is still running.
    with spawn(["cli_sleep.py", tmp_path], ranks=2, backend=backend, cwd=SCRIPTS) as launcher:
        _wait_for_pids(tmp_path, launcher)
        launcher.send_signal(signal.SIGTERM)
        assert launcher.wait(timeout=LIMIT) == 128 + signal.SIGTERM
    _assert_gone(tmp_path)


# A real-time busy loop on one CPU: while it runs, nothing else that may only use that CPU runs.
_HOG = """
import os, sys, time
os.sched_setaffinity(0, {int(sys.argv[1])})
os.sched_setscheduler(0, os.SCHED_FIFO, os.sched_param(50))
print("holding", flush=True)
start = time.monotonic()
while time.monotonic() - start < float(sys.argv[2]):
    pass
"""


def _pin(pid: int, cpus: set[int]) -> None:
    """Let every thread of process `pid` run on `cpus` only (threads it starts later inherit it)."""
    for tid in os.listdir(f"/proc/{pid}/task"):
        os.sched_setaffinity(int(tid), cpus)


@pytest.mark.parametrize(
    ("backend", "options", "name"),
    [
        pytest.param("mpi", [], "rank", marks=needs_mpi, id="mpi"),
        pytest.param("gloo", [], "rank", marks=needs_torch, id="gloo"),
        pytest.param("gloo", ["--min-np", "1"], "worker", marks=needs_torch, id="gloo-elastic"),
    ],
)
def test_ctrl_c_ends_the_job_with_status_130_and_keeps_what_a_slow_rank_prints(
    backend: str, options: list[str], name: str, tmp_path: Path
) -> None:
    """Ctrl-C as a terminal sends it: SIGINT to the launcher's whole process group (its own
    session here). Rank 0 waits in a collective (in MPI's or Gloo's C code), rank 1 sleeps; rank
    0 writes its pid only once it is blocked there (see ctrl_c.py). The job ends with 130, each
    rank's KeyboardInterrupt (rank 0's too, though Python sees no signal inside the engine's C
    code; under MPI it was lost once) and no launcher noise.

    Where it can, the test makes rank 1 unable to run for half a second when the signal comes (a
    loaded machine, made on purpose: rank 1 alone on a CPU that a real-time loop holds): the
    launcher waits for it to report its KeyboardInterrupt instead of stopping it first, which
    lost the line (seen once in CI-like load, and every time here before the Gloo and elastic
    launchers waited). Without two CPUs or real-time scheduling, the signal comes unheld."""
    cpus = os.sched_getaffinity(0)
    held, rest = max(cpus), cpus - {max(cpus)}
    if rest:
        os.sched_setaffinity(0, rest)  # the launcher and rank 0 inherit it
    try:
        with spawn(
            ["ctrl_c.py", tmp_path],
            ranks=2,
            backend=backend,
            options=options,
            cwd=SCRIPTS,
            capture=True,
        ) as launcher:
            _wait_for_pids(tmp_path, launcher)
            if rest:
                _pin(int((tmp_path / "1.pid").read_text()), {held})
                with subprocess.Popen(
                    [sys.executable, "-c", _HOG, str(held), "0.5"],
                    stdout=subprocess.PIPE,
                    stderr=subprocess.PIPE,
                    text=True,
                ) as hog:
                    assert hog.stdout is not None
                    # "holding", or nothing where real-time scheduling is refused: then unheld.
                    hog.stdout.readline()
                    os.killpg(launcher.pid, signal.SIGINT)
                    hog.communicate(timeout=LIMIT)
            else:
                os.killpg(launcher.pid, signal.SIGINT)
            stdout, stderr = launcher.communicate(timeout=LIMIT)
    finally:
        os.sched_setaffinity(0, cpus)
    output = stdout + stderr
    assert launcher.returncode == 128 + signal.SIGINT, output
    for rank in (0, 1):
        assert f"[{name} {rank}] KeyboardInterrupt" in stderr, output
    for noise in ("mpiexec@", "proxy:", "BAD TERMINATION", "MPI_Abort", "Ctrl-C", "Traceback"):
        assert noise not in output, output
    _assert_gone(tmp_path)


def _wait_for_pids(piddir: Path, launcher: subprocess.Popen[str], ranks: int = 2) -> None:
    """Wait until each of `ranks` ranks has written its pid to `piddir` (a hang guard: LIMIT)."""
    deadline = time.monotonic() + LIMIT
    while len([p for p in piddir.glob("*.pid") if p.read_text()]) < ranks:
        assert launcher.poll() is None, "the job ended before its ranks started"
        assert time.monotonic() < deadline, "the ranks did not start"
        time.sleep(0.05)


def _running(pid: int) -> bool:
    """Whether `pid` runs: a zombie (ended, not yet reaped by its parent) does not."""
    try:
        with open(f"/proc/{pid}/stat", "rb") as file:
            return file.read().rpartition(b")")[2].split()[0] not in (b"Z", b"X")
    except (OSError, IndexError):
        return False


def _assert_gone(piddir: Path) -> None:
    """Assert that the ranks that wrote their pid to `piddir` have all exited.

    Their launcher has returned: each was killed already, and only has to finish dying. The wait
    is a hang guard (LIMIT), as long as the kernel may take on a loaded machine.
    """
    pids = [int(p.read_text()) for p in piddir.glob("*.pid") if p.read_text()]
    deadline = time.monotonic() + LIMIT
    for pid in pids:
        while _running(pid):
            if time.monotonic() > deadline:
                os.kill(pid, signal.SIGKILL)
                pytest.fail(f"rank with pid {pid} outlived its job")
            time.sleep(0.05)


# --- bad input: clear errors, exit status 2 -------------------------------------------------


@pytest.mark.parametrize(
    ("args", "message"),
    [
        ("run -n 0 cli_env.py", "-n must be at least 1, got 0"),
        ("run -n 2 no_such_script.py", "script 'no_such_script.py' not found"),
        ("run -n 2 -m no_such_module_xyz", "no module named 'no_such_module_xyz'"),
        ("run -n 2", "the following arguments are required: SCRIPT"),
        ("run -n 2 --timeout 0 cli_env.py", "--timeout must be a positive"),
        ("run -n 2 --nnodes 2 cli_env.py", "with MPI use -H or --hostfile"),
        ("run -n 2 --backend gloo --nnodes 2 cli_env.py", "needs --master-addr"),
        (
            "run -n 2 --backend gloo --nnodes 2 --node-rank 2 --master-addr h cli_env.py",
            "--node-rank must be in 0..1",
        ),
        ("run -n 2 --backend gloo --hostfile cli_env.py cli_env.py", "'cli_env.py', line 1: "),
        ("run -H a:2,b:x cli_env.py", "'b:x' is not HOST, HOST:SLOTS or HOST slots=N"),
        ("run -n 5 -H a:2,b:2 --backend gloo cli_env.py", "-n 5 is more than the 4 slot(s)"),
        ("run -H a:2 --hostfile cli_env.py cli_env.py", "give -H or --hostfile, not both"),
        ("run -n 2 -p 2222 --backend gloo cli_env.py", "is for ranks started over ssh"),
        ("run -H a:2 -i cli_env.py cli_env.py", "-i with --backend mpi: mpiexec runs ssh"),
        ("run -n 2 --backend gloo --link-timeout 3 cli_env.py", "is for ranks started over ssh"),
        ("run -H a:2 --backend gloo --link-timeout 0.2 cli_env.py", "must be at least 0.5"),
        ("run -H a:2 --backend gloo --link-timeout nan cli_env.py", "must be at least 0.5"),
        ("run -H a:2 --backend gloo --nnodes 2 cli_env.py", "--nnodes number the machines"),
        (
            "run -n 2 --backend gloo --min-np 1 --blacklist-cooldown-range 5 1 cli_env.py",
            "needs 0 < LOW <= HIGH",
        ),
        ("run -n 2 --backend gloo --blacklist-cooldown-range 1 5 cli_env.py", "needs --min-np"),
        ("run -n 2 --backend nccl cli_env.py", "invalid choice: 'nccl'"),
        ("launch", "invalid choice: 'launch'"),
    ],
)
def test_bad_input_is_a_usage_error(
    args: str, message: str, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    code, _, err = _command_line(monkeypatch, capsys, *args.split())
    assert code == 2, err
    assert message in err
    assert "usage: dataparallel" in err


def test_run_on_a_host_that_does_not_resolve_fails_at_once_naming_it(
    monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    args = ["run", "-H", "localhost:1,no-such-host.invalid:1", "--backend", "gloo", "cli_env.py"]
    code, out, err = _command_line(monkeypatch, capsys, *args)
    assert code == 2, err
    assert "dataparallel: error: host 'no-such-host.invalid' cannot be resolved here" in err
    assert out == ""  # no rank started


def test_help_explains_the_commands(
    monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    code, out, _ = _command_line(monkeypatch, capsys, "--help")
    assert code == 0
    assert "run" in out and "info" in out
    code, out, _ = _command_line(monkeypatch, capsys, "run", "--help")
    assert code == 0
    for needle in ("--backend", "--timeout", "--hostfile", "--nnodes", "-m", "examples:", "124"):
        assert needle in out, needle


def test_version() -> None:
    # A real process: `python -m dataparallel` itself (the tests above call its main()).
    done = run_job([*CLI, "--version"], launcher="python", cwd=SCRIPTS)
    assert done.returncode == 0
    assert re.fullmatch(r"dataparallel \S+\n", done.stdout), done.stdout


def _command_line(
    monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str], *args: str
) -> tuple[int, str, str]:
    """Run `dataparallel ARGS` in this process, from tests/scripts; return (status, out, err).

    For what ends before any job starts (usage errors, --help): the same `main` that
    `python -m dataparallel` calls, without a process start-up each.
    """
    from dataparallel.launch.cli import main

    monkeypatch.chdir(SCRIPTS)
    try:
        code = main(list(args))
    except SystemExit as stop:  # argparse's errors and --help
        code = 0 if stop.code is None else stop.code if isinstance(stop.code, int) else 1
    out, err = capsys.readouterr()
    return code, out, err


# --- info ------------------------------------------------------------------------------------


def test_info_reports_mpi_frameworks_and_backends() -> None:
    done = run_job([*CLI, "info"], launcher="python", cwd=SCRIPTS)
    assert done.returncode == 0, done.stderr
    out = done.stdout
    for section in ("dataparallel", "MPI", "frameworks", "engines", "launchers", "backends"):
        assert re.search(rf"^{section}$", out, re.M), section
    assert re.search(r"^  torch +\S", out, re.M)
    assert re.search(r"^  single +usable$", out, re.M)
    assert re.search(r"^  Slurm +(srun at \S+, not in a job|not found)", out, re.M), out
    assert re.search(r"^  this process +not started as a rank", out, re.M), out
    if importlib.util.find_spec("mpi4py") is not None:
        assert re.search(r"^  library +\S", out, re.M), out
        assert re.search(r"^  thread level +MPI_THREAD_\w+$", out, re.M), out
        assert re.search(r"^  CUDA-aware +(yes|no|unknown)", out, re.M), out
        assert re.search(r"^  mpiexec +\S", out, re.M), out


# --- the launcher's argument split (in process) ---------------------------------------------


@pytest.mark.parametrize(
    ("argv", "own", "target"),
    [
        (["-n", "2", "s.py", "-n", "5"], ["-n", "2"], ["s.py", "-n", "5"]),
        (["-n2", "--timeout=3", "s.py"], ["-n2", "--timeout=3"], ["s.py"]),
        (["-n", "2", "-m", "pytest", "-q"], ["-n", "2", "-m"], ["pytest", "-q"]),
        (["-n", "2", "--", "-odd.py", "a"], ["-n", "2"], ["-odd.py", "a"]),
        (["-n", "2", "s.py", "--", "a"], ["-n", "2"], ["s.py", "--", "a"]),
        (["--backend", "gloo", "-n", "2"], ["--backend", "gloo", "-n", "2"], []),
        (
            ["--blacklist-cooldown-range", "1", "5", "s.py", "a"],
            ["--blacklist-cooldown-range", "1", "5"],
            ["s.py", "a"],
        ),
    ],
)
def test_split_target(argv: list[str], own: list[str], target: list[str]) -> None:
    assert _split_target(argv) == (own, target)


def test_split_target_knows_every_option_that_takes_a_value() -> None:
    run = next(
        choice
        for action in _parser()._actions
        if isinstance(action, argparse._SubParsersAction)
        for name, choice in action.choices.items()
        if name == "run"
    )
    taking = {
        flag
        for action in run._actions
        if action.nargs in (None, 1)
        for flag in action.option_strings
    }
    assert taking == set(_RUN_VALUE_OPTIONS)
    pairs = {flag for action in run._actions if action.nargs == 2 for flag in action.option_strings}
    assert pairs == set(_RUN_PAIR_OPTIONS)
    assert {a.nargs for a in run._actions if a.option_strings} <= {None, 0, 2}, "a new nargs"


# --- the Gloo launcher's output streaming (in process) --------------------------------------


def test_output_closes_a_partial_line_that_another_rank_interrupts() -> None:
    sink = io.StringIO()
    out = Output(sink)
    out.write(b"[rank 0] ", b"loading 50%", complete=False)
    out.write(b"[rank 0] ", b" 60%", complete=False)  # same rank: continues, no new prefix
    out.write(b"[rank 1] ", b"hello\n", complete=True)
    out.write(b"[rank 0] ", b"done\n", complete=True)
    out.end(b"[rank 1] ", b"no newline at exit")
    out.end(b"[rank 0] ", b"")
    assert sink.getvalue() == (
        "[rank 0] loading 50% 60%\n[rank 1] hello\n[rank 0] done\n[rank 1] no newline at exit\n"
    )


def test_pump_prefixes_lines_and_progress_bar_redraws() -> None:
    read, write = os.pipe()
    os.write(write, b"a\nb\r\nbar 1\rbar 2\rlast")
    os.close(write)
    sink = io.StringIO()
    pump(os.fdopen(read, "rb"), Output(sink), b"[rank 3] ")
    assert sink.getvalue() == (
        "[rank 3] a\n[rank 3] b\r\n[rank 3] bar 1\r[rank 3] bar 2\r[rank 3] last\n"
    )


def test_pump_shows_a_stalled_partial_line() -> None:
    read, write = os.pipe()
    sink = io.StringIO()
    thread = threading.Thread(target=pump, args=(os.fdopen(read, "rb"), Output(sink), b"[0] "))
    thread.start()
    try:
        os.write(write, b"Name: ")  # a prompt: no newline until the answer
        # Shown after PARTIAL_LINE_SECONDS of silence; waited for until LIMIT (a hang guard).
        deadline = time.monotonic() + max(LIMIT, PARTIAL_LINE_SECONDS)
        while sink.getvalue() != "[0] Name: " and time.monotonic() < deadline:
            time.sleep(0.05)
        assert sink.getvalue() == "[0] Name: "
        os.write(write, b"Ada\n")
    finally:
        os.close(write)
        thread.join(timeout=LIMIT)
    assert sink.getvalue() == "[0] Name: Ada\n"


# --- which mpiexec (in process) -------------------------------------------------------------


def test_find_mpiexec_prefers_the_one_beside_this_python() -> None:
    path, warning = find_mpiexec()
    beside = Path(sys.executable).parent / "mpiexec"
    if not beside.exists():
        pytest.skip("no mpiexec beside this Python")
    assert path == str(beside)
    assert warning is None


def _fake_mpiexec(folder: Path) -> Path:
    folder.mkdir()
    exe = folder / "mpiexec"
    exe.write_text("#!/bin/sh\nexit 0\n")
    exe.chmod(0o755)
    return exe


def test_find_mpiexec_falls_back_to_path_with_a_warning(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    empty = tmp_path / "env" / "bin"
    empty.mkdir(parents=True)
    monkeypatch.setattr(sys, "executable", str(empty / "python"))
    monkeypatch.setattr(sysconfig, "get_path", lambda name: str(empty))
    other = _fake_mpiexec(tmp_path / "other")
    monkeypatch.setenv("PATH", str(other.parent))
    path, warning = find_mpiexec()
    assert path == str(other)
    assert warning is not None
    assert "from PATH" in warning and "pip install 'dataparallel[mpi]'" in warning


def test_find_mpiexec_without_any_says_what_to_install(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(sys, "executable", str(tmp_path / "python"))
    monkeypatch.setattr(sysconfig, "get_path", lambda name: str(tmp_path))
    monkeypatch.setenv("PATH", str(tmp_path))
    with pytest.raises(BackendUnavailableError, match=r"pip install 'dataparallel\[mpi\]'"):
        find_mpiexec()


def test_missing_mpi4py_says_what_to_install(monkeypatch: pytest.MonkeyPatch) -> None:
    real = importlib.util.find_spec
    monkeypatch.setattr(
        importlib.util, "find_spec", lambda name, *a: None if name == "mpi4py" else real(name, *a)
    )
    with pytest.raises(BackendUnavailableError, match=r"pip install 'dataparallel\[mpi\]'"):
        require_mpi4py()


def test_mpi_command_runs_this_python_through_the_runner(tmp_path: Path) -> None:
    exe = _fake_mpiexec(tmp_path / "bin")  # says nothing to --version: taken for Hydra
    command = mpi_command(str(exe), 3, ["-m", "pytest", "-q"])
    runner = [sys.executable, "-m", "dataparallel.launch.runner"]
    assert command == [str(exe), "-n", "3", *runner, "-m", "pytest", "-q"]
    # Across hosts Hydra prefixes each line with its rank and host; the runner then does not.
    command = mpi_command(str(exe), 3, ["-m", "pytest", "-q"], hostfile="hosts")
    hosts = ["-f", "hosts", "-prepend-pattern", "[rank %r on %h] "]
    runner.append("--prefixed")
    assert command == [str(exe), "-n", "3", *hosts, *runner, "-m", "pytest", "-q"]


@needs_mpi
def test_run_mpi_with_a_hostfile(tmp_path: Path) -> None:
    hosts = tmp_path / "hosts"
    hosts.write_text("localhost:3\n")
    done = run_job(["cli_hello.py"], ranks=3, options=["--hostfile", hosts], cwd=SCRIPTS)
    assert done.returncode == 0, done.stderr
    ranks: dict[int, dict[str, object]] = {}
    for line in done.stdout.splitlines():  # each prefixed with its rank and host, by Hydra
        found = re.fullmatch(r"\[rank (\d+) on localhost\] (\{.*\})", line)
        assert found is not None, done.stdout
        ranks[int(found[1])] = json.loads(found[2])
        assert ranks[int(found[1])]["rank"] == int(found[1]), line
    assert sorted(ranks) == [0, 1, 2]
    assert all(data["size"] == 3 and data["sum"] == 3 for data in ranks.values()), ranks


# --- the per-rank runner on its own ----------------------------------------------------------


def _runner(*args: str) -> subprocess.CompletedProcess[str]:
    """Run `python -m dataparallel.launch.runner ARGS` alone (no launcher: a world of one)."""
    return run_job(["-m", "dataparallel.launch.runner", *args], launcher="python", cwd=SCRIPTS)


def test_runner_alone_is_a_world_of_one(tmp_path: Path) -> None:
    assert _runner("cli_exit.py", "0", "all").returncode == 0
    assert _runner("cli_exit.py", "5", "0").returncode == 5
    script = tmp_path / "raises.py"
    script.write_text("def f():\n    raise KeyError('x')\n\nf()\n")
    done = _runner(str(script))
    assert done.returncode == 1
    assert done.stderr.count("Traceback") == 1
    assert "[rank 0] Traceback (most recent call last):\n" in done.stderr
    assert "[rank 0] KeyError: 'x'\n" in done.stderr
    assert "in f\n" in done.stderr


def test_runner_rejects_bad_options(capsys: pytest.CaptureFixture[str]) -> None:
    # In this process: the options are read before the runner does anything else.
    from dataparallel.launch.runner import main

    for args, message in (
        ((), "expected a script path or -m module"),
        (("--bogus", "x.py"), "unknown option '--bogus'"),
        (("--parent", "x.py"), "--parent needs the launcher's process id"),
    ):
        with pytest.raises(SystemExit) as stop:
            main(list(args))
        assert stop.value.code == 2
        err = capsys.readouterr().err
        assert message in err and "usage: python -m dataparallel.launch.runner" in err, err

"""torch's ecosystem in every job (`torch_distributed.py`, `launch/runner.py`).

- `dp.initialize()` makes torch.distributed's default group alongside any engine, so a DDP script
  keeps `DistributedSampler`, `dist.all_reduce` and `DistributedDataParallel` unchanged;
  `DATAPARALLEL_TORCH_DISTRIBUTED=0` turns it off; `dp.finalize()` destroys it.
- the group is there whatever the order of `import torch` and `dp.initialize()`, so that
  torchmetrics' metrics are global (`torchmetrics_sync.py`); a rank that imports torch where the
  others do not fails loudly, on every rank;
- `dataparallel run` gives every rank torchrun's variables under MPI too, so a torchrun script
  that calls `dist.init_process_group()` itself runs unchanged; `dp.initialize()` after it joins
  its group, and waits only as long as its own timeout; `dist.init_process_group()` after
  `dp.initialize()` makes the program's own group under MPI and is refused saying what to do
  under Gloo (whose engine is torch's group).

Every test launches its own jobs (`spawns`), at 2 and 3 ranks, under MPI and Gloo: each test
runs each engine once, at 2 ranks on one and 3 on the other (`ENGINES`), and the next test swaps.
"""

from __future__ import annotations

import importlib.util
import json
import re
from pathlib import Path

import pytest
from _jobs import run_job

pytestmark = [
    pytest.mark.spawns,
    pytest.mark.skipif(importlib.util.find_spec("torch") is None, reason="needs torch"),
]
needs_torchmetrics = pytest.mark.skipif(
    importlib.util.find_spec("torchmetrics") is None,
    reason="needs torchmetrics (pip install -c constraints.txt -e '.[test]')",
)

SCRIPTS = Path(__file__).parent / "scripts"
needs_mpi = pytest.mark.skipif(importlib.util.find_spec("mpi4py") is None, reason="needs mpi4py")
ENGINES = [
    pytest.param("mpi", 2, marks=needs_mpi),
    pytest.param("mpi", 3, marks=needs_mpi),
    pytest.param("gloo", 2),
    pytest.param("gloo", 3),
]


def _lines(stdout: str, tag: str) -> dict[int, dict[str, str]]:
    """Each rank's `TAG key=value ...` line, by rank (prefixed by the launcher or not)."""
    found = re.findall(rf"^(?:\[rank \d+\] )?{tag} (.*)$", stdout, flags=re.MULTILINE)
    fields = [dict(pair.split("=", 1) for pair in line.split()) for line in found]
    return {int(f["rank"]): f for f in fields}


@pytest.mark.parametrize(("backend", "n"), [ENGINES[0], ENGINES[3]])
def test_a_ddp_script_runs_unchanged_beside_the_world_until_finalize(backend: str, n: int) -> None:
    """One job checks both: DDP's script (DistributedSampler's shares, DDP's averaged gradients)
    runs unchanged, and torch's group made beside the world holds the same ranks, reduces
    (`sum`), and is gone after dp.finalize()."""
    done = run_job(["ddp_sampler.py"], ranks=n, backend=backend, cwd=SCRIPTS)
    assert done.returncode == 0, done.stdout + done.stderr
    ranks = _lines(done.stdout, "ddp")
    assert sorted(ranks) == list(range(n)), done.stdout
    seen: list[int] = []
    for r, line in ranks.items():
        assert (line["size"], line["backend"]) == (str(n), backend)
        assert line["total"] == "12" and line["same_grads"] == "True", done.stdout
        samples = [int(i) for i in line["samples"].split(",")]
        assert samples == list(range(r, 12, n)), done.stdout  # DistributedSampler's share
        seen += samples
        assert line["sum"] == str(n * (n + 1) // 2), f"torch's group beside: {done.stdout}"
    assert sorted(seen) == list(range(12))
    finalized = done.stdout.count("AFTER FINALIZE rank=- initialized=False")
    assert finalized == n, f"torch's group after dp.finalize(): {done.stdout}"


@needs_torchmetrics
@pytest.mark.parametrize(
    ("backend", "order"),
    [
        pytest.param("mpi", "dp-first", marks=needs_mpi),
        # Gloo's engine is torch's group: `dp.initialize()` imports torch itself, so torch
        # comes first whatever the script's order, and one order tells all.
        ("gloo", "dp-first"),
    ],
)
def test_torchmetrics_is_global_whatever_the_import_order(backend: str, order: str) -> None:
    """`dp.initialize()` before `import torch` (dp-first) once left MPI without torch's group,
    and torchmetrics' `compute()` gave each rank its own accuracy, silently. The other order
    under MPI (torch first, then `dp.initialize()`) is the torchmetrics page's own, which
    asserts the global metric on every rank in the 3-rank MPI job of `test_readme.py`: a
    job of its own here would check it again, at the start-up cost of torchmetrics' imports."""
    done = run_job(["torchmetrics_sync.py", order], ranks=2, backend=backend, cwd=SCRIPTS)
    assert done.returncode == 0, done.stdout + done.stderr
    ranks = _lines(done.stdout, "METRIC")
    assert sorted(ranks) == [0, 1], done.stdout
    accuracies = set()
    for line in ranks.values():
        assert line["initialized"] == "True", done.stdout
        assert line["accuracy"] == line["global"], done.stdout
        accuracies.add(line["accuracy"])
    assert len(accuracies) == 1, done.stdout


@needs_mpi
def test_a_rank_that_alone_imports_torch_fails_loudly_on_every_rank() -> None:
    """Rank 0 imports torch after `dp.initialize()`, rank 1 goes on to an allreduce: both get
    the mismatch, naming torch's group and the fix, instead of waiting for each other."""
    done = run_job(["torchmetrics_sync.py", "rank0-only"], ranks=2, backend="mpi", cwd=SCRIPTS)
    assert done.returncode == 0, done.stdout + done.stderr
    mismatches = [line for line in done.stdout.splitlines() if line.startswith("MISMATCH")]
    assert sorted(line.split()[1] for line in mismatches) == ["rank=0", "rank=1"], done.stdout
    for line in mismatches:
        assert "torch.distributed's default group, made as torch is first imported" in line
        assert "import torch on every rank" in line and "allreduce" in line, line


@needs_mpi
def test_torch_distributed_alongside_can_be_turned_off() -> None:
    env = {"DATAPARALLEL_TORCH_DISTRIBUTED": "0"}
    done = run_job(["torch_alongside.py", "check"], ranks=2, env=env, cwd=SCRIPTS)
    assert done.returncode == 0, done.stdout + done.stderr
    assert done.stdout.count("NOT INITIALIZED") == 2, done.stdout


def test_a_world_of_one_has_torch_distributed_too() -> None:
    done = run_job(["torch_alongside.py", "check"], launcher="python", cwd=SCRIPTS)
    assert done.returncode == 0, done.stdout + done.stderr
    assert "ALONGSIDE rank=0 same_ranks=True sum=1" in done.stdout


@pytest.mark.parametrize(("backend", "n"), [ENGINES[1], ENGINES[2]])
def test_a_torchrun_script_runs_under_dataparallel_run(backend: str, n: int) -> None:
    target = ["torchrun_plain.py", "--dp-after"]  # then dp.initialize() joins its group
    done = run_job(target, ranks=n, backend=backend, cwd=SCRIPTS)
    assert done.returncode == 0, done.stdout + done.stderr
    ranks = _lines(done.stdout, "torchrun")
    assert sorted(ranks) == list(range(n)), done.stdout
    for r, line in ranks.items():
        total = str(n * (n + 1) // 2)
        assert line == {"rank": str(r), "size": str(n), "local": str(r), "sum": total}
    assert sorted(_lines(done.stdout, "dp")) == list(range(n)), done.stdout


@pytest.mark.parametrize(("backend", "n"), [ENGINES[0], ENGINES[3]])
def test_a_script_that_leaves_its_group_has_it_destroyed_at_exit(backend: str, n: int) -> None:
    """A torchrun script that never destroys its group: `dataparallel run` destroys it at exit,
    while the interpreter is whole (a Gloo worker freeing its last call at the interpreter's
    finalization aborts the rank: `runner._destroy_torch_group`), and the rank exits 0."""
    done = run_job(["torchrun_plain.py", "--leave-group"], ranks=n, backend=backend, cwd=SCRIPTS)
    assert done.returncode == 0, done.stdout + done.stderr
    assert _lines(done.stdout, "exit") == {
        r: {"rank": str(r), "initialized": "True"} for r in range(n)
    }, done.stdout


@needs_mpi
def test_init_process_group_after_dp_initialize_makes_the_programs_own_group() -> None:
    """A Horovod program's `hvd.init()` then `dist.init_process_group()`: the program's group
    replaces the one made beside the world, works, and outlives `dp.finalize()`."""
    done = run_job(["torch_alongside.py", "user-after"], backend="mpi", cwd=SCRIPTS)
    assert done.returncode == 0, done.stdout + done.stderr
    ranks = _lines(done.stdout, "OWN")
    assert ranks == {
        r: {"rank": str(r), "sum": "3", "dp_sum": "2", "kept": "True"} for r in range(2)
    }, done.stdout


def test_init_process_group_after_dp_initialize_under_gloo_says_what_to_do() -> None:
    done = run_job(["torch_alongside.py", "user-after"], backend="gloo", cwd=SCRIPTS)
    assert done.returncode == 0, done.stdout + done.stderr
    refused = [line for line in done.stdout.splitlines() if "REFUSED" in line]
    assert len(refused) == 2, done.stdout
    for line in refused:
        assert "REFUSED ValueError" in line and "default process group twice" not in line
        assert "Drop the call" in line and "before dp.initialize()" in line, line


def test_the_timeout_holds_over_the_programs_own_group() -> None:
    """`dist.init_process_group()` then `dp.initialize(timeout=3)`: a peer that never comes
    ends rank 0's call within the setting's timeout, not torch's 30 minutes (the launcher's
    `--timeout` is only the guard)."""
    done = run_job(
        ["torch_alongside.py", "user-first-late"],
        backend="gloo",
        job_timeout=40,
        env={"DATAPARALLEL_CHECK": "0"},
        cwd=SCRIPTS,
    )
    output = done.stdout + done.stderr
    assert done.returncode == 3, output  # rank 0's, not the launcher's
    timed_out = [line for line in done.stdout.splitlines() if "TIMEOUT" in line]
    assert len(timed_out) == 1 and "NO TIMEOUT" not in timed_out[0], output
    assert "allreduce" in timed_out[0] and "timed out" in timed_out[0], output


@needs_mpi
@pytest.mark.parametrize("n", [3])
def test_run_under_mpi_gives_torchrun_variables(n: int) -> None:
    done = run_job(["cli_env.py"], ranks=n, cwd=SCRIPTS)
    assert done.returncode == 0, done.stdout + done.stderr
    ranks = [json.loads(line) for line in done.stdout.splitlines() if line.startswith("{")]
    assert sorted(int(r["RANK"]) for r in ranks) == list(range(n)), done.stdout
    for r in ranks:
        assert r["WORLD_SIZE"] == r["LOCAL_WORLD_SIZE"] == r["ROLE_WORLD_SIZE"] == str(n)
        assert r["LOCAL_RANK"] == r["RANK"] == r["ROLE_RANK"]  # one machine
        assert (r["GROUP_RANK"], r["GROUP_WORLD_SIZE"], r["ROLE_NAME"]) == ("0", "1", "default")
        assert (r["TORCHELASTIC_RUN_ID"], r["TORCHELASTIC_USE_AGENT_STORE"]) == ("none", "False")
    masters = {(r["MASTER_ADDR"], r["MASTER_PORT"]) for r in ranks}
    assert len(masters) == 1 and masters.pop()[1].isdigit(), done.stdout


@needs_mpi
def test_an_unresolvable_host_name_is_named_not_waited_on() -> None:
    # torch's store would retry the name until its timeout (30 minutes): the ranks say so at once.
    env = {"MASTER_ADDR": "no-such-host.invalid"}
    done = run_job(["torch_alongside.py", "check"], launcher="mpiexec", env=env, cwd=SCRIPTS)
    assert done.returncode != 0, done.stdout + done.stderr
    assert "rank 0's host name 'no-such-host.invalid' does not resolve" in done.stderr
    assert "set MASTER_ADDR to an address of rank 0's host" in done.stderr

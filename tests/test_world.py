"""The process group (`dataparallel.world`), and the suite's own guard against hangs.

Tests that need a world other than the session's save and restore `world._world` (monkeypatch),
so the session's world is untouched. The guard tests launch their own MPI jobs (`spawns`).
"""

from __future__ import annotations

import re
import shutil
import subprocess
import sys
import textwrap
from pathlib import Path
from typing import Any

import numpy as np
import pytest
from _jobs import require_mpiexec, run_job

import dataparallel as dp
import dataparallel.world as world_module
from dataparallel.backends import registry
from dataparallel.backends.single import SingleBackend
from dataparallel.config import Settings
from dataparallel.world import choose_device

# --- device choice ----------------------------------------------------------------------------


def test_choose_device_round_robin() -> None:
    assert [choose_device(r, 2) for r in range(5)] == [0, 1, 0, 1, 0]
    assert [choose_device(r, 4) for r in range(3)] == [0, 1, 2]
    assert choose_device(3, 0) is None


def test_choose_device_from_gpu_devices() -> None:
    assert [choose_device(r, 8, [6, 7, 2]) for r in range(3)] == [6, 7, 2]
    assert choose_device(1, 0, [5, 3]) is None  # no GPU visible: run on the CPU
    with pytest.raises(ValueError, match=r"gpu_devices=\[0, 1\] names 2 GPUs, but this node runs "):
        choose_device(2, 4, [0, 1])
    with pytest.raises(ValueError, match=r"gpu_devices\[1\]=4, but this process sees 4 GPU\(s\)"):
        choose_device(1, 4, [0, 4])


def test_device_is_none_without_gpus(world: Any) -> None:
    if world_module.cuda_device_count() == 0:
        assert dp.device() is None
    else:
        assert dp.device() == dp.local_rank() % world_module.cuda_device_count()


# --- the active world -------------------------------------------------------------------------


def test_rank_size_and_backend(world: Any, rank: int, size: int) -> None:
    assert dp.initialized()
    assert dp.get_backend() is world
    assert (dp.rank(), dp.size()) == (world.rank, world.size) == (rank, size)
    assert 0 <= rank < size
    assert world.name in ("mpi", "gloo", "nccl", "single")
    if size == 1:
        assert world.name == "single" or not Settings.from_env().mpi_launched
    if Settings.from_env().mpi_launched:
        assert world.name == "mpi"


def test_ranks_are_distinct_and_local_ranks_consistent(rank: int, size: int) -> None:
    every = dp.allgather_object((dp.rank(), dp.local_rank(), dp.local_size()))
    assert [r for r, _, _ in every] == list(range(size))
    # The suite runs on one machine: the node holds the whole world.
    assert sorted(local for _, local, _ in every) == list(range(size))
    assert all(n == size for _, _, n in every)
    assert sum(1 for _, _, _ in every) == size


def test_is_main(rank: int) -> None:
    assert dp.is_main() is (rank == 0)


def test_initialize_is_idempotent(world: Any) -> None:
    assert dp.initialize() is world and dp.initialize(world.name) is world
    other = "gloo" if world.name == "mpi" else "mpi"
    with pytest.raises(ValueError, match=rf"dp.initialize\('{other}'\) was called, but the "):
        dp.initialize(other)  # another engine than the active one: refused, never ignored
    assert dp.initialize() is world


def test_print_prefixes_time_rank_and_size(
    rank: int, size: int, capsys: pytest.CaptureFixture[str]
) -> None:
    dp.print("hello", 3, sep="|")
    dp.print("to stderr", file=sys.stderr)
    out, err = capsys.readouterr()
    # Under a launcher that prefixes every line with `[rank R] ` (Gloo's), one prefix is enough.
    where = "" if world_module.current().settings.prefixed else rf"\[{rank}/{size}\] "
    assert re.fullmatch(rf"\[\d\d:\d\d:\d\d\.\d{{3}}\] {where}hello\|3\n", out), out
    assert err.endswith(f"] {where.replace(chr(92), '')}to stderr\n")


def test_print_never_communicates(rank: int, size: int, capsys: pytest.CaptureFixture[str]) -> None:
    if rank == 0:
        dp.print("only rank 0 prints")
    # Had the print been collective, the other ranks would now be waiting in it, not here.
    assert dp.allreduce(np.ones(1))[0] == size
    assert ("only rank 0 prints" in capsys.readouterr().out) is (rank == 0)


# --- other worlds, set up and torn down in place of the session's ---------------------------


@pytest.fixture
def no_world(monkeypatch: pytest.MonkeyPatch) -> None:
    """Hide the session's world for the test (restored afterwards)."""
    monkeypatch.setattr(world_module, "_world", None)


def test_before_initialize(no_world: None, capsys: pytest.CaptureFixture[str]) -> None:
    assert not dp.initialized()
    for call in (dp.rank, dp.size, dp.local_rank, dp.get_backend, dp.is_main):
        with pytest.raises(dp.NotInitializedError, match=r"call dp\.initialize\(\) first"):
            call()
    assert isinstance(dp.NotInitializedError("x"), dp.DataParallelError)
    dp.print("early")  # printing needs no world
    assert "[-/-] early" in capsys.readouterr().out
    dp.finalize()  # finalizing no world is harmless


def test_a_fresh_world_of_one(no_world: None, capsys: pytest.CaptureFixture[str]) -> None:
    backend = dp.initialize("single", verbose=True)
    assert isinstance(backend, SingleBackend)
    assert "[0/1] initialized single backend, local rank 0" in capsys.readouterr().out
    assert dp.initialize() is backend and dp.initialize("single") is backend
    with pytest.raises(ValueError, match=r"dp.initialize\('mpi'\) was called, but the 'single'"):
        dp.initialize("mpi")  # another engine than the active one: refused, never silently ignored
    assert (dp.rank(), dp.size(), dp.local_rank(), dp.local_size()) == (0, 1, 0, 1)
    x = np.ones(3)
    request = dp.iallreduce(x, op="avg")
    assert world_module.current().pending == [request]
    dp.finalize()  # waits for the request in flight
    assert request.test() and not dp.initialized()
    dp.finalize()


def test_abandoning_a_world_frees_its_groups_and_raises_nothing(no_world: None) -> None:
    """`world.abandon()` (an elastic run leaving a world that lost a member) ends the world as
    `finalize` does, groups included, and a new world can be made after it."""
    dp.initialize("single")
    group = dp.new_group([0])
    world_module.abandon()
    assert not dp.initialized()
    with pytest.raises(ValueError, match="it was freed"):
        _ = group.backend
    world_module.abandon()  # no world: harmless
    dp.initialize("single")
    dp.finalize()


def test_unknown_backend_names_are_refused(no_world: None) -> None:
    message = r"backend='bogus' is not known: use 'auto', 'mpi', 'gloo', 'nccl', 'single'\."
    with pytest.raises(ValueError, match=message):
        dp.initialize("bogus")
    assert not dp.initialized()


def test_a_world_of_one_refuses_peers(no_world: None) -> None:
    with pytest.raises(ValueError, match=r"'single' backend is a world of one, but rank=None, "):
        dp.initialize("single", world_size=2)
    with pytest.raises(ValueError, match=r"rank=1, world_size=None"):
        dp.initialize("single", rank=1)
    assert not dp.initialized()


@pytest.mark.parametrize("timeout", [-3, 0, 0.0, float("nan"), float("inf"), -float("inf")])
def test_a_timeout_that_is_not_positive_and_finite_is_refused(
    no_world: None, timeout: float
) -> None:
    with pytest.raises(ValueError, match=rf"timeout={re.escape(repr(timeout))} is not valid: give"):
        dp.initialize(timeout=timeout)
    assert not dp.initialized()


@pytest.mark.parametrize("timeout", ["5", True, [5]], ids=repr)
def test_a_timeout_that_is_not_a_number_is_refused(no_world: None, timeout: Any) -> None:
    with pytest.raises(TypeError, match=rf"timeout={re.escape(repr(timeout))} is not a number"):
        dp.initialize(timeout=timeout)
    assert not dp.initialized()


def test_import_star_leaves_the_builtin_print_alone() -> None:
    import builtins

    namespace: dict[str, Any] = {}
    exec("from dataparallel import *", namespace)
    assert "print" not in namespace and "allreduce" in namespace
    exec("print_is = print", namespace)  # what a module doing `import *` calls print
    assert namespace["print_is"] is builtins.print
    assert dp.print is world_module.print  # dp.print is still there, by name


def test_timeout_argument_reaches_the_settings(no_world: None) -> None:
    dp.initialize("single", timeout=12.5)
    try:
        assert world_module.current().settings.timeout == 12.5
    finally:
        dp.finalize()


@pytest.mark.parametrize(
    ("backend", "init_method", "env", "name"),
    [
        ("auto", None, {}, "single"),
        ("auto", None, {"PMI_RANK": "0", "PMI_SIZE": "2"}, "mpi"),
        ("auto", None, {"RANK": "0", "WORLD_SIZE": "2", "MASTER_ADDR": "h"}, "gloo"),
        ("auto", "mpi", {}, "mpi"),
        ("auto", "tcp://h:1234", {}, "gloo"),
        ("auto", "file:///tmp/x", {}, "gloo"),
        ("nccl", None, {"PMI_RANK": "0"}, "nccl"),
        ("single", None, {"PMI_RANK": "0"}, "single"),
    ],
)
def test_auto_backend_resolution(
    backend: str, init_method: str | None, env: dict[str, str], name: str, monkeypatch: Any
) -> None:
    monkeypatch.setattr(registry, "_mpi_already_initialized", lambda: False)
    # This pass's own world may have torch.distributed (Gloo's engine, or alongside MPI).
    monkeypatch.setattr(registry, "_torch_distributed_initialized", lambda: False)
    settings = Settings.from_env(env)
    assert registry.choose(backend, init_method, settings) == name


# --- the suite's guard (conftest.py), on real MPI jobs ---------------------------------------


def run_test_job(
    tmp_path: Path, test_source: str, ranks: int = 2, env: dict[str, str] | None = None
) -> subprocess.CompletedProcess[str]:
    """Run pytest on `test_source` under `mpiexec -n ranks`, with this suite's conftest."""
    require_mpiexec()
    shutil.copy(Path(__file__).with_name("conftest.py"), tmp_path / "conftest.py")
    (tmp_path / "test_job.py").write_text(textwrap.dedent(test_source))
    return run_job(
        ["-m", "pytest", "-q", "-p", "no:cacheprovider", "test_job.py"],
        launcher="mpiexec",
        ranks=ranks,
        env={"PYTHONDONTWRITEBYTECODE": "1", **(env or {})},
        cwd=tmp_path,
    )


@pytest.mark.spawns
def test_guard_only_rank_0_reports_and_spawns_tests_are_skipped(tmp_path: Path) -> None:
    job = run_test_job(
        tmp_path,
        """
        import hypothesis
        import pytest
        import dataparallel as dp

        def test_world(world, rank, size):
            assert size == 2 and world.name == "mpi" and rank == dp.rank()
            assert hypothesis.settings.default.derandomize
            assert hypothesis.settings.default.database is None

        @pytest.mark.spawns
        def test_spawner():
            raise AssertionError("never runs under mpiexec")
        """,
    )
    output = job.stdout + job.stderr
    assert job.returncode == 0, output
    assert output.count("1 passed, 1 skipped") == 1, output  # rank 0's summary alone
    assert "launches its own processes" in job.stdout or "1 skipped" in job.stdout


@pytest.mark.spawns
def test_guard_aborts_the_job_when_one_rank_fails(tmp_path: Path) -> None:
    job = run_test_job(
        tmp_path,
        """
        import dataparallel as dp

        def test_fails_on_rank_1(rank):
            assert rank != 1, "rank 1 is broken"
            dp.barrier()  # rank 0 would wait here forever

        def test_never_reached():
            pass
        """,
    )
    output = job.stdout + job.stderr
    assert job.returncode != 0, output
    assert "[rank 1] FAILED test_job.py::test_fails_on_rank_1" in job.stderr, output
    assert "AssertionError: rank 1 is broken" in job.stderr
    assert "[rank 0] FAILED" not in output
    assert "APPLICATION TIMED OUT" not in output, output  # aborted, not ended by MPIEXEC_TIMEOUT


@pytest.mark.spawns
def test_a_rank_killed_by_a_signal_leaves_a_note_naming_its_test(tmp_path: Path) -> None:
    # A crash in C (SIGABRT from a corrupted heap, say) ends a rank before pytest can report:
    # faulthandler prints its stacks, which do not name the test; the trail does (Makefile).
    trail = tmp_path / "trail"
    job = run_test_job(
        tmp_path,
        """
        import os
        import dataparallel as dp

        def test_passes(world):
            world.barrier()

        def test_crashes_on_rank_1(rank):
            dp.barrier()  # both ranks have noted this test before rank 1 aborts
            if rank == 1:
                os.abort()
            dp.barrier()  # rank 0 waits here until mpiexec ends the job
        """,
        env={"PYTEST_RANK_TRAIL": str(trail)},
    )
    output = job.stdout + job.stderr
    assert job.returncode != 0, output
    assert "Fatal Python error: Aborted" in output, output  # faulthandler's stacks, unnamed
    notes = {path.name: path.read_text() for path in trail.glob("rank-*")}
    assert sorted(notes) == ["rank-0", "rank-1"], notes
    for rank, note in enumerate(notes[f"rank-{r}"] for r in range(2)):
        assert note.startswith(f"[rank {rank}] was running test_job.py::test_crashes_on_rank_1 ")
    # Without the variable, no note is kept (an outer suite's is not inherited: `_jobs`).
    job = run_test_job(tmp_path, "def test_nothing(world):\n    world.barrier()\n")
    assert job.returncode == 0, job.stdout + job.stderr
    assert {path.name: path.read_text() for path in trail.glob("rank-*")} == notes


@pytest.mark.spawns
def test_guard_aborts_on_a_failing_fixture_and_on_collection_errors(tmp_path: Path) -> None:
    job = run_test_job(
        tmp_path,
        """
        import pytest

        @pytest.fixture
        def broken(rank):
            yield
            assert rank != 1, "teardown broke"

        def test_teardown(broken):
            pass

        def test_after(world):
            world.barrier()
        """,
    )
    assert job.returncode != 0
    assert "[rank 1] FAILED test_job.py::test_teardown (in teardown)" in job.stderr, job.stderr
    job = run_test_job(
        tmp_path,
        """
        import dataparallel as dp

        if dp.rank() == 1:
            raise ImportError("rank 1 cannot import this module")

        def test_anything(world):
            world.barrier()
        """,
    )
    assert job.returncode != 0
    assert "[rank 1] ERROR collecting test_job.py" in job.stderr, job.stdout + job.stderr
    assert "rank 1 cannot import this module" in job.stderr


def test_settings_come_from_the_environment_at_initialize(
    no_world: None, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("DATAPARALLEL_CHECK", "0")
    monkeypatch.setenv("DATAPARALLEL_BUCKET_BYTES", "4096")
    dp.initialize("single")
    try:
        settings = world_module.current().settings
        assert settings.check is False and settings.bucket_bytes == 4096
        assert dp.CoalescingReducer().bucket_bytes == 4096
    finally:
        dp.finalize()
    monkeypatch.setenv("DATAPARALLEL_CHECK", "sometimes")
    with pytest.raises(ValueError, match=r"DATAPARALLEL_CHECK='sometimes' is not a valid flag"):
        dp.initialize("single")
    assert not dp.initialized()

"""`dp.progress`: a tqdm bar on the main rank, the iterable itself on the others."""

from __future__ import annotations

import importlib.util
import io
from collections.abc import Callable
from pathlib import Path

import pytest
from _jobs import outer_world_size, run_job

import dataparallel.world as world
from dataparallel.progress import progress

SCRIPTS = Path(__file__).parent / "scripts"
LAUNCHER_RANKS = ("RANK", "PMI_RANK", "OMPI_COMM_WORLD_RANK", "PMIX_RANK")


in_world_of_one = pytest.mark.skipif(
    outer_world_size() > 1,
    reason="launches its own multi-process jobs: run it in a world of one",
)

SetRank = Callable[[int | None], None]


@pytest.fixture
def world_of(monkeypatch: pytest.MonkeyPatch) -> SetRank:
    """Make `progress` see a world with the given rank (None: not initialized, no launcher)."""

    def set_rank(rank: int | None) -> None:
        for name in LAUNCHER_RANKS:
            monkeypatch.delenv(name, raising=False)
        monkeypatch.setattr(world, "initialized", lambda: rank is not None)
        monkeypatch.setattr(world, "is_main", lambda: rank == 0)

    return set_rank


@pytest.mark.parametrize("rank", [0, None], ids=["rank0", "not-initialized"])
def test_main_rank_draws_a_bar_with_tqdm_options(world_of: SetRank, rank: int | None) -> None:
    world_of(rank)
    out = io.StringIO()
    items = [1, 2, 3]
    bar = progress(items, desc="epoch 7", file=out, mininterval=0)
    assert bar is not items
    assert len(bar) == 3  # type: ignore[arg-type]
    assert sum(bar) == 6
    text = out.getvalue()
    assert "epoch 7" in text
    assert "3/3" in text
    assert "100%" in text


def test_other_ranks_get_the_iterable_itself_and_print_nothing(
    world_of: SetRank, capsys: pytest.CaptureFixture[str]
) -> None:
    world_of(1)
    out = io.StringIO()
    items = [1, 2, 3]
    assert progress(items, desc="epoch 7", file=out) is items
    assert out.getvalue() == ""
    captured = capsys.readouterr()
    assert captured.out == captured.err == ""


@pytest.mark.parametrize(("value", "draws"), [("0", True), ("2", False)])
@pytest.mark.parametrize("variable", ["RANK", "PMI_RANK"])
def test_before_initialize_the_launchers_rank_decides(
    world_of: SetRank, monkeypatch: pytest.MonkeyPatch, value: str, draws: bool, variable: str
) -> None:
    world_of(None)
    monkeypatch.setenv(variable, value)
    items = range(4)
    bar = progress(items, file=io.StringIO())
    assert (bar is not items) is draws


def test_in_the_world_of_one_the_bar_is_drawn() -> None:
    world.initialize()  # the test session's world (a world of one outside a launcher)
    if world.size() != 1:
        pytest.skip("checks the world of one")
    out = io.StringIO()
    assert list(progress(range(2), file=out)) == [0, 1]
    assert "2/2" in out.getvalue()


def test_tqdm_is_imported_only_where_a_bar_is_drawn() -> None:
    code = (
        "import sys\n"
        "from dataparallel.progress import progress\n"
        "assert 'tqdm' not in sys.modules, 'imported at import time'\n"
        "items = [1]\n"
        "assert progress(items) is items\n"
        "assert 'tqdm' not in sys.modules, 'imported on a rank that draws no bar'\n"
    )
    done = run_job(["-c", code], launcher="python", env={"RANK": "1"})  # no other launcher's rank
    assert done.returncode == 0, done.stderr


@pytest.mark.parametrize(
    "backend",
    [
        pytest.param(
            "mpi",
            marks=pytest.mark.skipif(
                importlib.util.find_spec("mpi4py") is None, reason="needs mpi4py"
            ),
        ),
        pytest.param(
            "gloo",
            marks=pytest.mark.skipif(
                importlib.util.find_spec("torch") is None, reason="needs torch"
            ),
        ),
    ],
)
@pytest.mark.spawns
@in_world_of_one
def test_a_job_draws_one_bar(backend: str) -> None:
    done = run_job(["cli_progress.py"], ranks=3, backend=backend, cwd=SCRIPTS)
    assert done.returncode == 0, done.stderr
    assert "bar-from-rank-0" in done.stderr
    assert "bar-from-rank-1" not in done.stderr and "bar-from-rank-2" not in done.stderr
    for rank in range(3):
        assert f"rank {rank} sum 10" in done.stdout
    assert "rank 0 got tqdm" in done.stdout
    assert "rank 1 got the list" in done.stdout and "rank 2 got the list" in done.stdout

"""A world made again after `dp.finalize()`, and what finalize undoes (issue 17: all state on the
world): the registered caches (`dataparallel.caches`), the private duplicates of the engines,
`sys.excepthook`.

The sub-jobs (`spawns`, run in the world-of-one pass) make worlds one after the other in one
process with `tests/scripts/reinit.py`: Gloo under `dataparallel run`, through its variables
(env://) and through tcp:// and file:// rendezvous in turn, MPI under mpiexec (then finalized),
and the world of one; both at 2 ranks (a world made again does not depend on its size, and
each rank imports torch, for the optimizer). The other tests run in every pass, on a world of
one of their own (the session's is hidden meanwhile).
"""

from __future__ import annotations

import json
import sys
from pathlib import Path
from typing import Any

import numpy as np
import pytest
from _jobs import free_port, require_mpiexec, run_job

import dataparallel as dp
from dataparallel import caches, startup
from dataparallel import world as world_module
from dataparallel.arrays import dtypes
from dataparallel.arrays.comm_thread import Privates
from dataparallel.backends.base import Backend
from dataparallel.backends.rendezvous import RENDEZVOUS_FILE
from dataparallel.backends.single import SingleBackend
from dataparallel.config import Settings

SCRIPT = Path(__file__).parent / "scripts" / "reinit.py"
OVERLAP = {"DATAPARALLEL_OVERLAP": "1"}  # buckets go to the communication thread


@pytest.fixture
def no_world(monkeypatch: pytest.MonkeyPatch) -> None:
    """Hide the session's world for the test (restored afterwards)."""
    monkeypatch.setattr(world_module, "_world", None)


# --- the registry ---------------------------------------------------------------------------


def test_registry_runs_every_callback_in_order_and_raises_the_first_error() -> None:
    calls: list[str] = []

    def first() -> None:
        calls.append("first")
        raise ValueError("first failed")

    def second() -> None:
        calls.append("second")
        raise KeyError("second failed")

    def third() -> None:
        calls.append("third")

    for clear in (first, second, third, first):  # a second registration is a no-op
        assert caches.register(clear) is clear
    try:
        assert caches.registered()[-3:] == (first, second, third)
        with pytest.raises(ValueError, match="first failed") as raised:
            caches.clear_all()
        assert calls == ["first", "second", "third"]
        assert any("second failed" in note for note in raised.value.__notes__)
    finally:
        for clear in (first, second, third):
            caches.unregister(clear)
    assert not {first, second, third} & set(caches.registered())
    caches.unregister(third)  # unregistering what is not registered is harmless


def test_the_library_caches_are_registered() -> None:
    from dataparallel.arrays import device, tree
    from dataparallel.backends import half

    owners = [getattr(clear, "__self__", None) for clear in caches.registered()]
    assert any(owner is dtypes._DTYPE_NAMES for owner in owners)
    assert any(owner is device._OPS for owner in owners)
    assert any(owner is half._SCRATCH for owner in owners)
    assert tree._clear in caches.registered()


def test_finalize_clears_the_registered_caches(no_world: None) -> None:
    cleared: list[int] = []

    def clear() -> None:
        cleared.append(1)

    caches.register(clear)
    try:
        dp.initialize("single")
        dp.allreduce(np.ones(3, np.float32))
        dtypes.dtype_name(np.dtype(np.float32))
        assert dtypes._DTYPE_NAMES and not cleared
        dp.finalize()
        assert cleared == [1] and not dtypes._DTYPE_NAMES
        dp.finalize()  # no world: nothing runs again
        assert cleared == [1]
    finally:
        caches.unregister(clear)


# --- finalize in place, on a world of one --------------------------------------------------


def test_initialize_finalize_initialize_in_one_process(no_world: None) -> None:
    for _ in range(2):
        dp.initialize("single")
        request = dp.iallreduce(np.arange(4.0), op="avg")
        np.testing.assert_array_equal(dp.allreduce(np.arange(3)), np.arange(3))
        job = world_module.current().comm_thread.submit(lambda: None)
        job.wait()
        np.testing.assert_array_equal(request.wait(), np.arange(4.0))
        dp.finalize()
        assert not dp.initialized()


def test_finalize_puts_the_excepthook_back(no_world: None, monkeypatch: pytest.MonkeyPatch) -> None:
    def mine(*_: Any) -> None: ...

    def later(*_: Any) -> None: ...

    monkeypatch.setattr(sys, "excepthook", mine)
    fake = _FakeEngine(rank=0, size=2)
    # What initialize does for a world of several ranks, without the ranks.
    world = world_module.World(backend=fake, settings=Settings(), device=None)
    monkeypatch.setattr(world_module, "_world", world)
    world_module._abort_on_uncaught_exceptions(fake)
    world.restore_excepthook = startup.excepthook_restorer(mine)
    assert sys.excepthook is not mine
    dp.finalize()
    assert sys.excepthook is mine
    # A hook the program set after initialize is left as it is.
    world = world_module.World(backend=fake, settings=Settings(), device=None)
    monkeypatch.setattr(world_module, "_world", world)
    world_module._abort_on_uncaught_exceptions(fake)
    world.restore_excepthook = startup.excepthook_restorer(mine)
    sys.excepthook = later
    dp.finalize()
    assert sys.excepthook is later


class _FakeEngine(SingleBackend):
    """An engine of `size` ranks that makes no call; counts its duplicates and closes."""

    name = "fake"

    def __init__(self, rank: int = 0, size: int = 2, dup_is_self: bool = False) -> None:
        super().__init__()
        self.rank, self.size, self.local_rank, self.local_size = rank, size, rank, size
        self.dup_is_self = dup_is_self
        self.duplicates: list[_FakeEngine] = []
        self.closed = 0

    def duplicate(self) -> Backend:
        if self.dup_is_self:
            return self
        dup = _FakeEngine(self.rank, self.size)
        self.duplicates.append(dup)
        return dup

    def close(self) -> None:
        self.closed += 1

    def abort(self, code: int = 1) -> None:
        raise AssertionError("no abort expected")


def test_privates_close_each_duplicate_once() -> None:
    privates = Privates()
    a, b, alone, selfish = _FakeEngine(), _FakeEngine(), _FakeEngine(size=1), _FakeEngine()
    selfish.dup_is_self = True
    assert privates(a) is privates(a) is a.duplicates[0]
    assert privates(b) is b.duplicates[0]
    assert privates(alone) is alone and privates(selfish) is selfish
    privates.close()
    privates.close()  # safe twice
    assert [a.duplicates[0].closed, b.duplicates[0].closed] == [1, 1]
    assert (a.closed, b.closed, alone.closed, selfish.closed) == (0, 0, 0, 0)  # their owners'
    with pytest.raises(RuntimeError, match=r"closed \(dp.finalize\(\) ran\)"):
        privates(a)


# --- real worlds, made again in one process -------------------------------------------------


def _results(stdout: str) -> list[dict[str, Any]]:
    lines = [line.split("RESULT ", 1)[1] for line in stdout.splitlines() if "RESULT " in line]
    return [json.loads(line) for line in lines]


def _check_rounds(results: list[dict[str, Any]], backend: str, size: int, rounds: int) -> None:
    assert sorted((r["round"], r["rank"]) for r in results) == [
        (i, rank) for i in range(rounds) for rank in range(size)
    ], results
    total = size * (size + 1) / 2
    several = size > 1
    for r in results:
        assert (r["backend"], r["size"]) == (backend, size), r
        assert r["allreduce"] == [total] * 3, r
        assert r["broadcast"] == [i * size for i in range(4)], r
        assert r["group"] == [size] and r["group_freed"], r  # a group goes with its world
        # The step summed every rank's gradient once, on the new world's optimizer only.
        assert r["weight_ok"] and r["bias_ok"], r
        # The duplicate and the thread were used (several ranks), and finalize undid everything.
        assert r["duplicate"] is several and r["thread_ran"] is several, r
        assert r["hooked"] is several, r
        assert r["duplicate_closed"] and r["thread_stopped"], r
        assert r["hook_restored"] and r["caches_cleared"], r


@pytest.mark.spawns
def test_a_world_of_one_again_and_again() -> None:
    job = run_job([SCRIPT, "single", "--rounds", "3"], launcher="python", env=OVERLAP)
    assert job.returncode == 0, job.stdout + job.stderr
    _check_rounds(_results(job.stdout), "single", 1, 3)


@pytest.mark.spawns
def test_gloo_again_through_env_tcp_and_file_rendezvous(tmp_path: Path) -> None:
    """Under `dataparallel run`, each way of meeting twice, in turn: env:// (a later world meets
    through the first one's TCP store, the same MASTER_PORT), tcp:// (a store on the same port
    again) and file:// (each world's rendezvous file is gone with it)."""
    shared = tmp_path / "shared"
    ways = ["env", f"tcp://127.0.0.1:{free_port()}", f"file://{shared}"]
    meet = [arg for way in ways for arg in ("--init-method", way)]
    job = run_job(
        [SCRIPT, "gloo", "--rounds", str(2 * len(ways)), *meet],
        ranks=2,
        backend="gloo",
        job_timeout=300,
        env=OVERLAP,
        timeout=300,
    )
    assert job.returncode == 0, job.stdout + job.stderr
    results = _results(job.stdout)
    _check_rounds(results, "gloo", 2, 2 * len(ways))
    taken = [r["way"] for r in sorted(results, key=lambda r: (r["round"], r["rank"]))]
    assert taken == [way for way in ["env", "tcp", "file"] * 2 for _ in range(2)], taken
    assert not list(shared.iterdir()), list(shared.iterdir())
    assert RENDEZVOUS_FILE == "dataparallel-rendezvous"


@pytest.mark.spawns
@pytest.mark.parametrize("ranks", [2])
def test_mpi_again_while_initialized_and_refused_once_finalized(ranks: int) -> None:
    """dp.finalize() leaves MPI initialized: dp.initialize('mpi') makes a world again. Once the
    program finalizes MPI itself, dp.initialize('mpi') is refused with the reason."""
    require_mpiexec()
    job = run_job(
        [SCRIPT, "mpi-finalized", "--rounds", "2"],
        launcher="mpiexec",
        ranks=ranks,
        env=OVERLAP,
        timeout=300,
    )
    assert job.returncode == 0, job.stdout + job.stderr
    _check_rounds(_results(job.stdout), "mpi", ranks, 2)
    refusals = [line for line in job.stdout.splitlines() if "REFUSED " in line]
    assert len(refusals) == ranks, job.stdout + job.stderr
    for line in refusals:
        assert "BackendUnavailableError: The 'mpi' backend cannot start: MPI was finalized" in line
        assert "dataparallel run --backend gloo" in line and "dp.initialize('gloo')" in line
    assert "Attempting to use an MPI routine" not in job.stderr

"""The test suite's world: one process group per run, and a guard so that no failure ever hangs.

The same tests run as a world of one (`pytest`), under MPI (`mpiexec -n 3 python -m pytest`) and
under Gloo (`dataparallel run -n 2 --backend gloo -m pytest`): the world is set up once, when pytest
starts, by `dp.initialize()`, which reads how the process was launched.

When the world has several ranks:
- a failing test, in any phase (setup, call, teardown), or a module that fails to import, prints
  `[rank r] FAILED test_id` and its traceback to stderr and ends the whole job at once
  (`MPI_Abort`, or `os._exit(1)` for other engines): the other ranks would otherwise wait forever
  in the next collective;
- every rank must collect the same tests, in the same order (checked once, after collection);
- only rank 0 prints pytest's usual report, so the job's last line is rank 0's summary;
- tests marked `spawns` (they launch their own processes) are skipped; they run in the world of one;
  so are tests in which no rank takes part (a parser, the source, a store or sockets of their
  own): each rank would check the same thing alone, so they skip themselves
  (`skipif(outer_world_size() > 1)`, tests/_jobs.py);
- hypothesis draws the same examples on every rank (`derandomize=True`);
- with `PYTEST_RANK_TRAIL` set to a folder, each rank keeps there a one-line note of the test it
  is in (`rank-R`): a rank killed by a signal (a crash in C: Python's faulthandler prints only
  its stacks) leaves no report naming its test, and the Makefile prints the notes when a pass
  fails.

A test marked `matrix` (a product: families x dtypes x ops, say) runs every case at MPI with two
ranks (`FULL_MATRIX`, the cheapest world where an engine really reduces) and, in every other world,
a sample that still holds every pair of its parameters' values (`covering_sample`). The rest are
deselected, unless named on the command line; `--matrix=full` or `sample` decides for every world.

A test marked `heavy` (seconds where most take milliseconds: a training run to a loss, many
hypothesis examples) checks what no engine and no world size changes: of the four multi-rank
worlds it runs in two, each engine once and each size once (`HEAVY_WORLDS`: MPI 3 and Gloo 2 for
its first case, Gloo 3 and MPI 2 for the next, and so on), and in the world of one. The first
pair costs less: Gloo's calls wait far longer than MPI's, longer still with three ranks on two
cores, so a heavy test of one case runs where Gloo has two ranks. A test marked `spread` goes
further, for parameters that no engine or size changes either (eager or jitted, one optimizer or
another): each case runs in one multi-rank world, the cases taking the four in turn (`TURNS`), so
that its first two cases already put it on both engines at both sizes; one spread test starts
with MPI, the next with Gloo, so that a first case (eager, say) meets both engines across the
tests. With one case it runs as a `heavy` one. Other worlds (4 ranks, NCCL) run every case; so
does `--matrix=full`, or naming the case on the command line.

The world of one runs in two pytest-xdist workers (`make test-1`, `--dist loadgroup`): most of
its time goes to tests that start jobs and wait on them. Each test goes to whichever worker is
free, except the files of `ONE_WORKER`, whose tests share what is built once (the sdist, the docs
site, a job whose output several tests read) or one thing of the machine (the Slurm cluster):
each goes whole to one worker. (Whole files for all, `loadfile`, left one worker running the few
slow files at the end, on its own: xdist deals files out by their number of tests.) The
`spawns` tests go out first, the quick ones last. No test may count what runs on the whole
machine, nor expect another test of its file to have run before it: any test may run beside it.

Fixtures: `world` (the active backend), `rank`, `size`.
"""

from __future__ import annotations

import hashlib
import io
import itertools
import os
import tempfile
import time
from collections.abc import Hashable, Iterable
from pathlib import Path
from typing import Any

import pytest
from hypothesis import HealthCheck
from hypothesis import settings as hypothesis_settings

import dataparallel as dp
from dataparallel.backends.base import Backend

# Test files that go whole to one pytest-xdist worker (see the module docstring): their tests
# share a module-scoped fixture or one thing of the machine.
ONE_WORKER = frozenset(
    {
        "test_data.py",
        "test_docs.py",
        "test_nccl.py",
        "test_package.py",
        "test_quiet.py",
        "test_slurm_cluster.py",
        "test_torch_optim.py",
    }
)
SPAWNS_REASON = "launches its own processes; runs in the world-of-one pass"
# The world that runs every case of a `matrix` test: (engine, ranks).
FULL_MATRIX = ("mpi", 2)
# The four multi-rank worlds in the turn that the cases of a `spread` test take them, one world a
# case: the first two, and the last two, hold every engine and every size, and the engines come
# in both orders (a spread test starts at the first or the third, in turn).
TURNS = (("mpi", 3), ("gloo", 2), ("gloo", 3), ("mpi", 2))
# The multi-rank worlds of each case of a `heavy` test, case by case in turn: every engine and
# every size once per case.
HEAVY_WORLDS = (TURNS[:2], TURNS[2:])

# On a GPU, JAX multiplies float32 matrices in TF32 by default (errors near 1e-3): the tests
# compare sharded and one-process training at 1e-5, so they ask for full precision (launched
# jobs inherit it). Seen on an H200: test_optax_sharded's checkpoint runs off by 3.6e-4.
os.environ.setdefault("JAX_DEFAULT_MATMUL_PRECISION", "highest")

# Set in pytest_configure: the backend, and a private copy of the real stderr (pytest redirects
# file descriptor 2 while it captures, and a dying rank's report must reach the terminal).
_state: dict[str, Any] = {}

hypothesis_settings.register_profile("dataparallel", database=None, deadline=None)
# Under several ranks every rank must draw the same examples, and nothing may depend on timing:
# a health check that fails on one slow rank only would desynchronize the ranks.
hypothesis_settings.register_profile(
    "dataparallel-world",
    derandomize=True,
    database=None,
    deadline=None,
    suppress_health_check=[HealthCheck.too_slow],
)


@pytest.hookimpl(trylast=True)
def pytest_configure(config: pytest.Config) -> None:
    """Set up the world, the markers, the hypothesis profile, and quiet ranks > 0."""
    config.addinivalue_line(
        "markers", f"spawns: the test launches its own processes ({SPAWNS_REASON})"
    )
    config.addinivalue_line(
        "markers",
        "heavy: a slow test of what no engine or size changes; of the multi-rank worlds it runs "
        "in MPI 3 + Gloo 2 or Gloo 3 + MPI 2, case by case",
    )
    config.addinivalue_line(
        "markers",
        "spread: a heavy test whose parameters no engine or size changes either; of the "
        "multi-rank worlds each case runs in one, the cases taking the four in turn",
    )
    config.addinivalue_line(
        "markers",
        "matrix(strength=2): a parametrized product; every case runs at MPI 2 ranks, a sample "
        "covering every pair (strength=1: every value) of its parameters' values elsewhere",
    )
    backend = dp.initialize()
    _state["backend"] = backend
    _state["stderr"] = os.dup(2)
    multi = backend.size > 1
    hypothesis_settings.load_profile("dataparallel-world" if multi else "dataparallel")
    if multi and backend.rank > 0:
        _quiet(config)
    trail = os.environ.get("PYTEST_RANK_TRAIL")
    if multi and trail:
        _state["trail"] = Path(trail)
        _state["trail"].mkdir(parents=True, exist_ok=True)
        _note("has set up its world")
    if multi:
        # pytest prunes old temporary folders at exit: ranks sharing a root would race on it.
        root = Path(tempfile.gettempdir()) / f"pytest-dataparallel-rank-{backend.rank}"
        root.mkdir(exist_ok=True)
        os.environ.setdefault("PYTEST_DEBUG_TEMPROOT", str(root))  # read at the first tmp_path


@pytest.hookimpl(trylast=True)
def pytest_unconfigure(config: pytest.Config) -> None:
    """Tear the world down after the last test."""
    dp.finalize()
    stderr = _state.pop("stderr", None)
    if stderr is not None:
        os.close(stderr)


def _quiet(config: pytest.Config) -> None:
    """Keep pytest's terminal report on this rank in memory; the guard still reports failures.

    The reporter is replaced rather than removed, so plugins that write through it still work.
    The report is shown after all if the session still ends badly on this rank (see
    `pytest_sessionfinish`): a rank must never fail the job silently.
    """
    reporter = config.pluginmanager.get_plugin("terminalreporter")
    if reporter is None:
        return
    config.pluginmanager.unregister(reporter)
    report = io.StringIO()
    _state["report"] = report
    config.pluginmanager.register(pytest.TerminalReporter(config, report), "terminalreporter")


@pytest.hookimpl(trylast=True)
def pytest_sessionfinish(session: pytest.Session, exitstatus: int) -> None:
    """On a quiet rank whose session failed (warnings turned errors at the end, say): show why."""
    report = _state.get("report")
    if report is None or exitstatus in (0, pytest.ExitCode.NO_TESTS_COLLECTED):
        return
    rank = _state["backend"].rank
    text = "".join(f"[rank {rank}] {line}\n" for line in report.getvalue().splitlines()[-60:])
    os.write(_state["stderr"], f"[rank {rank}] pytest exit status {exitstatus}:\n{text}".encode())


def _multi() -> bool:
    backend = _state.get("backend")
    return backend is not None and backend.size > 1


def _abort(header: str, text: str) -> None:
    """Print `header` and `text` to the real stderr and end the whole job at once."""
    backend: Backend = _state["backend"]
    message = f"[rank {backend.rank}] {header}\n{text}\n"
    fd = _state.get("stderr", 2)
    os.write(fd, message.encode(errors="replace"))
    if backend.name == "mpi":
        backend.abort(1)
    os._exit(1)


def _note(text: str) -> None:
    """Replace this rank's note in the trail folder (`PYTEST_RANK_TRAIL`), if there is one."""
    trail = _state.get("trail")
    if trail is None:
        return
    rank = _state["backend"].rank
    line = f"[rank {rank}] {text} (pid {os.getpid()}, {time.strftime('%H:%M:%S')})\n"
    # Written aside, then renamed: a rank killed mid-write leaves its last whole note, not none.
    path = trail / f"rank-{rank}"
    staged = path.with_name(f".{path.name}.new")
    staged.write_text(line)
    os.replace(staged, path)


def pytest_runtest_logstart(nodeid: str, location: tuple[str, int | None, str]) -> None:
    """Note the test this rank is starting (a crash in it then names it)."""
    _note(f"was running {nodeid}")


def pytest_runtest_logfinish(nodeid: str, location: tuple[str, int | None, str]) -> None:
    """Note that this rank finished the test (a crash before the next names the last one)."""
    _note(f"had finished {nodeid}")


def pytest_runtest_logreport(report: pytest.TestReport) -> None:
    """End the job when a test fails on a rank of a multi-rank world (any phase)."""
    if report.failed and _multi():
        phase = "" if report.when == "call" else f" (in {report.when})"
        _abort(f"FAILED {report.nodeid}{phase}", report.longreprtext)


def pytest_collectreport(report: pytest.CollectReport) -> None:
    """End the job when a module fails to import on a rank of a multi-rank world."""
    if report.failed and _multi():
        _abort(f"ERROR collecting {report.nodeid}", report.longreprtext)


def pytest_internalerror(excrepr: Any, excinfo: Any) -> None:
    """End the job when pytest itself fails on a rank of a multi-rank world."""
    if _multi():
        _abort("INTERNALERROR", str(excrepr))


def pytest_addoption(parser: pytest.Parser) -> None:
    """`--matrix`: which cases of the `matrix` tests run (see the module docstring)."""
    parser.addoption(
        "--matrix",
        choices=("auto", "full", "sample"),
        default="auto",
        help="matrix tests: every case, a covering sample, or auto (every case at MPI 2 ranks)",
    )


def _value_key(value: object) -> Hashable:
    """Return a key equal for equal parameter values (by identity for unhashable ones)."""
    try:
        hash(value)
    except TypeError:
        return ("id", id(value))
    return value


def _runnable(item: pytest.Item) -> bool:
    """Return whether none of the item's values says it cannot run here (`skip_reason()`)."""
    for value in item.callspec.params.values():  # type: ignore[attr-defined]
        reason = getattr(value, "skip_reason", None)
        if callable(reason) and reason() is not None:
            return False
    return True


def covering_sample(items: list[pytest.Item], strength: int) -> list[pytest.Item]:
    """Return the cases of one matrix test that together hold every `strength`-tuple of values.

    Pairs by default (`matrix(strength=1)`: every value once). An engine sees a dtype and an op,
    never a family, so every world still puts every dtype-op pair through its engine. Greedy, in
    collection order, so the same on every rank: take the case holding the most tuples not yet
    held (the first such); runnable cases first, then those that will skip here (a value with a
    `skip_reason()`, such as a family this machine lacks) for what they alone hold.
    """

    def tuples(item: pytest.Item) -> set[tuple[tuple[str, Hashable], ...]]:
        params = sorted(item.callspec.params.items())  # type: ignore[attr-defined]
        values = [(name, _value_key(value)) for name, value in params]
        return set(itertools.combinations(values, min(strength, len(values))))

    held = {id(item): tuples(item) for item in items}
    wanted: set[tuple[tuple[str, Hashable], ...]] = set().union(*held.values())
    chosen: set[int] = set()
    for group in ([i for i in items if _runnable(i)], [i for i in items if not _runnable(i)]):
        while wanted:
            best = max(group, key=lambda i: len(held[id(i)] & wanted), default=None)
            if best is None or not held[id(best)] & wanted:
                break
            chosen.add(id(best))
            wanted -= held[id(best)]
    return [item for item in items if id(item) in chosen]


def _matrices(items: Iterable[pytest.Item]) -> dict[str, list[pytest.Item]]:
    """Return the parametrized `matrix` items, by test function, in collection order."""
    groups: dict[str, list[pytest.Item]] = {}
    for item in items:
        if item.get_closest_marker("matrix") is not None and hasattr(item, "callspec"):
            groups.setdefault(item.nodeid.split("[", 1)[0], []).append(item)
    return groups


def _named(config: pytest.Config, item: pytest.Item) -> bool:
    """Return whether the command line names this case itself (`test_x[numpy-int8-sum]`)."""
    for arg in config.args:
        path, _, name = arg.partition("::")
        if "[" in name and item.nodeid.endswith(f"::{name}") and Path(path).resolve() == item.path:
            return True
    return False


def _full_matrix(config: pytest.Config) -> bool:
    choice = config.getoption("matrix")
    if choice != "auto":
        return bool(choice == "full")
    backend: Backend = _state["backend"]
    return (backend.name, backend.size) == FULL_MATRIX


def heavy_elsewhere(items: Iterable[pytest.Item], here: tuple[str, int]) -> set[int]:
    """Return the ids of the `heavy` and `spread` items whose worlds (`HEAVY_WORLDS`, `TURNS`)
    are not `here`, the (engine, ranks) of this world: none in a world of none of them."""
    if here not in TURNS:
        return set()
    cases: dict[str, list[pytest.Item]] = {}
    for item in items:
        if item.get_closest_marker("heavy") or item.get_closest_marker("spread"):
            cases.setdefault(item.nodeid.split("[", 1)[0], []).append(item)
    elsewhere = set()
    spread = 0
    for group in cases.values():
        if len(group) > 1 and group[0].get_closest_marker("spread") is not None:
            start, spread = 2 * spread, (spread + 1) % 2
            turns = [(TURNS[(start + case) % len(TURNS)],) for case in range(len(group))]
        else:
            turns = [HEAVY_WORLDS[case % 2] for case in range(len(group))]
        elsewhere |= {
            id(item) for item, worlds in zip(group, turns, strict=True) if here not in worlds
        }
    return elsewhere


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    """Keep a covering sample of each `matrix` test and the `heavy` and `spread` cases of this
    world; skip `spawns` tests when several ranks."""
    if config.getoption("matrix") != "full":
        drop: set[int] = set()
        if not _full_matrix(config):
            for group in _matrices(items).values():
                marker = group[0].get_closest_marker("matrix")
                assert marker is not None
                sample = covering_sample(group, int(marker.kwargs.get("strength", 2)))
                drop |= {id(item) for item in group} - {id(item) for item in sample}
        backend: Backend = _state["backend"]
        drop |= heavy_elsewhere(items, (backend.name, backend.size))
        dropped = [item for item in items if id(item) in drop and not _named(config, item)]
        if dropped:
            gone = {id(item) for item in dropped}
            config.hook.pytest_deselected(items=dropped)
            items[:] = [item for item in items if id(item) not in gone]
    if not _multi():
        if os.environ.get("PYTEST_XDIST_WORKER"):
            # Jobs first: a test that starts one takes seconds, one in this process milliseconds,
            # so the pass ends on short tests and no worker waits long for the other at the end.
            items.sort(key=lambda item: "spawns" not in item.keywords)
        return
    skip = pytest.mark.skip(reason=SPAWNS_REASON)
    for item in items:
        if "spawns" in item.keywords:
            item.add_marker(skip)


def pytest_collection_finish(session: pytest.Session) -> None:
    """Check that every rank collected the same tests, which the ranks must run in lockstep."""
    if not _multi():
        return
    backend: Backend = _state["backend"]
    ids = "\n".join(item.nodeid for item in session.items)
    mine = (len(session.items), hashlib.blake2b(ids.encode(), digest_size=16).hexdigest())
    every = backend.allgather_object(mine)
    if any(other != every[0] for other in every):
        counts = ", ".join(f"rank {r}: {n} tests" for r, (n, _) in enumerate(every))
        _abort(
            "collected different tests than another rank",
            f"({counts}). Every rank must collect the same tests in the same order: "
            "parametrize on values that are equal on every rank.",
        )


@pytest.fixture(scope="session")
def world() -> Backend:
    """Return the active backend (MPI under mpiexec, Gloo under `dataparallel run`, or single).

    The world is set up in `pytest_configure` and finalized in `pytest_unconfigure`, so the guard
    knows the rank from the start; this fixture only hands it out (and sets it up again if a test
    finalized it).
    """
    return dp.initialize()


@pytest.fixture(scope="session")
def rank(world: Backend) -> int:
    """Return this process's rank."""
    return world.rank


@pytest.fixture(scope="session")
def size(world: Backend) -> int:
    """Return the world size."""
    return world.size


@pytest.hookimpl(optionalhook=True)
def pytest_xdist_make_scheduler(config: pytest.Config, log: Any) -> Any:
    """`--dist loadgroup`: a test to whichever worker is free, a file of `ONE_WORKER` whole.

    xdist's own loadgroup groups by `xdist_group` marks, which it writes into a node id that
    pytest 9 no longer reads; the groups here are the files themselves, known by their names.
    """
    if config.getoption("dist") != "loadgroup":
        return None
    from xdist.scheduler import LoadScopeScheduling

    class Scheduling(LoadScopeScheduling):  # type: ignore[misc]
        def _split_scope(self, nodeid: str) -> str:
            path = nodeid.split("::", 1)[0]
            return path if Path(path).name in ONE_WORKER else nodeid

    return Scheduling(config, log)

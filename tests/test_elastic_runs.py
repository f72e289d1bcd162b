"""Elastic runs end to end: `dataparallel run --min-np ... --backend gloo` with workers killed by
SIGKILL mid-run, workers added through a discovery script, and the ways such a run must end.

The subject is tests/scripts/elastic_train.py: a victim kills itself after its K-th commit, in
the middle of the next step (a condition, not a clock). Every run must then finish, with final
float64 weights equal, bit for bit, to a replay of the committed steps kept in the state, and
every sample of every epoch in exactly one committed step.
"""

from __future__ import annotations

import collections
import importlib.util
import json
import stat
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
from _jobs import Arg, outer_world_size, run_job

pytestmark = [
    pytest.mark.spawns,
    pytest.mark.skipif(
        outer_world_size() > 1,
        reason="launches its own multi-process jobs: run this file in a world of one",
    ),
    pytest.mark.skipif(
        importlib.util.find_spec("torch") is None, reason="elastic runs need torch (Gloo)"
    ),
]

SCRIPTS = Path(__file__).parent / "scripts"
TRAIN = SCRIPTS / "elastic_train.py"
SAMPLES = 23
# Hang guard: a run of a few Python processes on two busy cores takes 20-40 s.
LIMIT = 300.0

sys.path.insert(0, str(SCRIPTS))
from elastic_train import replay  # noqa: E402


def elastic(
    n: int, options: list[str], args: list[str], tmp_path: Path, timeout: float = LIMIT
) -> subprocess.CompletedProcess[str]:
    return run_job(
        [TRAIN, "--samples", str(SAMPLES), "--out", tmp_path / "out.json", *args],
        ranks=n,
        backend="gloo",
        job_timeout=timeout - 30,
        options=options,
        timeout=timeout,
        cwd=tmp_path,
    )


def elastic_job(
    script: str,
    args: list[Arg],
    tmp_path: Path,
    env: dict[str, str] | None = None,
    ranks: int = 3,
) -> subprocess.CompletedProcess[str]:
    """`script` (of tests/scripts) run elastically by `ranks` Gloo workers that may fall to 2,
    those made to die by `args`."""
    return run_job(
        [SCRIPTS / script, *args],
        ranks=ranks,
        backend="gloo",
        job_timeout=LIMIT - 30,
        options=["--min-np", "2"],
        timeout=LIMIT,
        cwd=tmp_path,
        env=env,
    )


def check_run(tmp_path: Path, sizes: list[int]) -> None:
    """The run's committed history went through world sizes `sizes`, in that order; each epoch
    saw each sample once; the weights are the replay's, bit for bit."""
    out = json.loads((tmp_path / "out.json").read_text())
    history = out["history"]
    seen = []
    for _, size, _ in history:
        if not seen or seen[-1] != size:
            seen.append(size)
    assert seen == sizes
    epochs: dict[int, list[int]] = collections.defaultdict(list)
    for epoch, size, shares in history:
        assert len(shares) == size
        for share in shares:
            epochs[epoch] += share
    assert sorted(epochs) == [0, 1, 2]
    for epoch, indices in epochs.items():
        assert sorted(indices) == list(range(SAMPLES)), f"epoch {epoch}"
    np.testing.assert_array_equal(np.array(out["w"]), replay(history))
    assert out["w"] == replay(history).tolist()  # bit for bit, not only to a tolerance


def test_two_lost_in_one_step_then_rank_0_then_one_after_the_finish(tmp_path: Path) -> None:
    """One run of five workers that sets the epoch at the start of every epoch (torch's habit,
    `set_epoch(epoch)`, so also on re-entry after a roll-back; the other habit, `set_epoch(epoch
    + 1)` at the end, is every other run of this file):
    - workers 1 and 3 die in one step, after their 2nd commit: one re-forming, not two
      (`--reset-limit 2` holds with the re-forming below);
    - worker 0 (rank 0) dies after its 4th commit, in the middle of epoch 1: the new rank 0 is
      the lowest survivor (worker 2), which holds the same commit, and the epoch goes on from its
      record, its samples once each;
    - worker 4 is lost once rank 0 has finished (after training), which does not fail the
      finished run.
    (Losing a worker as a group forms: `test_lost_as_the_first_and_the_next_world_form_then_a_
    clean_exit`.)"""
    done = elastic(
        5,
        ["--min-np", "2", "--reset-limit", "2"],
        [
            *("--die", "w1:2", "--die", "w3:2", "--die", "w0:4"),
            *("--die-after-finish", "w4", "--set-epoch-at-start"),
        ],
        tmp_path,
    )
    assert done.returncode == 0, done.stderr
    for worker in (1, 3, 0, 4):
        assert f"worker {worker} was lost (SIGKILL)" in done.stderr, done.stderr
    assert "worker 0 was lost (SIGKILL); 2 worker(s) remain" in done.stderr, done.stderr
    check_run(tmp_path, [5, 3, 2])
    history = json.loads((tmp_path / "out.json").read_text())["history"]
    epochs = {size: [e for e, n, _ in history if n == size] for size in (5, 3, 2)}
    assert epochs[3] == [1] * 3 and epochs[2][0] == 1, f"rank 0 lost mid-epoch 1: {epochs}"


def test_lost_as_the_first_and_the_next_world_form_then_a_clean_exit(tmp_path: Path) -> None:
    """One run of four workers, `--min-np 1`:
    - worker 3 dies once round 0 has formed, before `dp.initialize()`: the others, making the
      library's world there, re-form without it (before: `dp.initialize()` raised and the run
      ended);
    - worker 1 dies as round 1's Gloo group begins to form, before its address is in the
      store: workers 0 and 2, waiting there for it, see the launcher's round 2 and go on
      without it (without the watch they would wait out --elastic-timeout, 600 s, past LIMIT);
    - worker 2 leaves with `sys.exit(0)` mid-run: a finished worker leaves the run, and worker
      0 re-forms alone and finishes (before: the launcher opened no round and worker 0 waited
      for one forever)."""
    done = elastic(
        4,
        ["--min-np", "1"],
        ["--die-initializing", "w3", "--die-forming", "w1:1", "--leave", "w2:3"],
        tmp_path,
    )
    assert done.returncode == 0, done.stderr
    assert "worker 3 was lost (SIGKILL); 3 worker(s) remain" in done.stderr, done.stderr
    assert "worker 1 was lost (SIGKILL); 2 worker(s) remain" in done.stderr, done.stderr
    assert "round 3 formed without worker(s) 2, which finished their script" in done.stderr
    check_run(tmp_path, [2, 1])


def discovery_script(tmp_path: Path, slots: str) -> Path:
    (tmp_path / "slots").write_text(slots + "\n")
    script = tmp_path / "discover.sh"
    script.write_text(f"#!/bin/sh\ncat {tmp_path / 'slots'}\n")
    script.chmod(script.stat().st_mode | stat.S_IXUSR)
    return script


def test_discovery_removes_fails_adds_and_removes_again(tmp_path: Path) -> None:
    """One run whose discovery script changes four times (`--max-np 3`):
    - worker 2, the newest, makes it report two slots before its `dp.initialize()`: the
      others, making the library's world of round 0, go on to round 1 without it, and it
      leaves with status 0;
    - it fails once (after rank 0's 2nd commit): the launcher keeps the slots it knew and runs
      it again (Horovod ends the run only when the first call fails:
      `test_bad_discovery_script`);
    - 2 -> 3 (after rank 0's 3rd commit): the newcomer, worker 3, gets the state from rank 0
      and the run goes on with three, without rolling back;
    - 3 -> 2 (after rank 0's 5th commit): worker 3, the newest, leaves at the next commit with
      status 0 (not a failure) and the others go on without rolling back."""
    fail = tmp_path / "fail"
    slots = tmp_path / "slots"
    slots.write_text("localhost:3\n")
    script = tmp_path / "discover.sh"
    script.write_text(
        f"#!/bin/sh\nif [ -e {fail} ]; then rm {fail}; echo no hosts today >&2; exit 3; fi\n"
        f"cat {slots}\n"
    )
    script.chmod(script.stat().st_mode | stat.S_IXUSR)
    changes = [f"{slots}:0:localhost:2", f"{slots}:3:localhost:3", f"{slots}:5:localhost:2"]
    done = elastic(
        3,
        ["--min-np", "2", "--max-np", "3", "--host-discovery-script", str(script)],
        [*(f"--slots={change}" for change in changes), "--fail-discovery", f"{fail}:2"],
        tmp_path,
    )
    assert done.returncode == 0, done.stderr
    assert "worker w2 was removed from the run" in done.stderr, done.stderr
    assert "exited with status 3: no hosts today" in done.stderr, done.stderr
    assert "keeping the 2 slot(s) it reported last" in done.stderr, done.stderr
    assert "worker 3 is removed (the discovery script leaves the run 2 slot(s))" in done.stderr
    assert "worker w3 was removed from the run" in done.stderr, done.stderr
    assert "was lost" not in done.stderr and "ended with status" not in done.stderr
    check_run(tmp_path, [2, 3, 2])


def test_below_min_np_ends_after_the_elastic_timeout(tmp_path: Path) -> None:
    """Worker 1 dies as it starts: worker 0 alone is below `--min-np 2` for the elastic
    timeout, and the run ends."""
    options = ["--min-np", "2", "--elastic-timeout", "0.5"]
    done = elastic(2, options, ["--die-initializing", "w1"], tmp_path)
    assert done.returncode == 1, done.stderr
    assert "fewer than --min-np 2" in done.stderr
    assert "1 slot(s) missing on this machine (lost: worker(s) 1)" in done.stderr


def test_every_worker_lost_fails_the_run(tmp_path: Path) -> None:
    """Both workers die (`--min-np 1`), as they start: no worker finished its script, so the
    run fails."""
    args = ["--die-initializing", "w0", "--die-initializing", "w1"]
    done = elastic(2, ["--min-np", "1"], args, tmp_path)
    assert done.returncode == 1, done.stderr
    assert "every worker was lost (worker(s) " in done.stderr
    assert "none finished its script" in done.stderr


def test_a_commit_on_some_ranks_only_fails_on_every_rank(tmp_path: Path) -> None:
    """Worker 1 skips its 2nd commit: worker 0's commit meets its next step's collective, and
    the protocol says so on every rank (a bug, not a lost worker: the run ends)."""
    done = elastic(2, ["--min-np", "2"], ["--skip", "w1:2"], tmp_path)
    assert done.returncode == 1, done.stderr
    assert "CollectiveMismatchError" in done.stderr


def test_reset_limit(tmp_path: Path) -> None:
    done = elastic(2, ["--min-np", "1", "--reset-limit", "0"], ["--die", "w1:1"], tmp_path)
    assert done.returncode == 1, done.stderr
    assert "--reset-limit is 0: stopping" in done.stderr


@pytest.mark.parametrize(
    ("output", "status", "message", "code"),
    [
        ("localhost:two", 0, "is not HOST:SLOTS", 1),
        # another host, reached over ssh: one that cannot be fails the launch at once, named
        ("nohost.invalid:2", 0, "cannot start ranks on host 'nohost.invalid'", 2),
        ("localhost:2", 3, "exited with status 3", 1),
    ],
)
def test_bad_discovery_script(
    tmp_path: Path, output: str, status: int, message: str, code: int
) -> None:
    script = tmp_path / "discover.sh"
    script.write_text(f"#!/bin/sh\necho {output}\nexit {status}\n")
    script.chmod(script.stat().st_mode | stat.S_IXUSR)
    done = elastic(2, ["--min-np", "1", "--host-discovery-script", str(script)], [], tmp_path)
    assert done.returncode == code and message in done.stderr, done.stderr


@pytest.mark.parametrize(
    ("options", "message"),
    [
        (["--min-np", "1", "--backend", "mpi"], "MPI cannot go on without a lost rank"),
        (["--min-np", "4", "--backend", "gloo"], "--min-np must be in 1..3"),
        (["--min-np", "2", "--max-np", "2", "--backend", "gloo"], "--max-np must be at least"),
        (["--max-np", "4", "--backend", "gloo"], "--max-np needs --min-np"),
        (
            ["--min-np", "2", "--host-discovery-script", "/nonexistent", "--backend", "gloo"],
            "is not an executable file",
        ),
    ],
)
def test_bad_options_are_refused_at_once(options: list[str], message: str) -> None:
    command = [sys.executable, "-m", "dataparallel", "run", "-n", "3", *options, TRAIN]
    done = run_job(command, launcher=None, timeout=60.0)
    assert done.returncode == 2 and message in done.stderr, done.stderr


@pytest.mark.parametrize(
    ("wrapper", "grouping", "stepping"), [("optimizer", "w2", "w0"), ("model", "w0", "w2")]
)
def test_a_horovod_elastic_script_loses_a_worker_as_its_wrapper_groups_then_one_mid_step(
    tmp_path: Path, wrapper: str, grouping: str, stepping: str
) -> None:
    """Horovod's names (`hvd.elastic.run`, `TorchState`, a reset callback), with a
    `hvd.DistributedOptimizer` or a `dp.torch.DataParallelModel`, four workers:
    - worker `grouping` dies as the wrapper, made before `hvd.elastic.run`, begins making its
      private group over round 0's world; the others wait there for its address until the
      launcher opens round 1 without it. They re-form there, as `dp.initialize` would, the
      wrapper is made on the new world, and the loop starts with the reset callbacks (lr for 3
      ranks) and the state synchronized (before: the wait's `RankFailedError` escaped the
      constructor, outside the loop, and ended the run with status 1);
    - worker `stepping` dies in the middle of step 5: the wrapper's gradient hooks are carried
      over to the world of the survivors, which end equal.
    Each wrapper loses rank 0 once and another rank once: the wrappers carry their hooks over
    the same way whoever is lost."""
    out = tmp_path / "out.json"
    ddp = ["--ddp"] if wrapper == "model" else []
    args: list[Arg] = ["--out", out, "--die-grouping", grouping, "--die", stepping, *ddp]
    done = elastic_job("elastic_hvd.py", args, tmp_path, ranks=4)
    assert done.returncode == 0, done.stderr
    assert f"worker {grouping[1:]} was lost (SIGKILL); 3 worker(s) remain" in done.stderr
    assert f"worker {stepping[1:]} was lost (SIGKILL); 2 worker(s) remain" in done.stderr
    assert json.loads(out.read_text()) == {"size": 2, "step": 12, "resets": [3, 2], "same": True}


@pytest.mark.skipif(importlib.util.find_spec("optax") is None, reason="needs JAX and optax")
def test_a_jitted_optax_step_loses_a_worker_on_either_route(tmp_path: Path) -> None:
    """The survivors lose a worker inside the jitted step's reduction, which JAX reports as
    its own `JaxRuntimeError`: worker 0 (rank 0) before step 4, which reduces through an FFI
    call, then worker 1 (rank 0 by then) before step 5, which reduces through a host callback
    (four workers; the steps take the two routes in turn). `elastic.run` re-forms all the same
    each time, and the steps, compiled for the old world, are traced again for the new one. The
    script converts nothing and clears no cache itself; the end is one process's training."""
    out = tmp_path / "out.json"
    args = ["--out", out, "--route", "ffi,callback", "--die", "w0:4", "--die", "w1:5"]
    done = elastic_job("elastic_jax.py", args, tmp_path, env={"JAX_PLATFORMS": "cpu"}, ranks=4)
    assert done.returncode == 0, done.stderr
    assert "worker 0 was lost (SIGKILL); 3 worker(s) remain" in done.stderr, done.stderr
    assert "worker 1 was lost (SIGKILL); 2 worker(s) remain" in done.stderr, done.stderr
    result = json.loads(out.read_text())
    assert (result["size"], result["step"], result["same"]) == (2, 8, True)
    from elastic_jax import replay

    np.testing.assert_allclose(result["params"], replay(8), rtol=1e-6, atol=1e-7)


def test_a_zero_run_of_both_stages_reshards_what_it_committed_twice(tmp_path: Path) -> None:
    """`TorchState` of a `DataParallelModel` under a stage-1 `ZeroRedundancyOptimizer` and a
    model under a stage-2 one: 4 workers, worker 0 dies mid-step, then worker 2 (rank 1 by then).
    Each time the survivors lay both optimizers out again (other segments, other padding), and
    their consolidated states are, bit for bit, the ones committed last; the run then finishes.
    Two reducers leave calls in flight on two engines when a worker dies: see
    `test_survivors_waiting_on_each_other_in_two_engines_re_form`."""
    out = tmp_path / "out.json"
    done = elastic_job(
        "elastic_zero.py", ["--out", out, "--die", "w0:3", "w2:7"], tmp_path, ranks=4
    )
    assert done.returncode == 0, done.stderr
    assert json.loads(out.read_text()) == {"size": 2, "step": 10, "checks": [True] * 8}


def test_survivors_waiting_on_each_other_in_two_engines_re_form(tmp_path: Path) -> None:
    """Worker 2 of 3 dies; rank 0 has a call in flight on a group that waits for rank 1, and
    rank 1 waits on the world's engine for rank 0 (tests/scripts/elastic_crossed.py). Each call
    ends only once the other process closes that engine: leaving the world closes every engine
    at once, so both fail, and the two re-form and finish. (Closed one after another, rank 0
    waited in the group's close for rank 1, which waited for rank 0's world engine to close,
    until Gloo's timeout.)"""
    out = tmp_path / "out.json"
    done = elastic_job("elastic_crossed.py", ["--out", out], tmp_path)
    assert done.returncode == 0, done.stderr
    assert json.loads(out.read_text()) == {"size": 2, "sizes": [3, 2]}


def check_fully_sharded(tmp_path: Path, sizes: list[int], epochs: int) -> None:
    """The fully sharded run went through world sizes `sizes`; each of its `epochs` saw each
    sample once; every re-formed world held, bit for bit, the parameters and Adam state
    committed last; the final parameters are an unsharded replay's of the committed steps, to
    float64 rounding (the reduce-scatter adds the ranks' gradients in another order than one
    process's sum)."""
    import torch
    from elastic_fully_shard import replay

    out = json.loads((tmp_path / "out.json").read_text())
    seen: list[int] = []
    by_epoch: dict[int, list[int]] = collections.defaultdict(list)
    for epoch, size, batch in out["history"]:
        if not seen or seen[-1] != size:
            seen.append(size)
        by_epoch[epoch] += batch
    assert seen == sizes
    assert sorted(by_epoch) == list(range(epochs))
    for epoch, indices in by_epoch.items():
        assert sorted(indices) == list(range(SAMPLES)), f"epoch {epoch}"
    assert out["checks"] == [True] * (len(sizes) - 1)
    expected = replay(out["history"])
    assert out["params"].keys() == expected.keys()
    for name, value in out["params"].items():
        torch.testing.assert_close(
            torch.tensor(value, dtype=torch.float64), expected[name], rtol=1e-9, atol=1e-11
        )


def test_a_fully_sharded_run_grows_then_loses_two_workers(tmp_path: Path) -> None:
    """`TorchState(fully_shard model, Adam)`, one run: 2 -> 3 through discovery, the newcomer
    sharding its model over three and getting its rows and their Adam state from the two that
    were there, without rolling back; then worker 1 (rank 1 of 3) dies after its 4th commit,
    mid-step, and the survivors cut every shard again for 2 ranks from their commits (its rows
    from the copy its neighbour kept); then worker 0 (rank 0 of 2) after its 6th, and the last
    one finishes alone. One run for the three re-forms: a job's start costs seconds."""
    script = discovery_script(tmp_path, "localhost:2")
    done = run_job(
        [
            SCRIPTS / "elastic_fully_shard.py",
            "--out",
            tmp_path / "out.json",
            "--epochs",
            "3",
            "--slots",
            f"{tmp_path / 'slots'}:2:localhost:3",
            "--die",
            "w1:4",
            "--die",
            "w0:6",
        ],
        ranks=2,
        backend="gloo",
        job_timeout=LIMIT - 30,
        options=["--min-np", "1", "--max-np", "3", "--host-discovery-script", str(script)],
        timeout=LIMIT,
        cwd=tmp_path,
    )
    assert done.returncode == 0, done.stderr
    assert "worker 1 was lost (SIGKILL); 2 worker(s) remain" in done.stderr
    assert "worker 0 was lost (SIGKILL); 1 worker(s) remain" in done.stderr
    check_fully_sharded(tmp_path, [2, 3, 2, 1], epochs=3)

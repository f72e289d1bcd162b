"""How `GradientSync` plans for overlap: a small first bucket, bucket sizes from the model's size,
and the mode (communication thread or after backward) timed by its first steps and agreed by all
ranks (`torch/_buckets.py`)."""

from __future__ import annotations

from typing import Any

import pytest
import torch
from _torch_common import gathered, global_batch, make_model, step_pair

import dataparallel as dp
from dataparallel.config import Settings
from dataparallel.torch._buckets import (
    FIRST_BUCKET_BYTES,
    ModeTrial,
    assign,
    bucket_bytes_for,
    overlaps,
)

MiB = 1 << 20


def test_the_first_bucket_is_capped_and_the_others_are_not() -> None:
    sizes = [4, 4, 4, 4, 4, 4]  # float32: 16 bytes each
    params = [(f"p{i}", torch.zeros(n)) for i, n in enumerate(sizes)]
    buckets = assign(params, list(range(len(sizes))), bucket_bytes=48, first_bytes=16)
    assert [b.members for b in buckets] == [[0], [1, 2, 3], [4, 5]]
    # A first limit above the bucket size changes nothing.
    same = assign(params, list(range(len(sizes))), bucket_bytes=48, first_bytes=1000)
    assert [b.members for b in same] == [[0, 1, 2], [3, 4, 5]]


def test_thread_buckets_are_an_eighth_of_the_model_within_limits() -> None:
    settings = Settings()
    assert bucket_bytes_for(False, 100 * MiB, settings) == settings.bucket_bytes
    assert bucket_bytes_for(True, 2 * MiB, settings) == FIRST_BUCKET_BYTES  # never below 1 MiB
    assert bucket_bytes_for(True, 16 * MiB, settings) == 2 * MiB
    assert bucket_bytes_for(True, 1000 * MiB, settings) == settings.thread_bucket_bytes
    small = Settings(bucket_bytes=4096, thread_bucket_bytes=4096)  # DATAPARALLEL_BUCKET_BYTES
    assert bucket_bytes_for(True, 1000 * MiB, small) == 4096
    # After backward on an engine that carries its calls in its own threads: DDP's size.
    assert bucket_bytes_for(False, MiB, settings, whole=True) == settings.thread_bucket_bytes
    assert bucket_bytes_for(False, MiB, small, whole=True) == 4096


@pytest.mark.parametrize("wait_after_backward", [False, True], ids=["optimizer", "model"])
def test_on_one_node_the_cores_choose_the_mode_and_the_engine_the_size(
    wait_after_backward: bool, world: Any
) -> None:
    """Every rank on this node: no trial, the mode `overlaps` gives (agreed by every rank), and
    after backward on Gloo buckets of DDP's 25 MiB (one call less than 256 KiB's per step)."""
    model = make_model(hidden=16)
    if wait_after_backward:
        sync = dp.torch.DataParallelModel(model).gradient_sync
    else:
        sync = dp.DistributedOptimizer(torch.optim.SGD(model.parameters(), lr=0.1)).gradient_sync
    settings = dp.world.current().settings
    if world.local_size < world.size or settings.overlap is not None:
        pytest.skip("ranks on other nodes, or DATAPARALLEL_OVERLAP set: not this rule")
    assert sync._trial is None
    assert sync.overlap is overlaps_everywhere(world)
    if sync.overlap:
        return  # the thread's size: test_thread_buckets_are_an_eighth_of_the_model_within_limits
    expected = settings.thread_bucket_bytes if world.progresses else settings.bucket_bytes
    assert sync.bucket_bytes == expected
    given = dp.torch.DataParallelModel(make_model(hidden=16), bucket_bytes=4096).gradient_sync
    assert given.bucket_bytes == 4096


def overlaps_everywhere(world: Any) -> bool:
    """Whether `overlaps` says so on every rank (any rank without a spare core: after backward)."""
    mine = torch.tensor([float(overlaps(world.local_size, None))])
    return all(bool(theirs[0][0]) for theirs in gathered([mine]))


class _One:
    size = local_size = 1


class _Across:
    """What the trial reads of a world whose ranks are on two nodes (one rank each)."""

    size, local_size = 2, 1


def test_the_trial_alternates_the_modes_then_keeps_the_faster() -> None:
    steps = ModeTrial.SKIP + 2 * ModeTrial.TRIALS
    for thread_faster in (True, False):
        trial, modes = ModeTrial(), []
        for _ in range(steps + 2):
            modes.append(trial.mode)
            fast = trial.mode == thread_faster
            trial.record(1.0 if fast else 2.0, _One())  # type: ignore[arg-type]
        assert modes[: ModeTrial.SKIP] == [True] * ModeTrial.SKIP
        assert modes[ModeTrial.SKIP : steps] == [False, True] * ModeTrial.TRIALS
        assert modes[steps:] == [thread_faster] * 2
        assert trial.chosen is thread_faster


@pytest.mark.parametrize("wait_after_backward", [False, True], ids=["optimizer", "model"])
def test_ranks_time_both_modes_and_the_slowest_rank_decides(
    wait_after_backward: bool, rank: int, world: Any, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Rank 0 alone would keep reducing after backward, every other rank on the thread; the
    slowest rank's medians decide, so every rank takes the thread, at the same step; the
    gradients are averaged right in both modes and across the switches. The trial runs where
    some rank is on another node: each rank here is told it is alone on its node."""
    monkeypatch.setattr(world, "local_size", 1)
    model, reference = make_model(hidden=16), make_model(hidden=16)
    if wait_after_backward:
        wrapped: Any = dp.torch.DataParallelModel(model)
        sync = wrapped.gradient_sync
        opt = torch.optim.SGD(model.parameters(), lr=0.1)
    else:
        wrapped = model
        opt = dp.DistributedOptimizer(torch.optim.SGD(model.parameters(), lr=0.1))
        sync = opt.gradient_sync
    if sync._trial is None:
        pytest.skip("no trial here: a world of one, or DATAPARALLEL_OVERLAP set")
    ref_opt = torch.optim.SGD(reference.parameters(), lr=0.1)
    record = sync._trial.record

    def timed(_: float, backend: Any) -> bool:  # after backward: rank 0 fast, others slow
        slow = sync.overlap if rank == 0 else not sync.overlap
        return record(3.0 if slow and rank > 0 else (2.0 if slow else 1.0), backend)

    monkeypatch.setattr(sync._trial, "record", timed)
    modes, sizes = [], []
    for step in range(ModeTrial.SKIP + 2 * ModeTrial.TRIALS + 2):
        modes.append(sync.overlap)
        sizes.append(sync.bucket_bytes)
        x, y = global_batch(step)
        step_pair(wrapped, opt, reference, ref_opt, x, y)
        for got, want in zip(model.parameters(), reference.parameters(), strict=True):
            torch.testing.assert_close(got, want)
    trial_steps = [True] * ModeTrial.SKIP + [False, True] * ModeTrial.TRIALS
    assert modes == [*trial_steps, True, True]
    assert sync._trial.chosen is True
    settings = dp.world.current().settings
    after = settings.thread_bucket_bytes if world.progresses else settings.bucket_bytes
    thread = sizes[0]
    assert sizes == [after if not m else thread for m in modes]
    everyone = gathered([torch.tensor([float(m) for m in modes])])
    assert all((theirs[0] == everyone[0][0]).all() for theirs in everyone)


def test_a_load_that_rises_during_the_trial_does_not_hide_the_faster_mode() -> None:
    """The machine's load doubles halfway through the trial: the modes' medians would pick
    after backward (its steps came earlier), the pairs of adjacent steps see the thread faster."""
    trial = ModeTrial()
    for _ in range(ModeTrial.SKIP):
        trial.record(1.0, _One())  # type: ignore[arg-type]
    for k in range(2 * ModeTrial.TRIALS):
        load = 1.0 if k < ModeTrial.TRIALS else 3.0
        cost = 0.0 if trial.mode else 0.2  # the thread is faster by 0.2 at any load
        trial.record(load + cost, _One())  # type: ignore[arg-type]
    assert trial.medians is not None
    after, thread = trial.medians
    assert after < thread  # what the medians alone would have chosen
    assert trial.chosen is True


@pytest.mark.parametrize(
    ("world", "after_faster_by", "thread_kept"),
    [(_Across, 0.03, True), (_Across, 0.10, False), (_One, 0.03, False)],
    ids=["across-nodes-within-margin", "across-nodes-beyond-margin", "one-node"],
)
def test_across_nodes_after_backward_must_win_by_the_margin(
    world: type, after_faster_by: float, thread_kept: bool, monkeypatch: pytest.MonkeyPatch
) -> None:
    # the world is pretended
    monkeypatch.setattr("dataparallel.collectives.reductions.allreduce", lambda x, **_: x)
    trial = ModeTrial()
    while trial.chosen is None:
        cost = 1.0 if not trial.mode or trial.steps < ModeTrial.SKIP else 1.0 + after_faster_by
        trial.record(cost, world())  # type: ignore[arg-type]
    assert trial.chosen is thread_kept

"""`ZeroRedundancyOptimizer(..., overlap_with_forward=model)`: the exchange lands in the forward.

Each test trains two copies of a model side by side from the same start on the same shares: one
with the overlap, one without (the same bucket size, so the same layout). They must end equal:
exactly at stage 1 (the same bits move), and at stage 2 as well, since both reduce the same
buckets. At any world size; in a world of one nothing is exchanged and the hooks wait for nothing.
"""

from __future__ import annotations

import copy
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch
from _jobs import run_job
from _torch_common import (
    Reversed,
    assert_same_on_every_rank,
    global_batch,
    loss_of,
    make_model,
    share,
)
from torch import nn

import dataparallel as dp
from dataparallel.backends.base import Backend
from dataparallel.torch import ZeroRedundancyOptimizer

SCRIPT = Path(__file__).parent / "scripts" / "zero_overlap_finalize.py"


class Tied(nn.Module):
    """`b` and `c` share one weight: two modules hold the same parameter."""

    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(4)
        self.a = nn.Linear(5, 8)
        self.b = nn.Linear(8, 8)
        self.c = nn.Linear(8, 8)
        self.c.weight = self.b.weight
        self.d = nn.Linear(8, 3)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.d(torch.tanh(self.c(torch.tanh(self.b(torch.tanh(self.a(x)))))))


def frozen_middle() -> nn.Module:
    """Its middle layer is frozen and outside the optimizer (`stepped` leaves it out)."""
    model = make_model(seed=5)
    model[2].requires_grad_(False)
    return model


MODELS = {
    "sequential": make_model,
    "reordered": lambda: Reversed(seed=3),
    "tied": Tied,
    "module-outside": frozen_middle,
}


def stepped(model: nn.Module) -> list[nn.Parameter]:
    return [p for p in model.parameters() if p.requires_grad]


def pair(
    make: Any, stage: int, on_wrapper: bool = False, **kw: Any
) -> tuple[nn.Module, nn.Module, ZeroRedundancyOptimizer, nn.Module, nn.Module, Any]:
    """Two copies: (model, net, optimizer with the overlap, plain model, plain net, plain
    optimizer); `net` is what runs the forward (the wrapper at stage 1)."""
    model = make()
    plain = copy.deepcopy(model)
    net = dp.torch.DataParallelModel(model) if stage == 1 else model
    plain_net = dp.torch.DataParallelModel(plain) if stage == 1 else plain
    options: dict[str, Any] = {"stage": stage, "lr": 0.01, **kw}
    opt = ZeroRedundancyOptimizer(
        stepped(model),
        torch.optim.Adam,
        overlap_with_forward=net if on_wrapper else model,
        **options,
    )
    plain_opt = ZeroRedundancyOptimizer(
        stepped(plain), torch.optim.Adam, **{**options, "bucket_bytes": opt.bucket_bytes}
    )
    return model, net, opt, plain, plain_net, plain_opt


def per_bucket(*opts: ZeroRedundancyOptimizer) -> None:
    """One call per bucket (Gloo merges them into one): the calls land one by one."""
    for opt in opts:
        opt._merge_bytes = 0  # read when the exchange is planned, at the first step


def one_step(net: nn.Module, opt: torch.optim.Optimizer, step: int) -> None:
    x, y = global_batch(step)
    opt.zero_grad()
    loss_of(net, share(x), share(y)).backward()
    opt.step()


def assert_in_flight(opt: ZeroRedundancyOptimizer) -> None:
    """`step()` returned with the exchange started and not landed (where there is one)."""
    assert opt._forward is not None
    assert (opt._forward._gather is not None) == (dp.size() > 1)


def assert_same(got: dict[str, torch.Tensor], want: dict[str, torch.Tensor], stage: int) -> None:
    assert got.keys() == want.keys()
    for key, value in want.items():
        if stage == 1:
            torch.testing.assert_close(got[key], value, atol=0, rtol=0)
        else:
            torch.testing.assert_close(got[key], value, atol=1e-6, rtol=1e-6)


@pytest.mark.matrix
@pytest.mark.parametrize("make", sorted(MODELS))
@pytest.mark.parametrize("stage", [1, 2])
@pytest.mark.parametrize("bucket_bytes", [64, None], ids=["small-buckets", "default-buckets"])
@pytest.mark.parametrize("staged", [False, True], ids=["host", "staged"])
@pytest.mark.parametrize("calls", ["engines", "per-bucket"])
def test_overlapped_steps_end_where_blocking_ones_do(
    make: str, stage: int, bucket_bytes: int | None, staged: bool, calls: str, world: Backend
) -> None:
    model, net, opt, plain, plain_net, plain_opt = pair(
        MODELS[make], stage, bucket_bytes=bucket_bytes, _staged=staged
    )
    if calls == "per-bucket":
        per_bucket(opt, plain_opt)
    if bucket_bytes == 64:
        assert len(opt._buckets) >= 3  # several buckets: some land before others
    for step in range(6):
        one_step(net, opt, step)
        assert_in_flight(opt)
        one_step(plain_net, plain_opt, step)
    assert_same(model.state_dict(), plain.state_dict(), stage)  # the pre-hook lands them
    assert opt._forward is not None and opt._forward._gather is None
    assert_same_on_every_rank(list(model.parameters()))


@pytest.mark.parametrize("stage", [1, 2])
def test_each_module_waits_for_its_own_buckets_only(stage: int, world: Backend) -> None:
    """The first layer's pre-hook lands its bucket and leaves the later layers' in flight."""
    model, net, opt, plain, plain_net, plain_opt = pair(make_model, stage, bucket_bytes=64)
    per_bucket(opt)
    one_step(net, opt, 0)
    one_step(plain_net, plain_opt, 0)
    assert opt._forward is not None
    first = opt._forward.modules[0]
    assert first[0] is model[0]
    seen: list[bool] = []

    def after_first(*_: object) -> None:
        gather = opt._forward._gather if opt._forward is not None else None
        seen.append(gather is not None and gather.in_flight)
        for p, q in zip(model[0].parameters(), plain[0].parameters(), strict=True):
            torch.testing.assert_close(p.detach(), q.detach(), atol=1e-6, rtol=1e-6)

    handle = model[0].register_forward_pre_hook(after_first)  # runs after the overlap's
    try:
        net(share(global_batch(1)[0]))
    finally:
        handle.remove()
    assert seen == [dp.size() > 1]  # the later layers' buckets were still in flight
    assert opt._forward._gather is None  # ... and landed by the end of the forward


@pytest.mark.parametrize("stage", [1, 2])
def test_model_state_dict_and_checkpoints_right_after_step_see_the_update(
    stage: int, world: Backend
) -> None:
    model, net, opt, plain, plain_net, plain_opt = pair(make_model, stage, bucket_bytes=64)
    for step in range(3):
        one_step(net, opt, step)
        one_step(plain_net, plain_opt, step)
    assert_same(model.state_dict(), plain.state_dict(), stage)
    one_step(net, opt, 3)
    one_step(plain_net, plain_opt, 3)
    assert_in_flight(opt)
    opt.consolidate_state_dict(to=0)  # lands the exchange first
    plain_opt.consolidate_state_dict(to=0)
    assert_same(model.state_dict(), plain.state_dict(), stage)
    if dp.rank() == 0:
        got, want = opt.state_dict()["state"], plain_opt.state_dict()["state"]
        for k, entry in want.items():
            for key, value in entry.items():
                torch.testing.assert_close(got[k][key], value, atol=0, rtol=0)


def test_a_model_state_loaded_right_after_step_is_not_overwritten(world: Backend) -> None:
    """`model.load_state_dict` between `step()` and the next forward: the exchange in flight
    lands before it (load pre-hook), not over it."""
    model, net, opt, _, _, _ = pair(make_model, 1, bucket_bytes=64)
    saved = {k: v.clone() for k, v in model.state_dict().items()}
    one_step(net, opt, 0)
    assert_in_flight(opt)
    model.load_state_dict(saved)
    net(share(global_batch(1)[0]))  # were anything still in flight, it would land here
    assert_same(model.state_dict(), saved, 1)


@pytest.mark.parametrize("stage", [1, 2])
def test_every_entry_point_of_the_optimizer_lands_the_exchange(stage: int, world: Backend) -> None:
    model, net, opt, plain, plain_net, plain_opt = pair(make_model, stage, bucket_bytes=64)
    entries = [
        lambda: opt.step(),  # a step without a forward in between (stage 1: the same grads)
        lambda: opt.state_bytes,
        lambda: opt.gradient_bytes,
        lambda: dp.wait_all(),  # as dp.finalize() does: the exchange is a request in flight
        lambda: opt.add_param_group({"params": [torch.nn.Parameter(torch.zeros(3))]}),
    ]
    if stage == 2:
        entries = entries[1:]  # stage 2 steps once a backward pass
    for step, entry in enumerate(entries):
        one_step(net, opt, step)
        one_step(plain_net, plain_opt, step)
        assert_in_flight(opt)
        entry()
        if stage == 1 and step == 0:
            plain_opt.step()  # had the first exchange landed after it, the values would be stale
            assert_same(model.state_dict(), plain.state_dict(), stage)
            continue
        assert opt._forward is not None and opt._forward._gather is None
        for p, q in zip(model.parameters(), plain.parameters(), strict=True):
            torch.testing.assert_close(p.detach(), q.detach(), atol=1e-6, rtol=1e-6)
    assert not [r for r in dp.world.current().pending if type(r).__name__ == "ForwardOverlap"]


@pytest.mark.parametrize("stage", [1, 2])
def test_collectives_between_step_and_the_forward(stage: int, world: Backend) -> None:
    """The user's own collectives while the exchange is in flight (every rank makes them in the
    same order after the same `step()`): both complete, the training is unchanged."""
    model, net, opt, plain, plain_net, plain_opt = pair(make_model, stage, bucket_bytes=64)
    for step in range(3):
        one_step(net, opt, step)
        assert_in_flight(opt)
        total = dp.allreduce(np.full(3, float(dp.rank())), op="sum")
        np.testing.assert_array_equal(total, np.full(3, dp.size() * (dp.size() - 1) / 2))
        dp.barrier()
        one_step(plain_net, plain_opt, step)
    assert_same(model.state_dict(), plain.state_dict(), stage)


def test_clip_grad_norm_after_an_overlapped_step(world: Backend) -> None:
    model, net, opt, plain, plain_net, plain_opt = pair(make_model, 2, bucket_bytes=64)
    for step in range(4):
        for n, o in ((net, opt), (plain_net, plain_opt)):
            x, y = global_batch(step)
            o.zero_grad()
            loss_of(n, share(x), share(y)).backward()
            norm = o.clip_grad_norm_(0.05)
            o.step()
        assert norm > 0
    assert_same(model.state_dict(), plain.state_dict(), 2)


def test_the_overlap_may_be_given_the_wrapper(world: Backend) -> None:
    model, net, opt, plain, plain_net, plain_opt = pair(make_model, 1, on_wrapper=True)
    for step in range(3):
        one_step(net, opt, step)
        one_step(plain_net, plain_opt, step)
    assert_same(model.state_dict(), plain.state_dict(), 1)


@pytest.mark.parametrize("stage", [1, 2])
def test_the_overlap_keeps_the_layout_and_the_calls(stage: int, world: Backend) -> None:
    """Only where the calls are waited for changes (benchmarks/zero.py: more, smaller calls
    were slower on Gloo)."""
    _, _, opt, _, _, plain_opt = pair(make_model, stage)
    assert opt.bucket_bytes == plain_opt.bucket_bytes
    assert opt._merge_bytes == plain_opt._merge_bytes


def test_a_model_without_the_optimizers_parameters_is_refused(world: Backend) -> None:
    model, other = make_model(), make_model()
    with pytest.raises(ValueError, match="holds none of the optimizer's parameters"):
        ZeroRedundancyOptimizer(model.parameters(), torch.optim.Adam, overlap_with_forward=other)
    with pytest.raises(TypeError, match=r"torch.nn.Module"):
        ZeroRedundancyOptimizer(
            model.parameters(),
            torch.optim.Adam,
            overlap_with_forward=model.parameters(),  # type: ignore[arg-type]
        )


@pytest.mark.spawns
@pytest.mark.parametrize(
    ("backend", "ranks", "cases"),
    # Each engine lands both stages, one of them staged: every stage and every way of copying
    # is landed on some engine, and each engine lands both kinds of exchange; MPI at 3 ranks
    # (uneven shards), Gloo at 2.
    [("mpi", 3, ["1:0", "2:1"]), ("gloo", 2, ["1:1", "2:0"])],
)
def test_finalize_lands_the_exchange_in_flight(backend: str, ranks: int, cases: list[str]) -> None:
    """`dp.finalize()` right after `step()`: the parameters are the updated ones afterwards."""
    result = run_job([SCRIPT, *cases], ranks=ranks, backend=backend, job_timeout=240, timeout=300)
    assert result.returncode == 0, result.stdout + result.stderr
    for case in cases:
        stage, staged = case.split(":")
        landed = f"landed {stage} {bool(int(staged))}"
        assert result.stdout.count(landed) == ranks, result.stdout + result.stderr

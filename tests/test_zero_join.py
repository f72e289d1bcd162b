"""`dp.torch.ZeroRedundancyOptimizer` under `dp.torch.join` (uneven data), at any world size.

Rank r trains on `BASE + r` batches of its own. While any rank still trains, the ranks that ran
out shadow every step: the final parameters must be the same on every rank and equal those of
a run without join in which a rank out of data contributes zero gradients to an average over
the whole world (Horovod's and `dp.join`'s rule), computed here in one process, and (stage 1)
exactly those of the unsharded `dp.DistributedOptimizer` under `dp.torch.join`. Values from the
other ranks are gathered with `dp.allgather_object` before asserting.
"""

from __future__ import annotations

from collections.abc import Callable

import numpy as np
import pytest
import torch
from _torch_common import (
    Branchy,
    assert_same_on_every_rank,
    global_batch,
    loss_of,
    make_model,
)
from torch import nn

import dataparallel as dp
from dataparallel.errors import CollectiveMismatchError, RankJoinedError
from dataparallel.torch import ZeroRedundancyOptimizer

BASE = 2  # batches of rank 0; rank r has BASE + r
MAX_NORM = 0.05  # small enough that every step clips


def counts(size: int) -> list[int]:
    return [BASE + r for r in range(size)]


def batch(rank: int, step: int, part: int) -> tuple[torch.Tensor, torch.Tensor]:
    return global_batch(step, seed=7000 + 100 * rank + 10 * part)


def train(
    model: nn.Module,
    opt: torch.optim.Optimizer,
    rank: int,
    *,
    passes: int = 1,
    clip: bool = False,
) -> None:
    """This rank's steps (`passes` backward passes each, the loss scaled by 1 / passes), with a
    metric reduced between backward and the step (joined ranks answer it with zeros)."""
    for step in range(counts(dp.size())[rank]):
        opt.zero_grad()
        for part in range(passes):
            loss = loss_of(model, *batch(rank, step, part)) / passes
            loss.backward()
        live = sum(step < c for c in counts(dp.size()))
        assert dp.allreduce(1.0) == live  # the joined ranks give 0
        if clip:
            assert isinstance(opt, ZeroRedundancyOptimizer)
            opt.clip_grad_norm_(MAX_NORM)
        opt.step()


def reference(size: int, *, passes: int = 1, clip: bool = False) -> list[torch.Tensor]:
    """One process: every rank's gradients, zeros once its data ends, averaged over `size`."""
    model = make_model()
    opt = torch.optim.Adam(model.parameters(), lr=0.01)
    every = counts(size)
    for step in range(max(every)):
        total = [torch.zeros_like(p) for p in model.parameters()]
        for r in range(size):
            for part in range(passes if step < every[r] else 0):
                model.zero_grad()
                (loss_of(model, *batch(r, step, part)) / passes).backward()
                total = [t + p.grad for t, p in zip(total, model.parameters(), strict=True)]
        for p, t in zip(model.parameters(), total, strict=True):
            p.grad = t / size
        if clip:
            torch.nn.utils.clip_grad_norm_(model.parameters(), MAX_NORM)
        opt.step()
    return [p.detach() for p in model.parameters()]


def zero_run(
    rank: int,
    stage: int,
    *,
    passes: int = 1,
    clip: bool = False,
    staged: bool = False,
    overlap: bool = False,
) -> tuple[nn.Module, ZeroRedundancyOptimizer, int | None]:
    """`overlap`: the exchange lands in the next forward, which a joined rank never runs (the
    block's end lands it: the parameters are read right after)."""
    model = make_model()
    opt = ZeroRedundancyOptimizer(
        model.parameters(),
        torch.optim.Adam,
        stage=stage,
        lr=0.01,
        _staged=staged,
        overlap_with_forward=model if overlap else None,
    )
    if stage == 1:
        net: nn.Module = dp.torch.DataParallelModel(model)
        block = dp.torch.join(net, opt)
    else:
        net = model
        block = dp.torch.join(opt)
    with block as joined:
        train(net, opt, rank, passes=passes, clip=clip)
    assert dp.wait_all() == []  # nothing left in flight: the parameters are current
    return model, opt, joined.last


@pytest.mark.parametrize(
    ("stage", "passes", "clip", "staged", "overlap"),
    [
        (1, 1, False, False, False),
        (1, 1, True, False, False),
        (2, 1, False, False, False),
        (2, 2, True, False, False),
        (1, 1, False, True, False),
        (2, 2, False, True, False),
        (1, 1, True, False, True),
        (2, 2, False, False, True),
    ],
    ids=[
        "stage1",
        "stage1-clip",
        "stage2",
        "stage2-accumulate-clip",
        "stage1-staged",
        "stage2-accumulate-staged",
        "stage1-clip-overlapped",
        "stage2-accumulate-overlapped",
    ],
)
def test_joined_ranks_shadow_every_step(
    rank: int, size: int, stage: int, passes: int, clip: bool, staged: bool, overlap: bool
) -> None:
    """`staged`: the GPU path (every engine call through host buffers), on CPU parameters;
    `overlap`: `overlap_with_forward=`."""
    model, opt, last = zero_run(
        rank, stage, passes=passes, clip=clip, staged=staged, overlap=overlap
    )
    params = list(model.parameters())
    assert_same_on_every_rank(params)
    tol = 1e-6 if stage == 1 else 1e-5
    for got, want in zip(params, reference(size, passes=passes, clip=clip), strict=True):
        torch.testing.assert_close(got.detach(), want, atol=tol, rtol=tol)
    assert dp.allgather_object(last) == [size - 1] * size
    # After the block: the state consolidates, every rank having stepped every step.
    opt.consolidate_state_dict(to=0)
    if rank == 0:
        state = opt.state_dict()["state"]
        assert len(state) == len(params)
        assert {float(s["step"]) for s in state.values()} == {float(max(counts(size)))}
        for index, p in enumerate(params):
            assert state[index]["exp_avg"].shape == p.shape


def test_stage_one_matches_the_unsharded_optimizer_under_join_exactly(rank: int, size: int) -> None:
    model, _, _ = zero_run(rank, 1)
    plain = make_model()
    opt = dp.DistributedOptimizer(torch.optim.Adam(plain.parameters(), lr=0.01))
    with dp.torch.join(opt) as joined:
        train(plain, opt, rank)
    # The unsharded run's joined ranks stop stepping: the rank that left last has the result.
    assert joined.last is not None
    want = dp.broadcast_object([p.detach() for p in plain.parameters()], root=joined.last)
    for got, expected in zip(model.parameters(), want, strict=True):
        np.testing.assert_array_equal(got.detach().numpy(), expected.numpy())


def against_unsharded(
    make: Callable[[], nn.Module],
    rank: int,
    stage: int,
    loss: Callable[[nn.Module, int], torch.Tensor],
) -> tuple[nn.Module, list[torch.Tensor]]:
    """Train `make()` sharded at `stage` under `dp.torch.join` (`loss(net, step)` each step),
    then unsharded (`dp.DistributedOptimizer`): return the sharded model and the unsharded
    result of the rank that joined last (the joined ranks of the unsharded run stop stepping)."""

    def run(opt: torch.optim.Optimizer, net: nn.Module, *joinables: object) -> int | None:
        with dp.torch.join(*joinables) as joined:  # type: ignore[arg-type]
            for step in range(counts(dp.size())[rank]):
                opt.zero_grad()
                loss(net, step).backward()
                opt.step()
        return joined.last

    model = make()
    opt = ZeroRedundancyOptimizer(model.parameters(), torch.optim.Adam, stage=stage, lr=0.01)
    if stage == 1:
        net = dp.torch.DataParallelModel(model)
        run(opt, net, net, opt)
    else:
        run(opt, model, opt)
    plain = make()
    unsharded = dp.DistributedOptimizer(torch.optim.Adam(plain.parameters(), lr=0.01))
    last = run(unsharded, plain, unsharded)
    assert last is not None
    return model, dp.broadcast_object([p.detach() for p in plain.parameters()], root=last)


class Mixed(nn.Module):
    """A bfloat16 layer between float32 ones."""

    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.a, self.b, self.c = nn.Linear(5, 8), nn.Linear(8, 8).bfloat16(), nn.Linear(8, 3)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.c(torch.tanh(self.b(torch.tanh(self.a(x)).bfloat16())).float())


@pytest.mark.parametrize("stage", [1, 2])
def test_bfloat16_parameters_beside_float32_ones(rank: int, size: int, stage: int) -> None:
    """The joined ranks' zero gradients take each parameter's dtype (`TorchFamily.adopt`), and
    the result is the unsharded optimizer's under join."""

    def loss(net: nn.Module, step: int) -> torch.Tensor:
        x, y = batch(rank, step, 0)
        return (net(x) - y).square().mean()

    model, want = against_unsharded(Mixed, rank, stage, loss)
    params = list(model.parameters())
    assert_same_on_every_rank([p.detach().float() for p in params])  # NumPy has no bfloat16
    assert model.b.weight.dtype == torch.bfloat16
    for got, expected in zip(params, want, strict=True):
        tol = 1e-2 if got.dtype == torch.bfloat16 else 1e-5
        torch.testing.assert_close(got.detach(), expected, atol=tol, rtol=tol)


def test_a_stage_one_optimizer_left_out_of_the_block_fails_on_every_rank(
    rank: int, size: int
) -> None:
    model = make_model()
    net = dp.torch.DataParallelModel(model)
    opt = ZeroRedundancyOptimizer(model.parameters(), torch.optim.Adam, lr=0.01)
    error: BaseException | None = None
    try:
        with dp.torch.join(net):  # the optimizer is not given
            train(net, opt, rank)
    except RankJoinedError as raised:
        error = raised
    raised_on = dp.allgather_object(error is not None)  # the world is usable afterwards
    assert raised_on == [size > 1] * size
    if error is not None:
        assert "dp.torch.join(model, optimizer)" in str(error)


def test_stage_one_alone_in_a_block_is_refused(rank: int, size: int) -> None:
    model = make_model()
    opt = ZeroRedundancyOptimizer(model.parameters(), torch.optim.Adam, lr=0.01)
    with pytest.raises(ValueError, match=r"dp.torch.join\(model, optimizer\)"):
        dp.torch.join(opt)
    # A wrapper over other parameters is not the one.
    other = dp.torch.DataParallelModel(make_model(seed=1))
    with pytest.raises(ValueError, match="DataParallelModel over its parameters"):
        dp.torch.join(other, opt)


@pytest.mark.parametrize("stage", [1, 2])
def test_parameters_some_or_no_rank_uses_match_the_unsharded_optimizer(
    rank: int, size: int, stage: int
) -> None:
    """`Branchy`: `b` gets gradients on rank 0 only (the first to join), `unused` on none; a
    parameter no working rank gave a gradient is skipped (Adam keeps it), as unsharded."""

    def loss(net: nn.Module, step: int) -> torch.Tensor:
        return net(batch(rank, step, 0)[0][:, :4]).square().mean()

    model, want = against_unsharded(Branchy, rank, stage, loss)
    params = list(model.parameters())
    assert_same_on_every_rank(params)
    tol = 0.0 if stage == 1 else 1e-5
    for got, expected in zip(params, want, strict=True):
        torch.testing.assert_close(got.detach(), expected, atol=tol, rtol=tol)
    torch.testing.assert_close(model.unused.weight.detach(), Branchy().unused.weight.detach())


def test_a_pass_too_many_while_a_rank_has_joined_fails_on_the_working_ranks(
    rank: int, size: int
) -> None:
    """Rank 0 has joined; at the same step rank 2 runs two passes where rank 1 steps: both get
    `CollectiveMismatchError` (their handshakes differ), the joined rank keeps answering, and
    after `zero_grad()` everyone goes on to the end with the same parameters."""
    if size != 3:
        pytest.skip("needs a joined rank and two working ones: 3 ranks")
    model = make_model()
    opt = ZeroRedundancyOptimizer(model.parameters(), torch.optim.Adam, stage=2, lr=0.01)
    errors = []
    with dp.torch.join(opt) as joined:
        for step in range(counts(size)[rank]):
            opt.zero_grad()
            try:
                for part in range(2 if (rank, step) == (2, BASE) else 1):
                    loss_of(model, *batch(rank, step, part)).backward()
                opt.step()
            except CollectiveMismatchError as error:
                errors.append((step, str(error)))
                opt.zero_grad()
    assert joined.last == 2
    assert [step for step, _ in errors] == ([BASE] if rank > 0 else [])
    for _, message in errors:
        assert "pass" in message and "step" in message
    assert_same_on_every_rank(list(model.parameters()))

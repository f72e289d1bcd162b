"""Error feedback for compressed gradient reductions (`dp.Compression.fp16_feedback`,
`.bf16_feedback`, `torch/_feedback.py`): each rank keeps what rounding to 16 bits took from each
gradient and adds it at the next step, so what was sent tracks what was computed (issue 24)."""

from __future__ import annotations

from typing import Any

import pytest
import torch
from _torch_common import assert_same_on_every_rank, resumable, through_disk, train_own_rows
from torch import nn

import dataparallel as dp
from dataparallel.torch._feedback import ErrorFeedback

STEPS = 64


def test_the_residual_is_what_rounding_dropped_and_is_added_next_time() -> None:
    feedback = ErrorFeedback("bfloat16")
    grad = torch.full((3,), 1 + 2**-9)  # bfloat16 rounds it to 1.0
    feedback.apply(0, grad)
    torch.testing.assert_close(grad, torch.full((3,), 1 + 2**-9), rtol=0, atol=0)
    torch.testing.assert_close(feedback.residuals[0], torch.full((3,), 2**-9), rtol=0, atol=0)
    second = torch.full((3,), 1 + 2**-9)
    feedback.apply(0, second)  # 1 + 2**-8 now: still rounds to 1.0, residual 2**-8
    torch.testing.assert_close(second, torch.full((3,), 1 + 2**-8), rtol=0, atol=0)
    torch.testing.assert_close(feedback.residuals[0], torch.full((3,), 2**-8), rtol=0, atol=0)


def test_what_fp16_cannot_hold_carries_nothing() -> None:
    feedback = ErrorFeedback("float16")
    grad = torch.tensor([1e6, 1.0, torch.inf])
    feedback.apply(0, grad)
    assert torch.equal(feedback.residuals[0], torch.zeros(3))  # no inf, no nan carried
    integers = torch.ones(3, dtype=torch.int64)
    feedback.apply(1, integers)  # travels as it is
    assert 1 not in feedback.residuals


class _Scaled(nn.Module):
    """loss = sum(w * c): the gradient is `c` at every step, on every rank."""

    def __init__(self) -> None:
        super().__init__()
        self.w = nn.Parameter(torch.zeros(8))

    def forward(self, c: torch.Tensor) -> torch.Tensor:
        return (self.w * c).sum()


def _drift(compression: Any, face: str) -> float:
    """How far `STEPS` SGD steps of lr 1 end from where the uncompressed gradients lead."""
    model = _Scaled()
    opt: Any = torch.optim.SGD(model.parameters(), lr=1.0)
    if face == "model":
        net: nn.Module = dp.torch.DataParallelModel(model, compression=compression)
    else:
        net, opt = model, dp.DistributedOptimizer(opt, compression=compression)
    # Rank 0 computes 1 + 2**-9 (bfloat16 sends 1.0 without feedback), the others 0: the
    # 16-bit sum then adds exact zeros, so only rank 0's own rounding is measured, at any size.
    c = torch.full((8,), 1 + 2**-9 if dp.rank() == 0 else 0.0)
    for _ in range(STEPS):
        opt.zero_grad()
        net(c).backward()
        opt.step()
    assert_same_on_every_rank([model.w.detach()])
    return float((model.w.detach() + STEPS * (1 + 2**-9) / dp.size()).abs().max())


@pytest.mark.heavy
@pytest.mark.parametrize("face", ["optimizer", "model"])
def test_feedback_sends_what_was_computed_over_the_steps(face: str) -> None:
    """Without feedback every step loses 2**-9 the same way (64 steps: 0.125, averaged over the
    ranks); with it, what was sent differs from what was computed by one residual, not by 64."""
    lost = _drift(dp.Compression.bf16, face)
    assert lost == pytest.approx(STEPS * 2**-9 / dp.size(), rel=1e-3)  # float32's own rounding
    kept = _drift(dp.Compression.bf16_feedback, face)
    assert kept <= 2**-8 / dp.size() + 1e-4, (kept, lost)  # one residual, below 2**-8


def _regression(compression: Any, steps: int = 60) -> float:
    """Least squares, 16 features, each rank its own rows; the loss over every rank's rows."""
    g = torch.Generator().manual_seed(7)
    truth = torch.randn(16, generator=g)
    x = torch.randn(32 * dp.size(), 16, generator=g)
    y = x @ truth
    mine = slice(32 * dp.rank(), 32 * (dp.rank() + 1))
    model = nn.Linear(16, 1, bias=False)
    nn.init.zeros_(model.weight)
    opt = dp.DistributedOptimizer(
        torch.optim.SGD(model.parameters(), lr=0.05), compression=compression
    )
    for _ in range(steps):
        opt.zero_grad()
        ((model(x[mine]).squeeze(1) - y[mine]) ** 2).mean().backward()
        opt.step()
    with torch.no_grad():
        return float(((model(x).squeeze(1) - y) ** 2).mean())


@pytest.mark.heavy
@pytest.mark.parametrize("wire", ["fp16", "bf16"])
def test_training_converges_no_worse_with_feedback(wire: str) -> None:
    plain = _regression(getattr(dp.Compression, wire))
    fed = _regression(getattr(dp.Compression, f"{wire}_feedback"))
    full = _regression(None)
    start = _regression(None, steps=0)
    assert fed < start / 100  # it trained
    assert fed <= plain * 1.05 + 1e-6, (fed, plain, full)


def test_calls_that_keep_no_state_refuse_feedback() -> None:
    with pytest.raises(TypeError, match=r"FP16FeedbackCompressor keeps each gradient's rounding"):
        dp.allreduce(torch.ones(3), op="avg", compression=dp.Compression.fp16_feedback)
    with pytest.raises(TypeError, match=r"use dp.Compression.bf16 \(no feedback\)"):
        dp.allreduce_gradients([torch.ones(3)], compression=dp.Compression.bf16_feedback)


# --- the residuals in checkpoints and elastic commits -----------------------------------------

RESUME_STEPS = 6  # the run is interrupted after half of them


def _resumable(face: str, wire: str) -> tuple[nn.Module, nn.Module, Any]:
    """A model (the same on every rank), what runs it, and its Adam, compressed with feedback."""
    return resumable(face, getattr(dp.Compression, f"{wire}_feedback"), (6, 5, 2))


def _params(model: nn.Module) -> list[torch.Tensor]:
    return [p.detach().clone() for p in model.parameters()]


@pytest.mark.spread
@pytest.mark.parametrize("wire", ["fp16", "bf16"])
@pytest.mark.parametrize("face", ["optimizer", "model"])
def test_a_resumed_run_equals_an_uninterrupted_one_bit_for_bit(face: str, wire: str) -> None:
    """Each rank saves its own checkpoint (model, optimizer: the residuals ride in the one whose
    reduction keeps them) halfway, a new model, wrapper and optimizer load it and go on; they end
    where the run that was never interrupted ends, bit for bit, on every rank."""
    model, net, opt = _resumable(face, wire)
    train_own_rows(net, opt, range(RESUME_STEPS))
    uninterrupted = _params(model)

    model, net, opt = _resumable(face, wire)
    train_own_rows(net, opt, range(RESUME_STEPS // 2))
    saved = through_disk(net, opt)
    keeper = saved[0] if face == "model" else saved[1]
    key = "_error_feedback" if face == "model" else "error_feedback"
    assert (keeper[key]["rank"], keeper[key]["size"]) == (dp.rank(), dp.size())
    reducer = net if face == "model" else opt
    assert sorted(keeper[key]["residuals"]) == sorted(n for n, _ in reducer.gradient_sync._params)

    def resume(state: list[Any]) -> list[torch.Tensor]:
        model, net, opt = _resumable(face, wire)
        train_own_rows(net, opt, range(1))  # a new run's residuals, which the checkpoint replaces
        net.load_state_dict(state[0])
        opt.load_state_dict(state[1])
        train_own_rows(net, opt, range(RESUME_STEPS // 2, RESUME_STEPS))
        return _params(model)

    for resumed, reference in zip(resume(saved), uninterrupted, strict=True):
        assert torch.equal(resumed, reference)
    del keeper[key]  # without the residuals (the checkpoints before), the run goes elsewhere
    lost = resume(saved)
    assert any(not torch.equal(a, b) for a, b in zip(lost, uninterrupted, strict=True))
    assert_same_on_every_rank(lost)


def test_another_ranks_residuals_are_not_taken() -> None:
    """A checkpoint saved by one rank and loaded on every rank: the others start from zero
    residuals (another rank's are what its rounding dropped); a plain optimizer and the bare
    module load the state as torch's; a residual that fits no parameter is named."""
    model, net, opt = _resumable("optimizer", "bf16")
    train_own_rows(net, opt, range(2))
    state = dp.broadcast_object(opt.state_dict(), root=0)
    assert opt.gradient_sync._feedback is not None
    opt.load_state_dict(state)
    kept = opt.gradient_sync._feedback.residuals
    assert bool(kept) == (dp.rank() == 0)
    plain = torch.optim.Adam(model.parameters(), lr=0.01)
    plain.load_state_dict(state)  # the extra key is ignored by torch
    assert set(plain.state_dict()) == {"state", "param_groups"}
    state["error_feedback"]["residuals"]["param_groups[0]['params'][0]"] = torch.zeros(3)
    state["error_feedback"]["rank"] = dp.rank()
    with pytest.raises(ValueError, match=r"residual of \"param_groups\[0\]\['params'\]\[0\]\""):
        opt.load_state_dict(state)

    model, net, opt = _resumable("model", "fp16")
    train_own_rows(net, opt, range(1))
    parent = nn.ModuleDict({"net": net})
    nested = parent.state_dict()
    assert "net._error_feedback" in nested
    parent.load_state_dict(nested)  # strict: the residuals are taken out, the rest loads
    bare = dict(net.state_dict())
    del bare["_error_feedback"]
    model.load_state_dict(bare)


def test_elastic_state_keeps_each_ranks_residuals() -> None:
    """`TorchState`: `sync()` gives every rank rank 0's parameters but leaves each its own
    residuals; a reducer carried over to a new world (`rebind_world`) keeps them; `restore()`
    rolls them back to the commit, bit for bit."""
    for face in ("optimizer", "model"):
        _, net, opt = _resumable(face, "bf16")
        state = dp.elastic.TorchState(net, opt)
        train_own_rows(net, opt, range(2))
        reducer = net if face == "model" else opt
        state.commit()
        committed = {i: r.clone() for i, r in reducer.gradient_sync._feedback.residuals.items()}
        train_own_rows(net, opt, range(2, 3))
        ahead = {i: r.clone() for i, r in reducer.gradient_sync._feedback.residuals.items()}
        assert any(not torch.equal(ahead[i], committed[i]) for i in committed)
        state.sync()
        reducer.rebind_world()  # as after a re-form
        now = reducer.gradient_sync._feedback.residuals
        assert sorted(now) == sorted(ahead)
        assert all(torch.equal(now[i], ahead[i]) for i in ahead)
        if dp.size() > 1:  # each rank's own, not rank 0's
            others = dp.allgather_object([r.tolist() for _, r in sorted(now.items())])
            assert len({str(o) for o in others}) == dp.size()
        state.restore()
        now = reducer.gradient_sync._feedback.residuals
        assert sorted(now) == sorted(committed)
        assert all(torch.equal(now[i], committed[i]) for i in committed)

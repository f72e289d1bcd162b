"""`ZeroRedundancyOptimizer.clip_grad_norm_` with a NaN or an infinity in one rank's gradient.

One rank's gradient holds the value at one item (a tensor hook, before the reduction); the
single-process reference has it at the same item of the averaged gradient, where it stays NaN
or infinite. The sharded norm must be torch's (`torch.nn.utils.clip_grad_norm_`): NaN wherever
one item is NaN, whichever rank's slice holds it; the gradients scaled as torch scales them (by
NaN when the norm is NaN), so the parameters after the step are the reference's; and
`error_if_nonfinite=True` raises on every rank, decided from the reduced norm. Under several
ranks every rank draws the same examples (`derandomize=True`, `conftest.py`).
"""

from __future__ import annotations

import copy
import math

import pytest
import torch
from _torch_common import assert_same_on_every_rank, global_batch, loss_of, make_model, share
from hypothesis import given, settings
from hypothesis import strategies as st
from torch import nn

import dataparallel as dp
from dataparallel.backends.base import Backend
from dataparallel.torch import ZeroRedundancyOptimizer

INF = float("inf")
NORMS = [2.0, INF, 1.0, 3.0, 0.0, -1.0, -INF]
VALUES = [math.nan, INF, -INF]


def poisoned(
    stage: int, param: int, item: int, rank: int, value: float
) -> tuple[nn.Module, ZeroRedundancyOptimizer, nn.Module, torch.optim.Optimizer]:
    """A model and its ZeRO optimizer after backward on this rank's share, `rank`'s gradient
    of parameter `param` holding `value` at `item`; the reference after backward on the whole
    batch, its gradient holding `value` there too."""
    model = make_model()
    reference = copy.deepcopy(model)
    ref_opt = torch.optim.Adam(reference.parameters(), lr=0.01)
    opt = ZeroRedundancyOptimizer(
        model.parameters(), torch.optim.Adam, stage=stage, bucket_bytes=64, lr=0.01
    )
    net = dp.torch.DataParallelModel(model) if stage == 1 else model
    target = list(model.parameters())[param]
    at = item % target.numel()

    def poison(grad: torch.Tensor) -> torch.Tensor:
        grad = grad.clone()
        grad.view(-1)[at] = value
        return grad

    if dp.rank() == rank:
        target.register_hook(poison)
    x, y = global_batch(0)
    opt.zero_grad()
    loss_of(net, share(x), share(y)).backward()
    ref_opt.zero_grad()
    loss_of(reference, x, y).backward()
    with torch.no_grad():
        list(reference.parameters())[param].grad.view(-1)[at] = value  # type: ignore[union-attr]
    return model, opt, reference, ref_opt


def check_like_torch(
    stage: int, norm_type: float, param: int, item: int, rank: int, value: float, max_norm: float
) -> None:
    model, opt, reference, ref_opt = poisoned(stage, param, item, rank, value)
    norm = opt.clip_grad_norm_(max_norm, norm_type=norm_type)
    want = torch.nn.utils.clip_grad_norm_(reference.parameters(), max_norm, norm_type=norm_type)
    torch.testing.assert_close(norm, want, atol=1e-6, rtol=1e-5, equal_nan=True)
    opt.step()
    ref_opt.step()
    for got, expected in zip(model.parameters(), reference.parameters(), strict=True):
        torch.testing.assert_close(got, expected, atol=1e-5, rtol=1e-5, equal_nan=True)
    assert_same_on_every_rank(list(model.parameters()))


@pytest.mark.parametrize("stage", [1, 2])
@pytest.mark.parametrize("norm_type", [2.0, INF], ids=["norm-2", "norm-inf"])
def test_a_nan_in_the_last_ranks_last_slice_makes_the_norm_and_every_parameter_nan(
    stage: int, norm_type: float, world: Backend
) -> None:
    last = len(list(make_model().parameters())) - 1
    check_like_torch(stage, norm_type, last, -1, world.size - 1, math.nan, 1.0)
    model, opt, _, _ = poisoned(stage, last, -1, world.size - 1, math.nan)
    assert math.isnan(float(opt.clip_grad_norm_(1.0, norm_type=norm_type)))
    opt.step()
    assert all(bool(p.isnan().all()) for p in model.parameters())  # torch scales by NaN


@pytest.mark.parametrize("stage", [1, 2])
@pytest.mark.parametrize("norm_type", [2.0, INF], ids=["norm-2", "norm-inf"])
@pytest.mark.parametrize("value", [math.nan, INF], ids=["nan", "inf"])
def test_error_if_nonfinite_raises_on_every_rank(
    stage: int, norm_type: float, value: float, world: Backend
) -> None:
    last = len(list(make_model().parameters())) - 1
    model, opt, reference, _ = poisoned(stage, last, -1, world.size - 1, value)
    with pytest.raises(RuntimeError, match="non-finite"):
        torch.nn.utils.clip_grad_norm_(reference.parameters(), 1.0, norm_type, True)
    with pytest.raises(RuntimeError, match="not finite"):
        opt.clip_grad_norm_(1.0, norm_type=norm_type, error_if_nonfinite=True)
    opt.zero_grad()  # every rank raised: the next collectives pair up
    assert_same_on_every_rank(list(model.parameters()))


@pytest.mark.heavy
@settings(max_examples=30)
@given(
    stage=st.sampled_from([1, 2]),
    norm_type=st.sampled_from(NORMS),
    param=st.integers(0, 5),
    item=st.integers(0, 63),
    rank=st.integers(0, 2),
    value=st.sampled_from(VALUES),
    max_norm=st.sampled_from([0.01, 1.0, 1e6]),
)
def test_wherever_a_nan_or_an_infinity_goes_the_norm_and_step_are_torchs(
    stage: int, norm_type: float, param: int, item: int, rank: int, value: float, max_norm: float
) -> None:
    check_like_torch(stage, norm_type, param, item, rank % dp.size(), value, max_norm)

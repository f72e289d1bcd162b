"""`dp.torch.SyncBatchNorm`: equal to one process's `BatchNorm` over the concatenated batch.

Every rank holds its rows of a global batch (uneven shares: rank r has r + 2 rows), drawn from a
seed, and an upstream gradient for them. The reference is one process running `BatchNorm` on the
whole batch with the loss `sum(y * w)`: its outputs and input gradients at this rank's rows are
this rank's; its weight and bias gradients are the sum over ranks of the ranks' (local) ones;
its running statistics are every rank's.
"""

from __future__ import annotations

import copy

import pytest
import torch
from _torch_common import assert_same_on_every_rank, global_batch, step_pair
from torch import nn

import dataparallel as dp
from dataparallel.backends.base import Backend

BATCH_NORMS = {1: nn.BatchNorm1d, 2: nn.BatchNorm2d, 3: nn.BatchNorm3d}
CHANNELS = 3


def rows_of(rank: int) -> int:
    return rank + 2


def offset_of(rank: int) -> int:
    return sum(rows_of(r) for r in range(rank))


def global_input(size: int, spatial: tuple[int, ...], step: int = 0) -> torch.Tensor:
    total = sum(rows_of(r) for r in range(size))
    g = torch.Generator().manual_seed(10 + step)
    return 3 + 2 * torch.randn(total, CHANNELS, *spatial, generator=g, dtype=torch.float64)


def mine(t: torch.Tensor, rank: int) -> torch.Tensor:
    return t[offset_of(rank) : offset_of(rank) + rows_of(rank)]


def pair(spatial_dims: int, **options: object) -> tuple[nn.Module, nn.Module]:
    """A SyncBatchNorm and a BatchNorm with the same (non-trivial) affine parameters."""
    torch.manual_seed(0)
    reference = BATCH_NORMS[max(spatial_dims, 1)](CHANNELS, **options).double()  # type: ignore[arg-type]
    if reference.affine:
        with torch.no_grad():
            reference.weight.uniform_(0.5, 1.5)
            reference.bias.uniform_(-1, 1)
    sync = dp.torch.SyncBatchNorm.convert_sync_batchnorm(copy.deepcopy(reference))
    assert isinstance(sync, dp.torch.SyncBatchNorm)
    return sync, reference


def step_both(
    sync: nn.Module, reference: nn.Module, rank: int, size: int, spatial: tuple[int, ...], step: int
) -> None:
    """Run forward and backward on both; check outputs, input and parameter gradients."""
    x_all = global_input(size, spatial, step)
    w_all = torch.randn(x_all.shape, generator=torch.Generator().manual_seed(50 + step))
    w_all = w_all.double()
    x = mine(x_all, rank).clone().requires_grad_()
    ref_x = x_all.clone().requires_grad_()
    y, ref_y = sync(x), reference(ref_x)
    torch.testing.assert_close(y, mine(ref_y, rank))
    (y * mine(w_all, rank)).sum().backward()
    (ref_y * w_all).sum().backward()
    assert x.grad is not None and ref_x.grad is not None
    torch.testing.assert_close(x.grad, mine(ref_x.grad, rank))
    for name in ("weight", "bias"):
        got, want = getattr(sync, name), getattr(reference, name)
        if want is None:
            assert got is None
            continue
        total = dp.allreduce(got.grad.clone(), "sum")
        torch.testing.assert_close(total, want.grad)
        got.grad = want.grad = None


@pytest.mark.parametrize("spatial", [(), (4,), (3, 2), (2, 2, 2)], ids=["1d", "1d-seq", "2d", "3d"])
def test_forward_backward_and_running_stats_equal_one_batch_norm(
    spatial: tuple[int, ...], rank: int, size: int
) -> None:
    sync, reference = pair(len(spatial))
    for step in range(3):
        step_both(sync, reference, rank, size, spatial, step)
    for name in ("running_mean", "running_var", "num_batches_tracked"):
        torch.testing.assert_close(getattr(sync, name), getattr(reference, name))
    assert_same_on_every_rank([sync.running_mean, sync.running_var])
    sync.eval()
    reference.eval()
    x_all = global_input(size, spatial, 9)
    torch.testing.assert_close(sync(mine(x_all, rank)), mine(reference(x_all), rank))


@pytest.mark.parametrize(
    "options",
    [
        {"momentum": None},
        {"affine": False},
        {"track_running_stats": False},
        {"eps": 1e-2, "momentum": 0.5},
    ],
    ids=["cumulative", "no-affine", "no-running-stats", "eps-momentum"],
)
def test_every_batch_norm_option_behaves_as_one_batch_norm(
    options: dict[str, object], rank: int, size: int
) -> None:
    sync, reference = pair(2, **options)
    for step in range(3):
        step_both(sync, reference, rank, size, (3, 2), step)
    if reference.track_running_stats:
        torch.testing.assert_close(sync.running_mean, reference.running_mean)
        torch.testing.assert_close(sync.running_var, reference.running_var)
    sync.eval()
    reference.eval()
    x_all = global_input(size, (3, 2), 9)
    torch.testing.assert_close(sync(mine(x_all, rank)), mine(reference(x_all), rank))


def test_a_rank_with_no_rows_still_takes_part(rank: int, size: int) -> None:
    sync, reference = pair(2)
    x_all = global_input(size, (2, 2))
    last = size - 1
    empty = size > 1 and rank == last
    x = (x_all[:0] if empty else mine(x_all, rank)).clone().requires_grad_()
    y = sync(x)
    ref_y = reference(x_all[: offset_of(last)] if size > 1 else x_all)
    if not empty:
        torch.testing.assert_close(y, mine(ref_y, rank))
    y.sum().backward()  # its backward allreduce too
    assert x.grad is not None and x.grad.shape == x.shape
    torch.testing.assert_close(sync.running_mean, reference.running_mean)
    torch.testing.assert_close(sync.running_var, reference.running_var)


def test_float32_inputs_with_a_large_mean_keep_their_variance(rank: int, size: int) -> None:
    """Statistics from (mean, squared deviations) per rank: no cancellation at mean 1e4.

    (A sum of squares in float32 would lose the variance, 4, against 1e8 entirely; what is left
    is float32's own rounding of x - mean.)
    """
    sync = dp.torch.SyncBatchNorm(2, affine=False)
    truth = nn.BatchNorm1d(2, affine=False).double()
    x_all = 1e4 + global_input(size, ()).float()[:, :2]
    y = sync(mine(x_all, rank))
    assert y.dtype == torch.float32
    want = mine(truth(x_all.double()), rank)
    torch.testing.assert_close(y.double(), want, rtol=0, atol=1e-3)  # an ulp of x at 1e4
    torch.testing.assert_close(sync.running_var.double(), truth.running_var, rtol=1e-3, atol=0)


def test_a_model_converted_and_trained_under_data_parallel_model_equals_one_process(
    world: Backend,
) -> None:
    torch.manual_seed(0)
    bare = nn.Sequential(nn.Linear(5, 8), nn.BatchNorm1d(8), nn.Tanh(), nn.Linear(8, 3))
    reference = copy.deepcopy(bare)
    converted = dp.torch.SyncBatchNorm.convert_sync_batchnorm(bare)
    assert converted is bare and isinstance(bare[1], dp.torch.SyncBatchNorm)
    model = dp.torch.DataParallelModel(converted)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    ref_opt = torch.optim.SGD(reference.parameters(), lr=0.1)
    for step in range(3):
        x, y = global_batch(step)
        step_pair(model, opt, reference, ref_opt, x, y)
        for got, want in zip(model.parameters(), reference.parameters(), strict=True):
            torch.testing.assert_close(got.grad, want.grad)
    mine_state, ref_state = model.module.state_dict(), reference.state_dict()
    assert list(mine_state) == list(ref_state)
    for key, want in ref_state.items():
        torch.testing.assert_close(mine_state[key], want)


def test_convert_keeps_parameters_buffers_and_modes() -> None:
    torch.manual_seed(0)
    net = nn.Sequential(nn.Conv2d(1, 4, 3), nn.Sequential(nn.BatchNorm2d(4), nn.ReLU()))
    inner = net[1][0]
    inner.running_mean.fill_(2.0)
    inner.weight.requires_grad_(False)
    net.eval()
    out = dp.torch.SyncBatchNorm.convert_sync_batchnorm(net)
    bn = out[1][0]
    assert isinstance(bn, dp.torch.SyncBatchNorm) and isinstance(
        bn, nn.modules.batchnorm._BatchNorm
    )
    assert bn.weight is inner.weight and not bn.weight.requires_grad
    assert bn.running_mean is inner.running_mean and not bn.training
    assert isinstance(out[0], nn.Conv2d)


def test_statistics_over_a_group_cover_its_ranks_only(rank: int, size: int) -> None:
    members = [0] if size == 1 else list(range(1, size))
    group = dp.new_group(members)
    if not group.member:
        return
    sync = dp.torch.SyncBatchNorm(CHANNELS, group=group).double()
    reference = nn.BatchNorm1d(CHANNELS).double()
    x_all = global_input(size, ())
    rows = torch.cat([mine(x_all, r) for r in members])
    y = sync(mine(x_all, rank))
    want = reference(rows)
    start = sum(rows_of(r) for r in members if r < rank)
    torch.testing.assert_close(y, want[start : start + rows_of(rank)])
    torch.testing.assert_close(sync.running_var, reference.running_var)


def test_bad_inputs_raise_on_every_rank(rank: int, size: int) -> None:
    sync = dp.torch.SyncBatchNorm(CHANNELS)
    with pytest.raises(ValueError, match=r"at least 2 dims"):
        sync(torch.ones(CHANNELS))
    with pytest.raises(ValueError, match="more than 1 value per channel"):
        sync(torch.ones(1 if rank == 0 else 0, CHANNELS))

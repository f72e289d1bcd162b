"""Training on a GPU: every way of reducing gradients matches one process on the whole batch.

Each rank trains a CUDA copy of the model on its share of a global batch; a reference trains on all
of it, on the same GPU. With a GPU per rank (NCCL) or ranks sharing one (MPI or Gloo staging through
pinned host memory), the parameters must agree with the reference and across ranks; so must
`ZeroRedundancyOptimizer`'s at stages 1 and 2, whose shards and state stay on the GPU (its engine
calls staged through pinned host buffers), and its consolidated checkpoint must load into a plain
Adam; error feedback keeps its residuals on the GPU and sends what was computed. Skipped where
torch sees no CUDA device.
"""

from __future__ import annotations

import copy
from collections.abc import Callable

import numpy as np
import pytest
import torch
from _torch_common import global_batch, loss_of, make_model, share
from torch import nn

import dataparallel as dp

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="torch sees no CUDA device")

Setup = Callable[[nn.Module], tuple[nn.Module, torch.optim.Optimizer]]


def adam(m: nn.Module) -> torch.optim.Optimizer:
    return torch.optim.Adam(m.parameters(), lr=0.01)


def zero(m: nn.Module, stage: int) -> dp.torch.ZeroRedundancyOptimizer:
    return dp.torch.ZeroRedundancyOptimizer(m.parameters(), torch.optim.Adam, stage=stage, lr=0.01)


def zero_stage_1(m: nn.Module) -> tuple[nn.Module, torch.optim.Optimizer]:
    opt = zero(m, 1)  # first: it moves the parameters into its flat buffers
    return dp.torch.DataParallelModel(m), opt


SETUPS: dict[str, Setup] = {
    "DistributedOptimizer": lambda m: (m, dp.DistributedOptimizer(adam(m))),
    "DataParallelModel": lambda m: (dp.torch.DataParallelModel(m), adam(m)),
    "allreduce_gradients": lambda m: (m, adam(m)),
    "ZeRO stage 1 + DataParallelModel": zero_stage_1,
    "ZeRO stage 2": lambda m: (m, zero(m, 2)),
}


def train(
    net: nn.Module,
    opt: torch.optim.Optimizer,
    reference: nn.Module,
    ref_opt: torch.optim.Optimizer,
    device: torch.device,
    steps: int,
    reduce_grads_of: nn.Module | None = None,
) -> None:
    """`steps` steps of `net` on this rank's share of each global batch, of `reference` on all
    of it; `reduce_grads_of`: its gradients reduced by `dp.allreduce_gradients` after backward."""
    for step in range(steps):
        x, y = (t.to(device) for t in global_batch(step))
        opt.zero_grad()
        loss_of(net, share(x.cpu()).to(device), share(y.cpu()).to(device)).backward()
        if reduce_grads_of is not None:
            dp.allreduce_gradients([p.grad for p in reduce_grads_of.parameters()])
        opt.step()
        ref_opt.zero_grad()
        loss_of(reference, x, y).backward()
        ref_opt.step()


@pytest.mark.parametrize("name", list(SETUPS))
def test_gpu_training_matches_one_process_on_the_whole_batch(name: str) -> None:
    device = torch.device("cuda", dp.device() or 0)
    model = make_model(hidden=64).to(device)
    reference = copy.deepcopy(model)
    ref_opt = adam(reference)
    net, opt = SETUPS[name](model)
    reduce = name == "allreduce_gradients"
    train(net, opt, reference, ref_opt, device, 5, model if reduce else None)
    for got, want in zip(model.parameters(), reference.parameters(), strict=True):
        assert got.device == device
        torch.testing.assert_close(got, want, atol=1e-5, rtol=1e-4)
    mine = [p.detach().cpu().numpy() for p in model.parameters()]
    for theirs in dp.allgather_object(mine):
        for a, b in zip(mine, theirs, strict=True):
            np.testing.assert_array_equal(a, b)


def assert_on(opt: dp.torch.ZeroRedundancyOptimizer, device: torch.device) -> None:
    """The shards, the flat buffers and the inner optimizer's state stay on the GPU."""
    assert all(piece.tensor.device == device for piece in opt.pieces)
    assert all(slab.data.device == device for slab in opt._slabs)
    for state in opt.optim.state.values():
        for key, value in state.items():
            if key != "step":
                assert value.device == device, key
    if opt._shards is not None:
        assert all(shard.device == device for shard in opt._shards.shards)


@pytest.mark.parametrize("stage", [1, 2])
def test_zero_on_the_gpu_keeps_its_state_there_and_consolidates(stage: int) -> None:
    device = torch.device("cuda", dp.device() or 0)
    model = make_model(hidden=64).to(device)
    reference = copy.deepcopy(model)
    ref_opt = adam(reference)
    net, opt = (zero_stage_1 if stage == 1 else SETUPS["ZeRO stage 2"])(model)
    assert isinstance(opt, dp.torch.ZeroRedundancyOptimizer)
    train(net, opt, reference, ref_opt, device, 3)
    assert_on(opt, device)
    opt.consolidate_state_dict(to=0)
    state = opt.state_dict() if dp.rank() == 0 else None
    state = dp.broadcast_object(state, root=0)
    plain = adam(copy.deepcopy(reference))  # a plain Adam on the GPU takes it
    plain.load_state_dict(state)
    for k, entry in ref_opt.state_dict()["state"].items():
        for key, value in entry.items():
            torch.testing.assert_close(
                plain.state_dict()["state"][k][key], value, atol=1e-5, rtol=1e-4
            )
    fresh_model = copy.deepcopy(model)
    fresh = zero(fresh_model, stage)
    fresh.load_state_dict(state)
    assert_on(fresh, device)


def test_zero_refuses_parameters_on_two_devices_and_names_one() -> None:
    params = [nn.Parameter(torch.zeros(3, device="cuda")), nn.Parameter(torch.zeros(3))]
    with pytest.raises(ValueError, match=r"\[1\] is on cpu, the parameters before it on cuda"):
        dp.torch.ZeroRedundancyOptimizer(params, torch.optim.Adam, lr=0.1)


class _Scaled(nn.Module):
    """loss = sum(w * c): the gradient is `c` at every step."""

    def __init__(self, device: torch.device) -> None:
        super().__init__()
        self.w = nn.Parameter(torch.zeros(8, device=device))

    def forward(self, c: torch.Tensor) -> torch.Tensor:
        return (self.w * c).sum()


def _drift(compression: object, face: str, device: torch.device, steps: int) -> float:
    """How far `steps` SGD steps of lr 1 end from where the uncompressed gradients lead; rank 0's
    gradient is 1 + 2**-9 (bfloat16 sends 1.0), the others' 0."""
    model = _Scaled(device)
    opt: torch.optim.Optimizer = torch.optim.SGD(model.parameters(), lr=1.0)
    if face == "model":
        net: nn.Module = dp.torch.DataParallelModel(model, compression=compression)
        sync = net.gradient_sync
    else:
        net = model
        opt = dp.DistributedOptimizer(opt, compression=compression)
        sync = opt.gradient_sync
    c = torch.full((8,), 1 + 2**-9 if dp.rank() == 0 else 0.0, device=device)
    for _ in range(steps):
        opt.zero_grad()
        net(c).backward()
        opt.step()
    assert model.w.device == device
    if sync._feedback is not None:
        assert all(r.device == device for r in sync._feedback.residuals.values())
    mine = model.w.detach().cpu().numpy()
    for theirs in dp.allgather_object(mine):
        np.testing.assert_array_equal(theirs, mine)
    return float((model.w.detach() + steps * (1 + 2**-9) / dp.size()).abs().max())


@pytest.mark.parametrize("face", ["optimizer", "model"])
def test_error_feedback_on_the_gpu_sends_what_was_computed(face: str) -> None:
    """Without feedback 32 steps lose 32 * 2**-9 (averaged over the ranks); with it, one
    residual at most, kept on the GPU."""
    device = torch.device("cuda", dp.device() or 0)
    lost = _drift(dp.Compression.bf16, face, device, 32)
    assert lost == pytest.approx(32 * 2**-9 / dp.size(), rel=1e-3)
    kept = _drift(dp.Compression.bf16_feedback, face, device, 32)
    assert kept <= 2**-8 / dp.size() + 1e-4, (kept, lost)

"""Training on a GPU: every way of reducing gradients matches one process on the whole batch.

Each rank trains a CUDA copy of the model on its share of a global batch; a reference trains on all
of it, on the same GPU. With a GPU per rank (NCCL) or ranks sharing one (MPI or Gloo staging through
pinned host memory), the parameters must agree with the reference and across ranks. Skipped where
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


SETUPS: dict[str, Setup] = {
    "DistributedOptimizer": lambda m: (m, dp.DistributedOptimizer(adam(m))),
    "DataParallelModel": lambda m: (dp.torch.DataParallelModel(m), adam(m)),
    "allreduce_gradients": lambda m: (m, adam(m)),
}


@pytest.mark.parametrize("name", list(SETUPS))
def test_gpu_training_matches_one_process_on_the_whole_batch(name: str) -> None:
    device = torch.device("cuda", dp.device() or 0)
    model = make_model(hidden=64).to(device)
    reference = copy.deepcopy(model)
    ref_opt = adam(reference)
    net, opt = SETUPS[name](model)
    for step in range(5):
        x, y = (t.to(device) for t in global_batch(step))
        opt.zero_grad()
        loss_of(net, share(x.cpu()).to(device), share(y.cpu()).to(device)).backward()
        if name == "allreduce_gradients":
            dp.allreduce_gradients([p.grad for p in model.parameters()])
        opt.step()
        ref_opt.zero_grad()
        loss_of(reference, x, y).backward()
        ref_opt.step()
    for got, want in zip(model.parameters(), reference.parameters(), strict=True):
        assert got.device == device
        torch.testing.assert_close(got, want, atol=1e-5, rtol=1e-4)
    mine = [p.detach().cpu().numpy() for p in model.parameters()]
    for theirs in dp.allgather_object(mine):
        for a, b in zip(mine, theirs, strict=True):
            np.testing.assert_array_equal(a, b)


@pytest.mark.parametrize("stage", [1, 2])
def test_zero_refuses_gpu_parameters_and_names_the_fix(stage: int) -> None:
    model = make_model().to(torch.device("cuda", dp.device() or 0))
    with pytest.raises(ValueError, match=r"on cuda:\d+; it shards host \(CPU\) parameters only"):
        dp.torch.ZeroRedundancyOptimizer(model.parameters(), torch.optim.Adam, stage=stage)

"""Models, batches and cross-rank checks shared by the PyTorch tests (`test_torch_*.py`).

Every rank trains on its share of a global batch and is compared with a single-process reference
that every rank computes locally on the whole batch, from the same seed. Values from the other
ranks are gathered with `dp.allgather_object` before asserting, so a failure on one rank cannot
leave the others waiting.
"""

from __future__ import annotations

import io
from collections.abc import Callable
from typing import Any

import numpy as np
import torch
from torch import nn

import dataparallel as dp
from dataparallel.data import shard_indices

BATCH = 12  # divisible by 1, 2 and 3: equal shares, so the average of means is the global mean

OPTIMIZERS: dict[str, Callable[[Any], torch.optim.Optimizer]] = {
    "sgd-momentum": lambda ps: torch.optim.SGD(ps, lr=0.1, momentum=0.9),
    "adam": lambda ps: torch.optim.Adam(ps, lr=0.01),
}


def make_model(seed: int = 0, hidden: int = 8) -> nn.Sequential:
    torch.manual_seed(seed)
    return nn.Sequential(
        nn.Linear(5, hidden), nn.Tanh(), nn.Linear(hidden, hidden), nn.Tanh(), nn.Linear(hidden, 3)
    )


def global_batch(step: int, seed: int = 1000) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(seed + step)
    return torch.randn(BATCH, 5, generator=g), torch.randn(BATCH, 3, generator=g)


def share(t: torch.Tensor) -> torch.Tensor:
    """Return this rank's share of the global batch `t`."""
    return t[torch.from_numpy(shard_indices(len(t), dp.rank(), dp.size()))]


def loss_of(model: nn.Module, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
    return ((model(x) - y) ** 2).mean()


def step_pair(
    model: nn.Module,
    opt: torch.optim.Optimizer,
    reference: nn.Module,
    ref_opt: torch.optim.Optimizer,
    x: torch.Tensor,
    y: torch.Tensor,
    loss: Callable[[nn.Module, torch.Tensor, torch.Tensor], torch.Tensor] = loss_of,
) -> None:
    """One step of `model` on this rank's share of `(x, y)`, and of `reference` on all of it."""
    opt.zero_grad()
    loss(model, share(x), share(y)).backward()
    opt.step()
    ref_opt.zero_grad()
    loss(reference, x, y).backward()
    ref_opt.step()


def gathered(tensors: list[torch.Tensor]) -> list[list[np.ndarray]]:
    """Every rank's copy of `tensors`, as NumPy arrays, in rank order."""
    return dp.allgather_object([t.detach().numpy().copy() for t in tensors])


def assert_same_on_every_rank(tensors: list[torch.Tensor]) -> None:
    every = gathered(tensors)
    for theirs in every[1:]:
        for a, b in zip(every[0], theirs, strict=True):
            np.testing.assert_array_equal(a, b)


class Reversed(nn.Module):
    """Registers its layers last to first; its forward runs them first to last."""

    def __init__(self, seed: int = 0) -> None:
        super().__init__()
        torch.manual_seed(seed)
        self.head = nn.Linear(8, 3)
        self.middle = nn.Linear(8, 8)
        self.stem = nn.Linear(5, 8)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.head(torch.tanh(self.middle(torch.tanh(self.stem(x)))))


class Branchy(nn.Module):
    """`b` is used on rank 0 only; `unused` on no rank."""

    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.a = nn.Linear(4, 2)
        self.b = nn.Linear(4, 2)
        self.unused = nn.Linear(4, 2)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        out = self.a(x)
        if dp.rank() == 0:
            out = out + self.b(x)
        return out


def resumable(
    face: str, compression: Any, widths: tuple[int, int, int]
) -> tuple[nn.Module, nn.Module, Any]:
    """A model of `widths` (in, hidden, out; the same on every rank), what runs it (`face`: the
    model under a `DistributedOptimizer`, or a `DataParallelModel`), and its Adam, compressed."""
    torch.manual_seed(3)
    model = nn.Sequential(nn.Linear(widths[0], widths[1]), nn.Tanh(), nn.Linear(*widths[1:]))
    opt: Any = torch.optim.Adam(model.parameters(), lr=0.01)
    if face == "model":
        return model, dp.torch.DataParallelModel(model, compression=compression), opt
    return model, model, dp.DistributedOptimizer(opt, compression=compression)


def train_own_rows(net: nn.Module, opt: Any, steps: range) -> None:
    """Train `steps` on each rank's own rows, sized from `net`'s first and last layers: what
    compression leaves behind then differs from rank to rank."""
    linears = [m for m in net.modules() if isinstance(m, nn.Linear)]
    width_in, width_out = linears[0].in_features, linears[-1].out_features
    for step in steps:
        g = torch.Generator().manual_seed(100 * step + dp.rank())
        x, y = torch.randn(4, width_in, generator=g), torch.randn(4, width_out, generator=g)
        opt.zero_grad()
        ((net(x) - y) ** 2).mean().backward()
        opt.step()


def through_disk(*objects: Any) -> list[Any]:
    """Each object's state dict through torch.save/torch.load (weights only), as on disk."""
    buffer = io.BytesIO()
    torch.save([o.state_dict() for o in objects], buffer)
    buffer.seek(0)
    return torch.load(buffer)  # type: ignore[no-any-return]

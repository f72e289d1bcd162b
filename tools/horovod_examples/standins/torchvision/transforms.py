"""`Compose`, `ToTensor`, `Normalize`: what Horovod's MNIST example applies to its images."""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

import torch


class Compose:
    def __init__(self, steps: Sequence[Callable[[Any], Any]]) -> None:
        self.steps = list(steps)

    def __call__(self, x: Any) -> Any:
        for step in self.steps:
            x = step(x)
        return x


class ToTensor:
    """uint8 HxW (or a tensor already) to float CxHxW in [0, 1]."""

    def __call__(self, x: Any) -> torch.Tensor:
        t = torch.as_tensor(x)
        if t.dtype == torch.uint8:
            t = t.float().div(255)
        return t.unsqueeze(0) if t.dim() == 2 else t


class Normalize:
    def __init__(self, mean: Sequence[float], std: Sequence[float]) -> None:
        self.mean = torch.tensor(mean).view(-1, 1, 1)
        self.std = torch.tensor(std).view(-1, 1, 1)

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        return (x - self.mean) / self.std

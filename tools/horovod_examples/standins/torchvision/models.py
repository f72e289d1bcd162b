"""`resnet50` and friends: one small residual network standing in for every model name.

Horovod's synthetic benchmark builds `getattr(models, args.model)(norm_layer=hvd.SyncBatchNorm)`;
any name gives this network (a stem, two residual blocks with `norm_layer`, a classifier of
`num_classes`), about 0.2 M parameters instead of ResNet-50's 25 M, so the benchmark runs on CPUs.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch
from torch import nn


class _Block(nn.Module):
    def __init__(self, channels: int, norm_layer: Callable[[int], nn.Module]) -> None:
        super().__init__()
        self.conv1 = nn.Conv2d(channels, channels, 3, padding=1, bias=False)
        self.bn1 = norm_layer(channels)
        self.conv2 = nn.Conv2d(channels, channels, 3, padding=1, bias=False)
        self.bn2 = norm_layer(channels)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = torch.relu(self.bn1(self.conv1(x)))
        return torch.relu(x + self.bn2(self.conv2(y)))


class SmallResNet(nn.Module):
    def __init__(
        self,
        num_classes: int = 1000,
        norm_layer: Callable[[int], nn.Module] | None = None,
        width: int = 32,
    ) -> None:
        super().__init__()
        norm = norm_layer if norm_layer is not None else nn.BatchNorm2d
        self.stem = nn.Sequential(
            nn.Conv2d(3, width, 7, stride=4, padding=3, bias=False), norm(width), nn.ReLU()
        )
        self.blocks = nn.Sequential(_Block(width, norm), nn.MaxPool2d(2), _Block(width, norm))
        self.fc = nn.Linear(width, num_classes)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = self.blocks(self.stem(x))
        return self.fc(torch.flatten(nn.functional.adaptive_avg_pool2d(x, 1), 1))


def __getattr__(name: str) -> Any:
    if name.startswith("_"):
        raise AttributeError(name)

    def build(**options: Any) -> SmallResNet:
        return SmallResNet(
            num_classes=options.get("num_classes", 1000), norm_layer=options.get("norm_layer")
        )

    return build

"""`MNIST`, synthetic: images made from a seed instead of downloaded.

Each class has its own random pattern, and every image is its class's pattern plus noise, so a
model learns something (the loss falls) in a few batches. `DATAPARALLEL_STANDIN_SAMPLES` sets the
size of the training set (default 2048; the test set is a quarter of it).
"""

from __future__ import annotations

import os
from collections.abc import Callable
from typing import Any

import torch


class MNIST(torch.utils.data.Dataset):  # type: ignore[type-arg]
    def __init__(
        self,
        root: str,
        train: bool = True,
        transform: Callable[[Any], Any] | None = None,
        target_transform: Callable[[Any], Any] | None = None,
        download: bool = False,
    ) -> None:
        samples = int(os.environ.get("DATAPARALLEL_STANDIN_SAMPLES", "2048"))
        n = samples if train else max(samples // 4, 1)
        generator = torch.Generator().manual_seed(0)
        patterns = torch.randint(0, 256, (10, 28, 28), generator=generator)
        generator.manual_seed(1 if train else 2)
        self.targets = torch.randint(0, 10, (n,), generator=generator)
        noise = torch.randint(-60, 61, (n, 28, 28), generator=generator)
        self.data = (patterns[self.targets] + noise).clamp(0, 255).to(torch.uint8)
        self.transform, self.target_transform = transform, target_transform

    def __len__(self) -> int:
        return len(self.targets)

    def __getitem__(self, index: int) -> tuple[Any, Any]:
        image, target = self.data[index], int(self.targets[index])
        if self.transform is not None:
            image = self.transform(image)
        if self.target_transform is not None:
            target = self.target_transform(target)
        return image, target

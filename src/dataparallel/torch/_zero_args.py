"""What `ZeroRedundancyOptimizer` is made with, checked before anything is laid out.

The inner optimizer's class, the stage and the bucket size (and the latter's default), the
parameters' one device, their structure the same on every rank (collective), and, at stage 2,
none of them reduced already by a model wrapper. Each error says what came and the fix.
"""

from __future__ import annotations

from typing import Literal

import torch

from dataparallel.backends.base import Backend
from dataparallel.config import Settings
from dataparallel.protocol import verify_same_call
from dataparallel.torch._hooks import owner as owner_of
from dataparallel.torch._zero_grads import GradientShards

__all__ = [
    "Stage",
    "check_options",
    "default_bucket_bytes",
    "inner_class",
    "one_device",
    "refuse_reduced",
    "verify_params",
]

Stage = Literal[1, 2]
Named = list[tuple[str, torch.Tensor]]


def default_bucket_bytes(stage: Stage, settings: Settings) -> int:
    """Stage 1: `Settings.thread_bucket_bytes` (25 MiB, DDP's size): its buckets cost no buffer
    (the allgathers land in the parameters), and every bucket is two calls (a reduce by the
    wrapper, an allgather), each about as dear whatever its size on a busy node. Stage 2: 4 x
    `Settings.bucket_bytes` (1 MiB): each bucket in flight is a send buffer of its size, which
    counts against the gradient memory stage 2 saves (benchmarks/zero.py, docs/zero.md)."""
    return settings.thread_bucket_bytes if stage == 1 else 4 * settings.bucket_bytes


def inner_class(cls: object) -> type[torch.optim.Optimizer]:
    """`cls`, a subclass of `torch.optim.Optimizer`; else `TypeError`."""
    if isinstance(cls, type) and issubclass(cls, torch.optim.Optimizer):
        return cls
    if isinstance(cls, torch.optim.Optimizer):
        raise TypeError(
            "ZeroRedundancyOptimizer(params, optimizer_class, ...) takes the optimizer's class "
            f"and its options, not an optimizer: give {type(cls).__name__}, lr=... instead of "
            f"{type(cls).__name__}(params, lr=...)."
        )
    raise TypeError(
        "ZeroRedundancyOptimizer: optimizer_class must be a subclass of torch.optim.Optimizer "
        f"(torch.optim.Adam, ...), got {cls!r}."
    )


def check_options(stage: object, bucket_bytes: object) -> None:
    """Raise `ValueError` for a stage other than 1 or 2, or a bucket size not a positive int."""
    if stage not in (1, 2):
        raise ValueError(f"ZeroRedundancyOptimizer: stage={stage!r} must be 1 or 2.")
    if bucket_bytes is not None and (
        isinstance(bucket_bytes, bool) or not isinstance(bucket_bytes, int) or bucket_bytes < 1
    ):
        raise ValueError(
            f"ZeroRedundancyOptimizer: bucket_bytes={bucket_bytes!r} must be a positive int."
        )


def one_device(named: Named, device: torch.device | None) -> torch.device | None:
    """The device of every parameter in `named` and of those before (`device`, None if none
    came before); `ValueError` names the first parameter on another."""
    for name, p in named:
        if device is None:
            device = p.device
        elif p.device != device:
            raise ValueError(
                f"ZeroRedundancyOptimizer: {name} is on {p.device}, the parameters before "
                f"it on {device}; it shards the parameters of one device. Move the "
                "model to one device first, or use one optimizer per device."
            )
    return device


def verify_params(
    backend: Backend,
    cls: type[torch.optim.Optimizer],
    stage: Stage,
    bucket_bytes: int,
    named: Named,
) -> None:
    """Check that every rank lays out the same parameters the same way (collective):
    `CollectiveMismatchError` names the parameter that differs."""
    call: dict[str, object] = {
        "collective": "ZeroRedundancyOptimizer parameters",
        "optimizer_class": f"{cls.__module__}.{cls.__qualname__}",
        "stage": stage,
        "bucket_bytes": bucket_bytes,
    }
    for name, p in named:
        call[name] = f"{str(p.dtype).removeprefix('torch.')}{list(p.shape)}"
    verify_same_call(backend, call)


def refuse_reduced(params: Named) -> None:
    """Raise `ValueError` for a parameter whose gradients a model wrapper already reduces."""
    for name, p in params:
        reducer = owner_of(p)
        if reducer is not None and not isinstance(reducer, GradientShards):
            who = getattr(reducer, "owner", type(reducer).__name__)
            raise ValueError(
                f"ZeroRedundancyOptimizer(stage=2): {name} is already reduced by a {who}; "
                "stage 2 reduce-scatters the gradients itself, so they would be reduced twice. "
                "Give stage=2 the unwrapped model's parameters, or use stage=1 under the "
                "wrapper."
            )

"""How `GradientSync` cuts its parameters into buckets: fixed members per (device, dtype)."""

from __future__ import annotations

from dataclasses import dataclass

import torch

__all__ = ["Bucket", "NamedParams", "plan", "signature"]

NamedParams = list[tuple[str, torch.Tensor]]


@dataclass
class Bucket:
    """Parameters reduced together: fixed members, one (device, dtype)."""

    members: list[int]  # parameter indices, in launch order
    key: tuple[str, str]  # (device, dtype)


def plan(params: NamedParams, order: list[int], bucket_bytes: int) -> list[Bucket]:
    """Cut `order` into buckets of at most `bucket_bytes` per (device, dtype)."""
    buckets: list[Bucket] = []
    open_: dict[tuple[str, str], tuple[Bucket, int]] = {}
    for i in order:
        p = params[i][1]
        key = (str(p.device), str(p.dtype).removeprefix("torch."))
        nbytes = p.numel() * p.element_size()
        current = open_.get(key)
        if current is None or (current[1] + nbytes > bucket_bytes and current[0].members):
            current = (Bucket([], key), 0)
            buckets.append(current[0])
        current[0].members.append(i)
        open_[key] = (current[0], current[1] + nbytes)
    return buckets


def signature(params: NamedParams) -> list[tuple[int, torch.dtype, torch.device]]:
    return [(id(p), p.dtype, p.device) for _, p in params]

"""What a stage-2 bucket's reduce-scatter sends and receives (`_zero_grads.py`).

The order the buckets go out in (the same on every rank), the dtype each travels in, the items
each rank receives (the bucket's padding is not sent), and the pool that the send and receive
buffers come from and go back to.
"""

from __future__ import annotations

import torch

from dataparallel.backends.base import Backend
from dataparallel.torch._zero_layout import Bucket, host_buffer

__all__ = ["Pool", "launch_order", "sent_counts", "wire_dtype"]


def launch_order(buckets: list[Bucket]) -> list[int]:
    """Buckets in the order backward usually completes them: latest parameters first."""
    return sorted(range(len(buckets)), key=lambda b: (-max(buckets[b].params), buckets[b].start))


def wire_dtype(dtype: torch.dtype, backend: Backend) -> torch.dtype:
    """The dtype a gradient bucket is reduced in: its own where the engine reduces it natively,
    else float32 (bfloat16)."""
    name = str(dtype).removeprefix("torch.")
    return dtype if name in backend.native_dtypes else torch.float32


def sent_counts(bucket: Bucket) -> list[int]:
    """Items per rank of a bucket's reduce-scatter: its padding (which ends the last ranks'
    segments) is not sent, so that a bucket of one parameter sends its gradient as it is."""
    part, items = bucket.counts[0], bucket.filled - bucket.start
    return [min(part, max(0, items - r * part)) for r in range(len(bucket.counts))]


class Pool:
    """Buffers taken and given back: a buffer is reused by any later request it can hold."""

    def __init__(self, device: torch.device | None = None, staged: bool = False) -> None:
        self.device = device  # None: host buffers (`host_buffer`: pinned if `staged`)
        self.staged = staged
        self._free = dict[torch.dtype, list[torch.Tensor]]()
        self.allocated = 0  # bytes of the buffers alive (given out or free)

    def take(self, dtype: torch.dtype, items: int) -> torch.Tensor:
        free = self._free.setdefault(dtype, [])
        for i, buf in enumerate(free):
            if buf.numel() >= items:
                return free.pop(i)
        if free:  # too small: dropped, so that no more buffers live than are in use at once
            self.allocated -= free.pop().nbytes
        if self.device is None:
            buf = host_buffer(items, dtype, self.staged)
        else:
            buf = torch.empty(items, dtype=dtype, device=self.device)
        self.allocated += buf.nbytes
        return buf

    def give(self, buf: torch.Tensor) -> None:
        self._free[buf.dtype].append(buf)

"""The NCCL calls of reduce-scatter and all-to-all on CUDA buffers (used by `NCCLBackend`).

`NCCLBackend.reduce_scatter` and `.alltoallv` send host buffers to the fallback engine, as every
other host call of that backend does, and enqueue the calls made here for CUDA buffers, on the
communication stream after the producer's stream, like the other NCCL calls:

- reduce-scatter: `ncclReduceScatter` when every rank's segment has the same size; uneven segments
  (Horovod's split of a first axis that `size` does not divide) are one `ncclReduce` per rank,
  rooted at that rank, in one NCCL group.
- all-to-all: NCCL has no all-to-all-v; it is one `ncclSend` and one `ncclRecv` per peer in one
  NCCL group (NCCL 2.7+), on raw bytes, so every dtype goes as it is.

Not exercised by the test suite, which runs without a GPU: the public `dp.reducescatter` and
`dp.alltoall` stage GPU leaves through host memory (docs/design.md), so these device paths are
reached only by direct backend calls. The host paths are the fallback's, which are tested.
"""

from __future__ import annotations

import itertools
from collections.abc import Callable
from types import ModuleType
from typing import Protocol

import numpy as np

from dataparallel.backends.base import Buffer, DeviceBuffer

__all__ = [
    "Call",
    "Communicator",
    "Event",
    "Stream",
    "alltoall_call",
    "device_pair",
    "scatter_call",
]


# What the NCCL backend uses of CuPy's objects (CuPy is not needed to check these types).
# Buffers are device addresses, counts are items of an `ncclDataType_t`, streams `cudaStream_t`.
class Communicator(Protocol):
    """`cupy.cuda.nccl.NcclCommunicator`."""

    def allReduce(
        self, send: int, recv: int, count: int, kind: int, op: int, stream: int
    ) -> None: ...

    def reduce(
        self, send: int, recv: int, count: int, kind: int, op: int, root: int, stream: int
    ) -> None: ...

    def bcast(self, buf: int, count: int, kind: int, root: int, stream: int) -> None: ...

    def broadcast(
        self, send: int, recv: int, count: int, kind: int, root: int, stream: int
    ) -> None: ...

    def reduceScatter(
        self, send: int, recv: int, count: int, kind: int, op: int, stream: int
    ) -> None: ...

    def send(self, buf: int, count: int, kind: int, peer: int, stream: int) -> None: ...

    def recv(self, buf: int, count: int, kind: int, peer: int, stream: int) -> None: ...

    def abort(self) -> None: ...

    def destroy(self) -> None: ...


class Stream(Protocol):
    """`cupy.cuda.Stream`: the backend's own communication stream."""

    @property
    def ptr(self) -> int: ...

    def wait_event(self, event: Event) -> None: ...

    def synchronize(self) -> None: ...


class Event(Protocol):
    """`cupy.cuda.Event`."""

    @property
    def ptr(self) -> int: ...

    @property
    def done(self) -> bool: ...


Call = Callable[[Communicator, int], None]  # (communicator, stream pointer) -> None


def device_pair(send: Buffer, recv: Buffer, what: str) -> tuple[DeviceBuffer, DeviceBuffer] | None:
    """Return the two CUDA buffers, or None when both are host arrays; raise on a mix."""
    if isinstance(send, DeviceBuffer) and isinstance(recv, DeviceBuffer):
        return send, recv
    if isinstance(send, np.ndarray) and isinstance(recv, np.ndarray):
        return None
    raise TypeError(
        f"{what}: send and recv must both be host arrays or both CUDA buffers, got "
        f"{type(send).__name__} and {type(recv).__name__}."
    )


def scatter_call(
    source: DeviceBuffer,
    target: DeviceBuffer,
    counts: list[int],
    how: tuple[int, int],
    op: int,
    rank: int,
    nccl: ModuleType,
) -> Call:
    """Return the NCCL reduce-scatter of `source` into `target` (`how`: NCCL type, parts)."""
    kind, parts = how

    def call(comm: Communicator, stream: int) -> None:
        if len(set(counts)) == 1:
            comm.reduceScatter(source.ptr, target.ptr, counts[0] * parts, kind, op, stream)
            return
        nccl.groupStart()
        try:
            offset = 0
            for root, count in enumerate(counts):
                into = target.ptr if root == rank else source.ptr + offset  # read at root only
                comm.reduce(source.ptr + offset, into, count * parts, kind, op, root, stream)
                offset += count * source.itemsize
        finally:
            nccl.groupEnd()

    return call


def alltoall_call(
    source: DeviceBuffer,
    target: DeviceBuffer,
    send_counts: list[int],
    recv_counts: list[int],
    nccl: ModuleType,
    byte_type: int,
) -> Call:
    """Return the all-to-all of `source` into `target` as grouped NCCL sends and receives."""
    item = source.itemsize
    sent = [0, *itertools.accumulate(send_counts)]
    received = [0, *itertools.accumulate(recv_counts)]

    def call(comm: Communicator, stream: int) -> None:
        nccl.groupStart()
        try:
            for peer, (out, into) in enumerate(zip(send_counts, recv_counts, strict=True)):
                comm.send(source.ptr + sent[peer] * item, out * item, byte_type, peer, stream)
                comm.recv(target.ptr + received[peer] * item, into * item, byte_type, peer, stream)
        finally:
            nccl.groupEnd()

    return call

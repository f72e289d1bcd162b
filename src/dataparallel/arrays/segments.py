"""Buckets laid out by rank: what one reduce-scatter or all-to-all call sends and receives.

The `Fusion` packs a bucket of arrays, each split along its first axis, so that one engine
call moves them all: the send buffer holds, for each destination rank in turn, that rank's rows of
every array in turn; the receive buffer holds, for each source rank in turn, the rows it sent of
every array in turn. A bucket of one contiguous array needs no packing: its rows are already in
rank order.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence

import numpy as np

from dataparallel.arrays.actions import Exchange, Scatter
from dataparallel.arrays.pool import BufferPool
from dataparallel.backends.base import Backend, Handle, ReduceOp

__all__ = ["Segments", "layout_of", "row_parts"]


def row_parts(n: int, size: int) -> list[int]:
    """Split `n` rows over `size` ranks as Horovod does: the first `n % size` get one more.

    >>> row_parts(7, 3), row_parts(2, 3)
    ([3, 2, 2], [1, 1, 0])
    """
    whole, extra = divmod(n, size)
    return [whole + (i < extra) for i in range(size)]


class Segments:
    """How a bucket of arrays is laid out in one call's send and receive buffers.

    Args:
        works: the bucket's arrays, each of shape `(rows, ...)`, in their storage dtype.
        sends: `sends[j][i]`, the rows of `works[j]` that go to rank i (consecutive, in rank order).
        receives: `receives[j][i]`, the rows of array j's result that come from source i (a
            reduce-scatter has one source: the reduction of this rank's part).

    Attributes:
        send_counts, recv_counts: items per destination and per source, the engine's counts.
    """

    def __init__(
        self, works: list[np.ndarray], sends: list[list[int]], receives: list[list[int]]
    ) -> None:
        self.works, self.sends, self.receives = works, sends, receives
        self.rows = [math.prod(work.shape[1:]) for work in works]  # items per row
        self.send_counts = [
            sum(parts[i] * row for parts, row in zip(sends, self.rows, strict=True))
            for i in range(len(sends[0]))
        ]
        self.recv_counts = [
            sum(parts[i] * row for parts, row in zip(receives, self.rows, strict=True))
            for i in range(len(receives[0]))
        ]

    def send_buffer(self, pool: BufferPool) -> tuple[np.ndarray, list[np.ndarray]]:
        """Return the send buffer and the pooled buffers to give back once the call is done.

        A bucket of one contiguous array is its own send buffer (no copy); others are packed.
        """
        if len(self.works) == 1 and self.works[0].flags.c_contiguous:
            return self.works[0].reshape(-1), []
        buf = pool.take(self.works[0].dtype, sum(self.send_counts))
        self.pack(buf)
        return buf, [buf]

    def start(
        self,
        backend: Backend,
        action: Scatter | Exchange,
        send: np.ndarray,
        recv: np.ndarray,
        item: int,
        op: ReduceOp,
        async_op: bool,
    ) -> Handle | None:
        """Start the engine call for this bucket (`item`: wire items per storage item)."""
        sends = [count * item for count in self.send_counts]
        if isinstance(action, Exchange):
            receives = [count * item for count in self.recv_counts]
            if async_op:
                return backend.ialltoallv(send, sends, recv, receives)
            backend.alltoallv(send, sends, recv, receives)
        elif async_op:
            return backend.ireduce_scatter(send, recv, sends, op)
        else:
            backend.reduce_scatter(send, recv, sends, op)
        return None

    def pack(self, buf: np.ndarray) -> None:
        """Write the arrays' rows into `buf`, destination by destination."""
        position, taken = 0, [0] * len(self.works)
        for i in range(len(self.send_counts)):
            for j, work in enumerate(self.works):
                rows = self.sends[j][i]
                items = rows * self.rows[j]
                if items:
                    segment = buf[position : position + items].reshape(rows, *work.shape[1:])
                    segment[...] = work[taken[j] : taken[j] + rows]
                taken[j] += rows
                position += items

    def unpack(self, recv: np.ndarray, deliver: Sequence[Callable[[np.ndarray], object]]) -> None:
        """Hand each array's result, from `recv`, to its `deliver` function, to keep.

        A result from one source, or of a bucket of one array, is a view of `recv` (which must not
        be reused); otherwise its rows are gathered from the sources' segments into a new array.
        """
        shapes = [
            (sum(parts), *work.shape[1:])
            for parts, work in zip(self.receives, self.works, strict=True)
        ]
        if len(self.recv_counts) == 1 or len(self.works) == 1:
            position = 0
            for shape, row, take in zip(shapes, self.rows, deliver, strict=True):
                items = shape[0] * row
                take(recv[position : position + items].reshape(shape))
                position += items
            return
        results = [np.empty(shape, recv.dtype) for shape in shapes]
        position, filled = 0, [0] * len(self.works)
        for i in range(len(self.recv_counts)):
            for j, result in enumerate(results):
                rows = self.receives[j][i]
                items = rows * self.rows[j]
                if items:
                    segment = recv[position : position + items].reshape(rows, *result.shape[1:])
                    result[filled[j] : filled[j] + rows] = segment
                filled[j] += rows
                position += items
        for result, take in zip(results, deliver, strict=True):
            take(result)


def layout_of(
    action: Scatter | Exchange, works: list[np.ndarray], rank: int, size: int
) -> Segments:
    """Return the layout of a bucket of `works` for `action` on rank `rank` of `size`."""
    if isinstance(action, Scatter):
        sends = [row_parts(work.shape[0], size) for work in works]
        return Segments(works, sends, [[parts[rank]] for parts in sends])
    return Segments(works, [list(action.splits)] * len(works), [list(action.received)] * len(works))

"""Buckets laid out by rank: what one reduce-scatter or all-to-all call sends and receives.

The fusion engine packs a bucket of arrays, each split along its first axis, so that one engine
call moves them all: the send buffer holds, for each destination rank in turn, that rank's rows of
every array in turn; the receive buffer holds, for each source rank in turn, the rows it sent of
every array in turn. A bucket of one contiguous array needs no packing: its rows are already in
rank order.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from typing import Any

import numpy as np

from dataparallel.engine.actions import Exchange, Scatter

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

    def unpack(self, recv: np.ndarray, deliver: list[Callable[[np.ndarray], Any]]) -> None:
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


def layout_of(action: Scatter | Exchange, works: list[Any], rank: int, size: int) -> Segments:
    """Return the layout of a bucket of `works` for `action` on rank `rank` of `size`."""
    if isinstance(action, Scatter):
        sends = [row_parts(work.shape[0], size) for work in works]
        return Segments(works, sends, [[parts[rank]] for parts in sends])
    return Segments(works, [list(action.splits)] * len(works), [list(action.received)] * len(works))

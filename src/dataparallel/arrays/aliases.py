"""Leaves of one call that share memory: `[a, a]`, `{"x": a, "y": a[:]}`, overlapping views.

A reduction's leaves are reduced in place when they can be (`Fusion` sends a large contiguous
array as itself), and the buckets of one call land one after another. Two leaves over the same
memory would then be reduced twice: the second one read after the first had been written. The
rule (Horovod's, through its fusion buffer): every leaf is reduced from the values it held when
the call began, once; where leaves overlap, their memory ends holding that result.

So in a call whose leaves may land apart, every leaf that overlaps another is given a copy of its
values before anything is sent (`unalias`), and the copy is written back when the call completes,
as a staged leaf is. Identical leaves and overlapping views alike: the shared part is reduced from
its original values, and every alias ends with the reduced value. Only host arrays are compared
(their byte ranges: conservative, interleaved views count as overlapping); GPU leaves are not.
"""

from __future__ import annotations

import ctypes
from collections.abc import Sequence

import numpy as np
from numpy.lib.array_utils import byte_bounds

__all__ = ["clusters", "overlapping", "span"]


def span(work: np.ndarray) -> tuple[int, int]:
    """Return the first and one past the last byte address `work` may touch.

    A contiguous writable array's address comes through the buffer protocol, several times
    cheaper than NumPy's `__array_interface__` (benchmarks/NOTES.md, "A leaf's address"); any
    other through `byte_bounds`.
    """
    if work.flags.c_contiguous and work.flags.writeable:  # typeshed: an ndarray is no Buffer
        low = ctypes.addressof(ctypes.c_char.from_buffer(work))  # type: ignore[arg-type]
        return low, low + work.nbytes
    low, high = byte_bounds(work)
    return low, high


def overlapping(works: Sequence[object]) -> list[int]:
    """Return the indices of the host arrays in `works` whose memory overlaps that of an
    earlier one (the first of each group of overlapping arrays is left out), in order.

    >>> a = np.zeros(10)
    >>> overlapping([a, np.zeros(3), a, a[5:], a[:2]])
    [2, 3, 4]
    """
    spans = []
    for i, work in enumerate(works):
        if type(work) is np.ndarray and work.size:
            low, high = span(work)
            spans.append((low, high, i))
    copies: list[int] = []
    for group in clusters(spans):
        copies += group[1:]
    return sorted(copies)


def clusters(spans: list[tuple[int, int, int]]) -> list[list[int]]:
    """Group `(low, high, index)` byte ranges into the groups of those that overlap (through
    others too); return the groups of two or more, each's indices in order.

    >>> clusters([(0, 8, 0), (16, 24, 1), (4, 12, 2), (10, 11, 3)])
    [[0, 2, 3]]
    """
    if len(spans) < 2:
        return []
    spans = sorted(spans)
    groups: list[list[int]] = []
    group: list[int] = []
    reach = -1
    for low, high, i in spans:
        if low >= reach:  # nothing met so far reaches this one: a new group begins
            if len(group) > 1:
                groups.append(sorted(group))
            group, reach = [i], high
        else:
            group.append(i)
            reach = max(reach, high)
    if len(group) > 1:
        groups.append(sorted(group))
    return groups

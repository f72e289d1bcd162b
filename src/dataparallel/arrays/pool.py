"""Host buffers allocated once and reused: `Fusion`'s memory after the first step."""

from __future__ import annotations

import sys
from math import prod

import numpy as np

__all__ = ["BufferPool"]

_MIN_CAPACITY = 1024
_ALIGN = 64  # what JAX needs to adopt NumPy memory without copying it
_MAX_LENT = 8  # buffers lent per (dtype, size) that the pool keeps track of
_UNREFERENCED = 3  # `sys.getrefcount` of a lent buffer only the pool holds: its list, the loop


class BufferPool:
    """Host buffers reused across flushes and calls, in power-of-two size classes per dtype."""

    def __init__(self) -> None:
        self._free: dict[tuple[np.dtype, int], list[np.ndarray]] = {}
        self._lent: dict[tuple[np.dtype, int], list[np.ndarray]] = {}

    def take(self, dtype: np.dtype, n: int) -> np.ndarray:
        """Return a 1-D buffer of `n` items (a view of a pooled buffer)."""
        capacity = max(_MIN_CAPACITY, 1 << max(n - 1, 0).bit_length())
        try:  # pop and append are atomic: a callback thread may share the pool with the main one
            base = self._free[(dtype, capacity)].pop()
        except (KeyError, IndexError):
            base = np.empty(capacity, dtype)
        return base[:n]

    def give(self, buf: np.ndarray) -> None:
        """Return a buffer obtained from `take` to the pool."""
        base = buf.base if buf.base is not None else buf
        assert isinstance(base, np.ndarray)
        self._free.setdefault((base.dtype, base.size), []).append(base)

    def lend(self, dtype: np.dtype, shape: tuple[int, ...]) -> np.ndarray:
        """Return a 64-byte aligned buffer of `shape` that the pool reuses once nothing refers
        to its memory any more: for results that a framework adopts without a copy (a JAX array
        made from NumPy memory holds it until JAX is done with it, computations in flight
        included; every view's `base` is the memory's owner, so its reference count says).
        """
        n = prod(shape)
        key = (np.dtype(dtype), n)
        itemsize = key[0].itemsize
        owners = self._lent.setdefault(key, [])
        for owner in owners:
            if sys.getrefcount(owner) == _UNREFERENCED:
                break
        else:
            owner = np.empty(n * itemsize + _ALIGN, np.uint8)
            if len(owners) < _MAX_LENT:
                owners.append(owner)
        start = -owner.ctypes.data % _ALIGN
        return owner[start : start + n * itemsize].view(key[0]).reshape(shape)

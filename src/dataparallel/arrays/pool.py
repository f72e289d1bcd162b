"""Buffers allocated once and reused: `Fusion`'s memory after the first step, and ZeRO's.

One pool, two sizing rules, any memory. The world's pool holds host NumPy buffers in
power-of-two size classes: a flush's buckets differ in size from call to call, and a class
serves them all. An owner whose buffers count against a memory bound (ZeRO stage 2's send and
receive buffers, in `ZeroRedundancyOptimizer.gradient_bytes`) takes them `exact`: made at the
size asked for, reused by any later request they can hold; a class would double a bucket's
buffer, and the smallest class alone outgrows a small bucket several times. Where the memory
lives (host NumPy, pinned host or device tensors of a framework) is the `Memory` the pool is
given; every pool counts the bytes it keeps (`allocated`).
"""

from __future__ import annotations

import sys
import weakref
from collections.abc import Hashable
from math import prod
from typing import Generic, Protocol, TypeVar

import numpy as np

__all__ = ["HOST", "BufferPool", "HostMemory", "Memory"]

_MIN_CAPACITY = 1024
_ALIGN = 64  # what JAX needs to adopt NumPy memory without copying it
_MAX_LENT = 8  # buffers lent per (dtype, size) that the pool keeps track of
# `sys.getrefcount` of a lent buffer only the pool holds: its entry, its aligned view (whose
# `base` it is), the loop's variable, the call's argument
_UNREFERENCED = 4

B = TypeVar("B")


class Memory(Protocol[B]):
    """Where a pool's buffers live: how to make one, find a view's whole buffer, size it."""

    def empty(self, dtype: Hashable, items: int) -> B: ...

    def base(self, buf: B) -> B: ...

    def nbytes(self, buf: B) -> int: ...


class HostMemory:
    """Host NumPy buffers."""

    def empty(self, dtype: Hashable, items: int) -> np.ndarray:
        return np.empty(items, np.dtype(dtype))  # type: ignore[call-overload]

    def base(self, buf: np.ndarray) -> np.ndarray:
        base = buf.base if buf.base is not None else buf
        assert isinstance(base, np.ndarray)
        return base

    def nbytes(self, buf: np.ndarray) -> int:
        return buf.nbytes


HOST = HostMemory()


class BufferPool(Generic[B]):
    """Buffers reused across flushes and calls, per dtype.

    Args:
        memory: where the buffers live (host NumPy by default).
        exact: make each buffer at the size asked for and reuse it for any request it holds (a
            free buffer too small for a request is dropped, so that no more buffers live than
            are in use at once); else power-of-two size classes of at least 1024 items.
    """

    def __init__(self, memory: Memory[B] = HOST, *, exact: bool = False) -> None:  # type: ignore[assignment]
        self.memory, self.exact = memory, exact
        self._free: dict[tuple[Hashable, int], list[B]] = {}  # exact: size -1, any size
        # Every buffer the pool made that is still alive, given out or free, by id (a buffer
        # dropped, or lost with a call that failed, leaves it once nothing holds it).
        self._kept: weakref.WeakValueDictionary[int, B] = weakref.WeakValueDictionary()
        # Each (dtype, size)'s lent buffers: the memory's owner, and its aligned view.
        self._lent: dict[tuple[np.dtype, int], list[tuple[np.ndarray, np.ndarray]]] = {}

    @property
    def allocated(self) -> int:
        """Bytes of the buffers this pool keeps, given out or free (lent ones included)."""
        lent = sum(owner.nbytes for owners in self._lent.values() for owner, _ in owners)
        return sum(self.memory.nbytes(buf) for buf in list(self._kept.values())) + lent

    def take(self, dtype: Hashable, n: int) -> B:
        """Return a 1-D buffer of `n` items (a view of a pooled buffer)."""
        if self.exact:
            base = self._fit(dtype, n)
        else:
            capacity = max(_MIN_CAPACITY, 1 << max(n - 1, 0).bit_length())
            try:  # pop and append are atomic: a callback thread may share the pool
                base = self._free[(dtype, capacity)].pop()
            except (KeyError, IndexError):
                base = self._make(dtype, capacity)
        return base[:n]  # type: ignore[index]

    def _fit(self, dtype: Hashable, n: int) -> B:
        free = self._free.setdefault((dtype, -1), [])
        for i, buf in enumerate(free):
            if len(buf) >= n:  # type: ignore[arg-type]
                return free.pop(i)
        if free:  # too small: dropped
            free.pop()
        return self._make(dtype, n)

    def _make(self, dtype: Hashable, n: int) -> B:
        base = self.memory.empty(dtype, n)
        self._kept[id(base)] = base
        return base

    def give(self, buf: B) -> None:
        """Return a buffer obtained from `take` to the pool."""
        base = self.memory.base(buf)
        size = -1 if self.exact else len(base)  # type: ignore[arg-type]
        self._free.setdefault((base.dtype, size), []).append(base)  # type: ignore[attr-defined]

    def lend(self, dtype: np.dtype, shape: tuple[int, ...]) -> np.ndarray:
        """Return a 64-byte aligned host buffer of `shape` that the pool reuses once nothing
        refers to its memory any more: for results that a framework adopts without a copy (a
        JAX array made from NumPy memory holds it until JAX is done with it, computations in
        flight included; every view's `base` is the memory's owner, so its reference count says).
        """
        n = prod(shape)
        key = (np.dtype(dtype), n)
        owners = self._lent.setdefault(key, [])
        for owner, kept in owners:
            if sys.getrefcount(owner) == _UNREFERENCED:
                aligned = kept
                break
        else:
            owner = np.empty(n * key[0].itemsize + _ALIGN, np.uint8)
            start = -owner.ctypes.data % _ALIGN
            aligned = owner[start : start + n * key[0].itemsize].view(key[0])
            if len(owners) < _MAX_LENT:
                owners.append((owner, aligned))
        return aligned.reshape(shape)

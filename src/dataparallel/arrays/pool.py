"""Host buffers allocated once and reused: `Fusion`'s memory after the first step."""

from __future__ import annotations

import numpy as np

__all__ = ["BufferPool"]

_MIN_CAPACITY = 1024


class BufferPool:
    """Host buffers reused across flushes and calls, in power-of-two size classes per dtype."""

    def __init__(self) -> None:
        self._free: dict[tuple[np.dtype, int], list[np.ndarray]] = {}

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

"""Flashlight's reducer framework: `InlineReducer` and `CoalescingReducer`, over `fusion.Fusion`.

A reducer ingests mutable arrays with `add` and completes their reduction with `finalize`; the
coalescing one caches them in fused buckets with Flashlight's flush rules (see `fusion.py`).
Every flush begins with a handshake (`protocol.handshake`): ranks whose reducers are about to send
different arrays raise `CollectiveMismatchError` instead of hanging or mixing buffers.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from bisect import bisect_right
from types import TracebackType
from typing import TypeVar

import numpy as np

from dataparallel import world
from dataparallel.arrays.actions import Reduction, reduction, validate_reduction
from dataparallel.arrays.aliases import span
from dataparallel.arrays.families import family_of, stage
from dataparallel.arrays.fusion import Fusion
from dataparallel.arrays.replay import Replay
from dataparallel.backends.base import Backend
from dataparallel.groups import Group, backend_of
from dataparallel.protocol import ReplayOf, handshake
from dataparallel.types import Op

__all__ = ["CoalescingReducer", "InlineReducer", "Reducer"]


_R = TypeVar("_R", bound="Reducer")


class Reducer(ABC):
    """Flashlight's reducer interface: ingest arrays with `add`, complete them with `finalize`."""

    @abstractmethod
    def add(self, x: object) -> None:
        """Ingest a mutable array; it holds its reduced value once the reducer is finalized."""

    @abstractmethod
    def finalize(self) -> None:
        """Complete every reduction started by `add`."""

    def __enter__(self: _R) -> _R:
        return self

    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        self.finalize()


class _FusionReducer(Reducer):
    """A reducer over `Fusion`; leaves without a writable host view are copied and written back."""

    def __init__(
        self,
        scale: float,
        *,
        op: Op,
        async_op: bool,
        contiguous: bool,
        bucket_bytes: int | None,
        backend: Backend | None,
    ) -> None:
        active = world.current()
        self.backend = backend if backend is not None else active.backend
        action = reduction(op, scale, self.backend.size)
        self.op, self.scale = op, float(scale)
        self._fusion = Fusion(
            self.backend,
            action,
            bucket_bytes=active.settings.bucket_bytes if bucket_bytes is None else bucket_bytes,
            async_op=async_op,
            contiguous=contiguous,
            pool=active.buffers,
            timeline=active.timeline,
            keep_open=False,  # the contract: the cache is flushed before an oversize array
        )
        if self.backend.size > 1:
            self._fusion.before_launch = self._agree
        self._valid_dtypes: set[str] = set()  # dtypes already checked against op and scale
        # The byte ranges of the arrays added since the last finalize, disjoint, sorted by start.
        self._starts: list[int] = []
        self._ends: list[int] = []
        self._contiguous: list[np.ndarray] = []  # ... their arrays, in the same order
        self._strided: list[np.ndarray] = []  # the strided ones, compared exactly
        self._added: list[np.ndarray] = []  # every one

    @property
    def bucket_bytes(self) -> int:
        """The flush threshold, in bytes."""
        return self._fusion.bucket_bytes

    @property
    def calls(self) -> int:
        """Communication calls made so far."""
        return self._fusion.calls

    def _agree(self, buckets: list[tuple[str, int]]) -> None:
        """Check that every rank is about to reduce the same buckets (`protocol.handshake`)."""
        name = type(self).__name__
        sizes = ", ".join(f"{dtype}[{items}]" for dtype, items in buckets)
        call = {"collective": f"{name} flush", "op": self.op, "scale": self.scale, "arrays": sizes}
        handshake(self.backend, repr(sorted(call.items())), call, replay=self._replay(buckets))

    def _replay(self, buckets: list[tuple[str, int]]) -> ReplayOf:
        """What a flush sends, one call per bucket, for ranks that have joined (`dp.join`)."""
        fusion = self._fusion
        if not fusion.contiguous or not isinstance(fusion.action, Reduction):
            return None  # one call per array: not described by the buckets alone
        action = fusion.action
        # Distinct keys: each bucket is its own call, as in the flush described.
        adds = [((i,), dtype, (items,)) for i, (dtype, items) in enumerate(buckets)]
        return lambda _: Replay.of(
            action, [adds], bucket_bytes=fusion.bucket_bytes, async_op=fusion.async_op
        )

    def add(self, x: object) -> None:
        family = family_of(x)
        if not family.mutable:
            raise TypeError(
                f"{type(self).__name__}.add takes mutable arrays (NumPy, PyTorch, CuPy), since it "
                f"reduces in place; got an immutable {family.name} value. Use "
                "`x = dp.allreduce(x)` for JAX arrays and numbers."
            )
        if isinstance(x, np.ndarray) and not x.flags.writeable:
            raise TypeError(
                f"{type(self).__name__}.add takes writable arrays, since it reduces in place; got "
                "a read-only NumPy array. Pass a writable copy (`np.array(x)`), or use "
                "`x = dp.allreduce(x)`."
            )
        dtype = family.dtype(x)
        if dtype not in self._valid_dtypes:
            validate_reduction(dtype, self.op, self.scale if self.scale != 1 else None, "x")
            self._valid_dtypes.add(dtype)
        staged = stage(family, x)
        work = staged[2]
        if staged[3] and type(work) is np.ndarray and work.size and self._seen(work):
            return  # added already since the last finalize: it will hold its reduced value once
        self._fusion.add_leaf(family, x, dtype, family.device(x), staged)

    def _seen(self, work: np.ndarray) -> bool:
        """Record the memory of `work` (a view of an added array) for this round; return whether
        the very same memory was added already. An array that overlaps another one without
        being the same memory is refused: its shared part would be reduced twice."""
        for other in self._strided:  # strided views, compared exactly (rare: one by one)
            if np.shares_memory(work, other):
                return self._same(work, other)
        if not work.flags.c_contiguous:
            for other in self._added:
                if np.shares_memory(work, other):
                    return self._same(work, other)
            self._strided.append(work)
            self._added.append(work)
            return False
        low, high = span(work)  # contiguous: byte ranges overlap exactly when memory does
        starts, ends = self._starts, self._ends
        i = bisect_right(starts, low)
        if i and ends[i - 1] > low:
            return self._same(work, self._contiguous[i - 1])
        if i < len(starts) and starts[i] < high:
            return self._same(work, self._contiguous[i])
        starts.insert(i, low)
        ends.insert(i, high)
        self._contiguous.insert(i, work)
        self._added.append(work)
        return False

    def _same(self, work: np.ndarray, other: np.ndarray) -> bool:
        """Return True if `work` is `other`'s very memory, element for element; else refuse it."""
        if work.dtype == other.dtype and span(work) == span(other):
            if (work.shape, work.strides) == (other.shape, other.strides):
                return True
            if work.flags.c_contiguous and other.flags.c_contiguous:
                return True  # the same bytes in another shape (a tensor and its view(-1))
        raise ValueError(
            f"{type(self).__name__}.add: this array shares memory with an array added since the "
            "last finalize() without being the same array, so their shared part would be "
            "reduced twice; add the whole array once, or finalize() between the two."
        )

    def _overlap(self) -> None:
        raise ValueError(
            f"{type(self).__name__}.add: this array shares memory with an array added since the "
            "last finalize() without being the same array, so their shared part would be "
            "reduced twice; add the whole array once, or finalize() between the two."
        )

    def finalize(self) -> None:
        self._starts, self._ends, self._contiguous, self._strided, self._added = [], [], [], [], []
        self._fusion.wait()


class InlineReducer(_FusionReducer):
    """Allreduce (sum) each added array at once, then multiply it by `scale`.

    Args:
        scale: factor applied after the sum (default 1.0); `1 / dp.size()` averages.
        backend: the engine to use (default: the active one).
        group: run among the ranks of this `dp.new_group` group (default: the world).

    >>> import numpy as np, dataparallel as dp
    >>> _ = dp.initialize("single")
    >>> g = np.ones(3, np.float32)
    >>> dp.InlineReducer(scale=0.5).add(g); g
    array([0.5, 0.5, 0.5], dtype=float32)
    """

    def __init__(
        self, scale: float = 1.0, *, backend: Backend | None = None, group: Group | None = None
    ) -> None:
        super().__init__(
            scale,
            op="sum",
            async_op=False,
            contiguous=True,
            bucket_bytes=1,
            backend=backend_of(backend, group),
        )

    def add(self, x: object) -> None:
        super().add(x)
        self.finalize()


class CoalescingReducer(_FusionReducer):
    """Cache added arrays and allreduce (sum) them in fused buckets, then multiply by `scale`.

    Flashlight's flush rules: when the cached bytes plus the new array would exceed `bucket_bytes`,
    the cache is flushed first (one call per (device, dtype) bucket, GPU ones per family too); an
    array larger than `bucket_bytes` is reduced on its own. After `finalize()` (or leaving the
    `with` block) every added array holds its scaled sum.

    Args:
        scale: factor applied after the sum (default 1.0).
        async_op: start flushes without blocking (default True); `finalize` waits.
        contiguous: pack each bucket into one buffer (default True); False makes one call per array.
        bucket_bytes: flush threshold (default `DATAPARALLEL_BUCKET_BYTES`, 256 KiB, chosen
            with `benchmarks/bucket_size.py`).
        op: `"sum"` (default, as Flashlight), or `"avg"`, `"min"`, `"max"`, `"prod"`.
        backend: the engine to use (default: the active one).
        group: run among the ranks of this `dp.new_group` group (default: the world).

    >>> import numpy as np, dataparallel as dp
    >>> _ = dp.initialize("single")
    >>> a, b = np.ones(2), np.ones(3)
    >>> with dp.CoalescingReducer(scale=2.0) as reducer:
    ...     reducer.add(a); reducer.add(b)
    >>> a, b
    (array([2., 2.]), array([2., 2., 2.]))
    """

    def __init__(
        self,
        scale: float = 1.0,
        *,
        async_op: bool = True,
        contiguous: bool = True,
        bucket_bytes: int | None = None,
        op: Op = "sum",
        backend: Backend | None = None,
        group: Group | None = None,
    ) -> None:
        super().__init__(
            scale,
            op=op,
            async_op=async_op,
            contiguous=contiguous,
            bucket_bytes=bucket_bytes,
            backend=backend_of(backend, group),
        )

    def flush(self) -> None:
        """Start reducing everything cached, without waiting."""
        self._fusion.flush()

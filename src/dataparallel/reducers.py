"""The one fusion engine (Flashlight's reducers, Horovod's tensor fusion, DDP's buckets).

Arrays handed to a reducer are cached in buckets per (array family, device, dtype); when the
cached bytes plus the next array would pass `bucket_bytes`, the cache is flushed: each bucket is
packed into one contiguous buffer and reduced with one call, non-blocking when `async_op`. An
array larger than `bucket_bytes` is reduced on its own, in place when it is contiguous (no copy at
all). Buffers come from a pool and are reused once their call completes. `finalize()` flushes,
waits and unpacks. Buckets of GPU leaves are packed on their device (`devices.DeviceBucket`) and
handed to the backend there, or staged through pinned host memory once per bucket.

The tree collectives (`dp.allreduce`, `dp.reduce`, `dp.broadcast`, ...) and the optimizers all run
on `Fusion`; `InlineReducer` and `CoalescingReducer` are its public faces.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from dataclasses import dataclass, field
from types import TracebackType
from typing import Any, TypeVar

import numpy as np

from dataparallel import world
from dataparallel.arrays import (
    BufferPool,
    Family,
    bf16_to_f32,
    f32_to_bf16,
    family_of,
    storage_dtype,
)
from dataparallel.backends.base import Backend, ReduceOp, Request
from dataparallel.checks import parse_op, validate_reduction
from dataparallel.devices import DeviceBucket, DeviceWork
from dataparallel.timeline import Timeline

__all__ = [
    "Broadcast",
    "CoalescingReducer",
    "Fusion",
    "InlineReducer",
    "Reducer",
    "Reduction",
]


@dataclass(frozen=True)
class Reduction:
    """Reduce with `op`, then multiply by `scale`; to every rank, or to `root` only."""

    op: ReduceOp
    scale: float | None = None
    root: int | None = None


@dataclass(frozen=True)
class Broadcast:
    """Copy `root`'s values to every rank."""

    root: int


@dataclass
class _Flight:
    """One communication call in flight and what to do when it lands."""

    request: Request | None
    dtype: str
    buf: np.ndarray  # storage-dtype values, 1-D
    wire: np.ndarray  # what the engine reduces (buf, or a widened copy)
    slots: list[tuple[np.ndarray, int]] = field(default_factory=list)  # (work, offset) to unpack
    pooled: list[np.ndarray] = field(default_factory=list)
    span: int = 0  # the timeline's id of the communicate phase
    device: DeviceBucket | None = None  # the GPU bucket this flight carries (devices.py)


class Fusion:
    """Bucket arrays, communicate each bucket with one call, unpack the results.

    Args:
        backend: the engine.
        action: a `Reduction` or a `Broadcast`.
        bucket_bytes: flush threshold.
        async_op: start calls without blocking (`finalize` waits).
        contiguous: pack a flush into one buffer per bucket (else one call per array).
        pool: where buffers come from.
        timeline: records queue/pack/communicate/unpack phases when given.
    """

    def __init__(
        self,
        backend: Backend,
        action: Reduction | Broadcast,
        *,
        bucket_bytes: int,
        async_op: bool = True,
        contiguous: bool = True,
        pool: BufferPool | None = None,
        timeline: Timeline | None = None,
    ) -> None:
        if bucket_bytes < 1:
            raise ValueError(f"bucket_bytes={bucket_bytes} must be positive.")
        self.backend, self.action = backend, action
        self.bucket_bytes, self.async_op, self.contiguous = bucket_bytes, async_op, contiguous
        self.pool = pool if pool is not None else BufferPool()
        self._open: dict[tuple[Any, ...], list[np.ndarray]] = {}
        self._open_bytes = 0
        self._flights: list[_Flight] = []
        self.timeline = timeline
        self._opened_at: dict[tuple[Any, ...], float] = {}
        self.calls = 0  # communication calls made (observable for tests and the timeline)

    def add(self, work: np.ndarray, dtype: str, key: tuple[Any, ...] = ()) -> None:
        """Queue `work` (a writable host array in `dtype`'s storage) for the collective."""
        nbytes = work.nbytes
        if nbytes > self.bucket_bytes:
            self.flush()  # as Flashlight: the cache goes first, then the oversize array alone
            self._launch([work], dtype)
            return
        if self._open_bytes + nbytes > self.bucket_bytes:
            self.flush()
        elif self._flights:
            # MPI progresses non-blocking collectives only inside MPI calls: testing the oldest
            # flight (about 1 us) moves them all along while the caller is still producing arrays.
            oldest = self._flights[0].request
            if oldest is not None:
                oldest.test()
        bucket_key = (*key, dtype)
        if self.timeline is not None and bucket_key not in self._open:
            self._opened_at[bucket_key] = self.timeline.now()
        self._open.setdefault(bucket_key, []).append(work)
        self._open_bytes += nbytes

    def flush(self) -> None:
        """Start communicating everything cached."""
        for bucket_key, works in self._open.items():
            dtype = bucket_key[-1]
            if self.timeline is not None:
                self._trace_queue(bucket_key, len(works))
            if self.contiguous:
                self._launch(works, dtype)
            else:
                for work in works:
                    self._launch([work], dtype)
        self._open.clear()
        self._open_bytes = 0

    def test(self) -> bool:
        """Return whether every call started so far has completed."""
        return all(f.request is None or f.request.test() for f in self._flights)

    def finalize(self) -> None:
        """Flush, wait for every call, and write the results into the queued arrays."""
        self.flush()
        flights, self._flights = self._flights, []
        for flight in flights:
            self._land(flight)

    def _trace_queue(self, bucket_key: tuple[Any, ...], arrays: int) -> None:
        assert self.timeline is not None
        opened = self._opened_at.pop(bucket_key, None)
        if opened is not None:
            self.timeline.complete("queue", opened, bucket=str(bucket_key), arrays=arrays)

    def _launch(self, works: list[np.ndarray], dtype: str) -> None:
        timeline = self.timeline
        if timeline is None:
            flight = self._pack(works, dtype)
        else:
            packing = timeline.now()
            flight = self._pack(works, dtype)
            timeline.complete(
                "pack", packing, dtype=dtype, arrays=len(works), bytes=flight.buf.nbytes
            )
            flight.span = timeline.begin("communicate", dtype=dtype, bytes=flight.wire.nbytes)
        self._start(flight)
        self.calls += 1
        if self.async_op:
            self._flights.append(flight)
        else:
            self._land(flight)

    def _pack(self, works: list[np.ndarray], dtype: str) -> _Flight:
        if type(works[0]) is DeviceWork:
            return self._pack_device(works, dtype)
        if len(works) == 1 and works[0].flags.c_contiguous:
            buf = works[0].reshape(-1)  # zero-copy: communicate in place
            flight = _Flight(None, dtype, buf, buf)
        else:
            buf = self.pool.take(storage_dtype(dtype), sum(w.size for w in works))
            flight = _Flight(None, dtype, buf, buf, pooled=[buf])
            offset = 0
            for work in works:
                buf[offset : offset + work.size].reshape(work.shape)[...] = work
                flight.slots.append((work, offset))
                offset += work.size
        if isinstance(self.action, Broadcast) or dtype == "bool":
            flight.wire = buf.view(np.uint8)
        elif dtype not in self.backend.native_dtypes:
            wide = self.pool.take(np.dtype(np.float32), buf.size)
            if dtype == "bfloat16":
                bf16_to_f32(buf, out=wide)
            else:
                wide[...] = buf
            flight.wire = wide
            flight.pooled.append(wide)
        return flight

    def _pack_device(self, works: list[Any], dtype: str) -> _Flight:
        """Pack GPU leaves on their device; hand the bucket over there, or stage it once."""
        bucket = DeviceBucket(works, dtype)
        if self.backend.accepts_device(bucket.device):
            wire = bucket.send_direct(self.backend, isinstance(self.action, Broadcast))
            return _Flight(None, dtype, bucket.buf, wire, device=bucket)
        flight = self._pack([bucket.stage()], dtype)  # one host buffer: communicated in place
        flight.device = bucket
        return flight

    def _start(self, flight: _Flight) -> None:
        action, backend, wire = self.action, self.backend, flight.wire
        if isinstance(action, Broadcast):
            if self.async_op:
                flight.request = backend.ibroadcast(wire, action.root)
            else:
                backend.broadcast(wire, action.root)
            return
        op = action.op
        if flight.dtype == "bool":  # logical or / and, as NumPy adds and multiplies booleans
            op = {ReduceOp.SUM: ReduceOp.MAX, ReduceOp.PROD: ReduceOp.MIN}.get(op, op)
        if action.root is not None:
            backend.reduce(wire, op, action.root)
        elif self.async_op:
            flight.request = backend.iallreduce(wire, op)
        else:
            backend.allreduce(wire, op)

    def _receives(self) -> bool:
        action, rank = self.action, self.backend.rank
        if isinstance(action, Broadcast):
            return rank != action.root
        return action.root is None or action.root == rank

    def _land(self, flight: _Flight) -> None:
        if flight.request is not None:
            flight.request.wait()
        timeline = self.timeline
        if timeline is not None:
            timeline.end("communicate", flight.span)
            unpacking = timeline.now()
        receives = self._receives()
        if flight.device is not None and flight.device.direct:
            scale = None if isinstance(self.action, Broadcast) else self.action.scale
            flight.device.land(receives, scale)
        elif receives:
            scale = None if isinstance(self.action, Broadcast) else self.action.scale
            if scale is not None and scale != 1:
                _scale_in_place(flight.wire, scale)
            if flight.wire is not flight.buf and flight.wire.dtype != np.uint8:
                if flight.dtype == "bfloat16":
                    f32_to_bf16(flight.wire, out=flight.buf)
                else:
                    flight.buf[...] = flight.wire
            for work, offset in flight.slots:
                work[...] = flight.buf[offset : offset + work.size].reshape(work.shape)
        if flight.device is not None and not flight.device.direct:
            flight.device.unstage(receives)
        for buf in flight.pooled:
            self.pool.give(buf)
        if timeline is not None:
            timeline.complete("unpack", unpacking, arrays=len(flight.slots))


def _scale_in_place(values: np.ndarray, scale: float) -> None:
    if values.dtype.kind in "iu":
        np.multiply(values, int(scale), out=values, casting="unsafe")
    else:
        np.multiply(values, scale, out=values, casting="unsafe")


_R = TypeVar("_R", bound="Reducer")


class Reducer(ABC):
    """Flashlight's reducer interface: ingest arrays with `add`, complete them with `finalize`."""

    @abstractmethod
    def add(self, x: Any) -> None:
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
        op: str,
        async_op: bool,
        contiguous: bool,
        bucket_bytes: int | None,
        backend: Backend | None,
    ) -> None:
        active = world.current()
        self.backend = backend if backend is not None else active.backend
        engine_op, average = parse_op(op)
        self.op, self.scale = op, float(scale)
        total = self.scale / self.backend.size if average else self.scale
        self._fusion = Fusion(
            self.backend,
            Reduction(engine_op, total if total != 1 else None),
            bucket_bytes=active.settings.bucket_bytes if bucket_bytes is None else bucket_bytes,
            async_op=async_op,
            contiguous=contiguous,
            pool=active.buffers,
            timeline=active.timeline,
        )
        self._staged: list[tuple[Family, Any, np.ndarray]] = []

    @property
    def bucket_bytes(self) -> int:
        """The flush threshold, in bytes."""
        return self._fusion.bucket_bytes

    @property
    def calls(self) -> int:
        """Communication calls made so far."""
        return self._fusion.calls

    def add(self, x: Any) -> None:
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
        validate_reduction(dtype, self.op, self.scale if self.scale != 1 else None, "x")
        work, is_view = family.work(x)
        if not is_view:
            self._staged.append((family, x, work))
        self._fusion.add(work, dtype, (family.name, family.device(x)))

    def finalize(self) -> None:
        self._fusion.finalize()
        staged, self._staged = self._staged, []
        for family, x, work in staged:
            family.from_host(x, work)


class InlineReducer(_FusionReducer):
    """Allreduce (sum) each added array at once, then multiply it by `scale`.

    Args:
        scale: factor applied after the sum (default 1.0); `1 / dp.size()` averages.
        backend: the engine to use (default: the active one).

    >>> import numpy as np, dataparallel as dp
    >>> _ = dp.initialize("single")
    >>> g = np.ones(3, np.float32)
    >>> dp.InlineReducer(scale=0.5).add(g); g
    array([0.5, 0.5, 0.5], dtype=float32)
    """

    def __init__(self, scale: float = 1.0, *, backend: Backend | None = None) -> None:
        super().__init__(
            scale, op="sum", async_op=False, contiguous=True, bucket_bytes=1, backend=backend
        )

    def add(self, x: Any) -> None:
        super().add(x)
        self.finalize()


class CoalescingReducer(_FusionReducer):
    """Cache added arrays and allreduce (sum) them in fused buckets, then multiply by `scale`.

    Flashlight's flush rules: when the cached bytes plus the new array would exceed `bucket_bytes`,
    the cache is flushed first (one call per (family, device, dtype) bucket); an array larger than
    `bucket_bytes` is reduced on its own. After `finalize()` (or leaving the `with` block) every
    added array holds its scaled sum.

    Args:
        scale: factor applied after the sum (default 1.0).
        async_op: start flushes without blocking (default True); `finalize` waits.
        contiguous: pack each bucket into one buffer (default True); False makes one call per array.
        bucket_bytes: flush threshold (default `DATAPARALLEL_BUCKET_BYTES`, 4 MiB, measured in
            `benchmarks/bucket_size.py`).
        op: `"sum"` (default, as Flashlight), or `"avg"`, `"min"`, `"max"`, `"prod"`.
        backend: the engine to use (default: the active one).

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
        op: str = "sum",
        backend: Backend | None = None,
    ) -> None:
        super().__init__(
            scale,
            op=op,
            async_op=async_op,
            contiguous=contiguous,
            bucket_bytes=bucket_bytes,
            backend=backend,
        )

    def flush(self) -> None:
        """Start reducing everything cached, without waiting."""
        self._fusion.flush()

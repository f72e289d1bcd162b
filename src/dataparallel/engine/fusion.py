"""The one fusion engine (Horovod's tensor fusion, DDP's buckets, Flashlight's coalescing).

Arrays handed to `Fusion` are cached in buckets per (array family, device, dtype); when the
cached bytes plus the next array would pass `bucket_bytes`, the cache is flushed: each bucket is
packed into one contiguous buffer and reduced with one call, non-blocking when `async_op`. An
array larger than `bucket_bytes` is reduced on its own, in place when it is contiguous (no copy at
all). Buffers come from a pool and are reused once their call completes. `wait()` flushes,
waits and unpacks. Buckets of GPU leaves are packed on their device (`device.DeviceBucket`) and
handed to the backend there, or staged through pinned host memory once per bucket.

The tree collectives (`dp.allreduce`, `dp.reduce`, `dp.broadcast`, ...), the reducers and the
optimizers all run on `Fusion`; there is no second engine.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import numpy as np

from dataparallel.backends.base import Backend, Handle, ReduceOp
from dataparallel.engine.arrays import Family
from dataparallel.engine.device import DeviceBucket, DeviceWork
from dataparallel.engine.dtypes import bf16_to_f32, f32_to_bf16, storage_dtype
from dataparallel.engine.pool import BufferPool
from dataparallel.engine.trace import Timeline

__all__ = ["Broadcast", "Fusion", "Reduction"]

# Calls in flight at once before the oldest is waited for. MPI progresses non-blocking collectives
# only inside MPI calls, so a second call in flight adds no overlap, and many at once slow MPICH
# down (measured: 50 arrays of 80 KB sent alone took 3.4 ms with all in flight, 1.7-2.5 ms with
# one; docs/performance.md). The caller still overlaps its own work with the one in flight.
MAX_IN_FLIGHT = 1


@dataclass(frozen=True)
class Reduction:
    """Reduce with `op`, then multiply by `scale`; to every rank, or to `root` only."""

    op: ReduceOp
    scale: float | None = None
    root: int | None = None

    def __str__(self) -> str:
        text = f"op={self.op.value}"
        text += "" if self.scale is None else f" scale={self.scale:g}"
        return text + ("" if self.root is None else f" root={self.root}")


@dataclass(frozen=True)
class Broadcast:
    """Copy `root`'s values to every rank."""

    root: int

    def __str__(self) -> str:
        return f"root={self.root}"


@dataclass
class _Flight:
    """One communication call in flight and what to do when it lands."""

    request: Handle | None
    dtype: str
    buf: np.ndarray  # storage-dtype values, 1-D
    wire: Any  # what the engine gets: buf, a widened copy, or a DeviceBuffer
    slots: list[tuple[np.ndarray, int]] = field(default_factory=list)  # (work, offset) to unpack
    pooled: list[np.ndarray] = field(default_factory=list)
    span: int = 0  # the timeline's id of the communicate phase
    device: DeviceBucket | None = None  # the GPU bucket this flight carries (device.py)


class Fusion:
    """Bucket arrays, communicate each bucket with one call, unpack the results.

    Args:
        backend: the engine.
        action: a `Reduction` or a `Broadcast`.
        bucket_bytes: flush threshold.
        async_op: start calls without blocking (`wait` completes them).
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
        self._leaves: list[tuple[Family, Any, Any, bool]] = []  # (family, leaf, work, is_view)
        self.calls = 0  # communication calls made (observable for tests and the timeline)

    def add_leaf(self, family: Family, x: Any, dtype: str, device: str) -> None:
        """Queue leaf `x` of `family`: through a zero-copy view, or a staged copy written back.

        `wait()` returns the leaves' results in the order they were added.
        """
        work, is_view = family.work(x)
        self._leaves.append((family, x, work, is_view))
        self.add(work, dtype, (family.name, device))

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

    def wait(self) -> list[Any]:
        """Flush, wait for every call, write the results into the queued arrays.

        Returns:
            The result of each leaf given to `add_leaf` since the last `wait`, in order: mutable
            leaves written in place (staged ones copied back), new values for immutable ones,
            and the leaves unchanged on a rank that receives nothing (a reduce's non-roots, a
            broadcast's root).
        """
        self.flush()
        flights, self._flights = self._flights, []
        for flight in flights:
            self._land(flight)
        leaves, self._leaves = self._leaves, []
        if not self._receives():
            return [x for _, x, _, _ in leaves]
        return [x if is_view else family.from_host(x, work) for family, x, work, is_view in leaves]

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
            if len(self._flights) > MAX_IN_FLIGHT:
                self._land(self._flights.pop(0))
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
    elif values.dtype == np.float16:  # in float32, as the engines' own half-precision math is
        np.multiply(values, np.float32(scale), out=values, dtype=np.float32, casting="unsafe")
    else:
        np.multiply(values, scale, out=values, casting="unsafe")

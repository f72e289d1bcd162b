"""The one `Fusion` (Horovod's tensor fusion, DDP's buckets): the life of a bucket.

Arrays handed to `Fusion` are cached in buckets per the key the caller gives (host arrays: per
(device, dtype) whatever their family; GPU ones per (array family, device, dtype)); when the
cached bytes plus the next array would pass `bucket_bytes`, the cache is flushed. Each bucket then
lives three steps, all here: packed into one buffer from a pool (`Flight`), carried by one engine
call (`start`), non-blocking when `async_op`, and landed (`settle`, `unpack`): waited for,
unpacked into the arrays and scaled. An array larger than `bucket_bytes` goes alone, in place
when contiguous. Buckets of GPU leaves are packed on their device (`device.DeviceBucket`) and
handed to the engine there, or staged through pinned host memory once per bucket. With a
`compression` wire dtype, floating buckets travel as 16-bit floats (`compression.py`).

Reduce-scatter (`Scatter`) and all-to-all (`Exchange`) split every array along its first axis
by rank: a bucket is laid out rank by rank (`segments.py`) so that one call moves it all, and the
results, which change shape, are handed to a `deliver` function per array instead of being
written back. They take host arrays only. A reduce-scatter of a bucket its caller packs and
splits itself (a ZeRO bucket's padded segments: `ShardFlight`) is one of the flights too, so that
one record bounds what is in flight.

The tree collectives (`dp.allreduce`, `dp.reduce`, `dp.broadcast`, `dp.reducescatter`,
`dp.alltoall`, ...), the reducers and the optimizers all run on `Fusion`; there is no second engine.
"""

from __future__ import annotations

import itertools
import math
import time
from collections.abc import Callable, Hashable, Sequence
from dataclasses import dataclass
from typing import NamedTuple, TypeAlias, cast

import numpy as np

from dataparallel.arrays.actions import Action, Broadcast, Exchange, Reduction, Scatter
from dataparallel.arrays.compression import COMPRESSIBLE, WIRE_DTYPES, from_wire, to_wire
from dataparallel.arrays.device import DeviceBucket, DeviceWork
from dataparallel.arrays.dtypes import (
    bf16_to_f32,
    f32_to_bf16,
    prescalable,
    prescale,
    prescaled_copy,
    scale_in_place,
    storage_dtype,
)
from dataparallel.arrays.families import Family, Staged, Work, stage, write_back
from dataparallel.arrays.pool import BufferPool
from dataparallel.arrays.segments import Segments, layout_of
from dataparallel.arrays.trace import Timeline
from dataparallel.backends.base import Backend, DeviceBuffer, Handle, ReduceOp
from dataparallel.types import WireDtype

__all__ = [
    "HOST_KEY",
    "Action",
    "BucketKey",
    "Deliver",
    "DeviceFlight",
    "Flight",
    "Fusion",
    "HostFlight",
    "InFlight",
    "SegmentFlight",
    "ShardFlight",
    "allreduce_into_scaled",
    "allreduce_scaled",
    "bucket_views",
    "pack_bucket",
    "settle",
    "start",
    "unpack",
]

# What a caller buckets arrays by (the dtype is added to it): (array family, device) for GPU leaves.
BucketKey: TypeAlias = tuple[Hashable, ...]
HOST_KEY: BucketKey = ("host", "cpu")  # the bucket key of every host buffer, whatever its family


Deliver = Callable[[np.ndarray], object]  # where a result handed over goes (`Fusion.add`)


@dataclass(frozen=True, slots=True, eq=False)
class HostFlight:
    """A host bucket: one array communicated in place, or several packed into a pooled buffer."""

    dtype: str
    buf: np.ndarray  # storage-dtype values, 1-D
    wire: np.ndarray  # what the engine gets: `buf`, its bytes, or a float32 or 16-bit copy
    slots: tuple[tuple[np.ndarray, int], ...] = ()  # (work, offset) to unpack; none in place
    pooled: tuple[np.ndarray, ...] = ()  # buffers to give back to the pool once landed
    compressed: WireDtype | None = None  # the 16-bit dtype `wire` holds, when compressed
    prescaled: bool = False  # scaled before the call (`dtypes.prescale`): nothing to do after
    staged: DeviceBucket | None = None  # a GPU bucket staged through `buf`, copied back on landing
    # (first slot, slots, deliver) of each pack in the bucket (`Fusion.add_pack`)
    packs: tuple[tuple[int, int, Deliver], ...] = ()


@dataclass(frozen=True, slots=True, eq=False)
class DeviceFlight:
    """A GPU bucket handed to the engine on its device (`device.DeviceBucket.send_direct`)."""

    dtype: str
    bucket: DeviceBucket
    wire: DeviceBuffer


@dataclass(frozen=True, slots=True, eq=False)
class SegmentFlight:
    """A reduce-scatter's or all-to-all's bucket, laid out rank by rank (`segments.Segments`)."""

    dtype: str
    buf: np.ndarray  # the send buffer, storage dtype
    wire: np.ndarray  # what the engine reads: `buf`, its bytes, or a float32 copy
    layout: Segments
    recv: np.ndarray  # the results, storage dtype, kept by the callers (not pooled)
    recv_wire: np.ndarray  # what the engine fills: `recv`, its bytes, or a float32 buffer
    deliver: tuple[Deliver, ...]  # where each array's result goes
    pooled: tuple[np.ndarray, ...] = ()


@dataclass(frozen=True, slots=True, eq=False)
class ShardFlight:
    """A reduce-scatter of a buffer its caller packed, split by the per-rank `counts` it gives:
    this rank's part of the sum lands in `recv`, which is then handed to `land` (that writes it
    where it belongs, by copy or add, and takes the caller's buffers back)."""

    dtype: str
    wire: np.ndarray  # what the engine reads, the counts' sum of items
    recv: np.ndarray  # what the engine fills: this rank's count of items
    counts: tuple[int, ...]
    land: Deliver
    pooled: tuple[np.ndarray, ...] = ()  # nothing of the pool's: the caller's buffers


# One engine call's worth of a bucket, packed; dispatched on by type when it starts and lands.
Flight: TypeAlias = HostFlight | DeviceFlight | SegmentFlight | ShardFlight


class InFlight(NamedTuple):
    """A started `Flight`: the engine's handle (None: it completed in the call), the
    timeline's id of its communicate phase, and its number among the calls (`Fusion.calls`)."""

    flight: Flight
    handle: Handle | None
    span: int
    call: int


class Fusion:
    """Bucket arrays, communicate each bucket with one call, unpack the results.

    Args:
        backend: the engine.
        action: a `Reduction`, `Broadcast`, `Scatter` or `Exchange`.
        bucket_bytes: flush threshold.
        async_op: start calls without blocking (`wait` completes them).
        contiguous: pack a flush into one buffer per bucket (else one call per array).
        pool: where buffers come from.
        timeline: records queue/pack/communicate/unpack phases when given.
        compression: `"float16"` or `"bfloat16"`: the wire dtype of floating buckets of an
            allreduce (see `compression.py`), or None.
        keep_open: an array larger than `bucket_bytes` goes alone at once and the open bucket
            keeps filling (fewer calls where large and small arrays alternate, as in a ResNet);
            False: the open bucket goes first (Flashlight's reducers).
    """

    def __init__(
        self,
        backend: Backend,
        action: Action,
        *,
        bucket_bytes: int,
        async_op: bool = True,
        contiguous: bool = True,
        pool: BufferPool | None = None,
        timeline: Timeline | None = None,
        compression: str | None = None,
        keep_open: bool = True,
    ) -> None:
        if bucket_bytes < 1:
            raise ValueError(f"bucket_bytes={bucket_bytes} must be positive.")
        if compression is not None and not (
            compression in WIRE_DTYPES and isinstance(action, Reduction) and action.root is None
        ):
            raise ValueError(f"compression={compression!r} applies to allreduces, in 16 bits.")
        self.compression = None if compression is None else WIRE_DTYPES[compression]
        self.backend, self.action = backend, action
        self.bucket_bytes, self.async_op, self.contiguous = bucket_bytes, async_op, contiguous
        self.keep_open = keep_open
        self.pool = pool if pool is not None else BufferPool()
        self._open: dict[BucketKey, list[Work]] = {}
        self._deliver: dict[BucketKey, list[Deliver]] = {}
        self._open_bytes = 0
        self._flights: list[InFlight] = []
        self.timeline = timeline
        self._opened_at: dict[BucketKey, float] = {}
        self._leaves: list[Staged] = []
        self._handed: dict[int, Deliver] = {}  # id of a work packed -> its deliver (`add`)
        # Each open bucket's packs: (first work's place, works, deliver) (`add_pack`)
        self._packs: dict[BucketKey, list[tuple[int, int, Deliver]]] = {}
        self.calls = 0  # communication calls made (observable for tests and the timeline)
        # Seconds between tests of a call in flight while waiting for it (`fusion.settle`);
        # 0: wait in the engine. Set by the communication thread's steps on MPI
        # (`comm_thread.Router.begin`).
        self.pause = 0.0
        # Called with [(dtype, items), ...] before each group of calls (a flush, an oversize
        # array), so that a caller can check that every rank is about to make the same calls.
        self.before_launch: Callable[[list[tuple[str, int]]], None] | None = None

    def add_leaf(
        self,
        family: Family,
        x: object,
        dtype: str,
        device: str,
        staged: tuple[Family, object, Work, bool] | None = None,
        deliver: Deliver | None = None,
    ) -> None:
        """Queue leaf `x` of `family`: through a zero-copy view, or a staged copy written back
        (`staged`: what `families.stage` gave for it, if the caller has it already).

        `wait()` returns the leaves' results in the order they were added. `deliver`: for a
        reduction, called instead with the result's place in its bucket where `x` is seen
        through a host view and packed with others (`add`); the caller makes `x` use it.
        """
        if staged is None:
            staged = stage(family, x)
        self._leaves.append(staged)
        work = staged[2]
        if not (staged[3] and type(work) is np.ndarray):
            deliver = None  # a staged copy is written back; a device leaf lands on its device
        # Host buffers are packed alike whatever their family, so ranks may mix families.
        key = HOST_KEY if type(work) is np.ndarray else (family.name, device)
        self.add(work, dtype, key, deliver)

    def add_pack(
        self,
        family: Family,
        xs: list[object],
        works: list[np.ndarray],
        dtype: str,
        deliver: Deliver,
    ) -> None:
        """Queue host leaves `xs` of `family` through their writable views `works` (contiguous,
        of `dtype`), as `add_leaf` queues each, and where they are packed together in one bucket
        of a reduction, hand their region of the bucket's memory to `deliver` once, in place of
        writing the results into them: one call for the pack where `add`'s deliver makes one
        per array. Where they would not be packed together (they do not fit in the open bucket,
        or each travels alone), they are queued one by one, the results written into them, and
        `deliver` is not called. The calls made are `add_leaf`'s either way, so that ranks
        queueing the same arrays one way or the other make the same calls.
        """
        self._leaves += [(family, x, w, True) for x, w in zip(xs, works, strict=True)]
        total = sum([w.nbytes for w in works])
        together = (
            len(works) > 1
            and self.contiguous
            and isinstance(self.action, Reduction)
            and self._open_bytes + total <= self.bucket_bytes
        )
        if not together:
            for work in works:
                self.add(work, dtype, HOST_KEY)
            return
        self.add(works[0], dtype, HOST_KEY)  # opens the bucket (or flushes nothing: they fit)
        key = (*HOST_KEY, dtype)
        opened = self._open[key]
        self._packs.setdefault(key, []).append((len(opened) - 1, len(works), deliver))
        opened.extend(works[1:])
        self._open_bytes += total - works[0].nbytes

    def add(
        self, work: Work, dtype: str, key: BucketKey = (), deliver: Deliver | None = None
    ) -> None:
        """Queue `work` (a writable host array in `dtype`'s storage) for the collective.

        `deliver` (required for `Scatter` and `Exchange`; for a `Reduction`, optional) is called
        with the array's result: a new host array in `dtype`'s storage, the caller's to keep. For
        a read-only `work` of a `Reduction`: a new array (none made where `reads_only` accepts
        it); for a writable one packed with others: its place in the bucket's own memory, lent
        by the pool until nothing refers to it, so that the result is not copied back (DDP's
        `gradient_as_bucket_view`); one that travels alone is reduced in place, and `deliver`
        is not called.
        """
        nbytes = work.nbytes
        if deliver is not None and isinstance(self.action, Reduction):
            assert isinstance(work, np.ndarray)  # host arrays only
            if work.flags.writeable or not self.reads_only(work, dtype):  # packed from; delivered
                self._handed[id(work)] = deliver
                deliver = None
        if deliver is not None and isinstance(self.action, Reduction):  # `reads_only` said yes
            assert isinstance(work, np.ndarray)
            if not self.keep_open:
                self.flush()
            if self.before_launch is not None:
                self.before_launch([(dtype, work.size)])
            self._reduce_into(work, dtype, deliver)
            return
        if nbytes > self.bucket_bytes:
            if not self.keep_open:
                self.flush()  # as Flashlight: the cache goes first, then the oversize array alone
            if self.before_launch is not None:
                self.before_launch([(dtype, work.size)])
            self._launch([work], dtype, [] if deliver is None else [deliver])
            return
        if self._open_bytes + nbytes > self.bucket_bytes:
            self.flush()
        elif self._flights:
            # MPI progresses non-blocking collectives only inside MPI calls: testing the oldest
            # flight, a cheap call, moves them all along while the caller is still producing arrays.
            oldest = self._flights[0].handle
            if oldest is not None:
                oldest.test()
        bucket_key = (*key, dtype)
        works = self._open.get(bucket_key)
        if works is None:
            works = self._open[bucket_key] = []
            if self.timeline is not None:
                self._opened_at[bucket_key] = self.timeline.now()
        works.append(work)
        if deliver is not None:
            self._deliver.setdefault(bucket_key, []).append(deliver)
        self._open_bytes += nbytes

    def reads_only(self, work: np.ndarray, dtype: str) -> bool:
        """Whether read-only `work` can be reduced as it is, its result handed to a `deliver`
        given to `add`: an allreduce of an array that goes alone (over `bucket_bytes`,
        contiguous) in a dtype the engine sums itself, uncompressed. The engine reads `work` and
        writes a new array (`Backend.allreduce_into`): no copy at all, and the same call as
        `work`'s copy would make. Other read-only arrays are copied by the caller first."""
        action = self.action
        return (
            isinstance(action, Reduction)
            and action.root is None
            and work.nbytes > self.bucket_bytes
            and work.flags.c_contiguous
            and dtype != "bool"
            and dtype in self.backend.native_dtypes
            and self._compressed(dtype) is None
        )

    def _reduce_into(self, work: np.ndarray, dtype: str, deliver: Deliver) -> None:
        """Allreduce read-only `work` into a new array, blocking; hand it to `deliver`."""
        assert isinstance(self.action, Reduction)
        while self._flights:  # the calls before it complete first, as `_launch` keeps them
            self._land(self._flights.pop(0))
        timeline = self.timeline
        started = timeline.now() if timeline is not None else 0.0
        # Into a buffer lent by the pool, adopted by the leaf's framework without a copy: MPI is
        # about twice as slow into new memory as into memory it has written before, and the lent
        # buffer comes back once the result is gone.
        result = self.pool.lend(work.dtype, work.shape)
        allreduce_into_scaled(self.backend, work.reshape(-1), result.reshape(-1), self.action)
        self.calls += 1
        if timeline is not None:
            timeline.complete("communicate", started, dtype=dtype, bytes=work.nbytes)
        deliver(result)

    def flush(self) -> None:
        """Start communicating everything cached (after an error, none of it is kept)."""
        opened, delivers, packs = self._open, self._deliver, self._packs
        self._open, self._deliver, self._packs, self._open_bytes = {}, {}, {}, 0
        if self.before_launch is not None and opened:
            self.before_launch(
                [(str(key[-1]), sum(w.size for w in works)) for key, works in opened.items()]
            )
        for bucket_key, works in opened.items():
            dtype = str(bucket_key[-1])  # the dtype name `add` put last
            if self.timeline is not None:
                self._trace_queue(bucket_key, len(works))
            given = delivers.get(bucket_key, [])
            if self.contiguous:
                self._launch(works, dtype, given, packs.get(bucket_key, ()))
            else:
                for i, work in enumerate(works):
                    self._launch([work], dtype, given[i : i + 1])

    def discard(self) -> None:
        """Forget what is queued and in flight after an error: none of it is written back, and
        the buffers of calls that may still be running are not reused."""
        self._leaves, self._open, self._deliver, self._flights = [], {}, {}, []
        self._open_bytes = 0
        self._handed, self._packs = {}, {}

    def test(self) -> bool:
        """Return whether every call started so far has completed."""
        return all(f.handle is None or f.handle.test() for f in self._flights)

    def land_before(self, calls: int) -> None:
        """Wait for the calls started before the `calls`-th (a value of `calls` taken earlier)
        and write their results, leaving later ones in flight: a caller that needs an earlier
        bucket's results (PowerSGD's second phase) while the next bucket travels."""
        while self._flights and self._flights[0].call < calls:
            self._land(self._flights.pop(0))

    def wait(self) -> list[object]:
        """Flush, wait for every call, write the results into the queued arrays.

        Returns:
            The result of each leaf given to `add_leaf` since the last `wait`, in order: mutable
            leaves written in place (staged ones copied back), new values for immutable ones,
            and the leaves unchanged on a rank that receives nothing (a reduce's non-roots, a
            broadcast's root).
        """
        leaves, self._leaves = self._leaves, []  # an error below leaves nothing for the next call
        try:
            self.flush()
        finally:
            flights, self._flights = self._flights, []
        self._land_all(flights)
        if not self._receives():
            return [x for _, x, _, _ in leaves]
        return write_back(leaves)

    @property
    def in_flight(self) -> bool:
        """Whether some call started has not landed yet."""
        return bool(self._flights)

    def land(self) -> None:
        """Complete every call in flight (what is queued stays queued)."""
        flights, self._flights = self._flights, []
        self._land_all(flights)

    def _land_all(self, flights: list[InFlight]) -> None:
        for flight in flights:
            self._land(flight)  # on an error the later flights are dropped, buffers not reused

    def reduce_scatter(self, pack: Callable[[], ShardFlight]) -> None:
        """Start a reduce-scatter of a bucket the caller packs, as this fusion's next flight:
        `pack` runs once the calls it must follow have landed (on MPI, all of them), so that it
        may reuse their buffers."""
        assert isinstance(self.action, Scatter)
        self._start(pack, 1)

    def _trace_queue(self, bucket_key: BucketKey, arrays: int) -> None:
        assert self.timeline is not None
        opened = self._opened_at.pop(bucket_key, None)
        if opened is not None:
            self.timeline.complete("queue", opened, bucket=str(bucket_key), arrays=arrays)

    def _launch(
        self,
        works: list[Work],
        dtype: str,
        delivers: list[Deliver],
        packs: Sequence[tuple[int, int, Deliver]] = (),
    ) -> None:
        self._start(lambda: self._pack(works, dtype, delivers, packs), len(works))

    def _start(self, pack: Callable[[], Flight], arrays: int) -> None:
        """Pack a bucket (`pack`), start its call, keep it in flight or land it."""
        if not self.backend.progresses:  # one call in flight at a time (`Backend.progresses`)
            while self._flights:
                self._land(self._flights.pop(0))
        timeline, span = self.timeline, 0
        if timeline is None:
            flight = pack()
        else:
            packing = timeline.now()
            flight = pack()
            if isinstance(flight, DeviceFlight):
                nbytes = flight.bucket.ops.nbytes(flight.bucket.buf)
            elif isinstance(flight, ShardFlight):
                nbytes = flight.wire.nbytes
            else:
                nbytes = flight.buf.nbytes
            dtype = flight.dtype
            timeline.complete("pack", packing, dtype=dtype, arrays=arrays, bytes=nbytes)
            span = timeline.begin("communicate", dtype=dtype, bytes=flight.wire.nbytes)
        handle = start(self.backend, self.action, flight, self.async_op)
        started = InFlight(flight, handle, span, self.calls)
        self.calls += 1
        if self.async_op:
            self._flights.append(started)
            if len(self._flights) > self.backend.calls_in_flight:
                self._land(self._flights.pop(0))
        else:
            self._land(started)

    def _pack(
        self,
        given: list[Work],
        dtype: str,
        delivers: list[Deliver],
        packs: Sequence[tuple[int, int, Deliver]],
    ) -> Flight:
        # A bucket holds one kind of work, as its key says: host arrays, or GPU leaves.
        works = cast("list[np.ndarray]", given)
        if isinstance(self.action, (Scatter, Exchange)):
            return self._pack_segments(works, dtype, delivers)
        if type(given[0]) is DeviceWork:
            return self._pack_device(cast("list[DeviceWork]", given), dtype)
        return self._pack_host(works, dtype, packs=packs)

    def _pack_host(
        self,
        works: list[np.ndarray],
        dtype: str,
        staged: DeviceBucket | None = None,
        packs: Sequence[tuple[int, int, Deliver]] = (),
    ) -> HostFlight:
        """Pack host `works` into one buffer (one contiguous writable array: itself, in place);
        `packs`: (first work, works, deliver) of each pack among them (`add_pack`)."""
        pooled: list[np.ndarray] = []
        slots: tuple[tuple[np.ndarray, int], ...] = ()
        compressed = self._compressed(dtype)
        action, scale = self.action, None  # a sum's shares' scale (`prescale`)
        if isinstance(action, Reduction) and action.root is None and action.op is ReduceOp.SUM:
            scale = action.scale if compressed is None else None
        # Scaled as they are packed where the engine takes the bucket as it is: one pass, not two.
        folded = scale if dtype in self.backend.native_dtypes else None
        prescaled = False
        if len(works) == 1 and works[0].flags.c_contiguous and works[0].flags.writeable:
            buf = works[0].reshape(-1)  # zero-copy: communicate in place
            self._handed.pop(id(works[0]), None)  # the result is written into it: no deliver
        else:
            size = sum([w.size for w in works])
            handed = self._handed
            if packs or any(w.flags.writeable and id(w) in handed for w in works):
                buf = self.pool.lend(storage_dtype(dtype), (size,))  # results handed out as views
            else:
                buf = self.pool.take(storage_dtype(dtype), size)
                pooled.append(buf)
            prescaled = pack_bucket(works, buf, folded)
            offsets = itertools.accumulate([w.size for w in works[:-1]], initial=0)
            slots = tuple(zip(works, offsets, strict=True))
        wire = buf
        if compressed is None:
            wire = self._wire(buf, dtype, pooled)
            if not prescaled:
                prescaled = prescale(wire, scale)
        elif dtype != compressed:
            wire = self.pool.take(storage_dtype(compressed), buf.size)
            to_wire(buf, dtype, compressed, out=wire)
            pooled.append(wire)
        return HostFlight(
            dtype, buf, wire, slots, tuple(pooled), compressed, prescaled, staged, tuple(packs)
        )

    def _compressed(self, dtype: str) -> WireDtype | None:
        """Return the 16-bit dtype a bucket of `dtype` travels as, or None (uncompressed)."""
        wire = self.compression
        return wire if dtype in COMPRESSIBLE else None

    def _wire(
        self, buf: np.ndarray, dtype: str, pooled: list[np.ndarray], copy: bool = True
    ) -> np.ndarray:
        """Return what the engine gets for `buf`: bytes, `buf` itself, or a float32 copy."""
        if isinstance(self.action, (Broadcast, Exchange)) or dtype == "bool":
            return buf.view(np.uint8)
        if dtype in self.backend.native_dtypes:
            return buf
        wide = self.pool.take(np.dtype(np.float32), buf.size)
        pooled.append(wide)
        if not copy:  # a receive buffer: nothing to widen yet
            return wide
        if dtype == "bfloat16":
            bf16_to_f32(buf, out=wide)
        else:
            wide[...] = buf
        return wide

    def _pack_segments(
        self, works: list[np.ndarray], dtype: str, delivers: list[Deliver]
    ) -> SegmentFlight:
        """Lay a bucket out rank by rank (`Segments`) for a reduce-scatter or an all-to-all."""
        assert isinstance(self.action, (Scatter, Exchange))
        layout = layout_of(self.action, works, self.backend.rank, self.backend.size)
        buf, pooled = layout.send_buffer(self.pool)
        # Not pooled: the results are views of it, which the caller may keep (Family.adopt).
        recv = np.empty(sum(layout.recv_counts), storage_dtype(dtype))
        wire = self._wire(buf, dtype, pooled)
        recv_wire = self._wire(recv, dtype, pooled, copy=False)
        return SegmentFlight(
            dtype, buf, wire, layout, recv, recv_wire, tuple(delivers), tuple(pooled)
        )

    def _pack_device(self, works: list[DeviceWork], dtype: str) -> Flight:
        """Pack GPU leaves on their device; hand the bucket over there, or stage it once."""
        bucket = DeviceBucket(works, dtype)
        compressed = self._compressed(dtype)
        if self.backend.accepts_device(bucket.device) and bucket.can_send(self.backend, compressed):
            broadcast = isinstance(self.action, Broadcast)
            return DeviceFlight(
                dtype, bucket, bucket.send_direct(self.backend, broadcast, compressed)
            )
        return self._pack_host([bucket.stage()], dtype, staged=bucket)  # communicated in place

    def _receives(self) -> bool:
        action, rank = self.action, self.backend.rank
        if isinstance(action, Broadcast):
            return rank != action.root
        return isinstance(action, (Scatter, Exchange)) or action.root is None or action.root == rank

    def _land(self, started: InFlight) -> None:
        flight, handle = started.flight, started.handle
        if handle is not None:
            if self.pause:  # on the communication thread, on MPI (`settle`)
                settle(handle, self.pause, getattr(self.backend, "timeout", None))
            handle.wait()
        timeline = self.timeline
        if timeline is not None:
            timeline.end("communicate", started.span)
            unpacking = timeline.now()
        action = self.action
        scale = action.scale if isinstance(action, (Reduction, Scatter)) else None
        prescaled = type(flight) is HostFlight and flight.prescaled
        unpack(flight, self._receives(), None if prescaled else scale, self._handed)
        if not isinstance(flight, DeviceFlight):
            for buf in flight.pooled:
                self.pool.give(buf)
        if timeline is not None:
            arrays = (
                len(flight.slots)
                if type(flight) is HostFlight
                else len(flight.deliver)
                if type(flight) is SegmentFlight
                else int(type(flight) is ShardFlight)
            )
            timeline.complete("unpack", unpacking, arrays=arrays)


def pack_bucket(works: list[np.ndarray], buf: np.ndarray, scale: float | None = None) -> bool:
    """Write `works` one after the other into `buf`, in C order: a host bucket's layout, whoever
    packs it (`Fusion`, or a call plan that keeps a bucket of its own). One copy, in C.

    With `scale`, write them times `scale` where `prescale` would scale the bucket (a sum's
    shares), in the same one pass; return whether it did."""
    if scale is None or not prescalable(buf.dtype, scale):
        np.concatenate(works, axis=None, out=buf)
        return False
    offset = 0
    for work in works:
        np.multiply(work.reshape(-1), scale, out=buf[offset : offset + work.size])
        offset += work.size
    return True


def bucket_views(buf: np.ndarray, shapes: list[tuple[int, ...]]) -> list[np.ndarray]:
    """Return each array's place in `buf` as `pack_bucket` lays arrays of `shapes` out."""
    views, offset = [], 0
    for shape in shapes:
        size = math.prod(shape)
        views.append(buf[offset : offset + size].reshape(shape))
        offset += size
    return views


# The engine call that carries a bucket.

# bool reductions are logical or / and on bytes, as NumPy adds and multiplies booleans.
_BOOL_OPS = {ReduceOp.SUM: ReduceOp.MAX, ReduceOp.PROD: ReduceOp.MIN}


def start(backend: Backend, action: Action, flight: Flight, async_op: bool) -> Handle | None:
    """Make the engine call that carries `flight`; return its handle when `async_op` (None: the
    call completed before returning)."""
    if type(flight) is ShardFlight:  # a reduce-scatter by the caller's counts
        assert isinstance(action, Scatter)
        counts = list(flight.counts)
        if async_op:
            return backend.ireduce_scatter(flight.wire, flight.recv, counts, action.op)
        backend.reduce_scatter(flight.wire, flight.recv, counts, action.op)
        return None
    if type(flight) is SegmentFlight:  # a reduce-scatter or an all-to-all
        assert isinstance(action, (Scatter, Exchange))
        op = action.op if isinstance(action, Scatter) else ReduceOp.SUM
        op = _BOOL_OPS.get(op, op) if flight.dtype == "bool" else op
        item = flight.buf.itemsize if flight.wire.dtype == np.uint8 else 1  # counts in wire items
        call = (flight.wire, flight.recv_wire, item, op, async_op)
        return flight.layout.start(backend, action, *call)
    wire = flight.wire
    if isinstance(action, Broadcast):
        if async_op:
            return backend.ibroadcast(wire, action.root)
        backend.broadcast(wire, action.root)
        return None
    assert isinstance(action, Reduction)
    op = _BOOL_OPS.get(action.op, action.op) if flight.dtype == "bool" else action.op
    if type(flight) is HostFlight and flight.compressed is not None:  # 16-bit host values
        handle = backend.iallreduce_half(flight.wire, op, flight.compressed)
        if async_op:
            return handle
        handle.wait()
    elif action.root is not None:
        backend.reduce(wire, op, action.root)
    elif async_op:
        return backend.iallreduce(wire, op)
    else:
        backend.allreduce(wire, op)
    return None


def allreduce_into_scaled(
    backend: Backend, send: np.ndarray, recv: np.ndarray, action: Reduction
) -> None:
    """Allreduce read-only `send` into `recv`, scaled as a bucket is: where the shares may be
    scaled first (`prescale`), written scaled into `recv` and reduced there in place (one pass
    over the memory, the engine's own copy of `send` included), else reduced into `recv` and
    the result scaled (a second pass over memory the engine has just shared costs more)."""
    if action.op is ReduceOp.SUM and prescaled_copy(send, recv, action.scale):
        backend.allreduce(recv, action.op)
        return
    backend.allreduce_into(send, recv, action.op)
    if action.scale is not None and action.scale != 1:
        scale_in_place(recv, action.scale)


def allreduce_scaled(backend: Backend, buf: np.ndarray, action: Reduction) -> None:
    """Allreduce `buf` in place, scaled as `Fusion` scales a bucket: a sum's shares before the
    sum where that is exact (`dtypes.prescale`), else the result."""
    prescaled = action.op is ReduceOp.SUM and prescale(buf, action.scale)
    backend.allreduce(buf, action.op)
    if action.scale is not None and not prescaled:
        scale_in_place(buf, action.scale)


# Where a bucket lands.


def settle(request: Handle, pause: float, limit: float | None) -> None:
    """Wait for `request` by testing it every `pause` seconds, sleeping in between.

    MPICH waits by polling its sockets without pause, a core's worth of system calls; on the
    communication thread that core is the one backward computes on wherever a rank has no
    spare core. Each test moves the call along, and the kernel's socket buffers
    keep the link busy between tests. Past the engine's timeout `limit` (`DATAPARALLEL_TIMEOUT`)
    it returns, for the caller to wait in the engine, which raises after that timeout again.
    """
    deadline = None if limit is None else time.monotonic() + limit
    while not request.test():
        if deadline is not None and time.monotonic() > deadline:
            return
        time.sleep(pause)


def unpack(flight: Flight, receives: bool, scale: float | None, handed: dict[int, Deliver]) -> None:
    """Write a completed `flight`'s results where they belong, scaled by `scale` (None: not).

    `receives`: whether this rank gets a result (not a reduce's non-roots, nor a broadcast's
    root). `handed`: the deliver of each array packed from, by its id (popped; `Fusion.add`).
    """
    match flight:
        case DeviceFlight(bucket=bucket):
            bucket.land(receives, scale)
        case ShardFlight():
            if scale is not None and scale != 1:
                scale_in_place(flight.recv, scale)
            flight.land(flight.recv)
        case SegmentFlight():
            if receives:
                _from_wire(flight.recv_wire, flight.recv, flight.dtype, scale)
                flight.layout.unpack(flight.recv, flight.deliver)
        case HostFlight():
            if receives:
                _unpack_host(flight, scale, handed)
            if flight.staged is not None:
                flight.staged.unstage(receives)


def _from_wire(wire: np.ndarray, buf: np.ndarray, dtype: str, scale: float | None) -> None:
    """Scale the uncompressed results in `wire` and bring them into `buf` if they are apart."""
    if scale is not None and scale != 1:
        scale_in_place(wire, scale)
    if wire is not buf and wire.dtype != np.uint8:
        if dtype == "bfloat16":
            f32_to_bf16(wire, out=buf)
        else:
            buf[...] = wire


def _unpack_host(flight: HostFlight, scale: float | None, handed: dict[int, Deliver]) -> None:
    wire, buf = flight.wire, flight.buf
    # A packed bucket is scaled as it is unpacked: one pass over it instead of two.
    fold = scale is not None and scale != 1 and bool(flight.slots) and wire is buf
    fold = fold and flight.compressed is None
    if flight.compressed is not None:  # widen, then scale in the wide dtype
        from_wire(wire, flight.compressed, buf, flight.dtype, scale)
    elif not fold:
        _from_wire(wire, buf, flight.dtype, scale)
    slots, packs = flight.slots, iter(flight.packs)
    pack, at = next(packs, None), 0
    while at < len(slots):
        if pack is not None and pack[0] == at:  # the pack's region, handed over at once
            _, count, deliver = pack
            last, end = slots[at + count - 1]
            region = buf[slots[at][1] : end + last.size]
            if fold:
                scale_in_place(region, scale)  # type: ignore[arg-type]
            deliver(region)
            pack, at = next(packs, None), at + count
            continue
        work, offset = slots[at]
        at += 1
        values = buf[offset : offset + work.size].reshape(work.shape)
        if work.flags.writeable and id(work) in handed:  # its place in the lent bucket
            if fold:
                scale_in_place(values, scale)  # type: ignore[arg-type]
            handed.pop(id(work))(values)
            continue
        if not work.flags.writeable:  # packed from a read-only view: a new array
            result = np.empty(work.shape, work.dtype)
            if fold:
                scale_in_place(values, scale, out=result)  # type: ignore[arg-type]
            else:
                np.copyto(result, values)
            handed.pop(id(work))(result)
            continue
        if fold:
            scale_in_place(values, scale, out=work)  # type: ignore[arg-type]
        else:
            work[...] = values

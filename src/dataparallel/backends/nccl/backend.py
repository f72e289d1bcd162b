"""NCCL for CUDA buffers, through CuPy's bindings; host buffers go to an MPI or Gloo fallback.

As Lux's NCCL backend holds an MPI one, CUDA buffers (torch tensors and CuPy arrays, as
`DeviceBuffer`s) are reduced by NCCL, while host buffers, objects, barriers and aborts go to the
fallback engine of the world (MPI under mpiexec, Gloo under torchrun or with an `init_method`, the
world of one otherwise). Why `cupy.cuda.nccl` rather than torch's NCCL process group: a
communicator needs only NCCL's unique id, which the fallback broadcasts (no c10d store, no second
process group sharing state with the user's `init_process_group`); every call takes the stream to
enqueue on, so the order below is ours to state; torch tensors and CuPy arrays reach it alike as
raw pointers; and CuPy users need no CUDA build of torch (torch users install CuPy as well).
NCCL's `ncclAvg` is not used: the array layer folds `avg`'s scale into its unpacking pass.

Stream order (Flashlight's `syncDistributed`): each call makes the communication stream wait for
an event recorded on the producer's stream (`DeviceBuffer.stream`), and records a completion event
on the communication stream; `Handle.wait()` makes the consumer's current stream wait for it
without blocking the host, `Handle.test()` queries it. A blocking call is the non-blocking one plus
`wait()`: only the host round trips below synchronize.

Dtypes NCCL lacks (int16, uint16, complex products) take a host round trip through the fallback;
complex sums are sums of the parts. Reduce-scatter is `ncclReduceScatter`, or for uneven segments
one `ncclReduce` per rank in one group; all-to-all is one `ncclSend` and `ncclRecv` per peer in one
group (NCCL 2.7+). The suite runs without a GPU: `dp.reducescatter` and `dp.alltoall` stage GPU
leaves through host memory, so those two device paths are reached only by direct backend calls.
What NCCL can do in this process, and what to install: `support.py`.
"""

from __future__ import annotations

import importlib
import itertools
from collections.abc import Callable, Sequence
from types import ModuleType
from typing import Protocol

import numpy as np

from dataparallel.backends import registry
from dataparallel.backends.base import (
    Backend,
    Buffer,
    DeviceBuffer,
    DoneHandle,
    Handle,
    HostBuffer,
    Received,
    ReduceOp,
)
from dataparallel.backends.nccl.support import (
    NCCL_BYTES,
    NCCL_OPS,
    nccl_reduction,
    unavailable_reason,
)
from dataparallel.config import Settings
from dataparallel.errors import BackendUnavailableError
from dataparallel.types import WireDtype

__all__ = ["NCCLBackend", "alltoall_call", "device_pair", "scatter_call"]


# What the NCCL backend uses of CuPy's objects (CuPy is not needed to check these types).
# Buffers are device addresses, counts are items of an `ncclDataType_t`, streams `cudaStream_t`.
class Communicator(Protocol):
    """`cupy.cuda.nccl.NcclCommunicator`."""

    def allReduce(
        self, send: int, recv: int, count: int, kind: int, op: int, stream: int
    ) -> None: ...

    def reduce(
        self, send: int, recv: int, count: int, kind: int, op: int, root: int, stream: int
    ) -> None: ...

    def bcast(self, buf: int, count: int, kind: int, root: int, stream: int) -> None: ...

    def broadcast(
        self, send: int, recv: int, count: int, kind: int, root: int, stream: int
    ) -> None: ...

    def reduceScatter(
        self, send: int, recv: int, count: int, kind: int, op: int, stream: int
    ) -> None: ...

    def send(self, buf: int, count: int, kind: int, peer: int, stream: int) -> None: ...

    def recv(self, buf: int, count: int, kind: int, peer: int, stream: int) -> None: ...

    def abort(self) -> None: ...

    def destroy(self) -> None: ...


class Stream(Protocol):
    """`cupy.cuda.Stream`: the backend's own communication stream."""

    @property
    def ptr(self) -> int: ...

    def wait_event(self, event: Event) -> None: ...

    def synchronize(self) -> None: ...


class Event(Protocol):
    """`cupy.cuda.Event`."""

    @property
    def ptr(self) -> int: ...

    @property
    def done(self) -> bool: ...


Call = Callable[[Communicator, int], None]  # (communicator, stream pointer) -> None


def device_pair(send: Buffer, recv: Buffer, what: str) -> tuple[DeviceBuffer, DeviceBuffer] | None:
    """Return the two CUDA buffers, or None when both are host arrays; raise on a mix."""
    if isinstance(send, DeviceBuffer) and isinstance(recv, DeviceBuffer):
        return send, recv
    if isinstance(send, np.ndarray) and isinstance(recv, np.ndarray):
        return None
    raise TypeError(
        f"{what}: send and recv must both be host arrays or both CUDA buffers, got "
        f"{type(send).__name__} and {type(recv).__name__}."
    )


def scatter_call(
    source: DeviceBuffer,
    target: DeviceBuffer,
    counts: list[int],
    how: tuple[int, int],
    op: int,
    rank: int,
    nccl: ModuleType,
) -> Call:
    """Return the NCCL reduce-scatter of `source` into `target` (`how`: NCCL type, parts)."""
    kind, parts = how

    def call(comm: Communicator, stream: int) -> None:
        if len(set(counts)) == 1:
            comm.reduceScatter(source.ptr, target.ptr, counts[0] * parts, kind, op, stream)
            return
        nccl.groupStart()
        try:
            offset = 0
            for root, count in enumerate(counts):
                into = target.ptr if root == rank else source.ptr + offset  # read at root only
                comm.reduce(source.ptr + offset, into, count * parts, kind, op, root, stream)
                offset += count * source.itemsize
        finally:
            nccl.groupEnd()

    return call


def alltoall_call(
    source: DeviceBuffer,
    target: DeviceBuffer,
    send_counts: list[int],
    recv_counts: list[int],
    nccl: ModuleType,
    byte_type: int,
) -> Call:
    """Return the all-to-all of `source` into `target` as grouped NCCL sends and receives."""
    item = source.itemsize
    sent = [0, *itertools.accumulate(send_counts)]
    received = [0, *itertools.accumulate(recv_counts)]

    def call(comm: Communicator, stream: int) -> None:
        nccl.groupStart()
        try:
            for peer, (out, into) in enumerate(zip(send_counts, recv_counts, strict=True)):
                comm.send(source.ptr + sent[peer] * item, out * item, byte_type, peer, stream)
                comm.recv(target.ptr + received[peer] * item, into * item, byte_type, peer, stream)
        finally:
            nccl.groupEnd()

    return call


class _NCCLHandle:
    """An NCCL call enqueued on the communication stream."""

    __slots__ = ("_backend", "_buffer", "_done")

    def __init__(self, backend: NCCLBackend, buffer: DeviceBuffer, done: Event) -> None:
        self._backend, self._buffer, self._done = backend, buffer, done

    def test(self) -> bool:
        return bool(self._done.done)

    def wait(self) -> None:
        """Make the consumer's current stream wait for the call (the host does not block)."""
        runtime, buffer = self._backend._cupy.cuda.runtime, self._buffer
        with self._backend._cupy.cuda.Device(buffer.device):
            runtime.streamWaitEvent(buffer.stream, self._done.ptr, 0)


class NCCLBackend(Backend):
    """NCCL collectives on CUDA buffers; the `fallback` engine for host buffers and objects.

    Args:
        fallback: the engine of the same processes (MPI, Gloo or single).
        device: the CUDA device to make the communicator on now; default: the device of the first
            CUDA buffer (`dp.initialize` binds it to `dp.device()` at once).
    """

    name = "nccl"
    stream_aware = True  # orders its calls on CUDA streams: no host synchronization needed
    # What NCCL reduces in device memory (exactly, possibly with a host round trip): every dtype
    # of the protocol, bfloat16 included. Host buffers follow the fallback's `native_dtypes`.
    device_native_dtypes = Backend.native_dtypes | {"bfloat16"}

    def __init__(self, fallback: Backend, device: int | None = None) -> None:
        reason = unavailable_reason()
        if reason is not None:
            raise BackendUnavailableError(reason)
        self._cupy = importlib.import_module("cupy")
        self._nccl = importlib.import_module("cupy.cuda.nccl")
        self.fallback = fallback
        self.rank, self.size = fallback.rank, fallback.size
        self.local_rank, self.local_size = fallback.local_rank, fallback.local_size
        self._comm: Communicator | None = None
        self._stream: Stream | None = None
        self._device: int | None = None
        if device is not None:
            self.bind_device(device)

    @property
    def native_dtypes(self) -> frozenset[str]:  # type: ignore[override]
        """The fallback's: host buffers are reduced by it."""
        return self.fallback.native_dtypes

    def iallreduce_half(self, buf: HostBuffer, op: ReduceOp, dtype: WireDtype) -> Handle:
        return self.fallback.iallreduce_half(buf, op, dtype)  # host buffers: the fallback's

    @classmethod
    def create(
        cls,
        *,
        init_method: str | None = None,
        rank: int | None = None,
        world_size: int | None = None,
        settings: Settings | None = None,
    ) -> NCCLBackend:
        reason = unavailable_reason()
        if reason is not None:
            raise BackendUnavailableError(reason)
        settings = settings if settings is not None else Settings.from_env()
        # The host engine of the same processes, picked as dp.initialize("auto") would pick.
        fallback = registry.load(registry.choose("auto", init_method, settings)).create(
            init_method=init_method, rank=rank, world_size=world_size, settings=settings
        )
        return cls(fallback)

    def bind_device(self, device: int) -> None:
        """Make this process's NCCL communicator on CUDA device `device` (collective, once).

        Rank 0 makes NCCL's unique id and the fallback engine broadcasts it.
        """
        if self._comm is not None:
            if device != self._device:
                raise ValueError(
                    f"This process's NCCL communicator is on cuda:{self._device}, but a buffer on "
                    f"cuda:{device} came: NCCL drives one GPU per process. Keep the arrays of "
                    "collectives on the device dp.initialize() chose (dp.device()), or choose "
                    "it with dp.initialize(gpu_devices=[...])."
                )
            return
        unique_id = self._nccl.get_unique_id() if self.rank == 0 else None
        unique_id = self.fallback.broadcast_object(unique_id, 0)
        with self._cupy.cuda.Device(device):
            self._comm = self._nccl.NcclCommunicator(self.size, unique_id, self.rank)
            self._stream = self._cupy.cuda.Stream(non_blocking=True)
        self._device = device

    def split(self, ranks: Sequence[int]) -> NCCLBackend | None:
        """Return an NCCL engine over `ranks`, on this one's GPU (collective)."""
        fallback = self.fallback.split(ranks)
        return None if fallback is None else NCCLBackend(fallback, self._device)

    def accepts_device(self, device: str) -> bool:
        return device == "cpu" or device.startswith("cuda")

    # -- streams -----------------------------------------------------------------------------

    def _enqueue(self, buffer: DeviceBuffer, call: Call) -> _NCCLHandle:
        """Run `call(comm, stream_pointer)` on the communication stream, after the producer."""
        self.bind_device(buffer.device)
        cupy, comm, stream = self._cupy, self._comm, self._stream
        if comm is None or stream is None:  # bind_device made both, or raised
            raise RuntimeError("NCCLBackend: no communicator after bind_device.")
        with cupy.cuda.Device(buffer.device):
            # The producer's stream is `buffer.stream`, a bare handle: the CUDA runtime's calls
            # take it as it is (CuPy 14 deprecates wrapping it in `ExternalStream`).
            ready = cupy.cuda.Event(disable_timing=True)
            cupy.cuda.runtime.eventRecord(ready.ptr, buffer.stream)
            stream.wait_event(ready)
            call(comm, stream.ptr)
            done = cupy.cuda.Event(disable_timing=True)
            done.record(stream)
        if buffer.record_stream is not None:  # the framework's allocator: in use on our stream
            buffer.record_stream(stream.ptr)
        return _NCCLHandle(self, buffer, done)

    def _via_host(self, buffer: DeviceBuffer, run: Callable[[HostBuffer], None]) -> Handle:
        """Do what NCCL cannot on a host copy, with the fallback engine, and copy it back."""
        cupy = self._cupy
        memory = cupy.cuda.UnownedMemory(buffer.ptr, buffer.nbytes, buffer.owner, buffer.device)
        with cupy.cuda.Device(buffer.device):
            array = cupy.ndarray((buffer.items,), buffer.dtype, cupy.cuda.MemoryPointer(memory, 0))
            cupy.cuda.runtime.streamSynchronize(buffer.stream)  # the producer's values are written
            host = array.get()
            run(host)
            array.set(host)
            cupy.cuda.get_current_stream().synchronize()
        return DoneHandle()

    # -- collectives ---------------------------------------------------------------------------

    def iallreduce(self, buf: Buffer, op: ReduceOp) -> Handle:
        if isinstance(buf, np.ndarray):
            return self.fallback.iallreduce(buf, op)
        buffer: DeviceBuffer = buf
        how = nccl_reduction(buffer.dtype, op)
        if how is None:
            return self._via_host(buffer, lambda host: self.fallback.allreduce(host, op))
        kind, parts = how

        def call(comm: Communicator, stream: int) -> None:
            count = buffer.items * parts
            comm.allReduce(buffer.ptr, buffer.ptr, count, kind, NCCL_OPS[op], stream)

        return self._enqueue(buffer, call)

    def allreduce(self, buf: Buffer, op: ReduceOp) -> None:
        if isinstance(buf, np.ndarray):
            self.fallback.allreduce(buf, op)
        else:
            self.iallreduce(buf, op).wait()

    def reduce(self, buf: Buffer, op: ReduceOp, root: int) -> None:
        if isinstance(buf, np.ndarray):
            self.fallback.reduce(buf, op, root)
            return
        buffer: DeviceBuffer = buf
        how = nccl_reduction(buffer.dtype, op)
        if how is None:
            self._via_host(buffer, lambda host: self.fallback.reduce(host, op, root))
            return
        kind, parts = how

        def call(comm: Communicator, stream: int) -> None:
            count = buffer.items * parts
            comm.reduce(buffer.ptr, buffer.ptr, count, kind, NCCL_OPS[op], root, stream)

        self._enqueue(buffer, call).wait()

    def ibroadcast(self, buf: Buffer, root: int) -> Handle:
        if isinstance(buf, np.ndarray):
            return self.fallback.ibroadcast(buf, root)
        buffer: DeviceBuffer = buf

        def call(comm: Communicator, stream: int) -> None:
            nbytes = buffer.items * buffer.itemsize
            comm.bcast(buffer.ptr, nbytes, NCCL_BYTES, root, stream)

        return self._enqueue(buffer, call)

    def broadcast(self, buf: Buffer, root: int) -> None:
        if isinstance(buf, np.ndarray):
            self.fallback.broadcast(buf, root)
        else:
            self.ibroadcast(buf, root).wait()

    def allgatherv(self, send: Buffer, recv: Buffer, counts: list[int]) -> None:
        if isinstance(send, np.ndarray) and isinstance(recv, np.ndarray):
            self.fallback.allgatherv(send, recv, counts)
            return
        if isinstance(send, np.ndarray) or isinstance(recv, np.ndarray):
            raise TypeError(
                "allgatherv: send and recv must both be host arrays or both CUDA buffers, got "
                f"{type(send).__name__} and {type(recv).__name__}."
            )
        source, target = send, recv
        nccl, rank = self._nccl, self.rank

        def call(comm: Communicator, stream: int) -> None:
            # NCCL's allgather needs equal counts: a group of one broadcast per rank instead.
            offset = 0
            nccl.groupStart()
            try:
                for r, count in enumerate(counts):
                    nbytes = count * target.itemsize
                    into = target.ptr + offset
                    comm.broadcast(
                        source.ptr if r == rank else into, into, nbytes, NCCL_BYTES, r, stream
                    )
                    offset += nbytes
            finally:
                nccl.groupEnd()

        self._enqueue(target, call).wait()

    def reduce_scatter(self, send: Buffer, recv: Buffer, counts: list[int], op: ReduceOp) -> None:
        pair = device_pair(send, recv, "reduce_scatter")
        if pair is None:
            self.fallback.reduce_scatter(send, recv, counts, op)
            return
        how = nccl_reduction(pair[0].dtype, op)
        if how is None:
            raise TypeError(
                f"reduce_scatter: NCCL cannot reduce {pair[0].dtype} with op={op.value!r} on the "
                "GPU; pass host buffers, which the fallback engine reduces."
            )
        call = scatter_call(*pair, counts, how, NCCL_OPS[op], self.rank, self._nccl)
        self._enqueue(pair[1], call).wait()

    def alltoallv(
        self, send: Buffer, send_counts: list[int], recv: Buffer, recv_counts: list[int]
    ) -> None:
        pair = device_pair(send, recv, "alltoallv")
        if pair is None:
            self.fallback.alltoallv(send, send_counts, recv, recv_counts)
            return
        call = alltoall_call(*pair, send_counts, recv_counts, self._nccl, NCCL_BYTES)
        self._enqueue(pair[1], call).wait()

    # -- the rest goes to the fallback -----------------------------------------------------------

    def broadcast_object(self, obj: object, root: int) -> Received:
        return self.fallback.broadcast_object(obj, root)

    def allgather_object(self, obj: object) -> list[Received]:
        return self.fallback.allgather_object(obj)

    def barrier(self) -> None:
        if self._stream is not None:
            self._stream.synchronize()  # NCCL work enqueued so far is part of "reached"
        self.fallback.barrier()

    def abort(self, code: int = 1) -> None:
        if self._comm is not None:
            self._comm.abort()
            self._comm = None
        self.fallback.abort(code)

    def close(self) -> None:
        if self._comm is not None and self._stream is not None:  # made together
            self._stream.synchronize()
            self._comm.destroy()
            self._comm = None
        self.fallback.close()

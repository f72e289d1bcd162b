"""The one small protocol every engine implements: collectives over flat, contiguous buffers.

A backend knows nothing of trees, array families or optimizers. It receives 1-D contiguous buffers
(NumPy arrays in host memory; `DeviceBuffer`s only where `accepts_device` says so), reduces or moves
them in place, and exchanges picklable objects for metadata. Every capability the layers above may
use is declared here, with a default: nothing is looked up with `getattr`.
"""

from __future__ import annotations

import enum
import functools
from abc import ABC, abstractmethod
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any, ClassVar, Protocol, TypeAlias

import numpy as np

from dataparallel.backends.half import TwoPhase
from dataparallel.config import Settings
from dataparallel.types import WireDtype

__all__ = [
    "Backend",
    "Buffer",
    "DeviceBuffer",
    "DoneHandle",
    "Handle",
    "HostBuffer",
    "Received",
    "ReduceOp",
    "host_only",
    "released",
]


class ReduceOp(enum.Enum):
    """Element-wise reductions every engine provides; `avg` is built above them (sum, scale)."""

    SUM = "sum"
    PROD = "prod"
    MIN = "min"
    MAX = "max"


class Handle(Protocol):
    """A non-blocking engine operation in flight (the public `dp.Request` is built over these)."""

    def wait(self) -> object:
        """Block until the operation has completed (what it returns, if anything, is not used)."""

    def test(self) -> bool:
        """Return whether the operation has completed, without blocking."""


class DoneHandle:
    """A handle that was finished when it was made (blocking engines, worlds of one)."""

    def wait(self) -> None:
        return None

    def test(self) -> bool:
        return True


_TYPESTR = {"bool": "|b1", "bfloat16": "<V2"}


@dataclass(frozen=True)
class DeviceBuffer:
    """A contiguous 1-D buffer in GPU memory, described without its framework.

    The engine layer makes these from torch tensors and CuPy arrays; a backend that accepts device
    buffers sees only this. It exposes `__cuda_array_interface__`, so mpi4py takes it as it is.

    Attributes:
        ptr: the device address of the first item.
        items, itemsize: the number of items and the bytes of each.
        dtype: the items' dtype name (`"float32"`, `"bfloat16"`, `"uint8"` for raw bytes).
        device: the CUDA device index.
        stream: the producer's current CUDA stream (a `cudaStream_t` as int; 0: the default).
        owner: the framework array that owns the memory, kept alive while the call runs.
        record_stream: tells the framework's caching allocator that the memory is in use on
            another stream (given as `cudaStream_t`), or None where nothing needs telling.
    """

    ptr: int
    items: int
    itemsize: int
    dtype: str
    device: int
    stream: int
    owner: object
    record_stream: Callable[[int], None] | None = None

    @property
    def nbytes(self) -> int:
        return self.items * self.itemsize

    @property
    def __cuda_array_interface__(self) -> dict[str, object]:
        typestr = _TYPESTR.get(self.dtype) or np.dtype(self.dtype).str
        return {
            "shape": (self.items,),
            "typestr": typestr,
            "data": (self.ptr, False),
            "version": 3,
            "strides": None,
            "stream": None,  # ordering is the caller's: it synchronized the producer first
        }


# A flat, contiguous host buffer: a 1-D NumPy array in a storage dtype (bfloat16 as uint16 bits).
HostBuffer: TypeAlias = np.ndarray
# What a backend's collectives take: host memory, or device memory where `accepts_device` says so.
Buffer: TypeAlias = HostBuffer | DeviceBuffer
# An object another rank sent (`broadcast_object`, `allgather_object`): unpickled here, so its
# type is whatever the sender's was, which no signature on this side can know.
Received: TypeAlias = Any


def host_only(buf: Buffer, where: str) -> HostBuffer:
    """Return `buf` for a call that takes host memory only; raise TypeError for device memory."""
    if isinstance(buf, DeviceBuffer):
        raise TypeError(f"{where}: this engine takes host buffers only here, got a device buffer.")
    return buf


class Backend(ABC):
    """A process group and its collectives over flat buffers.

    Attributes:
        name: `"mpi"`, `"gloo"`, `"nccl"` or `"single"`.
        rank: this process's place in the world, 0-based.
        size: the number of processes in the world.
        local_rank: this process's place among the processes on this node.
        local_size: the number of processes on this node.
        native_dtypes: dtype names the engine reduces natively in host memory; others are widened
            to float32 before reducing.
        device_native_dtypes: the same for device buffers (NCCL adds bfloat16).
        stream_aware: whether the engine orders its device work on CUDA streams itself (NCCL);
            otherwise the producer's stream is synchronized before a device buffer is handed over.
        progresses: whether a non-blocking call moves on while the caller does something else
            (Gloo's threads, NCCL's streams); MPI moves one only inside MPI calls.
    """

    name: ClassVar[str]
    native_dtypes: ClassVar[frozenset[str]] = frozenset(
        {"int8", "int16", "int32", "int64", "uint8", "uint16", "uint32", "uint64"}
        | {"float16", "float32", "float64", "complex64", "complex128"}
    )

    stream_aware: ClassVar[bool] = False
    progresses: ClassVar[bool] = True

    rank: int
    size: int
    local_rank: int
    local_size: int

    @property
    def calls_in_flight(self) -> int:
        """How many of a step's calls an engine that progresses is left with once the next
        starts (`fusion.Fusion`): one, so that a call's results are written while the next
        moves; more where calls queue in threads of the engine's own that carry them one after
        the other (Gloo's hierarchy). On MPI each call completes before the next starts (many
        in flight slow MPICH down: benchmarks/NOTES.md, "Fusion")."""
        return 1

    @property
    def device_native_dtypes(self) -> frozenset[str]:
        """Dtypes reduced natively in device memory (default: the host set)."""
        return self.native_dtypes

    @classmethod
    @abstractmethod
    def create(
        cls,
        *,
        init_method: str | None = None,
        rank: int | None = None,
        world_size: int | None = None,
        settings: Settings | None = None,
    ) -> Backend:
        """Join (or form) the process group; called once by `dp.initialize()`."""

    def accepts_device(self, device: str) -> bool:
        """Whether buffers on `device` (`"cuda:0"`, ...) may be passed directly, without staging."""
        return device == "cpu"

    def bind_device(self, device: int) -> None:
        """Take note of the GPU this process was given (NCCL makes its communicator there)."""
        return None

    def duplicate(self) -> Backend:
        """Return an engine over the same processes whose traffic never meets this one's.

        Collective: every rank must call it. Used where calls are made from another thread
        (host callbacks under `jax.jit`). Engines that cannot separate their traffic return
        themselves (the world of one has none to separate).
        """
        return self

    def split(self, ranks: Sequence[int]) -> Backend | None:
        """Return an engine over `ranks` of this one, or None on a rank outside them.

        `ranks` are sorted and distinct; their order is their rank in the new engine. Collective:
        every rank of this engine calls it with the same `ranks` (`dp.new_group` checks that).
        """
        raise NotImplementedError(f"the {self.name!r} backend cannot form groups of ranks.")

    @abstractmethod
    def allreduce(self, buf: Buffer, op: ReduceOp) -> None:
        """Reduce `buf` across all ranks, in place on every rank."""

    def allreduce_into(self, send: HostBuffer, recv: HostBuffer, op: ReduceOp) -> None:
        """Reduce `send` across all ranks into `recv` (same size and dtype); `send` is only read.

        For a send buffer that is not this library's to write (a JAX array's memory). The
        default copies `send` into `recv` and reduces there; engines that take the two buffers
        apart (MPI) make no copy.
        """
        recv[...] = send
        self.allreduce(recv, op)

    @abstractmethod
    def iallreduce(self, buf: Buffer, op: ReduceOp) -> Handle:
        """Start `allreduce` without blocking; `buf` must not be touched until it completes."""

    def iallreduce_half(self, buf: HostBuffer, op: ReduceOp, dtype: WireDtype) -> Handle:
        """Start reducing 16-bit floats in place, moving 16 bits (a compressed allreduce).

        `buf` is a 1-D host buffer of `dtype` `"float16"`, or `"bfloat16"` held as raw bits
        (`uint16`). The default: float16 through the engine's `iallreduce`; bfloat16 through an
        all-to-all, a float32 reduction of this rank's part and an allgather (`half.TwoPhase`).
        Engines that reduce either type natively and fast say so by overriding this.
        """
        if dtype == "float16":
            return self.iallreduce(buf, op)
        return TwoPhase(self, buf, op, dtype)

    @abstractmethod
    def reduce(self, buf: Buffer, op: ReduceOp, root: int) -> None:
        """Reduce `buf` across all ranks into `root`'s `buf`; other ranks' buffers are unchanged."""

    @abstractmethod
    def broadcast(self, buf: Buffer, root: int) -> None:
        """Copy `root`'s `buf` into every rank's `buf`."""

    @abstractmethod
    def ibroadcast(self, buf: Buffer, root: int) -> Handle:
        """Start `broadcast` without blocking."""

    @abstractmethod
    def allgatherv(self, send: Buffer, recv: Buffer, counts: list[int]) -> None:
        """Gather every rank's `send` into `recv`, in rank order; rank r sends `counts[r]` items."""

    def allgather(self, send: Buffer, recv: Buffer) -> None:
        """Gather every rank's `send` (the same size on every rank) into `recv`, in rank order."""
        items = send.items if isinstance(send, DeviceBuffer) else len(send)
        self.allgatherv(send, recv, [items] * self.size)

    def iallgather(self, send: Buffer, recv: Buffer) -> Handle:
        """Start `allgather` without blocking (default: it runs to completion at once)."""
        self.allgather(send, recv)
        return DoneHandle()

    def reduce_scatter(self, send: Buffer, recv: Buffer, counts: list[int], op: ReduceOp) -> None:
        """Reduce `send` across all ranks; this rank keeps its segment of the result in `recv`.

        `send` holds `sum(counts)` items laid out by rank: rank r's segment is the `counts[r]`
        items after the first `sum(counts[:r])`. `recv` gets the reduction of this rank's segment
        (`counts[rank]` items). Counts may differ between ranks (MPI's `Reduce_scatter`).

        The default is exact on host buffers and works on any engine, at an allreduce's cost:
        reduce a copy of the whole of `send`, keep this rank's segment. Engines override it.
        """
        start, recv = sum(counts[: self.rank]), host_only(recv, "reduce_scatter")
        whole = np.array(host_only(send, "reduce_scatter"), copy=True)
        self.allreduce(whole, op)
        recv[: counts[self.rank]] = whole[start : start + counts[self.rank]]

    def ireduce_scatter(
        self, send: Buffer, recv: Buffer, counts: list[int], op: ReduceOp
    ) -> Handle:
        """Start `reduce_scatter` without blocking (default: it runs to completion at once)."""
        self.reduce_scatter(send, recv, counts, op)
        return DoneHandle()

    def alltoallv(
        self, send: Buffer, send_counts: list[int], recv: Buffer, recv_counts: list[int]
    ) -> None:
        """Send segment i of `send` to rank i; receive rank i's segment for this rank into `recv`.

        `send` holds `sum(send_counts)` items laid out by destination (segment i: `send_counts[i]`
        items after the first `sum(send_counts[:i])`); `recv` receives `recv_counts[i]` items from
        rank i, laid out by source the same way. Every rank's `send_counts[j]` must equal rank j's
        `recv_counts[rank]` (MPI's `Alltoallv`).

        The default is exact on host buffers and works on any engine, at an allgather's cost:
        every rank's whole `send` is gathered and each rank keeps what was meant for it.
        """
        send, size = np.ascontiguousarray(host_only(send, "alltoallv")).reshape(-1), self.size
        recv = host_only(recv, "alltoallv")
        counts = np.empty(size * size, np.int64)
        self.allgatherv(np.asarray(send_counts, np.int64), counts, [size] * size)
        matrix = counts.reshape(size, size)  # matrix[i, j]: the items rank i sends rank j
        totals = matrix.sum(axis=1)
        every = np.empty(int(totals.sum()), send.dtype)
        self.allgatherv(send, every, [int(t) for t in totals])
        offset = 0
        for i, start in enumerate(np.concatenate([[0], np.cumsum(totals)[:-1]])):
            begin, count = int(start + matrix[i, : self.rank].sum()), int(matrix[i, self.rank])
            recv[offset : offset + count] = every[begin : begin + count]
            offset += count

    def ialltoallv(
        self, send: Buffer, send_counts: list[int], recv: Buffer, recv_counts: list[int]
    ) -> Handle:
        """Start `alltoallv` without blocking (default: it runs to completion at once)."""
        self.alltoallv(send, send_counts, recv, recv_counts)
        return DoneHandle()

    def sendrecv(
        self,
        send: HostBuffer | None,
        dest: int,
        recv: HostBuffer | None,
        source: int,
        sendtag: int = 0,
        recvtag: int = 0,
    ) -> None:
        """Send `send` to rank `dest` and receive rank `source`'s message into `recv` at once
        (MPI's `Sendrecv`, which cannot deadlock on a ring); `send` None only receives, `recv`
        None only sends. Both peers are other ranks than this one; the bytes sent and the bytes
        received must be as many on both ends (the caller agrees on that first).
        """
        raise NotImplementedError(f"the {self.name!r} backend has no point-to-point calls.")

    @abstractmethod
    def broadcast_object(self, obj: object, root: int) -> Received:
        """Return `root`'s picklable `obj` on every rank."""

    @abstractmethod
    def allgather_object(self, obj: object) -> list[Received]:
        """Return the list of every rank's picklable `obj`, in rank order."""

    @abstractmethod
    def barrier(self) -> None:
        """Block until every rank has reached the barrier."""

    @abstractmethod
    def abort(self, code: int = 1) -> None:
        """End the whole job at once (used when one rank fails and the others would hang)."""

    def close(self) -> None:
        """Release the engine's resources (called by `dp.finalize()`)."""
        return None

    def sever(self) -> None:
        """Cut the engine's connections, so that every call in flight on them fails at once,
        in this process and at its peers (before `release`, by a world that lost a member:
        `world.abandon`). The engine is unusable after. An engine that cannot does nothing."""
        return None

    def release(self) -> Callable[[], None]:
        """Close the engine but for the part that waits for its calls in flight; return that part.

        Such a wait ends only when the peers close their side too. A world that lost a member
        (`world.abandon`) releases every engine first and runs the returned parts side by side:
        closed one after another, a process can wait in one engine's close for a peer that is
        itself waiting in another engine of this process, which nothing would ever close. An
        engine whose close does not wait closes here and returns a part that does nothing.
        """
        self.close()
        return _nothing

    def __repr__(self) -> str:
        return f"<{type(self).__name__} rank={self.rank} size={self.size}>"


def released(engine: Backend, *, cut: bool = False) -> Callable[[], None]:
    """`engine.release()`, after `engine.sever()` if `cut`; where either raises, the function
    returned raises it instead."""
    try:
        if cut:
            engine.sever()
        return engine.release()
    except Exception as error:
        return functools.partial(_raise, error)


def _raise(error: BaseException) -> None:
    raise error


def _nothing() -> None:
    """What is left of closing an engine that closed at once (`Backend.release`)."""

"""MPI through mpi4py's buffer interface: upper-case calls only, arrays never go through pickle.

A call in flight is an `MPIHandle`; with a timeout, every wait tests the MPI request until the
deadline (`wait_request`), so that a peer that never joins raises instead of hanging the job. Its
buffers are kept until MPI has completed it, even where its caller lets go of it first
(`Unfinished`).

MPICH waits by polling without pause, a core's worth of CPU for as long as the wait lasts, now and
then calling `sched_yield`, which gives the core up only to a task that is queued on it. Where a
machine runs more ranks than it has cores (`crowded`), the rank that waits for a slower one takes
the core that rank computes on. There the world's engine makes MPICH sleep where it would yield
(`MPIBackend.sleep`). With a core for each rank the polling costs nobody and answers sooner, so
it is left. `DATAPARALLEL_MPI_SLEEP=1/0` overrides the choice; other MPI libraries, which have no
such variable, are left as they are.

16-bit sums are one call, with this module's own op (`half_sum`); PROD, MIN and MAX keep
`half.TwoPhase`.

The library itself (imported, CUDA-aware or not, able to start under the launcher's PMI):
`library.py`; the count of calls that makes leaving collective: `board.py`.
"""

from __future__ import annotations

import atexit
import collections
import itertools
import os
import pickle
import socket
import sys
import threading
import time
import zlib
from collections.abc import Callable, Sequence
from types import ModuleType
from typing import TYPE_CHECKING

import numpy as np

from dataparallel import caches
from dataparallel.backends.base import Backend, Buffer, Handle, HostBuffer, Received, ReduceOp
from dataparallel.backends.half import TwoPhase, add16
from dataparallel.backends.mpi.board import CallBoard
from dataparallel.backends.mpi.library import check_pmi, control, detect_cuda_aware, import_mpi
from dataparallel.config import Settings
from dataparallel.errors import CollectiveTimeoutError
from dataparallel.types import WireDtype

if TYPE_CHECKING:
    from mpi4py import MPI

__all__ = [
    "SLEEP_VARIABLE",
    "UNFINISHED",
    "MPIBackend",
    "MPIHandle",
    "Unfinished",
    "crowded",
    "half_sum",
    "wait_request",
]

# MPICH's control variable that makes its waits sleep instead of yield.
SLEEP_VARIABLE = "MPIR_CVAR_ENABLE_HEAVY_YIELD"


def _by_rank(buf: Buffer, counts: list[int]) -> list[object]:
    """Return mpi4py's `[buffer, (counts, displacements)]` for segments laid out in rank order."""
    return [buf, (counts, [0, *itertools.accumulate(counts)][:-1])]


def wait_request(request: MPI.Request, timeout: float | None, what: str, rank: int) -> None:
    """Wait for an MPI request; past `timeout` seconds raise `CollectiveTimeoutError`."""
    if timeout is None:
        request.Wait()
        return
    deadline = time.monotonic() + timeout
    while not request.Test():
        if time.monotonic() > deadline:
            raise CollectiveTimeoutError(
                f"rank {rank}: {what} did not complete within {timeout:g} s. Another rank is not "
                "making the same call: it is stuck, has died, or called a different collective. "
                "Every rank must make the same collective calls in the same order; raise the "
                "limit with DATAPARALLEL_TIMEOUT or dp.initialize(timeout=...) if it is too short."
            )
        time.sleep(0)  # let other Python threads (e.g. a progress bar) run while we poll


# CPUs a machine may have, as far as `crowded` counts them.
_MAX_CPUS = 4096


def crowded(mpi: ModuleType, comm: MPI.Comm) -> bool:
    """Whether this process's machine runs more of `comm`'s ranks than there are cores they may
    run on (collective; the same answer on every rank of a machine).

    A machine is a kernel (its boot id): hosts emulated in namespaces, or containers, on one
    machine share its cores. Its cores are those its ranks may run on (their CPU affinity,
    joined).
    """
    machine = comm.Split(_machine_key(), comm.Get_rank())
    try:
        cpus = np.zeros(_MAX_CPUS, np.uint8)
        cpus[[c for c in _cpus() if c < _MAX_CPUS]] = 1
        machine.Allreduce(mpi.IN_PLACE, cpus, mpi.MAX)
        return bool(machine.Get_size() > max(int(cpus.sum()), 1))
    finally:
        machine.Free()


def _machine_key() -> int:
    """A number shared by the processes of one kernel: its boot id (the host's name where
    there is none)."""
    try:
        with open("/proc/sys/kernel/random/boot_id", encoding="ascii") as file:
            name = file.read().strip()
    except OSError:
        name = socket.gethostname()
    return zlib.crc32(name.encode()) & 0x7FFFFFFF


def _cpus() -> set[int]:
    if hasattr(os, "sched_getaffinity"):
        return os.sched_getaffinity(0)
    return set(range(os.cpu_count() or 1))


class Unfinished:
    """Calls whose caller let go of them before MPI completed them, kept with their buffers.

    A caller lets go of a call in flight where an error is raised between its start and its
    wait, or where an object holding it is dropped. mpi4py frees a dropped request with
    `MPI_Request_free`, which lets the call run on, and MPI would go on writing into memory that
    Python has freed, corrupting the heap (a crash later, anywhere): `MPIHandle` hands such a
    call here instead, and it is kept until MPI says it completed.

    `keep` takes a request and the buffers MPI reads and writes for it; `release` lets go of
    those MPI has completed. Every call of an engine begins with `release`, so what a program
    drops is let go of at its next call. Module-level and never cleared at `dp.finalize()`: a
    call outlives its engine (MPI completes the calls in flight on a freed communicator), and
    letting go of one before MPI completes it is what this prevents. After `MPI_Finalize` MPI
    writes nothing more: everything is let go of.
    """

    def __init__(self) -> None:
        # Appended to from `MPIHandle.__del__`, on whatever thread a collection runs: a deque's
        # append and popleft are atomic, so `keep` takes no lock and makes no MPI call.
        self._held: collections.deque[tuple[MPI.Request, tuple[object, ...]]]
        self._held = collections.deque()
        self._releasing = threading.Lock()  # one thread tests the requests at a time

    def __len__(self) -> int:
        return len(self._held)

    def keep(self, request: MPI.Request, buffers: tuple[object, ...]) -> None:
        """Keep `request` and `buffers` until MPI has completed the call (no MPI call here)."""
        if request:  # MPI.REQUEST_NULL once a wait or test saw it complete
            self._held.append((request, buffers))

    def release(self) -> None:
        """Let go of the calls MPI has completed (each tested once; no wait)."""
        if not self._held or not self._releasing.acquire(blocking=False):
            return
        try:
            mpi = sys.modules.get("mpi4py.MPI")
            if mpi is None or mpi.Is_finalized():
                self._held.clear()
                return
            for _ in range(len(self._held)):  # those kept meanwhile wait for the next call
                request, buffers = self._held.popleft()
                if not request.Test():
                    self._held.append((request, buffers))
        finally:
            self._releasing.release()


# Every MPI engine's calls dropped in flight (see `Unfinished`).
UNFINISHED = Unfinished()


class MPIHandle:
    """An MPI request in flight, and the buffers MPI uses for it; waited for against the
    engine's timeout. Dropped before its completion was seen, it hands both to `UNFINISHED`
    (`Unfinished` says why)."""

    __slots__ = ("_buffers", "_rank", "_request", "_timeout", "_what")

    def __init__(
        self,
        request: MPI.Request,
        timeout: float | None,
        what: str,
        rank: int,
        buffers: tuple[object, ...],
    ) -> None:
        self._request, self._timeout, self._what, self._rank = request, timeout, what, rank
        self._buffers = buffers

    def wait(self) -> None:
        wait_request(self._request, self._timeout, self._what, self._rank)

    def test(self) -> bool:
        return bool(self._request.Test())

    def __del__(self) -> None:
        UNFINISHED.keep(self._request, self._buffers)


_OPS: dict[WireDtype, MPI.Op] = {}


def half_sum(mpi: ModuleType, dtype: WireDtype) -> MPI.Op:
    """Return the MPI op that sums `dtype` (`"float16"`, `"bfloat16"`) values sent as `UINT16_T`.

    MPI has no bfloat16, and MPICH's float16 sum is a scalar loop, so, as Horovod does, this
    module registers its own sum (`MPI.Op.Create`). MPI calls it once per piece of the buffer it
    reduces, never per value, and it adds with `backends/half.py`'s `add16` (each sum rounded once
    to 16 bits, as a native half sum is). The values travel as `UINT16_T`, two bytes that MPI only
    moves. MPICH reduces with a user-defined op by recursive doubling, `log2(p)` times the buffer
    at `p` ranks against a ring's `2 (p - 1) / p`, which is why only SUM goes this way: PROD, MIN
    and MAX keep `half.TwoPhase`. The ops belong to no world: made once per process, freed with
    the caches at `dp.finalize()` (mpi4py has a few dozen slots for user-defined ops).
    """
    op = _OPS.get(dtype)
    if op is None:
        view = np.float16 if dtype == "float16" else np.uint16

        def reduce(values: memoryview, into: memoryview, _datatype: object) -> None:
            add16(np.frombuffer(values, view), np.frombuffer(into, view), dtype)

        op = _OPS[dtype] = mpi.Op.Create(reduce, commute=True)
    return op


def _free_half_sums() -> None:
    mpi = sys.modules.get("mpi4py.MPI")
    if mpi is not None and not mpi.Is_finalized():  # else MPI freed them itself
        for op in _OPS.values():
            op.Free()
    _OPS.clear()


caches.register(_free_half_sums)


# Seconds a rank about to abort gives mpiexec to forward its last words (they can be lost else).
_ABORT_GRACE_S = 0.3


class MPIBackend(Backend):
    """Collectives on a private duplicate of `MPI.COMM_WORLD` (or of the communicator given).

    The duplicate keeps the library's traffic apart from the user's own MPI calls. With a
    `timeout`, every call is made non-blocking and polled, so that a peer that never joins ends
    the call with `CollectiveTimeoutError` instead of a hang.

    Every collective is counted on a `CallBoard`, and `close()` (`dp.finalize()`, or the
    interpreter's exit) is collective: it waits for every rank, and ends the job when another
    rank waits in a collective that this one will never join (`board.py`).
    """

    name = "mpi"
    # MPICH moves a non-blocking collective only inside MPI calls: a second one in flight adds no
    # overlap, and two large ones slow each other down (benchmarks/NOTES.md, "MPI's progress").
    progresses = False

    def __init__(
        self,
        comm: MPI.Comm | None = None,
        *,
        cuda_aware: bool | None = None,
        timeout: float | None = None,
        board: CallBoard | None = None,
    ) -> None:
        mpi = import_mpi()
        self._mpi = mpi
        self.timeout = timeout
        if cuda_aware is None:
            cuda_aware = Settings.from_env().cuda_aware_mpi
        # Whether CUDA buffers may be passed as they are (else `Fusion` stages them).
        self.cuda_aware = detect_cuda_aware(mpi) if cuda_aware is None else cuda_aware
        self.comm = (comm if comm is not None else mpi.COMM_WORLD).Dup()
        self.local_comm = self.comm.Split_type(mpi.COMM_TYPE_SHARED)
        self.rank, self.size = self.comm.Get_rank(), self.comm.Get_size()
        self.local_rank, self.local_size = self.local_comm.Get_rank(), self.local_comm.Get_size()
        # A duplicate shares its parent's board: the ranks' counts cover all of their engines.
        self._owns_board = board is None
        self._board = CallBoard(mpi, self.comm) if board is None else board
        self._closed = False
        # Whether MPICH's waits sleep (`sleep`), and what its variable held before, to put back.
        self.sleeps = False
        self._slept: int | None = None
        if self._owns_board:
            atexit.register(self.close)  # a rank that ends without dp.finalize() leaves too
        self._ops: dict[ReduceOp, MPI.Op] = {
            ReduceOp.SUM: mpi.SUM,
            ReduceOp.PROD: mpi.PROD,
            ReduceOp.MIN: mpi.MIN,
            ReduceOp.MAX: mpi.MAX,
        }

    @classmethod
    def create(
        cls,
        *,
        init_method: str | None = None,
        rank: int | None = None,
        world_size: int | None = None,
        settings: Settings | None = None,
    ) -> MPIBackend:
        if init_method not in (None, "mpi"):
            raise ValueError(
                f"init_method={init_method!r} does not apply to MPI, which rendezvous through its "
                "launcher: use init_method='mpi' (or none), or backend='gloo' for env/tcp/file."
            )
        settings = settings if settings is not None else Settings.from_env()
        if "mpi4py.MPI" not in sys.modules:
            check_pmi(settings)  # MPI_Init would abort the process under an unknown PMI
        backend = cls(cuda_aware=settings.cuda_aware_mpi, timeout=settings.timeout)
        sleep = settings.mpi_sleep
        if sleep is None:
            sleep = crowded(backend._mpi, backend.comm)
        if sleep:
            backend.sleep()
        for given, actual, what in (
            (rank, backend.rank, "rank"),
            (world_size, backend.size, "world_size"),
        ):
            if given is not None and given != actual:
                backend.close()  # release the duplicated communicators before failing
                raise ValueError(
                    f"{what}={given} was given, but the MPI launcher made it {actual}: "
                    "under MPI, rank and size come from mpiexec; drop the argument."
                )
        return backend

    def sleep(self) -> None:
        """Make MPICH's waits sleep between polls instead of yielding, for the whole process,
        until this engine closes (the module's docstring says why); no change with an MPI
        library that has no such variable.

        MPICH's `MPIR_CVAR_ENABLE_HEAVY_YIELD=1` makes every wait of the process call
        `nanosleep` where it would call `sched_yield`; it is written at run time
        (`library.control`) and put back by `close()`.
        """
        if self._slept is None:
            self._slept = control(self._mpi, SLEEP_VARIABLE, 1)
        self.sleeps = self._slept is not None

    def accepts_device(self, device: str) -> bool:
        """Return True for host buffers, and for CUDA buffers when the MPI library is CUDA-aware.

        CUDA-aware: detected (`detect_cuda_aware`), or `DATAPARALLEL_CUDA_AWARE_MPI=1`. mpi4py takes
        device buffers as `__cuda_array_interface__` or DLPack objects.
        """
        return device == "cpu" or (self.cuda_aware and device.startswith("cuda"))

    def _begin(self) -> None:
        """What every call does first: count it (`CallBoard`), and let go of the calls dropped
        in flight that MPI has completed since (`Unfinished`)."""
        self._board.tick()
        if UNFINISHED:
            UNFINISHED.release()

    def _complete(
        self,
        what: str,
        blocking: Callable[[], object],
        start: Callable[[], MPI.Request],
        *buffers: object,
    ) -> None:
        """Run `blocking()`, or with a timeout `start()` and poll it against the deadline; a
        call that times out keeps `buffers` until MPI completes it (`Unfinished`)."""
        if self.timeout is None:
            blocking()
        else:
            self._wait(start(), what, buffers)

    def _wait(self, request: MPI.Request, what: str, buffers: tuple[object, ...]) -> None:
        """Wait for `request` against the timeout; past it, `UNFINISHED` keeps it and `buffers`
        (the caller lets go of them as the error unwinds)."""
        try:
            wait_request(request, self.timeout, what, self.rank)
        except BaseException:
            UNFINISHED.keep(request, buffers)
            raise

    def allreduce(self, buf: Buffer, op: ReduceOp) -> None:
        self._begin()
        mpi_op, comm, in_place = self._ops[op], self.comm, self._mpi.IN_PLACE
        if self.timeout is None:  # every blocking allreduce: no closures on its way
            comm.Allreduce(in_place, buf, mpi_op)
            return
        self._complete(
            "allreduce",
            lambda: comm.Allreduce(in_place, buf, mpi_op),
            lambda: comm.Iallreduce(in_place, buf, mpi_op),
            buf,
        )

    def allreduce_into(self, send: HostBuffer, recv: HostBuffer, op: ReduceOp) -> None:
        self._begin()
        mpi_op, comm = self._ops[op], self.comm
        if self.timeout is None:
            comm.Allreduce(send, recv, mpi_op)
            return
        self._complete(
            "allreduce",
            lambda: comm.Allreduce(send, recv, mpi_op),
            lambda: comm.Iallreduce(send, recv, mpi_op),
            send,
            recv,
        )

    def iallreduce(self, buf: Buffer, op: ReduceOp) -> Handle:
        self._begin()
        request = self.comm.Iallreduce(self._mpi.IN_PLACE, buf, self._ops[op])
        return MPIHandle(request, self.timeout, "iallreduce", self.rank, (buf,))

    def iallreduce_half(self, buf: HostBuffer, op: ReduceOp, dtype: WireDtype) -> Handle:
        """A sum is one `Iallreduce` with this module's own 16-bit sum (`half_sum`): MPI has no
        bfloat16, and MPICH's float16 sum is a scalar loop. Other ops go `half.TwoPhase`."""
        if op is not ReduceOp.SUM:
            return TwoPhase(self, buf, op, dtype)
        self._begin()
        typed = [buf, self._mpi.UINT16_T]
        request = self.comm.Iallreduce(self._mpi.IN_PLACE, typed, half_sum(self._mpi, dtype))
        return MPIHandle(request, self.timeout, "iallreduce", self.rank, (buf,))

    def reduce(self, buf: Buffer, op: ReduceOp, root: int) -> None:
        self._begin()
        send, recv = (self._mpi.IN_PLACE, buf) if self.rank == root else (buf, None)
        mpi_op, comm = self._ops[op], self.comm
        self._complete(
            "reduce",
            lambda: comm.Reduce(send, recv, mpi_op, root),
            lambda: comm.Ireduce(send, recv, mpi_op, root),
            buf,
        )

    def broadcast(self, buf: Buffer, root: int) -> None:
        self._begin()
        self._broadcast(buf, root)

    def _broadcast(self, buf: Buffer, root: int) -> None:
        comm = self.comm
        self._complete(
            "broadcast", lambda: comm.Bcast(buf, root), lambda: comm.Ibcast(buf, root), buf
        )

    def ibroadcast(self, buf: Buffer, root: int) -> Handle:
        self._begin()
        request = self.comm.Ibcast(buf, root)
        return MPIHandle(request, self.timeout, "ibroadcast", self.rank, (buf,))

    def allgatherv(self, send: Buffer, recv: Buffer, counts: list[int]) -> None:
        self._begin()
        self._allgatherv(send, recv, counts)

    def _allgatherv(self, send: Buffer, recv: Buffer, counts: list[int]) -> None:
        displacements = [0, *itertools.accumulate(counts)][:-1]
        target, comm = [recv, (counts, displacements)], self.comm
        self._complete(
            "allgather",
            lambda: comm.Allgatherv(send, target),
            lambda: comm.Iallgatherv(send, target),
            send,
            recv,
        )

    def allgather(self, send: Buffer, recv: Buffer) -> None:
        self._begin()
        if self.timeout is None:  # the handshake of every call: no closures on its way
            self.comm.Allgather(send, recv)
        else:
            self._wait(self.comm.Iallgather(send, recv), "allgather", (send, recv))

    def iallgather(self, send: Buffer, recv: Buffer) -> Handle:
        self._begin()
        request = self.comm.Iallgather(send, recv)
        return MPIHandle(request, self.timeout, "iallgather", self.rank, (send, recv))

    def reduce_scatter(self, send: Buffer, recv: Buffer, counts: list[int], op: ReduceOp) -> None:
        self._begin()
        mpi_op, comm = self._ops[op], self.comm
        self._complete(
            "reduce_scatter",
            lambda: comm.Reduce_scatter(send, recv, counts, mpi_op),
            lambda: comm.Ireduce_scatter(send, recv, counts, mpi_op),
            send,
            recv,
        )

    def ireduce_scatter(
        self, send: Buffer, recv: Buffer, counts: list[int], op: ReduceOp
    ) -> Handle:
        self._begin()
        request = self.comm.Ireduce_scatter(send, recv, counts, self._ops[op])
        return MPIHandle(request, self.timeout, "ireduce_scatter", self.rank, (send, recv))

    def alltoallv(
        self, send: Buffer, send_counts: list[int], recv: Buffer, recv_counts: list[int]
    ) -> None:
        self._begin()
        source, target, comm = _by_rank(send, send_counts), _by_rank(recv, recv_counts), self.comm
        self._complete(
            "alltoall",
            lambda: comm.Alltoallv(source, target),
            lambda: comm.Ialltoallv(source, target),
            send,
            recv,
        )

    def ialltoallv(
        self, send: Buffer, send_counts: list[int], recv: Buffer, recv_counts: list[int]
    ) -> Handle:
        self._begin()
        request = self.comm.Ialltoallv(_by_rank(send, send_counts), _by_rank(recv, recv_counts))
        return MPIHandle(request, self.timeout, "ialltoall", self.rank, (send, recv))

    def sendrecv(
        self,
        send: HostBuffer | None,
        dest: int,
        recv: HostBuffer | None,
        source: int,
        sendtag: int = 0,
        recvtag: int = 0,
    ) -> None:
        """Not counted on the `CallBoard`: only the two ends take part, not every rank."""
        if UNFINISHED:
            UNFINISHED.release()
        comm = self.comm
        if send is not None and recv is not None:
            self._complete(
                "sendrecv",
                lambda: comm.Sendrecv(send, dest, sendtag, recv, source, recvtag),
                lambda: comm.Isendrecv(send, dest, sendtag, recv, source, recvtag),
                send,
                recv,
            )
        elif send is not None:
            self._complete(
                "send",
                lambda: comm.Send(send, dest, sendtag),
                lambda: comm.Isend(send, dest, sendtag),
                send,
            )
        elif recv is not None:
            self._complete(
                "recv",
                lambda: comm.Recv(recv, source, recvtag),
                lambda: comm.Irecv(recv, source, recvtag),
                recv,
            )

    def broadcast_object(self, obj: object, root: int) -> Received:
        self._begin()
        if self.timeout is None:
            return self.comm.bcast(obj, root)
        payload = pickle.dumps(obj) if self.rank == root else b""
        length = np.array([len(payload)], np.int64)
        self._broadcast(length, root)
        data = np.frombuffer(payload, np.uint8).copy() if self.rank == root else None
        data = data if data is not None else np.empty(int(length[0]), np.uint8)
        self._broadcast(data, root)
        return pickle.loads(data.tobytes())

    def allgather_object(self, obj: object) -> list[Received]:
        self._begin()
        if self.timeout is None:
            return list(self.comm.allgather(obj))
        payload = np.frombuffer(pickle.dumps(obj), np.uint8)
        lengths = np.empty(self.size, np.int64)
        self._allgatherv(np.array([payload.size], np.int64), lengths, [1] * self.size)
        received = np.empty(int(lengths.sum()), np.uint8)
        self._allgatherv(payload, received, [int(n) for n in lengths])
        edges = np.concatenate([[0], np.cumsum(lengths)])
        return [pickle.loads(received[a:b].tobytes()) for a, b in itertools.pairwise(edges)]

    def barrier(self) -> None:
        self._begin()
        self._complete("barrier", self.comm.Barrier, self.comm.Ibarrier)

    def split(self, ranks: Sequence[int]) -> MPIBackend | None:
        """Return an engine on a communicator of `ranks` (MPI_Comm_split; collective)."""
        member = self.rank in ranks
        sub = self.comm.Split(0 if member else self._mpi.UNDEFINED, self.rank)
        if not member:
            return None
        try:
            return MPIBackend(sub, cuda_aware=self.cuda_aware, timeout=self.timeout)
        finally:
            sub.Free()  # the engine works on its own duplicate

    def duplicate(self) -> MPIBackend:
        """Return an engine on a private duplicate of this one's communicator (collective)."""
        return MPIBackend(
            self.comm, cuda_aware=self.cuda_aware, timeout=self.timeout, board=self._board
        )

    def abort(self, code: int = 1) -> None:
        """End the job (`MPI_Abort`), after giving mpiexec a moment to forward what was printed."""
        sys.stdout.flush()
        sys.stderr.flush()
        time.sleep(_ABORT_GRACE_S)
        self._mpi.COMM_WORLD.Abort(code)

    def close(self) -> None:
        """Leave the world (collective, see the class), then free the communicators.

        Safe to call twice; also run at the interpreter's exit. Ends the job with `MPI_Abort`
        when another rank waits in a collective that this one will never join.
        """
        if self._closed:
            return
        self._closed = True
        if self._mpi.Is_finalized():  # the user finalized MPI: nothing left to free
            return
        if self._owns_board:
            atexit.unregister(self.close)
            reason = self._board.leave(self.timeout)
            if reason is not None:
                sys.stdout.flush()
                sys.stderr.write(f"dataparallel: {reason}\n")
                self.abort(1)
            self._board.free()
        if self._slept is not None:
            control(self._mpi, SLEEP_VARIABLE, self._slept)
            self._slept, self.sleeps = None, False
        for comm in (self.local_comm, self.comm):
            if comm != self._mpi.COMM_NULL:
                comm.Free()

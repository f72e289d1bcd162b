"""MPI through mpi4py's buffer interface: upper-case calls only, arrays never go through pickle."""

from __future__ import annotations

from typing import Any

from dataparallel.backends.base import Backend, ReduceOp, Request
from dataparallel.config import Settings
from dataparallel.errors import BackendUnavailableError

__all__ = ["MPIBackend", "detect_cuda_aware", "import_mpi"]


def import_mpi() -> Any:
    """Import `mpi4py.MPI`, or raise `BackendUnavailableError` saying what to install."""
    try:
        from mpi4py import MPI
    except ImportError as exc:
        raise BackendUnavailableError(
            "The 'mpi' backend needs mpi4py and an MPI library: "
            "pip install 'dataparallel[mpi]' (mpi4py and the mpich wheel, mpiexec included)."
        ) from exc
    return MPI


# Version strings of MPI libraries that take CUDA buffers but may lack MPIX_Query_cuda_support.
_CUDA_AWARE_HINTS = ("MVAPICH2-GDR", "MVAPICH-Plus")


def detect_cuda_aware(mpi: Any) -> bool:
    """Return whether the MPI library behind `mpi` (`mpi4py.MPI`) accepts CUDA device buffers.

    Asks, in order: `MPI.Query_cuda_support()` where mpi4py offers it; the library's own
    `MPIX_Query_cuda_support()` (MPICH 4+, Open MPI, and their derivatives export it; it answers for
    the running process, GPU support enabled or not); else the library's version string, for the
    few CUDA-aware builds known by name. Unknown means no: staging through the host is always
    correct. `DATAPARALLEL_CUDA_AWARE_MPI=0/1` overrides the answer (`Settings.cuda_aware_mpi`).
    """
    query = getattr(mpi, "Query_cuda_support", None)
    if query is None:
        query = _mpix_query(mpi)
    if query is not None:
        return bool(query())
    version = str(mpi.Get_library_version())
    return any(hint in version for hint in _CUDA_AWARE_HINTS)


def _mpix_query(mpi: Any) -> Any:
    """Return the MPI library's `MPIX_Query_cuda_support` function, or None where it has none."""
    import ctypes

    try:
        # dlsym on mpi4py's extension module searches the MPI library it is linked with.
        function = ctypes.CDLL(mpi.__file__).MPIX_Query_cuda_support
    except (AttributeError, OSError, TypeError):
        return None
    function.restype = ctypes.c_int
    function.argtypes = []
    return function


class _MPIRequest:
    __slots__ = ("_request",)

    def __init__(self, request: Any) -> None:
        self._request = request

    def wait(self) -> None:
        self._request.Wait()

    def test(self) -> bool:
        return bool(self._request.Test())


class MPIBackend(Backend):
    """Collectives on a private duplicate of `MPI.COMM_WORLD` (or of the communicator given).

    The duplicate keeps the library's traffic apart from the user's own MPI calls.
    """

    name = "mpi"

    def __init__(self, comm: Any = None, *, cuda_aware: bool | None = None) -> None:
        mpi = import_mpi()
        self._mpi = mpi
        if cuda_aware is None:
            cuda_aware = Settings.from_env().cuda_aware_mpi
        # Whether CUDA buffers may be passed as they are (else the fusion engine stages them).
        self.cuda_aware = detect_cuda_aware(mpi) if cuda_aware is None else cuda_aware
        self.comm = (comm if comm is not None else mpi.COMM_WORLD).Dup()
        self.local_comm = self.comm.Split_type(mpi.COMM_TYPE_SHARED)
        self.rank, self.size = self.comm.Get_rank(), self.comm.Get_size()
        self.local_rank, self.local_size = self.local_comm.Get_rank(), self.local_comm.Get_size()
        self._ops = {
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
        backend = cls(cuda_aware=settings.cuda_aware_mpi if settings is not None else None)
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

    def accepts_device(self, device: str) -> bool:
        """Return True for host buffers, and for CUDA buffers when the MPI library is CUDA-aware.

        CUDA-aware: detected (`detect_cuda_aware`), or `DATAPARALLEL_CUDA_AWARE_MPI=1`. mpi4py takes
        device buffers as `__cuda_array_interface__` or DLPack objects.
        """
        return device == "cpu" or (self.cuda_aware and device.startswith("cuda"))

    def allreduce(self, buf: Any, op: ReduceOp) -> None:
        self.comm.Allreduce(self._mpi.IN_PLACE, buf, self._ops[op])

    def iallreduce(self, buf: Any, op: ReduceOp) -> Request:
        return _MPIRequest(self.comm.Iallreduce(self._mpi.IN_PLACE, buf, self._ops[op]))

    def reduce(self, buf: Any, op: ReduceOp, root: int) -> None:
        if self.rank == root:
            self.comm.Reduce(self._mpi.IN_PLACE, buf, self._ops[op], root)
        else:
            self.comm.Reduce(buf, None, self._ops[op], root)

    def broadcast(self, buf: Any, root: int) -> None:
        self.comm.Bcast(buf, root)

    def ibroadcast(self, buf: Any, root: int) -> Request:
        return _MPIRequest(self.comm.Ibcast(buf, root))

    def allgatherv(self, send: Any, recv: Any, counts: list[int]) -> None:
        displacements = [0] * len(counts)
        for r in range(1, len(counts)):
            displacements[r] = displacements[r - 1] + counts[r - 1]
        self.comm.Allgatherv(send, [recv, (counts, displacements)])

    def broadcast_object(self, obj: Any, root: int) -> Any:
        return self.comm.bcast(obj, root)

    def allgather_object(self, obj: Any) -> list[Any]:
        return list(self.comm.allgather(obj))

    def barrier(self) -> None:
        self.comm.Barrier()

    def abort(self, code: int = 1) -> None:
        self._mpi.COMM_WORLD.Abort(code)

    def close(self) -> None:
        for comm in (self.local_comm, self.comm):
            if comm != self._mpi.COMM_NULL:
                comm.Free()

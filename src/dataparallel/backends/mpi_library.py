"""The MPI library behind mpi4py: imported (or an error saying what to install), and whether it
takes CUDA device buffers (`detect_cuda_aware`)."""

from __future__ import annotations

from collections.abc import Callable
from types import ModuleType

from dataparallel.errors import BackendUnavailableError

__all__ = ["detect_cuda_aware", "import_mpi", "mpix_query"]


def import_mpi() -> ModuleType:
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


def detect_cuda_aware(mpi: ModuleType) -> bool:
    """Return whether the MPI library behind `mpi` (`mpi4py.MPI`) accepts CUDA device buffers.

    Asks, in order: `MPI.Query_cuda_support()` where mpi4py offers it; the library's own
    `MPIX_Query_cuda_support()` (MPICH 4+, Open MPI, and their derivatives export it; it answers for
    the running process, GPU support enabled or not); else the library's version string, for the
    few CUDA-aware builds known by name. Unknown means no: staging through the host is always
    correct. `DATAPARALLEL_CUDA_AWARE_MPI=0/1` overrides the answer (`Settings.cuda_aware_mpi`).
    """
    query = getattr(mpi, "Query_cuda_support", None)
    if query is None:
        query = mpix_query(mpi)
    if query is not None:
        return bool(query())
    version = str(mpi.Get_library_version())
    return any(hint in version for hint in _CUDA_AWARE_HINTS)


def mpix_query(mpi: ModuleType) -> Callable[[], object] | None:
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

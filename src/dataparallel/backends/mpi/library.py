"""The MPI library behind mpi4py: imported (or an error saying what to install), whether it
takes CUDA device buffers (`detect_cuda_aware`), whether it can start at all under the
process-management interface it was given (`check_pmi`), and its control variables, read and
written while it runs (`control`).

`srun --mpi=pmix` gives the tasks PMIx only. The MPICH wheel (the MPI of `dataparallel[mpi]`)
speaks PMI-1/PMI-2 and aborts inside `MPI_Init` ("unsupported PMI version PMIx"), taking the
process with it before any Python error can be raised. So before MPI is initialized, a PMIx-only
task asks the library's version (in a child process: `MPI_Get_library_version` needs no
`MPI_Init`, but mpi4py initializes MPI when imported, unless told not to, which the child is) and
refuses MPICH builds configured without PMIx, with what to do instead.
"""

from __future__ import annotations

import subprocess
import sys
from collections.abc import Callable
from types import ModuleType

from dataparallel.config import Settings
from dataparallel.errors import BackendUnavailableError

__all__ = [
    "check_pmi",
    "control",
    "detect_cuda_aware",
    "import_mpi",
    "library_version",
    "mpix_query",
]


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


def control(mpi: ModuleType, name: str, value: int | None = None) -> int | None:
    """Read an integer control variable of the MPI library behind `mpi` while it runs, and
    write `value` into it if given; return the value it had, or None where the library has no
    such variable (another MPI than MPICH) or no tools interface.

    Through the MPI tools interface (`MPI_T_cvar_*`, which mpi4py does not wrap), the way
    `mpix_query` reaches the library: MPICH reads the variables as it runs, so a value written
    after `MPI_Init` holds from the next call on. Each call opens and closes the interface.
    """
    import ctypes

    try:
        lib = ctypes.CDLL(mpi.__file__)
        init, finalize = lib.MPI_T_init_thread, lib.MPI_T_finalize
    except (AttributeError, OSError, TypeError):
        return None
    provided = ctypes.c_int()
    if init(ctypes.c_int(mpi.Query_thread()), ctypes.byref(provided)) != 0:
        return None
    try:
        index, count, handle = ctypes.c_int(), ctypes.c_int(), ctypes.c_void_p()
        if lib.MPI_T_cvar_get_index(name.encode(), ctypes.byref(index)) != 0:
            return None
        if lib.MPI_T_cvar_handle_alloc(index, None, ctypes.byref(handle), ctypes.byref(count)):
            return None
        try:
            had = ctypes.c_int()
            if count.value != 1 or lib.MPI_T_cvar_read(handle, ctypes.byref(had)) != 0:
                return None
            if value is not None and lib.MPI_T_cvar_write(
                handle, ctypes.byref(ctypes.c_int(value))
            ):
                return None
            return had.value
        finally:
            lib.MPI_T_cvar_handle_free(ctypes.byref(handle))
    finally:
        finalize()


_PROBE = (
    "import mpi4py; mpi4py.rc.initialize = False; mpi4py.rc.finalize = False\n"
    "from mpi4py import MPI; print(MPI.Get_library_version())"
)


def check_pmi(settings: Settings) -> None:
    """Raise `BackendUnavailableError` where MPI_Init would abort on a PMIx-only srun step."""
    slurm = settings.slurm
    if slurm is None or slurm.pmi != "pmix" or not slurm.in_step:
        return
    version = library_version()
    if "MPICH" not in version or "pmix" in version.lower():
        return  # Open MPI, or an MPICH built with PMIx: it can start
    raise BackendUnavailableError(
        "srun started this task with PMIx (--mpi=pmix), which this MPI library (MPICH, the "
        "mpich wheel) cannot speak: MPI_Init would abort. Start the job with `srun --mpi=pmi2 "
        "...` to use MPI, or without --mpi (srun's default) to use Gloo, which dataparallel "
        "sets up from Slurm's variables (pip install 'dataparallel[torch]')."
    )


def library_version() -> str:
    """Return `MPI_Get_library_version()` of mpi4py's MPI without initializing it here ('' if
    it cannot be read)."""
    try:
        probe = subprocess.run(
            [sys.executable, "-c", _PROBE], capture_output=True, text=True, timeout=60, check=False
        )
    except (OSError, subprocess.TimeoutExpired):
        return ""
    return probe.stdout

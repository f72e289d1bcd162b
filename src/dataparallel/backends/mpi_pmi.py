"""Whether this process's MPI library can speak the process-management interface it was given.

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

from dataparallel.config import Settings
from dataparallel.errors import BackendUnavailableError

__all__ = ["check_pmi"]

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

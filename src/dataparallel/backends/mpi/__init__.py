"""The MPI engine, through mpi4py: `MPIBackend` (`backend.py`), the library behind it
(`library.py`), and the count of calls that lets a rank leave the world safely (`board.py`)."""

from dataparallel.backends.mpi.backend import MPIBackend
from dataparallel.backends.mpi.library import detect_cuda_aware, import_mpi

__all__ = ["MPIBackend", "detect_cuda_aware", "import_mpi"]

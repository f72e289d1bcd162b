"""What the test files that launch their own jobs need to know about the job running them."""

from __future__ import annotations

import os
import sys


def outer_world_size() -> int:
    """Return the size of the job (MPI, or torchrun-style) running this file (1 outside any)."""
    for name in ("PMI_SIZE", "OMPI_COMM_WORLD_SIZE", "WORLD_SIZE"):
        if os.environ.get(name, "").isdigit():
            return int(os.environ[name])
    mpi = sys.modules.get("mpi4py.MPI")
    if mpi is not None and mpi.Is_initialized() and not mpi.Is_finalized():
        return int(mpi.COMM_WORLD.Get_size())
    return 1

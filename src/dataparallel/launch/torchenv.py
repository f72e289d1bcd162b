"""torchrun's variables for every rank `dataparallel run` starts, whatever started it.

An unchanged torchrun script reads `RANK`, `WORLD_SIZE`, `LOCAL_RANK`, `LOCAL_WORLD_SIZE`,
`MASTER_ADDR` and `MASTER_PORT` and calls `dist.init_process_group()` itself (env://). Under Gloo
the launcher sets them already (`gloo.py`); under Slurm `config.py` derives them from the step;
under MPI the runner asks MPI, once, before the script runs: its rank and size, its rank among the
processes of its node (`COMM_TYPE_SHARED`), and rank 0's host name and a free port there,
broadcast. Variables already set are kept.
"""

from __future__ import annotations

import os
import socket
from types import ModuleType

from dataparallel.config import Settings
from dataparallel.launch._process import free_port

__all__ = ["TORCHRUN_VARIABLES", "set_torchrun_variables", "torchrun_variables"]

TORCHRUN_VARIABLES = (
    "RANK",
    "WORLD_SIZE",
    "LOCAL_RANK",
    "LOCAL_WORLD_SIZE",
    "MASTER_ADDR",
    "MASTER_PORT",
)


def torchrun_variables(settings: Settings, mpi: ModuleType | None) -> dict[str, str]:
    """Return torchrun's variables for this rank (empty when nothing knows them).

    Args:
        settings: what the launcher set (torchrun's own variables, or Slurm's step).
        mpi: `mpi4py.MPI`, initialized, when an MPI launcher started this rank (collective then).
    """
    if mpi is not None:
        world = mpi.COMM_WORLD
        node = world.Split_type(mpi.COMM_TYPE_SHARED)
        local = (node.Get_rank(), node.Get_size())
        node.Free()
        master = None
        if world.Get_rank() == 0:
            host = settings.master_addr or socket.gethostname()
            master = (host, settings.master_port or free_port(""))
        host, port = world.bcast(master, root=0)
        values: tuple[object, ...] = (world.Get_rank(), world.Get_size(), *local, host, port)
    else:
        values = (
            settings.rank,
            settings.world_size,
            settings.local_rank,
            settings.local_world_size,
            settings.master_addr,
            settings.master_port,
        )
    return {
        name: str(value)
        for name, value in zip(TORCHRUN_VARIABLES, values, strict=True)
        if value is not None
    }


def set_torchrun_variables(mpi: ModuleType | None) -> None:
    """Put torchrun's variables into this rank's environment, keeping any already set."""
    for name, value in torchrun_variables(Settings.from_env(), mpi).items():
        os.environ.setdefault(name, value)

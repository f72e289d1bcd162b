"""dataparallel: data-parallel training across processes and machines.

Horovod's power without Horovod's build: pure Python over real engines (MPI through mpi4py, Gloo and
NCCL), for NumPy, PyTorch, JAX and CuPy arrays in nested containers.

>>> import dataparallel as dp
>>> backend = dp.initialize()          # MPI under mpiexec, Gloo under torchrun, else a world of one
>>> grads = dp.allreduce_gradients({"w": 1.0})   # averaged across ranks
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING

from dataparallel import torch_distributed as _torch_distributed
from dataparallel.arrays.compression import Compression
from dataparallel.backends.base import Backend
from dataparallel.collectives.broadcasts import broadcast, ibroadcast
from dataparallel.collectives.exchanges import alltoall
from dataparallel.collectives.gathers import allgather
from dataparallel.collectives.join import join
from dataparallel.collectives.objects import allgather_object, barrier, broadcast_object
from dataparallel.collectives.pointtopoint import recv, send, sendrecv
from dataparallel.collectives.reductions import allreduce, allreduce_gradients, iallreduce, reduce
from dataparallel.collectives.requests import Request, wait_all
from dataparallel.collectives.scatters import reducescatter
from dataparallel.collectives.traced import handled_by as _traced_by
from dataparallel.errors import (
    BackendUnavailableError,
    CollectiveMismatchError,
    CollectiveTimeoutError,
    DataParallelError,
    LinkLostError,
    NotInitializedError,
    RankFailedError,
    RankJoinedError,
)
from dataparallel.groups import Group, new_group
from dataparallel.progress import progress
from dataparallel.protocol import verify_same_call as _verify_same_call
from dataparallel.reducers import CoalescingReducer, InlineReducer, Reducer
from dataparallel.training import DistributedOptimizer, synchronize
from dataparallel.version import VERSION as _VERSION
from dataparallel.world import (
    device,
    finalize,
    get_backend,
    initialize,
    initialized,
    is_main,
    local_rank,
    local_size,
    rank,
    size,
    timeline,
)
from dataparallel.world import (
    print as print,  # dp.print; not in __all__, so `import *` keeps the builtin
)

# torch's group, when made as torch is imported after `dp.initialize()`, begins with the
# handshake of a collective call, a layer above `torch_distributed`: wired here.
_torch_distributed.check_calls_with(_verify_same_call)
# Collectives on values JAX is tracing (inside `jax.jit`) are put in the program by
# `dataparallel.jax`, a layer above them: named here, loaded on the first traced call, so JAX is not
# imported before.
_traced_by("dataparallel.jax.traced")

__version__ = _VERSION
"""This package's version, from its installed metadata (`"0+unknown"` when not installed)."""

__all__ = [
    "Backend",
    "BackendUnavailableError",
    "CoalescingReducer",
    "CollectiveMismatchError",
    "CollectiveTimeoutError",
    "Compression",
    "DataParallelError",
    "DistributedOptimizer",
    "Group",
    "InlineReducer",
    "LinkLostError",
    "NotInitializedError",
    "RankFailedError",
    "RankJoinedError",
    "Reducer",
    "Request",
    "allgather",
    "allgather_object",
    "allreduce",
    "allreduce_gradients",
    "alltoall",
    "barrier",
    "broadcast",
    "broadcast_object",
    "device",
    "finalize",
    "get_backend",
    "iallreduce",
    "ibroadcast",
    "initialize",
    "initialized",
    "is_main",
    "join",
    "local_rank",
    "local_size",
    "new_group",
    "progress",
    "rank",
    "recv",
    "reduce",
    "reducescatter",
    "send",
    "sendrecv",
    "size",
    "synchronize",
    "timeline",
    "wait_all",
]

# Names whose modules load on first access, so `import dataparallel` needs NumPy alone.
_LAZY = {
    "torch": ("dataparallel.torch", None),
    "checkpoint": ("dataparallel.checkpoint", None),
    "elastic": ("dataparallel.elastic", None),
    "lightning": ("dataparallel.lightning", None),
    "DistributedDataContainer": ("dataparallel.data", "DistributedDataContainer"),
    "DistributedDataLoader": ("dataparallel.data", "DistributedDataLoader"),
}


if TYPE_CHECKING:  # what the type checker sees of them; at run time they load here
    from dataparallel import checkpoint as checkpoint
    from dataparallel import elastic as elastic
    from dataparallel import lightning as lightning
    from dataparallel import torch as torch
    from dataparallel.data import DistributedDataContainer as DistributedDataContainer
    from dataparallel.data import DistributedDataLoader as DistributedDataLoader


def __getattr__(name: str) -> object:
    if name not in _LAZY:
        raise AttributeError(f"module 'dataparallel' has no attribute {name!r}")
    module_name, attr = _LAZY[name]
    module = importlib.import_module(module_name)
    value = module if attr is None else getattr(module, attr)
    globals()[name] = value
    return value


def __dir__() -> list[str]:
    return sorted([*__all__, *_LAZY])

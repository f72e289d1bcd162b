"""Horovod 0.28's PyTorch API over dataparallel: `import dataparallel.horovod.torch as hvd`.

A Horovod script moves to dataparallel by changing its import line. Every call hands over to
dataparallel's own API; `docs/horovod.md` lists what differs (Adasum is not supported; `poll`
starts a queued operation; errors are dataparallel's, which name ranks and leaves).

>>> import torch
>>> import dataparallel.horovod.torch as hvd
>>> hvd.init()
>>> hvd.allreduce(torch.ones(2), op=hvd.Sum) * hvd.size()
tensor([1., 1.])
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from dataparallel.arrays.compression import Compression
from dataparallel.horovod.torch import _handles, elastic
from dataparallel.horovod.torch._basics import (
    Adasum,
    Average,
    HorovodInternalError,
    Max,
    Min,
    Product,
    Sum,
    ccl_built,
    cross_rank,
    cross_size,
    cuda_built,
    ddl_built,
    gloo_built,
    gloo_enabled,
    is_homogeneous,
    is_initialized,
    local_rank,
    local_size,
    mpi_built,
    mpi_enabled,
    mpi_threads_supported,
    nccl_built,
    rank,
    rocm_built,
    size,
    start_timeline,
    stop_timeline,
)
from dataparallel.horovod.torch._functions import (
    allgather_object,
    barrier,
    broadcast_object,
    broadcast_optimizer_state,
    broadcast_parameters,
    join,
)
from dataparallel.horovod.torch._lifetime import init, shutdown
from dataparallel.horovod.torch._movement import (
    allgather,
    allgather_async,
    alltoall,
    alltoall_async,
    broadcast,
    broadcast_,
    broadcast_async,
    broadcast_async_,
    grouped_allgather,
    grouped_allgather_async,
    sparse_allreduce_async,
)
from dataparallel.horovod.torch._optimizer import DistributedOptimizer
from dataparallel.horovod.torch._process_sets import (
    ProcessSet,
    add_process_set,
    global_process_set,
    remove_process_set,
)
from dataparallel.horovod.torch._reductions import (
    allreduce,
    allreduce_,
    allreduce_async,
    allreduce_async_,
    grouped_allreduce,
    grouped_allreduce_,
    grouped_allreduce_async,
    grouped_allreduce_async_,
)
from dataparallel.horovod.torch._scatters import (
    grouped_reducescatter,
    grouped_reducescatter_async,
    reducescatter,
    reducescatter_async,
)

if TYPE_CHECKING:
    from dataparallel.torch import SyncBatchNorm


def __getattr__(name: str) -> type[SyncBatchNorm]:
    if name == "SyncBatchNorm":  # imported on first use, as dataparallel.torch is
        from dataparallel.torch import SyncBatchNorm

        return SyncBatchNorm
    raise AttributeError(f"module 'dataparallel.horovod.torch' has no attribute {name!r}")


poll = _handles.poll
synchronize = _handles.synchronize


__all__ = [
    "Adasum",
    "Average",
    "Compression",
    "DistributedOptimizer",
    "HorovodInternalError",
    "Max",
    "Min",
    "ProcessSet",
    "Product",
    "Sum",
    "SyncBatchNorm",
    "add_process_set",
    "allgather",
    "allgather_async",
    "allgather_object",
    "allreduce",
    "allreduce_",
    "allreduce_async",
    "allreduce_async_",
    "alltoall",
    "alltoall_async",
    "barrier",
    "broadcast",
    "broadcast_",
    "broadcast_async",
    "broadcast_async_",
    "broadcast_object",
    "broadcast_optimizer_state",
    "broadcast_parameters",
    "ccl_built",
    "cross_rank",
    "cross_size",
    "cuda_built",
    "ddl_built",
    "elastic",
    "global_process_set",
    "gloo_built",
    "gloo_enabled",
    "grouped_allgather",
    "grouped_allgather_async",
    "grouped_allreduce",
    "grouped_allreduce_",
    "grouped_allreduce_async",
    "grouped_allreduce_async_",
    "grouped_reducescatter",
    "grouped_reducescatter_async",
    "init",
    "is_homogeneous",
    "is_initialized",
    "join",
    "local_rank",
    "local_size",
    "mpi_built",
    "mpi_enabled",
    "mpi_threads_supported",
    "nccl_built",
    "poll",
    "rank",
    "reducescatter",
    "reducescatter_async",
    "remove_process_set",
    "rocm_built",
    "shutdown",
    "size",
    "sparse_allreduce_async",
    "start_timeline",
    "stop_timeline",
    "synchronize",
]

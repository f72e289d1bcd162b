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

from collections.abc import Sequence
from typing import TYPE_CHECKING, Literal

from dataparallel import world
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
    learn_nodes,
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
    reset_process_sets,
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


_started: list[bool] = []  # [True] between this module's init() and shutdown()

poll = _handles.poll
synchronize = _handles.synchronize


def init(
    comm: Sequence[int] | None = None,
    process_sets: Sequence[ProcessSet] | Literal["dynamic"] | None = None,
) -> None:
    """Start dataparallel (`dp.initialize()`: MPI under an MPI launcher, Gloo under torchrun-
    style variables, else a world of one) and register `process_sets`.

    Args:
        comm: None (every process), or a list of all the world's ranks; a sub-communicator is not
            supported (make a process set instead).
        process_sets: process sets to register (`ProcessSet` objects), or `"dynamic"`.
    """
    if comm is not None and not isinstance(comm, (list, tuple)):
        raise ValueError("hvd.init(comm=...) takes a list of ranks here (not an MPI communicator).")
    first = not _started or not world.initialized()
    world.initialize()
    if comm is not None and sorted(comm) != list(range(world.size())):
        raise NotImplementedError(
            "hvd.init(comm=ranks) with a subset of the world is not supported: init every "
            "process and use hvd.add_process_set(ranks) for collectives among some of them."
        )
    _handles.reset()  # as Horovod's init: handles from before are forgotten
    if first:  # a second init keeps the process sets added since the first, as Horovod's
        reset_process_sets()
        _started.append(True)
    learn_nodes()
    if process_sets is not None and process_sets != "dynamic":
        for ps in process_sets:
            add_process_set(ps)


def shutdown() -> None:
    """Stop dataparallel (`dp.finalize()`); operations still queued are dropped."""
    if not world.initialized():
        return
    _handles.reset()
    reset_process_sets()
    _started.clear()
    world.finalize()


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

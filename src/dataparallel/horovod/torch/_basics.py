"""Horovod's process-level calls: init/shutdown, ranks and sizes, what is built, the reduce ops.

Everything hands over to `dataparallel`: `init()` is `dp.initialize()` (MPI under an MPI launcher,
Gloo under torchrun-style variables, else a world of one), `rank()` is `dp.rank()`, and so on.
"""

from __future__ import annotations

import importlib.util

from dataparallel import caches, world
from dataparallel.arrays.trace import Timeline
from dataparallel.collectives import objects
from dataparallel.errors import RankFailedError

__all__ = [
    "Adasum",
    "Average",
    "HorovodInternalError",
    "Max",
    "Min",
    "Product",
    "Sum",
    "ccl_built",
    "cross_rank",
    "cross_size",
    "cuda_built",
    "ddl_built",
    "gloo_built",
    "gloo_enabled",
    "is_homogeneous",
    "is_initialized",
    "local_rank",
    "local_size",
    "mpi_built",
    "mpi_enabled",
    "mpi_threads_supported",
    "nccl_built",
    "rank",
    "require_init",
    "rocm_built",
    "size",
    "start_timeline",
    "stop_timeline",
]

# Horovod's reduce ops are small ints (its C API's values); they name dataparallel's ops.
Average = 0
"""`op=Average`: the sum divided by the number of ranks (dataparallel's `op="avg"`)."""
Sum = 1
"""`op=Sum` (`op="sum"`)."""
Adasum = 2
"""`op=Adasum`: not supported here; raises `NotImplementedError`."""
Min = 3
"""`op=Min` (`op="min"`)."""
Max = 4
"""`op=Max` (`op="max"`)."""
Product = 5
"""`op=Product` (`op="prod"`)."""


class HorovodInternalError(RankFailedError):
    """A collective failed (Horovod's name; elastic training catches it).

    It is a `dp.RankFailedError`: elastic training (`hvd.elastic.run`) catches both alike.
    dataparallel's own errors (`CollectiveMismatchError`, `RankFailedError`, ...) are raised as
    they are: they are `RuntimeError`s too, and their messages name the ranks and leaves.
    """


class _Nodes:
    """Where the ranks run: the node index of each rank, learnt once at `init()`."""

    cross_rank = 0
    cross_size = 1
    homogeneous = True


_nodes = _Nodes()
_timeline: list[Timeline] = []


@caches.register
def _forget_the_world() -> None:
    """What `init()` learnt of the world goes with it (`dp.finalize()`)."""
    _nodes.cross_rank, _nodes.cross_size, _nodes.homogeneous = 0, 1, True
    _timeline.clear()


def require_init() -> None:
    """Raise Horovod's `ValueError` when `init()` has not run."""
    if not world.initialized():
        raise ValueError("Horovod has not been initialized; use hvd.init().")


def learn_nodes() -> None:
    """Find this process's node index and the node count (collective: called by `init()`)."""
    if world.size() == 1:
        _nodes.cross_rank, _nodes.cross_size, _nodes.homogeneous = 0, 1, True
        return
    places = objects.allgather_object((world.local_rank(), world.local_size()))
    # Node k holds the ranks whose local rank is 0 at or after the k-th such rank, in rank order.
    starts = [r for r, (local, _) in enumerate(places) if local == 0]
    node = max(i for i, start in enumerate(starts) if start <= world.rank())
    _nodes.cross_rank, _nodes.cross_size = node, len(starts)
    _nodes.homogeneous = len({n for _, n in places}) == 1


def is_initialized() -> bool:
    """Return whether `init()` has run (and `shutdown()` has not)."""
    return world.initialized()


def size() -> int:
    """Return the number of processes (`dp.size()`)."""
    require_init()
    return world.size()


def rank() -> int:
    """Return this process's rank (`dp.rank()`)."""
    require_init()
    return world.rank()


def local_size() -> int:
    """Return the number of processes on this node (`dp.local_size()`)."""
    require_init()
    return world.local_size()


def local_rank() -> int:
    """Return this process's rank on its node (`dp.local_rank()`)."""
    require_init()
    return world.local_rank()


def cross_size() -> int:
    """Return the number of nodes."""
    require_init()
    return _nodes.cross_size


def cross_rank() -> int:
    """Return the index of this process's node."""
    require_init()
    return _nodes.cross_rank


def is_homogeneous() -> bool:
    """Return whether every node runs the same number of processes."""
    require_init()
    return _nodes.homogeneous


def mpi_threads_supported() -> bool:
    """Return whether the MPI library was initialized with `MPI_THREAD_MULTIPLE`."""
    require_init()
    if world.get_backend().name != "mpi":
        return False
    from mpi4py import MPI

    return bool(MPI.Query_thread() == MPI.THREAD_MULTIPLE)


def mpi_enabled() -> bool:
    """Return whether the collectives run over MPI."""
    return world.initialized() and world.get_backend().name == "mpi"


def mpi_built() -> bool:
    """Return whether MPI can be used here (mpi4py is installed)."""
    return importlib.util.find_spec("mpi4py") is not None


def gloo_enabled() -> bool:
    """Return whether the collectives run over Gloo."""
    return world.initialized() and world.get_backend().name == "gloo"


def gloo_built() -> bool:
    """Return whether Gloo can be used here (PyTorch with `torch.distributed`)."""
    import torch.distributed

    return bool(torch.distributed.is_available() and torch.distributed.is_gloo_available())


def nccl_built() -> int:
    """Return the NCCL version as Horovod encodes it (2.18.3 is 21803), or 0 without NCCL."""
    if importlib.util.find_spec("cupy") is None:
        return 0
    try:
        from cupy.cuda import nccl

        return int(nccl.get_version())
    except Exception:  # CuPy without NCCL, or without a CUDA driver
        return 0


def ddl_built() -> bool:
    """IBM DDL: never (Horovod's name, kept for scripts that test it)."""
    return False


def ccl_built() -> bool:
    """Intel oneCCL: never (Horovod's name, kept for scripts that test it)."""
    return False


def cuda_built() -> bool:
    """Return whether GPU tensors can be reduced here (a CUDA build of PyTorch)."""
    import torch

    return bool(torch.backends.cuda.is_built())


def rocm_built() -> bool:
    """ROCm: never (Horovod's name, kept for scripts that test it)."""
    return False


def start_timeline(file_path: str, mark_cycles: bool = False) -> None:
    """Record every collective into the Chrome-trace file `file_path` (`dp.timeline`).

    `mark_cycles` is accepted for Horovod's signature; dataparallel has no cycles to mark.
    """
    require_init()
    stop_timeline()
    _timeline.append(world.timeline(file_path))


def stop_timeline() -> None:
    """Stop recording and close the timeline file."""
    require_init()
    while _timeline:
        _timeline.pop().close()

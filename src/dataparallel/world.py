"""Process-group state: the one global of the library, and the calls that read it."""

from __future__ import annotations

import builtins
import ctypes
import datetime
import importlib
import sys
from dataclasses import dataclass, field
from typing import Any

from dataparallel.arrays import BufferPool
from dataparallel.backends.base import Backend
from dataparallel.config import Settings
from dataparallel.errors import BackendUnavailableError, NotInitializedError

__all__ = [
    "choose_device",
    "device",
    "finalize",
    "get_backend",
    "initialize",
    "initialized",
    "is_main",
    "local_rank",
    "local_size",
    "print",
    "rank",
    "size",
]

_BACKENDS = {
    "mpi": "dataparallel.backends.mpi:MPIBackend",
    "gloo": "dataparallel.backends.gloo:GlooBackend",
    "nccl": "dataparallel.backends.nccl:NCCLBackend",
    "single": "dataparallel.backends.single:SingleBackend",
}


@dataclass
class World:
    """Everything `initialize` sets up: the backend, the settings it read, the device it chose."""

    backend: Backend
    settings: Settings
    device: int | None
    verbose: bool = False
    pending: list[Any] = field(default_factory=list)  # dp.Request objects not yet waited on
    buffers: BufferPool = field(default_factory=BufferPool)
    timeline: Any = None  # a dataparallel.timeline.Timeline while one records


_world: World | None = None


def initialize(
    backend: str = "auto",
    *,
    init_method: str | None = None,
    rank: int | None = None,
    world_size: int | None = None,
    gpu_devices: list[int] | None = None,
    timeout: float | None = None,
    verbose: bool = False,
) -> Backend:
    """Set up the process group and return its backend.

    Idempotent: a second call returns the active backend.

    Args:
        backend: `"auto"` (default), `"mpi"`, `"gloo"`, `"nccl"` or `"single"`. `"auto"` picks MPI
            when an MPI launcher started the process (or MPI is already initialized), Gloo when
            torchrun's `RANK`, `WORLD_SIZE` and `MASTER_ADDR` are set, else a world of one.
        init_method: rendezvous for Gloo/NCCL: `"env://"`, `"tcp://host:port"` or `"file:///dir"`
            (Flashlight's methods); `"mpi"` selects the MPI backend.
        rank, world_size: this process's rank and the world size, for `tcp://` and `file://`.
        gpu_devices: GPU index per local rank; default: round robin over the visible GPUs.
        timeout: seconds before a blocked collective or rendezvous fails (default: none).
        verbose: print the world's shape from every rank once initialized.

    Returns:
        The active `Backend`.
    """
    global _world
    if _world is not None:
        return _world.backend
    settings = Settings.from_env()
    if timeout is not None:
        settings = _replace(settings, timeout=timeout)
    name = _resolve_backend_name(backend, init_method, settings)
    cls = _load_backend(name)
    engine = cls.create(
        init_method=init_method, rank=rank, world_size=world_size, settings=settings
    )
    gpu = choose_device(engine.local_rank, _cuda_device_count(), gpu_devices)
    if gpu is not None:
        _point_frameworks_at(gpu)
        bind_device = getattr(engine, "bind_device", None)  # NCCL: make its communicator there
        if bind_device is not None:
            bind_device(gpu)
    _world = World(backend=engine, settings=settings, device=gpu, verbose=verbose)
    if settings.timeline:
        from dataparallel.timeline import Timeline

        _world.timeline = Timeline(settings.timeline, engine.rank, engine.size)
    if engine.size > 1:
        _abort_on_uncaught_exceptions(engine)
    if verbose:
        print(f"initialized {engine.name} backend, local rank {engine.local_rank}, GPU {gpu}")
    return engine


def _replace(settings: Settings, **changes: Any) -> Settings:
    import dataclasses

    return dataclasses.replace(settings, **changes)


def _resolve_backend_name(backend: str, init_method: str | None, settings: Settings) -> str:
    if backend not in ("auto", *_BACKENDS):
        raise ValueError(
            f"backend={backend!r} is not known: use 'auto', "
            + ", ".join(repr(n) for n in _BACKENDS)
            + "."
        )
    if backend != "auto":
        return backend
    if init_method == "mpi":
        return "mpi"
    if init_method is not None:
        return "gloo"
    if settings.mpi_launched or _mpi_already_initialized():
        return "mpi"
    if settings.torchrun_launched:
        return "gloo"
    return "single"


def _mpi_already_initialized() -> bool:
    mpi = sys.modules.get("mpi4py.MPI")
    return bool(mpi is not None and mpi.Is_initialized())


def _load_backend(name: str) -> type[Backend]:
    module_name, _, attr = _BACKENDS[name].partition(":")
    try:
        module = importlib.import_module(module_name)
    except ModuleNotFoundError as exc:
        if not exc.name or not exc.name.startswith("dataparallel"):
            raise
        raise BackendUnavailableError(f"The {name!r} backend is not available yet.") from exc
    cls: type[Backend] = getattr(module, attr)
    return cls


def choose_device(local_rank: int, n_gpus: int, gpu_devices: list[int] | None = None) -> int | None:
    """Return the GPU index for `local_rank`: `gpu_devices[local_rank]`, or round robin, or None.

    Without a visible GPU (`n_gpus == 0`) the answer is None, `gpu_devices` or not, so a script
    written for GPUs still runs on the CPU.

    >>> choose_device(3, 2), choose_device(1, 4, [2, 3]), choose_device(0, 0, [0])
    (1, 3, None)
    """
    if n_gpus <= 0:
        return None
    if gpu_devices is None:
        return local_rank % n_gpus
    if local_rank >= len(gpu_devices):
        raise ValueError(
            f"gpu_devices={gpu_devices!r} names {len(gpu_devices)} GPUs, but this node runs "
            f"local rank {local_rank}: give one GPU index per process on the node."
        )
    gpu = gpu_devices[local_rank]
    if not 0 <= gpu < n_gpus:
        raise ValueError(
            f"gpu_devices[{local_rank}]={gpu}, but this process sees {n_gpus} GPU(s), "
            f"0 to {n_gpus - 1} (CUDA_VISIBLE_DEVICES renumbers them from 0): give visible indices."
        )
    return gpu


def _cuda_device_count() -> int:
    """Count CUDA devices through the driver, without importing a framework."""
    for lib in ("libcuda.so.1", "libcuda.so"):
        try:
            cuda = ctypes.CDLL(lib)
        except OSError:
            continue
        count = ctypes.c_int(0)
        if cuda.cuInit(0) != 0 or cuda.cuDeviceGetCount(ctypes.byref(count)) != 0:
            return 0
        return count.value
    return 0


def _point_frameworks_at(gpu: int) -> None:
    """Make `gpu` the current device of torch and CuPy, where they are installed."""
    try:
        import torch

        if torch.cuda.is_available():  # a CPU build of torch on a GPU machine has no devices
            torch.cuda.set_device(gpu)
    except ImportError:
        pass
    try:
        import cupy

        cupy.cuda.Device(gpu).use()
    except ImportError:
        pass


def _abort_on_uncaught_exceptions(engine: Backend) -> None:
    """Make an uncaught exception end the whole job, not only this rank.

    Otherwise the other ranks wait forever in their next collective (mpi4py's `python -m mpi4py`
    and `dataparallel run` do the same; under them, their own handler acts first). The traceback is
    printed as usual, once, then the backend aborts the job.
    """
    previous = sys.excepthook

    def abort_the_job(kind: type[BaseException], error: BaseException, tb: Any) -> None:
        previous(kind, error, tb)
        if _world is not None and _world.backend is engine:
            sys.stderr.write(f"[rank {engine.rank}] uncaught {kind.__name__}: ending the job\n")
            sys.stderr.flush()
            engine.abort(1)

    sys.excepthook = abort_the_job


def initialized() -> bool:
    """Return whether `initialize()` has set up the process group."""
    return _world is not None


def finalize() -> None:
    """Wait for requests in flight, then tear the process group down. Safe to call twice."""
    global _world
    if _world is None:
        return
    world, _world = _world, None
    for request in list(world.pending):
        request.wait()
    if world.timeline is not None:
        world.timeline.close()
    world.backend.close()


def current() -> World:
    """Return the active world, or raise `NotInitializedError`."""
    if _world is None:
        raise NotInitializedError(
            "dataparallel is not initialized: call dp.initialize() first "
            "(it picks MPI, Gloo or a world of one from how the process was launched)."
        )
    return _world


def get_backend() -> Backend:
    """Return the active backend (`.name` is `"mpi"`, `"gloo"`, `"nccl"` or `"single"`)."""
    return current().backend


def rank() -> int:
    """Return this process's rank in the world (0-based)."""
    return current().backend.rank


def size() -> int:
    """Return the number of processes in the world."""
    return current().backend.size


def local_rank() -> int:
    """Return this process's rank among the processes on its node.

    Note: FluxMPI's `local_rank()` is the world rank, which is `dp.rank()` here.
    """
    return current().backend.local_rank


def local_size() -> int:
    """Return the number of processes on this node."""
    return current().backend.local_size


def is_main() -> bool:
    """Return whether this is rank 0, where logging, checkpoints and progress bars belong."""
    return rank() == 0


def device() -> int | None:
    """Return the GPU index this process was given, or None when it has no GPU."""
    return current().device


def print(*args: Any, **kwargs: Any) -> None:
    """Print with a timestamp and a `[rank/size]` prefix, flushed at once.

    Never communicates, so a print on one rank alone cannot deadlock (FluxMPI's is collective).
    """
    where = f"{rank()}/{size()}" if _world is not None else "-/-"
    stamp = datetime.datetime.now().strftime("%H:%M:%S.%f")[:-3]
    text = kwargs.pop("sep", " ").join(map(str, args))
    end = kwargs.pop("end", "\n")
    kwargs.setdefault("flush", True)
    # One write per line, so lines from ranks sharing a terminal never interleave mid-line.
    builtins.print(f"[{stamp}] [{where}] {text}{end}", end="", **kwargs)

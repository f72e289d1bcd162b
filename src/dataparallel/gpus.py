"""Which GPU a process uses: counted by the driver, chosen by local rank, set in the frameworks."""

from __future__ import annotations

import ctypes

__all__ = ["choose_device", "cuda_device_count", "point_frameworks_at"]


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


def cuda_device_count() -> int:
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


def point_frameworks_at(gpu: int) -> None:
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

"""The CuPy family: arrays on a GPU, packed and communicated on their device (`DeviceWork`),
written in place."""

from __future__ import annotations

from typing import TYPE_CHECKING

import numpy as np

from dataparallel.arrays.dtypes import dtype_name
from dataparallel.arrays.families.base import Family, Work, device_work

if TYPE_CHECKING:
    import cupy

__all__ = ["CupyFamily"]


class CupyFamily(Family["cupy.ndarray"]):
    """CuPy arrays live on a GPU: packed and communicated there, written in place."""

    name = "cupy"

    def work(self, x: cupy.ndarray) -> tuple[Work, bool]:
        return device_work(self, x), True

    def dtype(self, x: cupy.ndarray) -> str:
        return dtype_name(x.dtype)

    def shape(self, x: cupy.ndarray) -> tuple[int, ...]:
        return tuple(x.shape)

    def device(self, x: cupy.ndarray) -> str:
        return f"cuda:{x.device.id}"

    def to_host(self, x: cupy.ndarray) -> np.ndarray:
        return np.asarray(x.get())

    def from_host(self, x: cupy.ndarray, host: np.ndarray) -> cupy.ndarray:
        import cupy

        x[...] = cupy.asarray(host.reshape(x.shape))
        return x

    def new(self, like: cupy.ndarray, host: np.ndarray) -> cupy.ndarray:
        import cupy

        with cupy.cuda.Device(like.device.id):
            return cupy.asarray(host)

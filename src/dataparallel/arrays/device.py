"""Device buckets: the GPU counterpart of `Fusion`'s host path.

Leaves that live on a GPU (torch CUDA tensors, CuPy arrays) are not copied to the host one by one.
`Family.work` hands them to `Fusion` as `DeviceWork`, and at a flush `DeviceBucket` packs
each bucket (one per array family, device and dtype) into one contiguous device buffer of the
leaves' own family. Then either

- the backend takes device memory (`backend.accepts_device(device)`: NCCL, CUDA-aware MPI, a
  world of one): `send_direct` gives it the buffer as a framework-free `DeviceBuffer` (as bytes
  for broadcasts and bool, widened to float32 for a dtype the engine lacks), and `land` scales,
  narrows and unpacks on the GPU; or
- it does not: `stage` copies the bucket once into a pinned host buffer, which the host path
  communicates like any other host buffer, and `unstage` copies it back once and unpacks.

A single contiguous leaf is communicated in place, with no device copy at all, as on the host.

Stream order. A backend that orders its work on CUDA streams itself (`stream_aware = True`: NCCL)
gets the buffer at once and makes the compute stream wait when the request is waited on. For any
other engine (MPI), the producing stream is synchronized before the buffer is handed over, since MPI
reads device memory outside CUDA's stream order. Staging copies are synchronous.

Device buffers come from the frameworks' own caching allocators (torch's CUDA and pinned-host
allocators, CuPy's memory pools), so repeated flushes reuse memory without a pool of our own.
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Any, Protocol, TypeAlias

import numpy as np
import numpy.typing as npt

from dataparallel import caches
from dataparallel.arrays.dtypes import dtype_name
from dataparallel.backends.base import Backend, DeviceBuffer

if TYPE_CHECKING:
    import cupy
    import torch

__all__ = ["DeviceArray", "DeviceBucket", "DeviceOps", "DeviceWork", "device_ops"]

# A GPU leaf or a bucket's buffer: a torch tensor or a CuPy array. They share no type a checker
# knows (CuPy may be absent), so what is done to one is typed in its family's ops below.
DeviceArray: TypeAlias = Any


class LeafFamily(Protocol):
    """What a device leaf needs of its array family (`arrays.Family` provides it)."""

    name: str

    def device(self, x: DeviceArray) -> str: ...

    def to_host(self, x: DeviceArray) -> np.ndarray: ...


class DeviceOps(Protocol):
    """Device-buffer operations of one array family (`_TorchOps`, `_CupyOps`)."""

    def size(self, x: DeviceArray) -> int: ...
    def nbytes(self, x: DeviceArray) -> int: ...
    def contiguous(self, x: DeviceArray) -> bool: ...
    def flat(self, x: DeviceArray) -> DeviceArray: ...
    def empty(self, like: DeviceArray, n: int) -> DeviceArray: ...
    def put(self, buf: DeviceArray, offset: int, x: DeviceArray) -> None: ...
    def get(self, buf: DeviceArray, offset: int, x: DeviceArray) -> None: ...
    def as_bytes(self, buf: DeviceArray) -> DeviceArray: ...
    def widen(self, buf: DeviceArray) -> DeviceArray: ...
    def casts_to(self, dtype: str) -> bool: ...
    def cast(self, buf: DeviceArray, dtype: str) -> DeviceArray: ...
    def narrow(self, wide: DeviceArray, buf: DeviceArray) -> None: ...
    def scale(self, buf: DeviceArray, scale: float) -> None: ...
    def synchronize(self, buf: DeviceArray) -> None: ...
    def describe(self, buf: DeviceArray) -> DeviceBuffer: ...
    def to_host(self, buf: DeviceArray) -> tuple[object, np.ndarray]: ...
    def from_host(self, holder: object, buf: DeviceArray) -> None: ...


class _TorchOps:
    """Device-buffer operations on torch tensors (CUDA in use; any device works the same way)."""

    def __init__(self) -> None:
        torch = self.torch = importlib.import_module("torch")
        self._signed = {
            getattr(torch, f"uint{bits}"): getattr(torch, f"int{bits}")
            for bits in (16, 32, 64)
            if hasattr(torch, f"uint{bits}")
        }

    def size(self, x: torch.Tensor) -> int:
        return int(x.numel())

    def nbytes(self, x: torch.Tensor) -> int:
        return int(x.numel()) * int(x.element_size())

    def contiguous(self, x: torch.Tensor) -> bool:
        return bool(x.is_contiguous() and not x.is_conj() and not x.is_neg())

    def flat(self, x: torch.Tensor) -> torch.Tensor:
        return x.detach().view(-1)

    def empty(self, like: torch.Tensor, n: int) -> torch.Tensor:
        return self.torch.empty(n, dtype=like.dtype, device=like.device)

    def put(self, buf: torch.Tensor, offset: int, x: torch.Tensor) -> None:
        buf[offset : offset + x.numel()].view(x.shape).copy_(x.detach())

    def get(self, buf: torch.Tensor, offset: int, x: torch.Tensor) -> None:
        with self.torch.no_grad():
            x.copy_(buf[offset : offset + x.numel()].view(x.shape))

    def as_bytes(self, buf: torch.Tensor) -> torch.Tensor:
        return buf.view(self.torch.uint8)

    def widen(self, buf: torch.Tensor) -> torch.Tensor:
        return buf.to(self.torch.float32)

    def casts_to(self, dtype: str) -> bool:
        return True

    def cast(self, buf: torch.Tensor, dtype: str) -> torch.Tensor:
        return buf.to(getattr(self.torch, dtype))

    def narrow(self, wide: torch.Tensor, buf: torch.Tensor) -> None:
        buf.copy_(wide)  # float32 -> bfloat16 rounds to nearest even, as the host path does

    def scale(self, buf: torch.Tensor, scale: float) -> None:
        if buf.is_floating_point() or buf.is_complex():
            buf.mul_(scale)
            return
        # torch's uint16/32/64 have few kernels; their signed twins multiply to the same bits.
        signed = self._signed.get(buf.dtype)
        (buf if signed is None else buf.view(signed)).mul_(int(scale))

    def synchronize(self, buf: torch.Tensor) -> None:
        if buf.is_cuda:
            self.torch.cuda.current_stream(buf.device).synchronize()

    def describe(self, buf: torch.Tensor) -> DeviceBuffer:
        def record_stream(stream: int) -> None:
            buf.record_stream(self.torch.cuda.ExternalStream(stream))

        device = int(buf.device.index or 0)
        cuda = bool(buf.is_cuda)  # tests send CPU tensors down this path, as stand-ins
        return DeviceBuffer(
            ptr=int(buf.data_ptr()),
            items=int(buf.numel()),
            itemsize=int(buf.element_size()),
            dtype=dtype_name(buf.dtype),
            device=device,
            stream=int(self.torch.cuda.current_stream(device).cuda_stream) if cuda else 0,
            owner=buf,
            record_stream=record_stream if cuda else None,
        )

    def to_host(self, buf: torch.Tensor) -> tuple[torch.Tensor, np.ndarray]:
        host = self.torch.empty(buf.numel(), dtype=buf.dtype, pin_memory=bool(buf.is_cuda))
        host.copy_(buf)  # blocking: the values are on the host when this returns
        if host.dtype == self.torch.bfloat16:
            return host, host.view(self.torch.int16).numpy().view(np.uint16)
        return host, host.numpy()

    def from_host(self, holder: torch.Tensor, buf: torch.Tensor) -> None:
        buf.copy_(holder)


class _CupyOps:
    """Device-buffer operations on CuPy arrays."""

    def __init__(self) -> None:
        self.cupy = importlib.import_module("cupy")
        self.cupyx = importlib.import_module("cupyx")

    def size(self, x: cupy.ndarray) -> int:
        return int(x.size)

    def nbytes(self, x: cupy.ndarray) -> int:
        return int(x.nbytes)

    def contiguous(self, x: cupy.ndarray) -> bool:
        return bool(x.flags.c_contiguous)

    def flat(self, x: cupy.ndarray) -> cupy.ndarray:
        return x.reshape(-1)  # a view, since x is C-contiguous

    def empty(self, like: cupy.ndarray, n: int) -> cupy.ndarray:
        with self.cupy.cuda.Device(like.device.id):
            return self.cupy.empty(n, like.dtype)

    def put(self, buf: cupy.ndarray, offset: int, x: cupy.ndarray) -> None:
        buf[offset : offset + x.size].reshape(x.shape)[...] = x

    def get(self, buf: cupy.ndarray, offset: int, x: cupy.ndarray) -> None:
        x[...] = buf[offset : offset + x.size].reshape(x.shape)

    def as_bytes(self, buf: cupy.ndarray) -> cupy.ndarray:
        return buf.view(self.cupy.uint8)

    def widen(self, buf: cupy.ndarray) -> cupy.ndarray:
        return buf.astype(self.cupy.float32)

    def casts_to(self, dtype: str) -> bool:
        return dtype != "bfloat16"  # CuPy has no bfloat16: such buckets are staged

    def cast(self, buf: cupy.ndarray, dtype: str) -> cupy.ndarray:
        return buf.astype(dtype)

    def narrow(self, wide: cupy.ndarray, buf: cupy.ndarray) -> None:
        buf[...] = wide

    def scale(self, buf: cupy.ndarray, scale: float) -> None:
        factor = int(scale) if buf.dtype.kind in "iu" else scale
        self.cupy.multiply(buf, factor, out=buf, casting="unsafe")

    def synchronize(self, buf: cupy.ndarray) -> None:
        with self.cupy.cuda.Device(buf.device.id):
            self.cupy.cuda.get_current_stream().synchronize()

    def describe(self, buf: cupy.ndarray) -> DeviceBuffer:
        with self.cupy.cuda.Device(buf.device.id):
            stream = int(self.cupy.cuda.get_current_stream().ptr)
        return DeviceBuffer(
            ptr=int(buf.data.ptr),
            items=int(buf.size),
            itemsize=int(buf.itemsize),
            dtype=buf.dtype.name,
            device=int(buf.device.id),
            stream=stream,
            owner=buf,
        )

    def to_host(self, buf: cupy.ndarray) -> tuple[cupy.ndarray, np.ndarray]:
        host = self.cupyx.empty_pinned(buf.shape, buf.dtype)
        buf.get(out=host)  # blocking
        return host, host

    def from_host(self, holder: cupy.ndarray, buf: cupy.ndarray) -> None:
        buf.set(holder)
        self.synchronize(buf)  # the pinned buffer goes back to its pool once this returns


_OPS: dict[str, DeviceOps] = {}  # one per framework, made on first use; cleared by dp.finalize()
caches.register(_OPS.clear)
_OPS_CLASSES: dict[str, type] = {"torch": _TorchOps, "cupy": _CupyOps}


def device_ops(family: str) -> DeviceOps:
    """Return the device-buffer operations of array family `family` (`"torch"` or `"cupy"`)."""
    ops = _OPS.get(family)
    if ops is None:
        if family not in _OPS_CLASSES:
            raise TypeError(
                f"{family} arrays have no device path; expected a torch tensor or a CuPy array."
            )
        ops = _OPS[family] = _OPS_CLASSES[family]()
    return ops


class DeviceWork:
    """A GPU leaf queued for `Fusion` as it is, to be packed on its device.

    Stands where a host work array stands (`Family.work` returns it with `is_view=True`: results
    are written into the leaf itself). `nbytes` and `size` feed the engine's bucketing, and
    `np.asarray(work)` gives a host copy for the calls that need one (`dp.allgather`).
    """

    __slots__ = ("array", "device", "family", "nbytes", "ops", "size")

    def __init__(self, family: LeafFamily, array: DeviceArray) -> None:
        self.family, self.array = family, array
        self.ops = device_ops(family.name)
        self.device = family.device(array)
        self.size = self.ops.size(array)
        self.nbytes = self.ops.nbytes(array)

    def __array__(self, dtype: npt.DTypeLike | None = None, copy: bool | None = None) -> np.ndarray:
        host = self.family.to_host(self.array)
        return host if dtype is None else host.astype(dtype, copy=False)

    def __repr__(self) -> str:
        return f"DeviceWork({self.family.name}, {self.device}, {self.size} items)"


class DeviceBucket:
    """One bucket of GPU leaves of one family, device and dtype, packed into one device buffer.

    Args:
        works: the bucket's leaves, in order.
        dtype: their dtype name.
    """

    def __init__(self, works: list[DeviceWork], dtype: str) -> None:
        first = works[0]
        self.ops, self.dtype, self.device = first.ops, dtype, first.device
        self.slots: list[
            tuple[DeviceArray, int]
        ] = []  # (leaf, offset) to unpack; none when in place
        if len(works) == 1 and self.ops.contiguous(first.array):
            self.buf = self.ops.flat(first.array)  # communicate the leaf in place
        else:
            self.buf = self.ops.empty(first.array, sum(w.size for w in works))
            offset = 0
            for work in works:
                self.ops.put(self.buf, offset, work.array)
                self.slots.append((work.array, offset))
                offset += work.size
        self.wire = self.buf
        self.direct = False
        self._widened = self._compressed = False
        self._host: object = None

    def can_send(self, backend: Backend, compressed: str | None) -> bool:
        """Whether `backend` reduces this bucket on the device (compressed to `compressed`)."""
        return compressed is None or (
            compressed in backend.device_native_dtypes and self.ops.casts_to(compressed)
        )

    def send_direct(
        self, backend: Backend, broadcast: bool, compressed: str | None = None
    ) -> DeviceBuffer:
        """Return the device buffer to hand to `backend`, which accepts this bucket's device.

        With `compressed` (a 16-bit dtype), the values travel cast to it (`compression.py`).
        """
        self.direct = True
        if compressed is not None:
            self.wire, self._compressed = self.ops.cast(self.buf, compressed), True
        elif broadcast or self.dtype == "bool":
            self.wire = self.ops.as_bytes(self.buf)
        elif self.dtype not in backend.device_native_dtypes:
            self.wire, self._widened = self.ops.widen(self.buf), True
        if not backend.stream_aware:
            self.ops.synchronize(self.wire)
        return self.ops.describe(self.wire)

    def land(self, receives: bool, scale: float | None) -> None:
        """Finish a direct bucket on its device: scale, narrow and unpack into the leaves."""
        if receives:
            if self._compressed:  # widen back first, then scale in the leaves' dtype
                self.ops.narrow(self.wire, self.buf)
                if scale is not None and scale != 1:
                    self.ops.scale(self.buf, scale)
            else:
                if scale is not None and scale != 1:
                    self.ops.scale(self.wire, scale)
                if self._widened:
                    self.ops.narrow(self.wire, self.buf)
            self._unpack()
        self.wire = self.buf = None

    def stage(self) -> np.ndarray:
        """Copy the bucket once into pinned host memory; return it as a 1-D host array.

        The array holds the storage dtype (bfloat16 as its bits), as every host work does.
        """
        self._host, view = self.ops.to_host(self.buf)
        return view

    def unstage(self, receives: bool) -> None:
        """Copy the staged host values back once and unpack them into the leaves."""
        if receives:
            self.ops.from_host(self._host, self.buf)
            self._unpack()
        self._host = self.wire = self.buf = None

    def _unpack(self) -> None:
        for array, offset in self.slots:
            self.ops.get(self.buf, offset, array)

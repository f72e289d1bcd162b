"""One adapter per array family: what a leaf is, and how to see or stage its memory on the host.

Collectives work on host NumPy buffers in *storage* dtypes: the leaf's own dtype, except bfloat16,
which NumPy lacks and is carried as its raw bits (`uint16`). CPU leaves of mutable families are
seen through zero-copy views (writes land in the leaf); the rest are staged through host copies and
written back (in place for mutable families, as new arrays for immutable ones).
"""

from __future__ import annotations

import sys
from abc import ABC, abstractmethod
from typing import Any

import numpy as np

__all__ = [
    "SUPPORTED_DTYPES",
    "BufferPool",
    "Family",
    "bf16_to_f32",
    "dtype_name",
    "f32_to_bf16",
    "family_of",
    "storage_dtype",
]

SUPPORTED_DTYPES = frozenset(
    {"bool", "int8", "int16", "int32", "int64", "uint8", "uint16", "uint32", "uint64"}
    | {"float16", "bfloat16", "float32", "float64", "complex64", "complex128"}
)
INTEGER_DTYPES = frozenset(
    {"int8", "int16", "int32", "int64", "uint8", "uint16", "uint32", "uint64"}
)
_BF16_BITS = np.dtype(np.uint16)


_DTYPE_NAMES: dict[Any, str] = {}


def dtype_name(dtype: Any) -> str:
    """Return the name of a NumPy dtype (`"float32"`, `"bfloat16"`), cached: `.name` is slow."""
    name = _DTYPE_NAMES.get(dtype)
    if name is None:
        name = _DTYPE_NAMES[dtype] = str(np.dtype(dtype).name)
    return name


def storage_dtype(dtype: str) -> np.dtype:
    """Return the NumPy dtype that holds values of `dtype` on the host (bfloat16 as raw bits)."""
    return _BF16_BITS if dtype == "bfloat16" else np.dtype(dtype)


def bf16_to_f32(bits: np.ndarray, out: np.ndarray | None = None) -> np.ndarray:
    """Widen bfloat16 bits to float32 exactly."""
    wide = np.left_shift(bits.astype(np.uint32), 16)
    if out is None:
        return wide.view(np.float32)
    out.view(np.uint32)[...] = wide
    return out


def f32_to_bf16(values: np.ndarray, out: np.ndarray) -> np.ndarray:
    """Narrow float32 to bfloat16 bits, rounding to nearest even (NaN stays NaN)."""
    bits = values.view(np.uint32)
    rounding = ((bits >> 16) & 1) + np.uint32(0x7FFF)
    out[...] = ((bits + rounding) >> 16).astype(np.uint16)
    out[np.isnan(values)] = 0x7FC0
    return out


def _check_dtype(dtype: str, path: str) -> str:
    if dtype not in SUPPORTED_DTYPES:
        raise TypeError(
            f"{path}: dtype {dtype} is not supported by collectives; use one of "
            f"{', '.join(sorted(SUPPORTED_DTYPES))} (convert the leaf, or keep it out of the tree)."
        )
    return dtype


class Family(ABC):
    """How dataparallel sees one kind of array. Subclasses are stateless singletons."""

    name: str
    mutable: bool = True

    @abstractmethod
    def dtype(self, x: Any) -> str:
        """Return the leaf's dtype name (`"float32"`, `"bfloat16"`, ...)."""

    @abstractmethod
    def shape(self, x: Any) -> tuple[int, ...]:
        """Return the leaf's shape."""

    def device(self, x: Any) -> str:
        """Return `"cpu"` or `"cuda:N"`."""
        return "cpu"

    def host_view(self, x: Any) -> np.ndarray | None:
        """Return a writable zero-copy host view of `x` in its storage dtype, or None."""
        return None

    @abstractmethod
    def to_host(self, x: Any) -> np.ndarray:
        """Return a new writable host copy of `x` in its storage dtype."""

    @abstractmethod
    def from_host(self, x: Any, host: np.ndarray) -> Any:
        """Return `host`'s values as an array like `x` (written into `x` when it is mutable)."""

    @abstractmethod
    def new(self, like: Any, host: np.ndarray) -> Any:
        """Return a new array of `like`'s family, device and dtype holding `host` (any shape)."""

    def work(self, x: Any) -> tuple[np.ndarray, bool]:
        """Return a writable host array for `x` and whether it is a view (no write-back needed).

        GPU leaves of mutable families (torch CUDA tensors, CuPy arrays) come back as a
        `devices.DeviceWork` instead (with True): the fusion engine packs them on their device.
        """
        view = self.host_view(x)
        if view is not None:
            return view, True
        return self.to_host(x), False


class NumpyFamily(Family):
    name = "numpy"

    def dtype(self, x: np.ndarray) -> str:
        return dtype_name(x.dtype)

    def shape(self, x: np.ndarray) -> tuple[int, ...]:
        return tuple(x.shape)

    def host_view(self, x: np.ndarray) -> np.ndarray | None:
        if not x.flags.writeable or not x.dtype.isnative:  # byte-swapped: staged, converted
            return None
        return x.view(_BF16_BITS) if x.dtype.kind == "V" else x  # "V": ml_dtypes' bfloat16

    def to_host(self, x: np.ndarray) -> np.ndarray:
        native = np.array(x, dtype=x.dtype.newbyteorder("="))
        return native.view(storage_dtype(self.dtype(x)))

    def from_host(self, x: np.ndarray, host: np.ndarray) -> np.ndarray:
        if x.flags.writeable:
            if x.dtype.isnative:
                x.view(host.dtype)[...] = host
            else:
                x[...] = host.view(x.dtype.newbyteorder("="))
            return x
        return self.new(x, host)

    def new(self, like: np.ndarray, host: np.ndarray) -> np.ndarray:
        return np.array(host).view(like.dtype.newbyteorder("="))


_PYTHON_DTYPES = {bool: "bool", int: "int64", float: "float64", complex: "complex128"}


class ScalarFamily(Family):
    """Python numbers and NumPy scalars: immutable, returned as the same type."""

    name = "scalar"
    mutable = False

    def dtype(self, x: Any) -> str:
        if isinstance(x, np.generic):
            return dtype_name(x.dtype)
        return _PYTHON_DTYPES.get(type(x)) or dtype_name(np.asarray(x).dtype)

    def shape(self, x: Any) -> tuple[int, ...]:
        return ()

    def to_host(self, x: Any) -> np.ndarray:
        return np.array(x).view(storage_dtype(self.dtype(x)))  # bfloat16 as its bits

    def from_host(self, x: Any, host: np.ndarray) -> Any:
        if isinstance(x, np.generic):
            return host.reshape(()).view(x.dtype)[()]
        return type(x)(host.reshape(()).item())

    def new(self, like: Any, host: np.ndarray) -> np.ndarray:
        return np.array(host).view(np.asarray(like).dtype)


class TorchFamily(Family):
    name = "torch"

    def dtype(self, x: Any) -> str:
        name = _DTYPE_NAMES.get(x.dtype)
        if name is None:
            name = _DTYPE_NAMES[x.dtype] = str(x.dtype).removeprefix("torch.")
        return name

    def shape(self, x: Any) -> tuple[int, ...]:
        return tuple(x.shape)

    def device(self, x: Any) -> str:
        return str(x.device)

    def _host_numpy(self, t: Any) -> np.ndarray:
        import torch

        t = t.detach()
        if t.dtype == torch.bfloat16:
            return t.view(torch.int16).numpy().view(np.uint16)
        return t.numpy()

    def host_view(self, x: Any) -> np.ndarray | None:
        if x.device.type != "cpu" or x.is_conj() or x.is_neg():
            return None
        return self._host_numpy(x)

    def work(self, x: Any) -> tuple[Any, bool]:
        view = self.host_view(x)
        if view is not None:
            return view, True
        if x.is_cuda:
            return _device_work(self, x), True
        return self.to_host(x), False

    def to_host(self, x: Any) -> np.ndarray:
        return np.array(self._host_numpy(x.detach().cpu().resolve_conj().resolve_neg()))

    def _tensor(self, like: Any, host: np.ndarray) -> Any:
        import torch

        t = torch.from_numpy(np.ascontiguousarray(host))
        if like.dtype == torch.bfloat16:
            t = t.view(torch.bfloat16)
        return t

    def from_host(self, x: Any, host: np.ndarray) -> Any:
        import torch

        with torch.no_grad():
            x.copy_(self._tensor(x, host).reshape(x.shape))
        return x

    def new(self, like: Any, host: np.ndarray) -> Any:
        return self._tensor(like, np.array(host)).to(like.device)


class JaxFamily(Family):
    """JAX arrays are immutable: results always come back as new arrays on the leaf's device."""

    name = "jax"
    mutable = False

    def dtype(self, x: Any) -> str:
        return dtype_name(x.dtype)

    def shape(self, x: Any) -> tuple[int, ...]:
        return tuple(x.shape)

    def device(self, x: Any) -> str:
        dev = next(iter(x.devices()))
        return "cpu" if dev.platform == "cpu" else f"{dev.platform}:{dev.id}"

    def to_host(self, x: Any) -> np.ndarray:
        return np.array(x).view(storage_dtype(self.dtype(x)))

    def from_host(self, x: Any, host: np.ndarray) -> Any:
        return self.new(x, host.reshape(x.shape))

    def new(self, like: Any, host: np.ndarray) -> Any:
        import jax

        return jax.device_put(np.asarray(host).view(like.dtype), next(iter(like.devices())))


class CupyFamily(Family):
    """CuPy arrays live on a GPU: packed and communicated there (`devices.py`), written in place."""

    name = "cupy"

    def work(self, x: Any) -> tuple[Any, bool]:
        return _device_work(self, x), True

    def dtype(self, x: Any) -> str:
        return dtype_name(x.dtype)

    def shape(self, x: Any) -> tuple[int, ...]:
        return tuple(x.shape)

    def device(self, x: Any) -> str:
        return f"cuda:{x.device.id}"

    def to_host(self, x: Any) -> np.ndarray:
        return np.asarray(x.get())

    def from_host(self, x: Any, host: np.ndarray) -> Any:
        import cupy

        x[...] = cupy.asarray(host.reshape(x.shape))
        return x

    def new(self, like: Any, host: np.ndarray) -> Any:
        import cupy

        with cupy.cuda.Device(like.device.id):
            return cupy.asarray(host)


def _device_work(family: Family, x: Any) -> Any:
    from dataparallel.devices import DeviceWork  # GPU leaves only: the host path never loads it

    return DeviceWork(family, x)


_NUMPY, _SCALAR = NumpyFamily(), ScalarFamily()
_TORCH, _JAX, _CUPY = TorchFamily(), JaxFamily(), CupyFamily()


def _is_jax_array(x: Any) -> bool:
    jax = sys.modules.get("jax")
    return jax is not None and isinstance(x, jax.Array)


def family_of(x: Any, path: str = "x") -> Family:
    """Return the family of leaf `x`, checking that its dtype is supported.

    Raises:
        TypeError: `x` is not an array of a supported family and dtype, nor a number; the message
            starts with the leaf's `path`.
    """
    family: Family | None = None
    if isinstance(x, np.ndarray):
        family = _NUMPY
    elif isinstance(x, (bool, int, float, complex, np.generic)):
        family = _SCALAR
    else:
        module = type(x).__module__.partition(".")[0]
        torch = sys.modules.get("torch")
        if torch is not None and isinstance(x, torch.Tensor):  # subclasses too (Parameter, ...)
            family = _TORCH
        elif module in ("jax", "jaxlib") and _is_jax_array(x):
            if type(x).__name__.endswith("Tracer") or "Tracer" in type(x).__name__:
                raise TypeError(
                    f"{path}: got a traced JAX value; dataparallel collectives run eagerly. "
                    "Call them outside jax.jit, or use dp.DistributedOptimizer for optax, "
                    "which works inside jit."
                )
            family = _JAX
        elif module == "cupy":
            family = _CUPY
    if family is None:
        raise TypeError(
            f"{path}: expected an array (NumPy, PyTorch, JAX, CuPy) or a number, "
            f"got {type(x).__module__}.{type(x).__qualname__}."
        )
    is_int = family is _SCALAR and isinstance(x, int) and not isinstance(x, bool)
    if is_int and not -(2**63) <= x < 2**63:
        raise TypeError(f"{path}: the integer {x} does not fit in int64.")
    _check_dtype(family.dtype(x), path)
    return family


_MIN_CAPACITY = 1024


class BufferPool:
    """Host buffers reused across flushes and calls, in power-of-two size classes per dtype."""

    def __init__(self) -> None:
        self._free: dict[tuple[np.dtype, int], list[np.ndarray]] = {}

    def take(self, dtype: np.dtype, n: int) -> np.ndarray:
        """Return a 1-D buffer of `n` items (a view of a pooled buffer)."""
        capacity = max(_MIN_CAPACITY, 1 << max(n - 1, 0).bit_length())
        try:  # pop and append are atomic: a callback thread may share the pool with the main one
            base = self._free[(dtype, capacity)].pop()
        except (KeyError, IndexError):
            base = np.empty(capacity, dtype)
        return base[:n]

    def give(self, buf: np.ndarray) -> None:
        """Return a buffer obtained from `take` to the pool."""
        base = buf.base if buf.base is not None else buf
        assert isinstance(base, np.ndarray)
        self._free.setdefault((base.dtype, base.size), []).append(base)

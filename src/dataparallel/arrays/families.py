"""One adapter per array family: what a leaf is, and how to see or stage its memory on the host.

Collectives work on host NumPy buffers in *storage* dtypes: the leaf's own dtype, except bfloat16,
which NumPy lacks and is carried as its raw bits (`uint16`). CPU leaves of mutable families are
seen through zero-copy views (writes land in the leaf); the rest are staged through host copies and
written back (in place for mutable families, as new arrays for immutable ones).
"""

from __future__ import annotations

import functools
import sys
from abc import ABC, abstractmethod
from collections.abc import Callable
from typing import TYPE_CHECKING, Generic, TypeAlias, TypeVar, cast

import numpy as np

from dataparallel.arrays.device import DeviceWork
from dataparallel.arrays.dtypes import BF16_BITS, check_dtype, dtype_name, storage_dtype

if TYPE_CHECKING:
    import cupy
    import jax
    import torch

__all__ = [
    "Family",
    "Scalar",
    "Staged",
    "Work",
    "array_family",
    "family_of",
    "stage",
    "write_back",
]

# A leaf's work array: a writable host array in its storage dtype, or a GPU leaf as it is.
Work: TypeAlias = np.ndarray | DeviceWork
# The leaves of `ScalarFamily`: Python numbers and NumPy scalars.
Scalar: TypeAlias = bool | int | float | complex | np.generic

L = TypeVar("L")  # the family's leaf type


class Family(ABC, Generic[L]):
    """How dataparallel sees one kind of array (leaves of type `L`). Subclasses are stateless
    singletons; code that takes leaves of any family holds a bare `Family`."""

    name: str
    mutable: bool = True
    tracks_writes: bool = False  # whether `mark_written` must hear of writes through views

    @abstractmethod
    def dtype(self, x: L) -> str:
        """Return the leaf's dtype name (`"float32"`, `"bfloat16"`, ...)."""

    @abstractmethod
    def shape(self, x: L) -> tuple[int, ...]:
        """Return the leaf's shape."""

    def device(self, x: L) -> str:
        """Return `"cpu"`, or the device: `"cuda:N"` (torch, CuPy), JAX's `"gpu:N"`."""
        return "cpu"

    def host_view(self, x: L) -> np.ndarray | None:
        """Return a writable zero-copy host view of `x` in its storage dtype, or None."""
        return None

    @abstractmethod
    def to_host(self, x: L) -> np.ndarray:
        """Return a new writable host copy of `x` in its storage dtype."""

    @abstractmethod
    def from_host(self, x: L, host: np.ndarray) -> L:
        """Return `host`'s values as an array like `x` (written into `x` when it is mutable)."""

    def from_hosts(self, xs: list[L], hosts: list[np.ndarray]) -> list[L]:
        """`from_host` of each pair, in one framework call where the family has one."""
        return [self.from_host(x, host) for x, host in zip(xs, hosts, strict=True)]

    @abstractmethod
    def new(self, like: L, host: np.ndarray) -> L | np.ndarray:
        """Return a new array of `like`'s family, device and dtype holding `host` (any shape).

        A NumPy array for a number (`ScalarFamily`): a result of another shape is no number.
        """

    def read_view(self, x: L) -> np.ndarray | None:
        """Return a read-only zero-copy host view of an immutable `x` in its storage dtype, or
        None. A reduction reads it and hands its result over as a new array (`new`)."""
        return None

    def mark_written(self, xs: list[L]) -> None:
        """Tell the framework that `xs` were written in place behind its back (through views)."""
        return None

    def adopt(self, like: L, host: np.ndarray) -> L | np.ndarray:
        """Return `new(like, host)`, taking over `host`'s memory where the family can (no copy).

        The caller gives `host` up: it must not be used or reused afterwards.
        """
        return self.new(like, host)

    def work(self, x: L) -> tuple[Work, bool]:
        """Return a writable host array for `x` and whether it is a view (no write-back needed).

        GPU leaves of mutable families (torch CUDA tensors, CuPy arrays) come back as a
        `device.DeviceWork` instead (with True): `Fusion` packs them on their device.
        """
        view = self.host_view(x)
        if view is not None:
            return view, True
        return self.to_host(x), False


class NumpyFamily(Family[np.ndarray]):
    name = "numpy"

    def dtype(self, x: np.ndarray) -> str:
        return dtype_name(x.dtype)

    def shape(self, x: np.ndarray) -> tuple[int, ...]:
        return tuple(x.shape)

    def host_view(self, x: np.ndarray) -> np.ndarray | None:
        if not x.flags.writeable or not x.dtype.isnative:  # byte-swapped: staged, converted
            return None
        return x.view(BF16_BITS) if x.dtype.kind == "V" else x  # "V": ml_dtypes' bfloat16

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

    def adopt(self, like: np.ndarray, host: np.ndarray) -> np.ndarray:
        return host.view(like.dtype.newbyteorder("="))


_PYTHON_DTYPES = {bool: "bool", int: "int64", float: "float64", complex: "complex128"}


class ScalarFamily(Family[Scalar]):
    """Python numbers and NumPy scalars: immutable, returned as the same type."""

    name = "scalar"
    mutable = False

    def dtype(self, x: Scalar) -> str:
        if isinstance(x, np.generic):
            return dtype_name(x.dtype)
        return _PYTHON_DTYPES.get(type(x)) or dtype_name(np.asarray(x).dtype)

    def shape(self, x: Scalar) -> tuple[int, ...]:
        return ()

    def to_host(self, x: Scalar) -> np.ndarray:
        return np.array(x).view(storage_dtype(self.dtype(x)))  # bfloat16 as its bits

    def from_host(self, x: Scalar, host: np.ndarray) -> Scalar:
        if isinstance(x, np.generic):
            return host.reshape(-1).view(x.dtype)[0]  # a NumPy scalar of x's type
        return type(x)(host.reshape(()).item())

    def new(self, like: Scalar, host: np.ndarray) -> np.ndarray:
        return np.array(host).view(np.asarray(like).dtype)


class TorchFamily(Family["torch.Tensor"]):
    name = "torch"
    tracks_writes = True

    def dtype(self, x: torch.Tensor) -> str:
        return dtype_name(x.dtype)

    def shape(self, x: torch.Tensor) -> tuple[int, ...]:
        return tuple(x.shape)

    def device(self, x: torch.Tensor) -> str:
        return str(x.device)

    def _host_numpy(self, t: torch.Tensor) -> np.ndarray:
        import torch

        t = t.detach()
        if t.dtype == torch.bfloat16:
            return t.view(torch.int16).numpy().view(np.uint16)
        return t.numpy()

    def host_view(self, x: torch.Tensor) -> np.ndarray | None:
        if x.device.type != "cpu" or x.is_conj() or x.is_neg():
            return None
        return self._host_numpy(x)

    def work(self, x: torch.Tensor) -> tuple[Work, bool]:
        view = self.host_view(x)
        if view is not None:
            return view, True
        if x.is_cuda:
            return _device_work(self, x), True
        return self.to_host(x), False

    def to_host(self, x: torch.Tensor) -> np.ndarray:
        return np.array(self._host_numpy(x.detach().cpu().resolve_conj().resolve_neg()))

    def _tensor(self, like: torch.Tensor, host: np.ndarray) -> torch.Tensor:
        import torch

        t = torch.from_numpy(np.ascontiguousarray(host))
        if like.dtype == torch.bfloat16:
            t = t.view(torch.bfloat16)
        return t

    def from_host(self, x: torch.Tensor, host: np.ndarray) -> torch.Tensor:
        import torch

        with torch.no_grad():
            x.copy_(self._tensor(x, host).reshape(x.shape))
        return x

    def new(self, like: torch.Tensor, host: np.ndarray) -> torch.Tensor:
        return self._tensor(like, np.array(host)).to(like.device)

    def mark_written(self, xs: list[torch.Tensor]) -> None:
        """Bump the tensors' version counters, as torch's own in-place operations do.

        A tensor saved for backward and then written through a NumPy view would otherwise give
        a silently wrong gradient; with the bump, backward raises torch's usual "modified by an
        inplace operation" error. (Tensors made under `torch.inference_mode()` have no counter.)
        """
        import torch

        torch.autograd.graph.increment_version(xs)

    def adopt(self, like: torch.Tensor, host: np.ndarray) -> torch.Tensor:
        return self._tensor(like, host).to(like.device)  # on the CPU: host's memory itself


class JaxFamily(Family["jax.Array"]):
    """JAX arrays are immutable: results always come back as new arrays on the leaf's device."""

    name = "jax"
    mutable = False

    def dtype(self, x: jax.Array) -> str:
        return dtype_name(x.dtype)

    def shape(self, x: jax.Array) -> tuple[int, ...]:
        return tuple(x.shape)

    def device(self, x: jax.Array) -> str:
        dev = next(iter(x.devices()))
        return "cpu" if dev.platform == "cpu" else f"{dev.platform}:{dev.id}"

    def read_view(self, x: jax.Array) -> np.ndarray | None:
        devices = x.devices()
        if len(devices) != 1 or next(iter(devices)).platform != "cpu":
            return None
        _release_adopted()  # before this call's results are lent their memory
        return np.asarray(x).view(storage_dtype(self.dtype(x)))  # JAX's own memory, read-only

    def to_host(self, x: jax.Array) -> np.ndarray:
        # np.asarray is a view of a CPU array; copying it is 3x faster than np.array(x).
        return np.asarray(x).view(storage_dtype(self.dtype(x))).copy()

    def from_host(self, x: jax.Array, host: np.ndarray) -> jax.Array:
        return self.new(x, host.reshape(x.shape))

    def from_hosts(self, xs: list[jax.Array], hosts: list[np.ndarray]) -> list[jax.Array]:
        import jax

        if len(xs) < 2:
            return [self.from_host(x, host) for x, host in zip(xs, hosts, strict=True)]
        values = [h.reshape(x.shape).view(x.dtype) for x, h in zip(xs, hosts, strict=True)]
        # One `device_put` of the list (6 leaves: 0.09-0.10 ms, one by one 0.12-0.16 ms).
        return list(jax.device_put(values, [next(iter(x.devices())) for x in xs]))

    def new(self, like: jax.Array, host: np.ndarray) -> jax.Array:
        import jax

        return jax.device_put(np.asarray(host).view(like.dtype), next(iter(like.devices())))


def _release_adopted() -> None:
    """Let JAX drop now the NumPy memory of the arrays it adopted (`BufferPool.lend`'s buffers)
    that nothing uses any more.

    JAX frees an array made from NumPy memory without a copy at once, but releases its reference
    to that memory only at its next garbage collection (a `device_put`, ...), so a buffer lent
    to the last call's results looked taken to the next call, which then wrote into another one:
    two buffers in turn, each call writing memory that had left the cache (measured: 1.86 M
    float32 on 2 ranks, 1.04 ms into one buffer, 1.49 ms alternating between two).
    `collect_garbage` is jaxlib's, private (0.04 us): where it is missing, results alternate
    between two buffers as before."""
    _collect_garbage()()


@functools.cache
def _collect_garbage() -> Callable[[], object]:
    try:
        from jax._src.lib import _jax

        collect = getattr(_jax, "collect_garbage", None)
    except ImportError:  # pragma: no cover - another jaxlib
        collect = None
    return collect if callable(collect) else _nothing


def _nothing() -> None:
    return None


class CupyFamily(Family["cupy.ndarray"]):
    """CuPy arrays live on a GPU: packed and communicated there (`device.py`), written in place."""

    name = "cupy"

    def work(self, x: cupy.ndarray) -> tuple[Work, bool]:
        return _device_work(self, x), True

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


def _device_work(family: Family[L], x: L) -> DeviceWork:
    return DeviceWork(family, x)


_NUMPY, _SCALAR = NumpyFamily(), ScalarFamily()
_TORCH, _JAX, _CUPY = TorchFamily(), JaxFamily(), CupyFamily()
_ARRAY_FAMILIES: dict[str, Family] = {"numpy": _NUMPY, "torch": _TORCH, "jax": _JAX, "cupy": _CUPY}


def array_family(x: object) -> str | None:
    """Return `"numpy"`, `"torch"`, `"jax"` or `"cupy"` for an array of that family, else None.

    No framework is imported: an object of a framework's type means it is imported already.
    torch.Tensor subclasses (`nn.Parameter`, ...) count as torch.

    >>> array_family(np.zeros(2)), array_family(1.0)
    ('numpy', None)
    """
    if isinstance(x, np.ndarray):
        return "numpy"
    root = type(x).__module__.partition(".")[0]
    torch = sys.modules.get("torch")
    if torch is not None and isinstance(x, torch.Tensor):
        return "torch"
    if root in ("jax", "jaxlib"):
        jax = sys.modules.get("jax")
        return "jax" if jax is not None and isinstance(x, jax.Array) else None
    if root == "cupy":
        cupy = sys.modules.get("cupy")
        return "cupy" if cupy is not None and isinstance(x, cupy.ndarray) else None
    return None


def family_of(x: object, path: str = "x") -> Family:
    """Return the family of leaf `x`, checking that its dtype is supported.

    Raises:
        TypeError: `x` is not an array of a supported family and dtype, nor a number; the message
            starts with the leaf's `path`.
    """
    if isinstance(x, (bool, int, float, complex, np.generic)):
        if isinstance(x, int) and not isinstance(x, bool) and not -(2**63) <= x < 2**63:
            raise TypeError(f"{path}: the integer {x} does not fit in int64.")
        family: Family = _SCALAR
    else:
        name = array_family(x)
        if name is None:
            raise TypeError(
                f"{path}: expected an array (NumPy, PyTorch, JAX, CuPy) or a number, "
                f"got {type(x).__module__}.{type(x).__qualname__}."
            )
        if name == "jax" and "Tracer" in type(x).__name__:
            raise TypeError(
                f"{path}: got a traced JAX value; dataparallel collectives run eagerly. "
                "Call them outside jax.jit, or use dp.DistributedOptimizer for optax, "
                "which works inside jit."
            )
        if name == "torch":
            problem = _torch_problem(cast("torch.Tensor", x))  # array_family checked
            if problem is not None:
                raise TypeError(f"{path}: {problem}")
        family = _ARRAY_FAMILIES[name]
    check_dtype(family.dtype(x), path)
    return family


# A leaf on its way through a collective: (family, leaf, work array, whether work is a view).
Staged = tuple[Family, object, Work | None, bool]


def stage(family: Family[L], x: L) -> tuple[Family, object, Work, bool]:
    """Give leaf `x` its work array: a zero-copy view, a host copy, or a device bucket's member."""
    work, is_view = family.work(x)
    return family, x, work, is_view


def write_back(staged: list[Staged]) -> list[object]:
    """Return each leaf's value once its work array holds the result.

    Staged copies are written back (in place for mutable families, new values for immutable
    ones); the framework is told of writes through views (torch's version counters).
    """
    out: list[object] = []
    written: dict[Family, list[object]] = {}
    copied: dict[Family, list[int]] = {}  # per family, the leaves made from their host arrays
    for i, (family, x, work, is_view) in enumerate(staged):
        out.append(x)
        if is_view or not isinstance(work, np.ndarray):  # a view, a GPU leaf, or nothing
            if family.tracks_writes:
                written.setdefault(family, []).append(x)
        else:
            copied.setdefault(family, []).append(i)
    for family, at in copied.items():
        hosts = [cast(np.ndarray, staged[i][2]) for i in at]
        for i, value in zip(at, family.from_hosts([out[i] for i in at], hosts), strict=True):
            out[i] = value
    for family, xs in written.items():
        family.mark_written(xs)
    return out


def _torch_problem(t: torch.Tensor) -> str | None:
    """Return why torch tensor `t` cannot be communicated (nested, sparse, meta), or None."""
    if t.is_nested:
        return (
            "a nested torch tensor cannot be communicated, only dense (strided) ones: pass its "
            "components (t.unbind()) or a padded tensor (t.to_padded_tensor(0.0))."
        )
    if t.layout != _torch_strided():
        return (
            f"a torch tensor of layout {t.layout} cannot be communicated, only dense (strided) "
            "ones: pass t.to_dense(), or its indices and values as dense tensors."
        )
    if t.device.type == "meta":
        return (
            "a torch tensor on the 'meta' device has no data to communicate: give it storage "
            "first (e.g. module.to_empty(device='cpu'), then initialize it)."
        )
    return None


def _torch_strided() -> torch.layout:
    import torch

    return torch.strided

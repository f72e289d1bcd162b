"""The JAX family: immutable arrays, whose results come back as new arrays on the leaf's
device; a CPU array's own memory is read without a copy, and the memory JAX adopted from the
buffer pool is let go of before it is lent again."""

from __future__ import annotations

import functools
from collections.abc import Callable
from typing import TYPE_CHECKING

import numpy as np

from dataparallel.arrays.dtypes import dtype_name, storage_dtype
from dataparallel.arrays.families.base import Family

if TYPE_CHECKING:
    import jax

__all__ = ["JaxFamily"]


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
        # np.asarray is a view of a CPU array; copying it is faster than np.array(x).
        return np.asarray(x).view(storage_dtype(self.dtype(x))).copy()

    def from_host(self, x: jax.Array, host: np.ndarray) -> jax.Array:
        return self.new(x, host.reshape(x.shape))

    def from_hosts(self, xs: list[jax.Array], hosts: list[np.ndarray]) -> list[jax.Array]:
        import jax

        if len(xs) < 2:
            return [self.from_host(x, host) for x, host in zip(xs, hosts, strict=True)]
        values = [h.reshape(x.shape).view(x.dtype) for x, h in zip(xs, hosts, strict=True)]
        # One `device_put` of the list costs less than one per leaf.
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
    two buffers in turn, each call writing memory that had left the cache.
    `collect_garbage` is jaxlib's, private and cheap: where it is missing, results alternate
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

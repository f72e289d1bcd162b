"""What an array family is (`Family`: how dataparallel sees one kind of array), a leaf's work
array (`Work`), and how a leaf is staged through its family and written back (`stage`,
`write_back`). The families themselves: `host.py` (NumPy, numbers), `torch.py`, `jax.py`,
`cupy.py`; which family a leaf is of: the package's `__init__`.

Collectives work on host NumPy buffers in *storage* dtypes: the leaf's own dtype, except bfloat16,
which NumPy lacks and is carried as its raw bits (`uint16`). CPU leaves of mutable families are
seen through zero-copy views (writes land in the leaf); the rest are staged through host copies and
written back (in place for mutable families, as new arrays for immutable ones).
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from typing import Generic, TypeAlias, TypeVar, cast

import numpy as np

from dataparallel.arrays.device import DeviceWork

__all__ = ["Family", "Staged", "Work", "device_work", "stage", "write_back"]

# A leaf's work array: a writable host array in its storage dtype, or a GPU leaf as it is.
Work: TypeAlias = np.ndarray | DeviceWork

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
        `DeviceWork` instead (with True), which a fusion bucket packs on their device.
        """
        view = self.host_view(x)
        if view is not None:
            return view, True
        return self.to_host(x), False


def device_work(family: Family[L], x: L) -> DeviceWork:
    """Return GPU leaf `x` of `family` as the work a fusion bucket packs on its device."""
    return DeviceWork(family, x)


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

"""The one small protocol every engine implements: collectives over flat, contiguous buffers.

A backend knows nothing of trees, array families or optimizers. It receives 1-D contiguous buffers
(NumPy arrays in host memory; device buffers only where `accepts_device` says so), reduces or moves
them in place, and exchanges picklable objects for metadata.
"""

from __future__ import annotations

import enum
from abc import ABC, abstractmethod
from typing import Any, ClassVar, Protocol

from dataparallel.config import Settings

__all__ = ["Backend", "CompletedRequest", "ReduceOp", "Request"]


class ReduceOp(enum.Enum):
    """Element-wise reductions every engine provides; `avg` is built above them (sum, scale)."""

    SUM = "sum"
    PROD = "prod"
    MIN = "min"
    MAX = "max"


class Request(Protocol):
    """A non-blocking operation in flight."""

    def wait(self) -> None:
        """Block until the operation has completed."""

    def test(self) -> bool:
        """Return whether the operation has completed, without blocking."""


class CompletedRequest:
    """A request that was finished when it was made (blocking engines, worlds of one)."""

    def wait(self) -> None:
        return None

    def test(self) -> bool:
        return True


class Backend(ABC):
    """A process group and its collectives over flat buffers.

    Attributes:
        name: `"mpi"`, `"gloo"`, `"nccl"` or `"single"`.
        rank, size: this process's place in the world and the world's size.
        local_rank, local_size: the same among the processes on this node.
        native_dtypes: dtype names the engine reduces natively; others are widened before reducing.
    """

    name: ClassVar[str]
    native_dtypes: ClassVar[frozenset[str]] = frozenset(
        {"int8", "int16", "int32", "int64", "uint8", "uint16", "uint32", "uint64"}
        | {"float16", "float32", "float64", "complex64", "complex128"}
    )

    rank: int
    size: int
    local_rank: int
    local_size: int

    @classmethod
    @abstractmethod
    def create(
        cls,
        *,
        init_method: str | None = None,
        rank: int | None = None,
        world_size: int | None = None,
        settings: Settings | None = None,
    ) -> Backend:
        """Join (or form) the process group; called once by `dp.initialize()`."""

    def accepts_device(self, device: str) -> bool:
        """Whether buffers on `device` (`"cuda:0"`, ...) may be passed directly, without staging."""
        return device == "cpu"

    @abstractmethod
    def allreduce(self, buf: Any, op: ReduceOp) -> None:
        """Reduce `buf` across all ranks, in place on every rank."""

    @abstractmethod
    def iallreduce(self, buf: Any, op: ReduceOp) -> Request:
        """Start `allreduce` without blocking; `buf` must not be touched until it completes."""

    @abstractmethod
    def reduce(self, buf: Any, op: ReduceOp, root: int) -> None:
        """Reduce `buf` across all ranks into `root`'s `buf`; other ranks' buffers are unchanged."""

    @abstractmethod
    def broadcast(self, buf: Any, root: int) -> None:
        """Copy `root`'s `buf` into every rank's `buf`."""

    @abstractmethod
    def ibroadcast(self, buf: Any, root: int) -> Request:
        """Start `broadcast` without blocking."""

    @abstractmethod
    def allgatherv(self, send: Any, recv: Any, counts: list[int]) -> None:
        """Gather every rank's `send` into `recv`, in rank order; rank r sends `counts[r]` items."""

    @abstractmethod
    def broadcast_object(self, obj: Any, root: int) -> Any:
        """Return `root`'s picklable `obj` on every rank."""

    @abstractmethod
    def allgather_object(self, obj: Any) -> list[Any]:
        """Return the list of every rank's picklable `obj`, in rank order."""

    @abstractmethod
    def barrier(self) -> None:
        """Block until every rank has reached the barrier."""

    @abstractmethod
    def abort(self, code: int = 1) -> None:
        """End the whole job at once (used when one rank fails and the others would hang)."""

    def close(self) -> None:
        """Release the engine's resources (called by `dp.finalize()`)."""
        return None

    def __repr__(self) -> str:
        return f"<{type(self).__name__} rank={self.rank} size={self.size}>"

"""What a fused collective does with its buckets: reduce, broadcast, reduce-scatter, exchange."""

from __future__ import annotations

from dataclasses import dataclass

from dataparallel.backends.base import ReduceOp

__all__ = ["Broadcast", "Exchange", "Reduction", "Scatter"]


@dataclass(frozen=True)
class Reduction:
    """Reduce with `op`, then multiply by `scale`; to every rank, or to `root` only."""

    op: ReduceOp
    scale: float | None = None
    root: int | None = None

    def __str__(self) -> str:
        text = f"op={self.op.value}"
        text += "" if self.scale is None else f" scale={self.scale:g}"
        return text + ("" if self.root is None else f" root={self.root}")


@dataclass(frozen=True)
class Broadcast:
    """Copy `root`'s values to every rank."""

    root: int

    def __str__(self) -> str:
        return f"root={self.root}"


@dataclass(frozen=True)
class Scatter:
    """Reduce with `op`, multiply by `scale`, keep this rank's part of every array's first axis.

    Rank r's part of `n` rows is `row_parts(n, size)[r]` rows, in rank order (Horovod's
    reduce-scatter). Every rank must add arrays of the same shapes.
    """

    op: ReduceOp
    scale: float | None = None

    def __str__(self) -> str:
        return f"op={self.op.value}" + ("" if self.scale is None else f" scale={self.scale:g}")


@dataclass(frozen=True)
class Exchange:
    """Send `splits[i]` rows of every array to rank i; get `received[i]` rows from rank i."""

    splits: tuple[int, ...]
    received: tuple[int, ...]

    def __str__(self) -> str:
        return f"splits={list(self.splits)} received={list(self.received)}"

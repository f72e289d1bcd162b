"""What a fused collective does with its buckets: reduce, broadcast, reduce-scatter, exchange;
and the one place where a public `op` and `scale` become a `Reduction`."""

from __future__ import annotations

import numbers
from dataclasses import dataclass

from dataparallel.arrays.dtypes import INTEGER_DTYPES
from dataparallel.backends.base import ReduceOp

__all__ = [
    "Action",
    "Broadcast",
    "Exchange",
    "Reduction",
    "Scatter",
    "check_scale",
    "parse_op",
    "reduction",
    "reduction_error",
    "validate_reduction",
]


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


Action = Reduction | Broadcast | Scatter | Exchange


_OPS = ("sum", "prod", "min", "max", "avg")


def parse_op(op: str) -> tuple[ReduceOp, bool]:
    """Return the engine op for `op` and whether it is `"avg"` (sum, then divide by size)."""
    if op == "avg":
        return ReduceOp.SUM, True
    try:
        return ReduceOp(op), False
    except ValueError:
        raise ValueError(f"op={op!r} is not a reduction: use one of {_OPS}.") from None


def reduction(op: str, scale: object, size: int, root: int | None = None) -> Reduction:
    """Return what the engine does for a public `op` and `scale` on a world of `size` ranks.

    The one place where `"avg"` becomes a sum scaled by `1 / size`, and `scale` multiplies it.

    >>> reduction("avg", 2.0, 4)
    Reduction(op=<ReduceOp.SUM: 'sum'>, scale=0.5, root=None)
    """
    engine_op, average = parse_op(op)
    check_scale(scale)
    total = 1.0 if scale is None else float(scale)  # type: ignore[arg-type]
    if average:
        total /= size
    return Reduction(engine_op, None if total == 1 else total, root)


def check_scale(scale: object) -> None:
    """Raise `TypeError` unless `scale` is None or a real number (a 0-d array or tensor too)."""
    if scale is None or isinstance(scale, numbers.Real):
        return
    if not isinstance(scale, (str, bytes, numbers.Complex)) and hasattr(type(scale), "__float__"):
        return
    raise TypeError(
        f"scale={scale!r} must be a real number (an int or a float), got {type(scale).__name__}."
    )


def reduction_error(dtype: str, op: str, scale: float | None) -> str | None:
    """Return why a reduction cannot be done on `dtype`, or None when it can."""
    if dtype in INTEGER_DTYPES or dtype == "bool":
        if op == "avg":
            return (
                f"op='avg' on {dtype} values would truncate; convert the leaf to a floating "
                "dtype, or use op='sum' and divide yourself."
            )
        if scale is not None and (dtype == "bool" or not float(scale).is_integer()):
            return (
                f"scale={scale} cannot be applied to {dtype} values; use a floating dtype, "
                "or an integral scale."
            )
    if dtype.startswith("complex") and op in ("min", "max"):
        return f"op={op!r} is not defined for complex values ({dtype})."
    return None


def validate_reduction(dtype: str, op: str, scale: float | None, path: str) -> None:
    """Raise `TypeError` for a reduction the dtype cannot hold, naming the leaf's `path`."""
    error = reduction_error(dtype, op, scale)
    if error is not None:
        raise TypeError(f"{path}: {error}")

"""Input validation and collective mismatch detection.

Mismatch detection costs one 16-byte allreduce per collective: every rank hashes a description of
its call (collective, op, root, tree structure, shapes, dtypes) and the world reduces `[h, -h]` with
MAX, which yields both the largest and the smallest hash. Only when they differ is a second,
pickled exchange made, to name the ranks and what differs; every rank then raises
`CollectiveMismatchError`, and the world stays usable. `DATAPARALLEL_CHECK=0` turns it off.
"""

from __future__ import annotations

import hashlib
import numbers
from collections.abc import Callable
from typing import Any

import numpy as np

from dataparallel.backends.base import Backend, ReduceOp
from dataparallel.engine.dtypes import INTEGER_DTYPES
from dataparallel.engine.fusion import Reduction
from dataparallel.errors import CollectiveMismatchError

__all__ = [
    "check_scale",
    "parse_op",
    "reduction",
    "reduction_error",
    "validate_reduction",
    "verify_same_call",
]

_OPS = ("sum", "prod", "min", "max", "avg")
_MAX_DIFFERENCES = 8


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


def _digest(description: str) -> int:
    raw = hashlib.blake2b(description.encode(), digest_size=8).digest()
    return int.from_bytes(raw, "little") >> 2


def verify_same_call(
    backend: Backend,
    call: dict[str, Any] | Callable[[], dict[str, Any]],
    summary: str | None = None,
) -> None:
    """Raise `CollectiveMismatchError` on every rank unless all ranks make the same call.

    Args:
        backend: the engine the collective will run on.
        call: a description of the call, field by field (`{"collective": "allreduce", "op":
            "sum", "x['w']": "float32[3]"}`), or a function that makes one: it is only needed to
            explain a mismatch, so a caller with a cheap `summary` can defer it.
        summary: a string equal on two ranks exactly when their calls are the same (default:
            derived from `call`).
    """
    if backend.size == 1:
        return
    if summary is None:
        summary = repr(sorted((call if isinstance(call, dict) else call()).items()))
    h = _digest(summary)
    bounds = np.array([h, -h], dtype=np.int64)
    backend.allreduce(bounds, ReduceOp.MAX)
    if bounds[0] == -bounds[1]:
        return
    calls = backend.allgather_object(call if isinstance(call, dict) else call())
    raise CollectiveMismatchError(_explain(calls))


def _ranks(ranks: list[int]) -> str:
    return ("rank " if len(ranks) == 1 else "ranks ") + ", ".join(map(str, ranks))


def _explain(calls: list[dict[str, Any]]) -> str:
    """Describe, field by field, how the ranks' calls differ."""
    keys = sorted({k for call in calls for k in call}, key=lambda k: (k != "collective", k))
    lines = []
    for key in keys:
        groups: dict[str, list[int]] = {}
        for rank, call in enumerate(calls):
            value = call.get(key, "<absent>")
            groups.setdefault(value if isinstance(value, str) else repr(value), []).append(rank)
        if len(groups) > 1:
            parts = "; ".join(f"{value} on {_ranks(ranks)}" for value, ranks in groups.items())
            lines.append(f"  {key}: {parts}")
    shown = lines[:_MAX_DIFFERENCES]
    if len(lines) > len(shown):
        shown.append(f"  ... and {len(lines) - len(shown)} more differences")
    collectives = sorted({str(c.get("collective")) for c in calls})
    head = (
        f"Ranks called different collectives ({', '.join(collectives)})"
        if len(collectives) > 1
        else f"Ranks called {collectives[0]} with different arguments"
    )
    return (
        head
        + ":\n"
        + "\n".join(shown)
        + (
            "\nEvery rank must make the same collective calls, in the same order, with the same "
            "tree structure, shapes (first axis excepted for allgather), dtypes, ops and roots."
        )
    )

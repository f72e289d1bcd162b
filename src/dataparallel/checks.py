"""Input validation and collective mismatch detection.

Mismatch detection costs one 16-byte allreduce per collective: every rank hashes a description of
its call (collective, op, root, tree structure, shapes, dtypes) and the world reduces `[h, -h]` with
MAX, which yields both the largest and the smallest hash. Only when they differ is a second,
pickled exchange made, to name the ranks and what differs; every rank then raises
`CollectiveMismatchError`, and the world stays usable. `DATAPARALLEL_CHECK=0` turns it off.
"""

from __future__ import annotations

import hashlib
from typing import Any

import numpy as np

from dataparallel.arrays import INTEGER_DTYPES
from dataparallel.backends.base import Backend, ReduceOp
from dataparallel.errors import CollectiveMismatchError

__all__ = ["parse_op", "validate_reduction", "verify_same_call"]

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


def validate_reduction(dtype: str, op: str, scale: float | None, path: str) -> None:
    """Raise `TypeError` for a reduction the dtype cannot hold, naming the leaf's `path`."""
    if dtype in INTEGER_DTYPES or dtype == "bool":
        if op == "avg":
            raise TypeError(
                f"{path}: op='avg' on an {dtype} array would truncate; convert the leaf to a "
                "floating dtype, or use op='sum' and divide yourself."
            )
        if scale is not None and (dtype == "bool" or not float(scale).is_integer()):
            raise TypeError(
                f"{path}: scale={scale} cannot be applied to a {dtype} array; use a floating "
                "dtype, or an integral scale."
            )
    if dtype.startswith("complex") and op in ("min", "max"):
        raise TypeError(f"{path}: op={op!r} is not defined for complex values ({dtype}).")


def _digest(description: str) -> int:
    raw = hashlib.blake2b(description.encode(), digest_size=8).digest()
    return int.from_bytes(raw, "little") >> 2


def verify_same_call(backend: Backend, call: dict[str, Any]) -> None:
    """Raise `CollectiveMismatchError` on every rank unless all ranks describe the same `call`.

    Args:
        backend: the engine the collective will run on.
        call: an ordered description: `{"collective": "allreduce", "op": "sum", "x.shape": ...}`;
            every value has a stable `repr`.
    """
    if backend.size == 1:
        return
    description = repr(sorted(call.items()))
    h = _digest(description)
    bounds = np.array([h, -h], dtype=np.int64)
    backend.allreduce(bounds, ReduceOp.MAX)
    if bounds[0] == -bounds[1]:
        return
    calls = backend.allgather_object(call)
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
    return head + ":\n" + "\n".join(shown) + (
        "\nEvery rank must make the same collective calls, in the same order, with the same "
        "tree structure, shapes (first axis excepted for allgather), dtypes, ops and roots."
    )

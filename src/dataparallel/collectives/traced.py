"""Collectives on values that JAX is tracing (`jax.jit`, `jax.grad`): traced, not run.

A traced value has no data yet: the call must become part of the program JAX compiles, run each
time that program runs. That is JAX's business, a layer above this one (`dataparallel.jax` puts
such calls in the program as XLA FFI calls with an ordered effect), so the public collectives
ask `is_traced` first and hand such a call to the module the public face named with
`handled_by`, loaded on the first traced call only: `import dataparallel` still imports no JAX,
and an eager call pays one type check (a tree's leaves are looked at only once JAX is imported).
"""

from __future__ import annotations

import importlib
import sys
from typing import Any

import optree

from dataparallel.backends.base import Backend

__all__ = ["call", "handled_by", "is_traced", "tracing"]

_handlers: list[str] = []  # the module that puts traced calls in the program (`handled_by`)


def handled_by(module: str) -> None:
    """Have traced calls handled by `module`'s `trace_collective` (the public face names it)."""
    _handlers[:] = [module]


def is_traced(x: object) -> bool:
    """Whether `x` (a leaf or a tree) holds a value JAX is tracing."""
    if "jax" not in sys.modules:  # no JAX, no tracer: the eager call's whole cost
        return False
    tracer = sys.modules["jax"].core.Tracer
    if isinstance(x, tracer):
        return True
    if isinstance(x, (int, float)) or type(x).__module__ == "numpy":
        return False
    leaves: list[object] = optree.tree_leaves(x, none_is_leaf=True)  # type: ignore[arg-type]
    return any(isinstance(leaf, tracer) for leaf in leaves)


def tracing() -> bool:
    """Whether JAX is tracing a function now (a call without values, `dp.barrier()`, made inside
    `jax.jit` is put in the program too, not run once when traced)."""
    if "jax" not in sys.modules:
        return False
    core = importlib.import_module("jax._src.core")  # JAX's own trace state: no public API
    clean = getattr(core, "trace_state_clean", None)
    return clean is not None and not clean()


def call(collective: str, x: object, backend: Backend | None, **options: object) -> Any:
    """Put the call `collective(x, **options)` into the program being traced; return its
    traced result. `backend`: the engine (a group's), or None for the world's."""
    if not _handlers:
        raise TypeError(
            f"{collective}: got a traced JAX value, and no module puts collectives into a "
            "jitted program (import dataparallel, whose public face names it)."
        )
    module = importlib.import_module(_handlers[0])
    return module.trace_collective(collective, x, backend, **options)

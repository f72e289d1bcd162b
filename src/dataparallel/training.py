"""The calls that take any framework's training state: `DistributedOptimizer` and `synchronize`.

They dispatch on the type of what they are given: torch optimizers and modules go to `dp.torch`,
optax transformations to `dp.jax`, and pytrees to the collectives. Frameworks load only when an
object of theirs is passed, so `import dataparallel` imports neither.
"""

from __future__ import annotations

import sys
from collections.abc import Callable
from typing import Any

from dataparallel.backends.base import Backend
from dataparallel.collectives import synchronize_tree
from dataparallel.groups import Group, backend_of
from dataparallel.types import Op, Tree

__all__ = ["DistributedOptimizer", "synchronize"]


def DistributedOptimizer(optimizer: Any, *, op: Op = "avg", **options: Any) -> Any:
    """Wrap a `torch.optim.Optimizer` or an `optax.GradientTransformation` (dispatch on type).

    Gradients are reduced across ranks (averaged by default; `op="sum"` is FluxMPI's behaviour)
    before the inner update. See `dataparallel.torch.distributed_torch_optimizer` and
    `dataparallel.jax.distributed_optax` for the options of each.
    """
    module = type(optimizer).__module__.partition(".")[0]
    if module == "torch" or _is_torch_optimizer(optimizer):
        from dataparallel.torch import distributed_torch_optimizer

        return distributed_torch_optimizer(optimizer, op=op, **options)
    if _is_optax_transformation(optimizer):
        from dataparallel.jax import distributed_optax

        return distributed_optax(optimizer, op=op, **options)
    raise TypeError(
        "DistributedOptimizer wraps a torch.optim.Optimizer or an optax.GradientTransformation, "
        f"got {type(optimizer).__module__}.{type(optimizer).__qualname__}."
    )


def _is_torch_optimizer(optimizer: Any) -> bool:
    torch = sys.modules.get("torch")
    return torch is not None and isinstance(optimizer, torch.optim.Optimizer)


def _is_optax_transformation(optimizer: Any) -> bool:
    init, update = getattr(optimizer, "init", None), getattr(optimizer, "update", None)
    return callable(init) and callable(update)


def synchronize(
    x: Tree,
    *,
    root: int = 0,
    objects: str = "keep",
    backend: Backend | None = None,
    group: Group | None = None,
) -> Tree:
    """Make every rank hold `root`'s state: parameters, model state, optimizer state.

    Array and number leaves (bool and NumPy scalars included) are broadcast in fused buckets;
    `None` stays `None`; other leaves (strings, objects) are kept as each rank has them, or
    broadcast by pickling with `objects="broadcast"`. A `torch.nn.Module` gets its parameters and
    buffers broadcast in place; a `torch.optim.Optimizer` its state and hyper-parameters, including
    state it has not created yet on the other ranks.

    Args:
        x: a pytree, a `torch.nn.Module` or a `torch.optim.Optimizer` (or a tree holding them).
        root: the rank whose state wins (default 0).
        objects: `"keep"` (default) or `"broadcast"`, for leaves that are not numbers or arrays.
        backend: the engine to use (default: the active one).
        group: run among the ranks of this `dp.new_group` group (default: the world).

    Returns:
        `x` with root's values (use the return value: JAX arrays and numbers come back new).

    >>> import numpy as np, dataparallel as dp
    >>> _ = dp.initialize("single")
    >>> dp.synchronize({"w": np.ones(2), "name": "net"})
    {'w': array([1., 1.]), 'name': 'net'}
    """
    return synchronize_tree(
        x, root=root, objects=objects, backend=backend_of(backend, group), special=_torch_sync
    )


def _torch_sync(leaf: Any) -> Callable[[Any, int, Backend], Any] | None:
    """Return how to synchronize `leaf` when it is a torch module or optimizer, else None."""
    torch = sys.modules.get("torch")
    if torch is None or not isinstance(leaf, (torch.nn.Module, torch.optim.Optimizer)):
        return None
    from dataparallel.torch import synchronize_torch

    def sync(obj: Any, root: int, backend: Backend) -> Any:
        return synchronize_torch(obj, root=root, backend=backend)

    return sync

"""The calls that take any framework's training state: `DistributedOptimizer` and `synchronize`.

They dispatch on the type of what they are given: torch optimizers and modules go to `dp.torch`,
optax transformations to `dp.jax`, and pytrees to the collectives. Frameworks load only when an
object of theirs is passed, so `import dataparallel` imports neither.
"""

from __future__ import annotations

import sys
from collections.abc import Callable
from typing import TYPE_CHECKING, Any, Literal, TypeVar, overload

from dataparallel.backends.base import Backend
from dataparallel.collectives.state import synchronize_tree
from dataparallel.groups import Group, backend_of
from dataparallel.types import Op, Tree

if TYPE_CHECKING:
    import optax
    import torch

    from dataparallel.arrays.compression import Compressing

__all__ = ["DistributedOptimizer", "synchronize"]

_O = TypeVar("_O", bound="torch.optim.Optimizer")


@overload
def DistributedOptimizer(
    optimizer: _O,
    *,
    op: Op = "avg",
    bucket_bytes: int | None = None,
    backward_passes_per_step: int = 1,
    backend: Backend | None = None,
    group: Group | None = None,
    compression: Compressing = None,
    sparse_as_dense: bool = False,
) -> _O: ...


@overload
def DistributedOptimizer(
    optimizer: optax.GradientTransformation,
    *,
    op: Op = "avg",
    backend: Backend | None = None,
    group: Group | None = None,
    compression: Compressing = None,
    shard_state: bool = False,
    route: Literal["auto", "callback", "ffi", "mpi4jax"] = "auto",
) -> optax.GradientTransformationExtraArgs: ...


def DistributedOptimizer(optimizer: Any, *, op: Op = "avg", **options: Any) -> object:
    """Wrap a `torch.optim.Optimizer` or an `optax.GradientTransformation` (dispatch on type).

    Gradients are reduced across ranks (averaged by default; `op="sum"` is FluxMPI's behaviour)
    before the inner update. See `dataparallel.torch.distributed_torch_optimizer` and
    `dataparallel.jax.distributed_optax` for the options of each. For optax, `shard_state=True`
    keeps on each rank the state of its slice of the parameters only
    (`dataparallel.jax.sharded_optax`, docs/zero.md); for PyTorch that is
    `dp.torch.ZeroRedundancyOptimizer`.
    """
    if options.pop("shard_state", False):
        if not _is_optax_transformation(optimizer) or _is_torch_optimizer(optimizer):
            raise TypeError(
                "DistributedOptimizer(shard_state=True) takes an optax transformation; for "
                "PyTorch use dp.torch.ZeroRedundancyOptimizer(params, optimizer_class, ...)."
            )
        if options.get("compression") is not None:
            raise TypeError(
                "DistributedOptimizer(shard_state=True) takes no compression=: each rank "
                "receives only its slice of the gradients (a reduce-scatter), which neither a "
                "16-bit wire nor PowerSGD's low-rank factors fit; drop shard_state to compress "
                "(DistributedOptimizer(optimizer, compression=dp.Compression.powersgd(...)))."
            )
        from dataparallel.jax import sharded_optax

        return sharded_optax(optimizer, op=op, **options)
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


def _is_torch_optimizer(optimizer: object) -> bool:
    torch = sys.modules.get("torch")
    return torch is not None and isinstance(optimizer, torch.optim.Optimizer)


def _is_optax_transformation(optimizer: object) -> bool:
    init, update = getattr(optimizer, "init", None), getattr(optimizer, "update", None)
    return callable(init) and callable(update)


def synchronize(
    x: Tree,
    *,
    root: int = 0,
    objects: Literal["keep", "broadcast"] = "keep",
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


def _torch_sync(
    leaf: object,
) -> Callable[[torch.nn.Module | torch.optim.Optimizer, int, Backend], object] | None:
    """Return how to synchronize `leaf` when it is a torch module or optimizer, else None."""
    loaded = sys.modules.get("torch")
    if loaded is None or not isinstance(leaf, (loaded.nn.Module, loaded.optim.Optimizer)):
        return None
    from dataparallel.torch import synchronize_torch

    def sync(obj: torch.nn.Module | torch.optim.Optimizer, root: int, backend: Backend) -> object:
        return synchronize_torch(obj, root=root, backend=backend)

    return sync

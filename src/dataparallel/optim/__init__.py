"""`DistributedOptimizer`: reduce gradients across ranks, then hand off to the wrapped optimizer."""

from __future__ import annotations

from typing import Any

__all__ = ["DistributedOptimizer"]


def DistributedOptimizer(optimizer: Any, *, op: str = "avg", **options: Any) -> Any:
    """Wrap a `torch.optim.Optimizer` or an `optax.GradientTransformation` (dispatch on type).

    Gradients are reduced across ranks (averaged by default; `op="sum"` is FluxMPI's behaviour)
    before the inner update. See `dataparallel.optim.torch_optimizer` and `.optax_transform` for the
    options of each.
    """
    module = type(optimizer).__module__.partition(".")[0]
    if module == "torch" or _is_torch_optimizer(optimizer):
        from dataparallel.optim.torch_optimizer import distributed_torch_optimizer

        return distributed_torch_optimizer(optimizer, op=op, **options)
    if _is_optax_transformation(optimizer):
        from dataparallel.optim.optax_transform import distributed_optax

        return distributed_optax(optimizer, op=op, **options)
    raise TypeError(
        "DistributedOptimizer wraps a torch.optim.Optimizer or an optax.GradientTransformation, "
        f"got {type(optimizer).__module__}.{type(optimizer).__qualname__}."
    )


def _is_torch_optimizer(optimizer: Any) -> bool:
    import sys

    torch = sys.modules.get("torch")
    return torch is not None and isinstance(optimizer, torch.optim.Optimizer)


def _is_optax_transformation(optimizer: Any) -> bool:
    init, update = getattr(optimizer, "init", None), getattr(optimizer, "update", None)
    return callable(init) and callable(update)

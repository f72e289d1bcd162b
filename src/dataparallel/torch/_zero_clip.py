"""`ZeroRedundancyOptimizer.clip_grad_norm_`'s arithmetic: the norm over every rank's slice.

A rank holds only its slice of the gradients at stage 2, so torch's `clip_grad_norm_` over the
model's parameters cannot see them; each rank's part of the norm is reduced (one allreduce of
one float64), and each rank scales its own slice.
"""

from __future__ import annotations

import numpy as np
import torch

from dataparallel.backends.base import Backend, ReduceOp

__all__ = ["clip_slices"]


def clip_slices(
    grads: list[torch.Tensor],
    max_norm: float,
    norm_type: float,
    error_if_nonfinite: bool,
    backend: Backend,
) -> float:
    """Scale `grads` (this rank's slices) so that the norm of order `norm_type` over every
    rank's is at most `max_norm`, and return that norm (collective).

    Raises:
        RuntimeError: the norm is not finite and `error_if_nonfinite`.
    """
    if norm_type == float("inf"):
        local = max((float(g.abs().max()) for g in grads if g.numel()), default=0.0)
        total = np.array([local], np.float64)
        if backend.size > 1:
            backend.allreduce(total, ReduceOp.MAX)
        norm = float(total[0])
    else:
        local = sum(float(g.double().abs().pow(norm_type).sum()) for g in grads)
        total = np.array([local], np.float64)
        if backend.size > 1:
            backend.allreduce(total, ReduceOp.SUM)
        norm = float(total[0]) ** (1.0 / norm_type)
    if error_if_nonfinite and not np.isfinite(norm):
        raise RuntimeError(
            f"The total norm of order {norm_type} of the gradients is {norm}: not finite, "
            "so they cannot be clipped (error_if_nonfinite=True)."
        )
    coefficient = max_norm / (norm + 1e-6)
    if coefficient < 1.0:
        for g in grads:
            g.mul_(coefficient)
    return norm

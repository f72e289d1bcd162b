"""JAX integration: `DistributedOptimizer` for optax, eagerly and inside `jax.jit`.

Loaded when `dp.DistributedOptimizer` is given an optax transformation, so that
`import dataparallel` does not import JAX.
"""

from __future__ import annotations

from dataparallel.jax._accumulate import multi_steps
from dataparallel.jax._optax import DistributedState, distributed_optax

__all__ = ["DistributedState", "distributed_optax", "multi_steps"]

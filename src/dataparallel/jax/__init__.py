"""JAX integration: `DistributedOptimizer` for optax, eagerly and inside `jax.jit`.

Loaded when `dp.DistributedOptimizer` is given an optax transformation, so that
`import dataparallel` does not import JAX.
"""

from __future__ import annotations

from dataparallel.jax._accumulate import multi_steps
from dataparallel.jax._optax import DistributedState, distributed_optax
from dataparallel.jax._powersgd import PowerSGDState
from dataparallel.jax._sharded import (
    ShardedState,
    consolidate_state,
    shard_state,
    sharded_optax,
    slice_places,
)

__all__ = [
    "DistributedState",
    "PowerSGDState",
    "ShardedState",
    "consolidate_state",
    "distributed_optax",
    "multi_steps",
    "shard_state",
    "sharded_optax",
    "slice_places",
]

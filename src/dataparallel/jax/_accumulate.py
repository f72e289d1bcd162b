"""`multi_steps`: gradient accumulation that communicates once per real update.

`optax.MultiSteps(dp.DistributedOptimizer(opt), k)` is correct but reduces on every micro-step:
optax's `MultiSteps` calls the inner update on every call and keeps its result only on the k-th
(`jnp.where`). `multi_steps(opt, k)` accumulates as MultiSteps does (each rank's running
mean) and runs the distributed transformation (the reduction and the inner update) under
`lax.cond` on the k-th call only: the k-1 other micro-steps send nothing.
"""

from __future__ import annotations

from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
import optax

from dataparallel.jax._optax import distributed_optax

__all__ = ["MultiStepsState", "multi_steps"]


class MultiStepsState(NamedTuple):
    """`multi_steps`' state, as optax's `MultiStepsState` names it."""

    mini_step: jax.Array  # micro-steps since the last real update
    gradient_step: jax.Array  # real updates so far
    acc_grads: optax.Updates  # the running mean of this rank's micro-step gradients
    inner_state: optax.OptState  # the distributed transformation's


def multi_steps(
    inner: optax.GradientTransformation, every_k_schedule: int, **options: Any
) -> optax.GradientTransformationExtraArgs:
    """Accumulate gradients over `every_k_schedule` micro-steps, then reduce once and update.

    Each rank keeps the running mean of its micro-step gradients (as `optax.MultiSteps` does);
    on the k-th call that mean is reduced across ranks and handed to `inner`, under `lax.cond`,
    so the k-1 other calls send nothing. The updates are zeros on those calls.

    Args:
        inner: the optax transformation of each real update.
        every_k_schedule: micro-steps per real update (an int).
        **options: `distributed_optax`'s (`op`, `backend`, `group`, `compression`, `route`).

    Returns:
        An `optax.GradientTransformationExtraArgs` whose state is a `MultiStepsState`.

    >>> import jax.numpy as jnp, optax, dataparallel as dp
    >>> _ = dp.initialize()
    >>> opt = dp.jax.multi_steps(optax.sgd(1.0), 2)
    >>> params = {"w": jnp.zeros(2)}
    >>> state = opt.init(params)
    >>> u, state = opt.update({"w": jnp.ones(2)}, state, params)  # accumulated, no update yet
    >>> u, state = opt.update({"w": jnp.ones(2) * 3}, state, params)  # the mean of the two
    >>> u["w"].tolist(), int(state.gradient_step)
    ([-2.0, -2.0], 1)
    """
    k = int(every_k_schedule)
    if k < 1:
        raise ValueError(f"every_k_schedule={every_k_schedule!r}: give a positive int.")
    dist = distributed_optax(inner, **options)

    def init_fn(params: optax.Params) -> MultiStepsState:
        zero = jnp.zeros((), jnp.int32)
        acc = jax.tree.map(jnp.zeros_like, params)
        return MultiStepsState(zero, zero, acc, dist.init(params))

    def update_fn(
        updates: optax.Updates,
        state: MultiStepsState,
        params: optax.Params | None = None,
        **extra_args: object,
    ) -> tuple[optax.Updates, MultiStepsState]:
        n = state.mini_step
        acc = jax.tree.map(
            lambda g, a: (a + (g - a) / (n + 1).astype(a.dtype)).astype(a.dtype),
            updates,
            state.acc_grads,
        )

        def real(a: optax.Updates, s: optax.OptState) -> tuple[optax.Updates, optax.OptState]:
            return dist.update(a, s, params, **extra_args)

        shapes = jax.eval_shape(real, acc, state.inner_state)

        def idle(a: optax.Updates, s: optax.OptState) -> tuple[optax.Updates, optax.OptState]:
            return jax.tree.map(lambda x: jnp.zeros(x.shape, x.dtype), shapes[0]), s

        emit = n == k - 1
        new_updates, inner_state = jax.lax.cond(emit, real, idle, acc, state.inner_state)
        keep = jnp.logical_not(emit)
        new_state = MultiStepsState(
            (n + 1) % k,
            state.gradient_step + emit.astype(state.gradient_step.dtype),
            jax.tree.map(lambda a: a * keep.astype(a.dtype), acc),
            inner_state,
        )
        return new_updates, new_state

    return optax.GradientTransformationExtraArgs(init_fn, update_fn)

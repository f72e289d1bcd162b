"""`dp.DistributedOptimizer(tx, shard_state=True)`: optax state sharded across ranks.

Runs at any world size (`pytest`, `mpiexec -n 3 ... pytest`, `dataparallel run --backend gloo`):
every rank trains on its share of a global batch and is compared with the unsharded
`DistributedOptimizer` (and one process on the whole batch). Values from the other ranks are
gathered before asserting, so a failure on one rank cannot leave the others waiting.
"""

from __future__ import annotations

import pickle
from pathlib import Path
from typing import Any

import numpy as np
import pytest

jax = pytest.importorskip("jax")
optax = pytest.importorskip("optax")
jnp = jax.numpy

from _jobs import relaunch_through  # noqa: E402
from test_optax import OPTIMIZERS, STEPS, assert_same_on_every_rank, problem, share, train  # noqa: E402

import dataparallel as dp  # noqa: E402
from dataparallel.jax import ShardedState, consolidate_state, shard_state  # noqa: E402

RESUME = Path(__file__).parent / "scripts" / "optax_sharded_resume.py"


def close(a: Any, b: Any, tol: float = 1e-5) -> None:
    jax.tree.map(lambda u, v: np.testing.assert_allclose(u, v, rtol=tol, atol=tol), a, b)


@pytest.mark.matrix(strength=1)
@pytest.mark.parametrize("jit", [False, True], ids=["eager", "jit"])
@pytest.mark.parametrize("name", sorted(OPTIMIZERS))
def test_sharded_state_matches_the_unsharded_optimizer(
    name: str, jit: bool, rank: int, size: int
) -> None:
    params, x, y = problem()
    xs, ys = share(x, rank, size), share(y, rank, size)
    reference, _ = train(OPTIMIZERS[name](), params, x, y, STEPS, jit=True)
    unsharded, _ = train(dp.DistributedOptimizer(OPTIMIZERS[name]()), params, xs, ys, STEPS, jit)
    opt = dp.DistributedOptimizer(OPTIMIZERS[name](), shard_state=True)
    mine, state = train(opt, params, xs, ys, STEPS, jit=jit)
    assert isinstance(state, ShardedState)
    close(mine, unsharded)
    close(mine, reference)
    assert_same_on_every_rank(mine)


def test_each_rank_keeps_the_state_of_its_slice(rank: int, size: int) -> None:
    params, x, y = problem()
    opt = dp.DistributedOptimizer(optax.adam(1e-2), shard_state=True)
    _, state = train(opt, params, share(x, rank, size), share(y, rank, size), 1, jit=False)
    total = sum(np.size(leaf) for leaf in jax.tree.leaves(params))
    mu = state.inner_state[0].mu["float32"]
    every = dp.allgather_object(int(mu.size))
    assert every == [-(-total // size)] * size  # equal segments; fewer than size items of padding


def test_mixed_dtypes(rank: int, size: int) -> None:
    params = {"a": jnp.linspace(0.0, 1.0, 7, dtype=jnp.float32), "b": jnp.ones(5, jnp.bfloat16)}
    grads = {"a": jnp.full(7, float(rank + 1), jnp.float32), "b": jnp.full(5, 2.0, jnp.bfloat16)}
    opt = dp.DistributedOptimizer(optax.sgd(0.5), shard_state=True)
    for step in (jax.jit(opt.update), opt.update):
        updates, _ = step(grads, opt.init(params), params)
        mean = sum(range(1, size + 1)) / size
        np.testing.assert_allclose(updates["a"], np.full(7, -0.5 * mean), rtol=1e-6)
        assert updates["b"].dtype == jnp.bfloat16
        np.testing.assert_allclose(np.asarray(updates["b"], np.float32), np.full(5, -1.0))


@pytest.mark.parametrize("jit", [False, True], ids=["eager", "jit"])
def test_consolidated_state_restores_at_any_world_size(jit: bool, rank: int, size: int) -> None:
    """The consolidated state is the world-size-free state over the flat parameters: it equals a
    world of one's, and a rank of any world keeps its segments of it."""
    params, x, y = problem()
    xs, ys = share(x, rank, size), share(y, rank, size)
    opt = dp.DistributedOptimizer(optax.adam(1e-2), shard_state=True)
    mine, state = train(opt, params, xs, ys, 3, jit=jit)
    whole = consolidate_state(state, params, to=0)
    assert (whole is None) == (rank != 0)
    whole = dp.broadcast_object(whole, root=0)
    one = dp.DistributedOptimizer(optax.adam(1e-2), shard_state=True, backend=_single())
    _, ref_state = train(one, params, x, y, 3, jit=False)
    close(whole, ref_state)
    resumed = shard_state(whole, params)
    close(resumed, state, tol=0)
    grads = jax.tree.map(jnp.ones_like, mine)
    went_on, _ = opt.update(grads, resumed, mine)
    want, _ = opt.update(grads, state, mine)
    close(went_on, want, tol=0)


def test_a_state_from_other_parameters_is_refused(rank: int, size: int) -> None:
    params, _, _ = problem()
    opt = dp.DistributedOptimizer(optax.adam(1e-2), shard_state=True)
    whole = consolidate_state(opt.init(params), params, to=0)
    whole = dp.broadcast_object(whole, root=0)
    with pytest.raises(ValueError, match="this state is from other parameters"):
        shard_state(whole, {"w": jnp.ones(3)})
    with pytest.raises(ValueError, match="expects the ShardedState"):
        shard_state(optax.adam(1e-2).init(params), params)
    with pytest.raises(TypeError, match="ZeroRedundancyOptimizer"):
        torch = pytest.importorskip("torch")
        dp.DistributedOptimizer(
            torch.optim.SGD([torch.zeros(1, requires_grad=True)], lr=1.0), shard_state=True
        )


def _single() -> Any:
    from dataparallel.backends.single import SingleBackend

    return SingleBackend.create()


@pytest.mark.spawns
def test_checkpoints_move_between_world_sizes_and_engines(tmp_path: Path) -> None:
    """2 Gloo ranks save; 3 MPI ranks load and go on (more shards, uneven); then 1 (Gloo: one
    shard); the end matches one process throughout: its parameters, and its consolidated state
    (a world of one's sharded state)."""
    previous, steps = relaunch_through(
        ((2, "gloo"), (3, "mpi"), (1, "gloo")),
        lambda before, saved, _: [RESUME, before, saved, "2"],
        tmp_path,
        ".pkl",
        steps_per_job=2,
    )
    final = pickle.loads(previous.read_bytes())
    assert final["sizes"] == [2, 3, 1]
    params, x, y = problem()
    want, _ = train(optax.adam(1e-2), params, x, y, steps, jit=True)
    close(final["params"], want)
    one = dp.DistributedOptimizer(optax.adam(1e-2), shard_state=True, backend=_single())
    _, want_state = train(one, params, x, y, steps, jit=False)
    close(final["state"], want_state)

"""`dp.DistributedOptimizer(tx, shard_state=True)`: optax state sharded across ranks.

Runs at any world size (`pytest`, `mpiexec -n 3 ... pytest`, `dataparallel run --backend gloo`):
every rank trains on its share of a global batch and is compared with the unsharded
`DistributedOptimizer` (and one process on the whole batch). Values from the other ranks are
gathered before asserting, so a failure on one rank cannot leave the others waiting.
"""

from __future__ import annotations

from typing import Any

import numpy as np
import pytest

jax = pytest.importorskip("jax")
optax = pytest.importorskip("optax")
jnp = jax.numpy

from test_optax import OPTIMIZERS, STEPS, assert_same_on_every_rank, problem, share, train  # noqa: E402

import dataparallel as dp  # noqa: E402
from dataparallel.jax import ShardedState, consolidate_state, shard_state  # noqa: E402

# Masks and labels as trees of `problem()`'s parameters: no decay on biases, the usual recipe.
MASK = {"hidden": {"w": True, "b": False}, "out": [True, False]}
LABELS = {"hidden": {"w": "adam", "b": "sgd"}, "out": ["adam", "sgd"]}
# Chains that are not merely element-wise, but that run on slices the same as unsharded.
SHARDABLE: dict[str, Any] = {
    "adam": lambda: optax.adam(1e-2),
    "adamw-masked": lambda: optax.adamw(1e-2, weight_decay=0.5, mask=MASK),
    "partition": lambda: optax.partition(
        {"adam": optax.adam(1e-2), "sgd": optax.sgd(5e-2, momentum=0.9)}, LABELS
    ),
    "inject-adamw": lambda: optax.inject_hyperparams(optax.adamw)(
        learning_rate=optax.linear_schedule(1e-2, 1e-3, 4), weight_decay=0.5, mask=MASK
    ),
}


def close(a: Any, b: Any, tol: float = 1e-5) -> None:
    jax.tree.map(lambda u, v: np.testing.assert_allclose(u, v, rtol=tol, atol=tol), a, b)


@pytest.mark.spread
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
    mu = state.inner_state[0].mu
    assert jax.tree.structure(mu) == jax.tree.structure(params)  # the tree, cut down to slices
    every = dp.allgather_object(sum(int(np.size(leaf)) for leaf in jax.tree.leaves(mu)))
    part = -(-total // size)  # equal segments; fewer than size items of padding
    assert sum(every) == total
    assert all(part - size < n <= part for n in every)


@pytest.mark.heavy
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


@pytest.mark.spread
@pytest.mark.parametrize("jit", [False, True], ids=["eager", "jit"])
@pytest.mark.parametrize("name", sorted(set(SHARDABLE) - {"adam"}))
def test_masks_and_labels_as_trees_pick_the_same_leaves(
    name: str, jit: bool, rank: int, size: int
) -> None:
    """A mask or label tree picks whole leaves; each rank's slices keep their leaves' places, so
    the sharded optimizer decays (or partitions) exactly what the unsharded one does."""
    params, x, y = problem()
    xs, ys = share(x, rank, size), share(y, rank, size)
    unsharded, _ = train(dp.DistributedOptimizer(SHARDABLE[name]()), params, xs, ys, 4, jit)
    opt = dp.DistributedOptimizer(SHARDABLE[name](), shard_state=True)
    mine, _ = train(opt, params, xs, ys, 4, jit=jit)
    close(mine, unsharded)
    assert_same_on_every_rank(mine)


def _no_decay_on_vectors(tree: Any) -> Any:
    return jax.tree.map(lambda p: p.ndim > 1, tree)


# What cannot run on slices, and the name its refusal must carry.
UNSHARDABLE: dict[str, tuple[Any, str]] = {
    "clip_by_global_norm": (
        lambda: optax.chain(optax.clip_by_global_norm(1.0), optax.adam(1e-2)),
        "optax.clip_by_global_norm",
    ),
    "callable mask": (
        lambda: optax.adamw(1e-2, mask=_no_decay_on_vectors),
        "optax.masked .* mask=jax.tree.map",
    ),
    "callable labels": (
        lambda: optax.partition(
            {"a": optax.adam(1e-2), "s": optax.sgd(1e-2)},
            lambda p: jax.tree.map(lambda x: "a" if x.ndim > 1 else "s", p),
        ),
        "optax.partition",
    ),
    "lamb": (lambda: optax.lamb(1e-2), "optax.scale_by_trust_ratio"),
    "adafactor": (lambda: optax.adafactor(1e-2), "optax.scale_by_factored_rms"),
    "apply_if_finite": (
        lambda: optax.apply_if_finite(optax.adam(1e-2), 3),
        "optax.apply_if_finite",
    ),
    "inject a chain with clipping": (
        lambda: optax.inject_hyperparams(
            lambda learning_rate: optax.chain(
                optax.clip_by_global_norm(1.0), optax.adam(learning_rate)
            )
        )(learning_rate=1e-2),
        "optax.clip_by_global_norm",
    ),
}


@pytest.mark.parametrize("name", sorted(UNSHARDABLE))
def test_what_cannot_run_on_slices_is_refused_by_name(name: str) -> None:
    """Each of these would train differently sharded (a norm of one rank's slice, a mask of flat
    slices): refused when built, naming the optax part and what to do, before any collective."""
    make, says = UNSHARDABLE[name]
    with pytest.raises(ValueError, match=f"shard_state=True .*{says}"):
        dp.DistributedOptimizer(make(), shard_state=True)
    dp.DistributedOptimizer(make())  # unsharded: accepted


@pytest.mark.matrix(strength=1)
@pytest.mark.parametrize("dtype", ["bfloat16", "float16"])
@pytest.mark.parametrize("jit", [False, True], ids=["eager", "jit"])
def test_half_precision_average_is_correctly_rounded(
    dtype: str, jit: bool, rank: int, size: int
) -> None:
    """Every rank's 16-bit gradients averaged are the exact mean rounded once to 16 bits, item by
    item, as the unsharded optimizer's are (summed and divided in float32)."""
    n = 301
    shares = []
    for r in range(size):
        rng = np.random.default_rng(100 + r)
        values = rng.normal(size=n) * 2.0 ** rng.integers(-4, 5, size=n)
        shares.append(np.asarray(jnp.asarray(values, dtype), np.float64))  # 16-bit values
    mean = np.sum(shares, axis=0) / size  # exact in float64 (few terms, close exponents)
    want = _rounded(mean, jnp.dtype(dtype))
    grads = {"g": jnp.asarray(shares[rank], dtype)}
    params = {"g": jnp.zeros(n, dtype)}
    for sharded in (False, True):
        opt = dp.DistributedOptimizer(optax.sgd(-1.0), shard_state=sharded)
        update = jax.jit(opt.update) if jit else opt.update
        got, _ = update(grads, opt.init(params), params)
        wrong = np.flatnonzero(np.asarray(got["g"], np.float64) != want.astype(np.float64))
        assert wrong.size == 0, (sharded, wrong[:5], np.asarray(got["g"])[wrong[:5]])


def _rounded(x: np.ndarray, dtype: Any) -> np.ndarray:
    """`x` (float64) rounded to the nearest `dtype` value, ties to even: of a cast and its two
    neighbours (the cast may round twice, through float32), the nearest, the even one of two."""
    cast = np.asarray(x.astype(np.float32).astype(dtype))
    bits = cast.view(np.uint16).astype(np.int32)
    candidates = [(bits + d).astype(np.uint16) for d in (-1, 0, 1)]
    errors = np.stack([np.abs(c.view(dtype).astype(np.float64) - x) for c in candidates])
    errors[np.isnan(errors)] = np.inf  # a neighbour of zero or of the largest value
    odd = np.stack([c & 1 for c in candidates])
    best = np.lexsort((odd, errors), axis=0)[0]  # least error, then even
    return np.choose(best, candidates).view(dtype)


@pytest.mark.spread
@pytest.mark.parametrize("jit", [False, True], ids=["eager", "jit"])
@pytest.mark.parametrize("name", ["adam", "adamw-masked"])
def test_consolidated_state_restores_at_any_world_size(
    name: str, jit: bool, rank: int, size: int
) -> None:
    """The consolidated state is the world-size-free state over the flat parameters: it equals a
    world of one's, and a rank of any world keeps its slices of it (a masked state too)."""
    params, x, y = problem()
    xs, ys = share(x, rank, size), share(y, rank, size)
    make = SHARDABLE[name]
    opt = dp.DistributedOptimizer(make(), shard_state=True)
    mine, state = train(opt, params, xs, ys, 3, jit=jit)
    whole = consolidate_state(state, params, to=0)
    assert (whole is None) == (rank != 0)
    whole = dp.broadcast_object(whole, root=0)
    one = dp.DistributedOptimizer(make(), shard_state=True, backend=_single())
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


def assert_resumed_like_one_process(final: dict[str, Any], sizes: list[int]) -> None:
    """`final`, the end of a chain of `optax_sharded_resume.resume` runs at world sizes `sizes`
    (test_checkpoint.py's jobs run it), matches one process throughout: its parameters,
    and its consolidated state (a world of one's sharded state)."""
    assert final["sizes"] == sizes, f"sharded optax resume chain: world sizes {final['sizes']}"
    steps = 2 * len(sizes)
    params, x, y = problem()
    want, _ = train(optax.adam(1e-2), params, x, y, steps, jit=True)
    one = dp.DistributedOptimizer(optax.adam(1e-2), shard_state=True, backend=_single())
    _, want_state = train(one, params, x, y, steps, jit=False)
    for what, got, expected in (("parameters", "params", want), ("state", "state", want_state)):
        try:
            close(final[got], expected)
        except AssertionError as error:
            where = f"sharded optax resumed at world sizes {sizes}: the {what}"
            raise AssertionError(f"{where}: {error}") from None

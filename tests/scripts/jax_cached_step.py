"""A jitted training step, traced after `--before` other jitted steps, whose program JAX's
persistent compilation cache (JAX_COMPILATION_CACHE_DIR) finds when the job runs again.

The step reduces through the FFI call twice: the optimizer's gradient and a metric averaged by
`dp.allreduce` inside the step. Each rank writes `--out`/rank-N.json: the cache's hits and
misses counted by JAX (`jax.monitoring`) during the step's first call, which traces and
compiles it.
"""

from __future__ import annotations

import argparse
import collections
import json
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
import optax

import dataparallel as dp

parser = argparse.ArgumentParser()
parser.add_argument("--before", type=int, default=0, help="other jitted steps traced first")
parser.add_argument("--out", type=Path, required=True, help="a folder for each rank's counts")
args = parser.parse_args()
events: collections.Counter[str] = collections.Counter()
jax.monitoring.register_event_listener(lambda event, **_: events.update([event]))

dp.initialize()
opt = dp.DistributedOptimizer(optax.sgd(0.1), route="ffi")


def step(
    params: dict[str, jax.Array], state: optax.OptState, grads: dict[str, jax.Array]
) -> tuple[dict[str, jax.Array], optax.OptState, jax.Array]:
    updates, state = opt.update(grads, state, params)
    loss = dp.allreduce(jnp.sum(grads["w"] ** 2), op="avg")
    return optax.apply_updates(params, updates), state, loss


for n in range(args.before):  # steps of other shapes, each given a slot first
    other = {"w": jnp.ones(n + 7)}
    jax.block_until_ready(jax.jit(step)(other, opt.init(other), other))

params = {"w": jnp.ones(5)}
state, grads = opt.init(params), {"w": jnp.full(5, dp.rank() + 1.0)}
events.clear()
params, state, loss = jax.jit(step)(params, state, grads)
counts = {
    "hits": events["/jax/compilation_cache/cache_hits"],
    "misses": events["/jax/compilation_cache/cache_misses"],
}
mean = (dp.size() + 1) / 2
np.testing.assert_allclose(np.asarray(params["w"]), np.full(5, 1 - 0.1 * mean), rtol=1e-6)
squares = np.mean([5 * (r + 1) ** 2 for r in range(dp.size())])
np.testing.assert_allclose(float(loss), squares, rtol=1e-6)
(args.out / f"rank-{dp.rank()}.json").write_text(json.dumps(counts))
dp.finalize()

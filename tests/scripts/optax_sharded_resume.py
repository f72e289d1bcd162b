"""Resume a sharded optax state at this job's world size, train, consolidate and save again.

Usage: optax_sharded_resume.py PREVIOUS|- SAVED STEPS. Loads PREVIOUS (saved by another world
size: the parameters and the consolidated `ShardedState`), keeps this rank's segments
(`dp.jax.shard_state`), trains STEPS Adam steps on this rank's share of the regression batch
(jitted at odd world sizes, eager at even ones), consolidates on rank 0, which saves the
parameters, the state and the world sizes so far (NumPy leaves, pickled).
"""

from __future__ import annotations

import pickle
import sys
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import jax
import optax
from test_optax import loss, problem, share

import dataparallel as dp

previous, saved, steps = sys.argv[1], Path(sys.argv[2]), int(sys.argv[3])
dp.initialize()
rank, size = dp.rank(), dp.size()
params, x, y = problem()
opt = dp.DistributedOptimizer(optax.adam(1e-2), shard_state=True)
sizes: list[int] = []
state = None
if previous != "-":
    checkpoint = pickle.loads(Path(previous).read_bytes())
    params = jax.tree.map(jax.numpy.asarray, checkpoint["params"])
    state = dp.jax.shard_state(checkpoint["state"], params)
    sizes = checkpoint["sizes"]
xs, ys = share(x, rank, size), share(y, rank, size)
grad = jax.jit(jax.grad(loss))


def step(params: object, state: object) -> tuple[object, object]:
    updates, state = opt.update(grad(params, xs, ys), state, params)
    return optax.apply_updates(params, updates), state


run = jax.jit(step) if size % 2 else step
if state is None:
    state = opt.init(params)
for _ in range(steps):
    params, state = run(params, state)
whole = dp.jax.consolidate_state(state, params, to=0)
if rank == 0:
    out = jax.tree.map(np.asarray, {"params": params, "state": whole})
    saved.write_bytes(pickle.dumps({**out, "sizes": [*sizes, size]}))
dp.finalize()

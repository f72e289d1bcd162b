"""Resume a sharded optax state at this world's size, train, consolidate and save again.

`resume(previous, saved)`: loads `previous` (saved by a world of another size: the parameters
and the consolidated `ShardedState`; "-" to start), keeps this rank's segments
(`dp.jax.shard_state`), trains two Adam steps on this rank's share of the regression batch
(jitted at odd world sizes, eager at even ones), consolidates on rank 0, which saves the
parameters, the state and the world sizes so far (NumPy leaves, pickled). A step of
`optax_checkpoint.py` (`resume`), so that the jobs that check `dp.checkpoint` with optax
carry this chain too.
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

STEPS = 2


def resume(previous: str, saved: str | Path) -> None:
    """Load `previous` ("-": none), train `STEPS` steps at this world's size, save `saved`."""
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
    for _ in range(STEPS):
        params, state = run(params, state)
    whole = dp.jax.consolidate_state(state, params, to=0)
    if rank == 0:
        out = jax.tree.map(np.asarray, {"params": params, "state": whole})
        Path(saved).write_bytes(pickle.dumps({**out, "sizes": [*sizes, size]}))
    dp.barrier()  # the file is whole before any rank's next step reads it

"""Train a sharded optax state, or resume one, through `dp.checkpoint` at this job's world size.

    optax_checkpoint_job.py load FOLDER OUT
    optax_checkpoint_job.py save FOLDER REF
    optax_checkpoint_job.py load FOLDER OUT save FOLDER2 REF2 resume PREVIOUS SAVED

`save` trains two Adam steps (`shard_state=True`, each rank its own gradients) over parameters of
three dtypes and odd sizes, writes FOLDER with `dp.checkpoint.save` (every rank its slices, as
`dp.checkpoint.OptaxShards`), and rank 0 pickles REF: the parameters and the state consolidated
with `dp.jax.consolidate_state` (the same at every world size), as NumPy leaves. `load` makes a
fresh state at its own world size, loads FOLDER into it, and rank 0 pickles the same of what it
got into OUT: any job's OUT must equal REF bit for bit. Several actions run in turn, each from a
fresh state, so that one job can load one checkpoint and save the next. `resume PREVIOUS SAVED`
is `optax_sharded_resume.resume` (a chain of sharded runs, each going on from what a world of
another size consolidated: PREVIOUS "-" starts it).
"""

from __future__ import annotations

import pickle
import sys
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
import optax

import dataparallel as dp


def make_params() -> dict[str, Any]:
    return {
        "w": jnp.arange(35.0, dtype=jnp.float32).reshape(5, 7) / 10,
        "b": jnp.linspace(-1, 1, 7, dtype=jnp.float32),
        "h": jnp.ones((3, 3), jnp.bfloat16),
        "v": jnp.arange(4.0, dtype=jnp.float64) if jax.config.jax_enable_x64 else jnp.ones(4),
    }


def host(tree: Any) -> Any:
    return jax.tree.map(np.asarray, tree)


def act(mode: str, folder: str, out: str) -> None:
    """`save`, `load` or `resume` (see the module docstring), from a fresh state."""
    if mode == "resume":
        from optax_sharded_resume import resume

        resume(folder, out)
        return
    opt = dp.DistributedOptimizer(optax.adam(0.1), shard_state=True)
    params = make_params()
    state = opt.init(params)
    if mode == "save":
        for step in range(2):
            grads = jax.tree.map(
                lambda p, s=step: (
                    (jnp.cos(jnp.arange(p.size) + s + dp.rank()) * 3)
                    .reshape(p.shape)
                    .astype(p.dtype)
                ),
                params,
            )
            updates, state = opt.update(grads, state, params)
            params = optax.apply_updates(params, updates)
        dp.checkpoint.save(
            {"params": params, "opt": dp.checkpoint.OptaxShards(state, params), "step": 2}, folder
        )
    else:
        loaded = dp.checkpoint.load(
            {"params": params, "opt": dp.checkpoint.OptaxShards(state, params), "step": 0}, folder
        )
        params, state = loaded["params"], loaded["opt"]
        assert loaded["step"] == 2
    whole = dp.jax.consolidate_state(state, params)
    if dp.rank() == 0:
        with open(out, "wb") as f:
            pickle.dump({"params": host(params), "state": host(whole), "size": dp.size()}, f)


def main() -> None:
    actions = sys.argv[1:]
    dp.initialize()
    for i in range(0, len(actions), 3):
        act(*actions[i : i + 3])
    dp.finalize()


if __name__ == "__main__":
    main()

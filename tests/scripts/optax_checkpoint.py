"""Save, load or resume a sharded optax state through `dp.checkpoint` at this world's size.

`act(MODE, FOLDER, PATH)`: the optax steps of `checkpoint_job.py` (`optax-save`, `optax-load`,
`optax-resume`: the jobs that check `dp.checkpoint` across sizes carry optax's sharded state
too), and of `test_checkpoint.py` in its own world of one.

`save` trains two Adam steps (`shard_state=True`, each rank its own gradients) over parameters of
three dtypes and odd sizes, writes FOLDER with `dp.checkpoint.save` (every rank its slices, as
`dp.checkpoint.OptaxShards`), and rank 0 pickles PATH: the parameters and the state consolidated
with `dp.jax.consolidate_state` (the same at every world size), as NumPy leaves. `load` makes a
fresh state at its own world size, loads FOLDER into it, and rank 0 pickles the same of what it
got into PATH: it must equal the saving world's bit for bit. Each step starts from a fresh
state. `resume PREVIOUS SAVED` is `optax_sharded_resume.resume` (a chain of sharded runs, each
going on from what a world of another size consolidated: PREVIOUS "-" starts it).
"""

from __future__ import annotations

import pickle
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
import optax

import dataparallel as dp


def make_params() -> dict[str, Any]:
    """Made by NumPy and put on the device: each eager JAX operation is a program to compile."""
    wide = np.float64 if jax.config.jax_enable_x64 else np.float32
    host = {
        "w": np.arange(35.0, dtype=np.float32).reshape(5, 7) / 10,
        "b": np.linspace(-1, 1, 7, dtype=np.float32),
        "h": np.ones((3, 3), jnp.bfloat16),
        "v": np.arange(4.0, dtype=wide),
    }
    return jax.device_put(host)


def gradient(p: jax.Array, step: int) -> jax.Array:
    """A leaf's gradient at `step`, differing per rank (NumPy, as `make_params`)."""
    x = np.cos(np.arange(p.size, dtype=np.float32) + step + dp.rank()) * 3
    return jax.device_put(x.reshape(p.shape).astype(p.dtype))


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
            grads = jax.tree.map(lambda p, s=step: gradient(p, s), params)
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

"""An elastic optax run whose step is jitted (`dp.DistributedOptimizer`, `--route ffi` or
`callback`, or `ffi,callback`: the steps take the routes in turn): `dp.elastic.run` over a
`dp.elastic.TreeState`, a commit per step, no reset callback and no handling of JAX's errors by
the script.

Worker `--die W` SIGKILLs itself before step `--at` (`--die W:K`: before step K; several may
die), so the others lose it inside the jitted step's reduction, which JAX reports as its own
`JaxRuntimeError`. Worker `--pause W:K:FILE`,
before step K, creates FILE.paused and waits until FILE exists, the others waiting on it inside
the step's reduction (a test cuts a link meanwhile), then steps with them. Every rank trains on
the same batch, so the average gradient is the batch's at any world size (`replay`: one
process). Rank 0 writes `--out`: the world size at the end, the steps, whether every rank holds
the same parameters, and the parameters.
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import time
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
import optax

import dataparallel as dp

rng = np.random.default_rng(3)
x = jnp.asarray(rng.normal(size=(16, 4)), jnp.float32)
y = jnp.asarray(rng.normal(size=16), jnp.float32)
LEARNING_RATE = 0.1


def loss(params: dict[str, jax.Array]) -> jax.Array:
    return jnp.mean((x @ params["w"] + params["b"] - y) ** 2)


def start() -> dict[str, jax.Array]:
    return {"w": jnp.zeros(4, jnp.float32), "b": jnp.zeros((), jnp.float32)}


def flat(params: dict[str, jax.Array]) -> np.ndarray:
    return np.concatenate([np.ravel(np.asarray(v)) for v in jax.tree.leaves(params)])


def replay(steps: int) -> np.ndarray:
    """One process's training, to compare the run's end with."""
    params, tx = start(), optax.sgd(LEARNING_RATE)
    state = tx.init(params)
    for _ in range(steps):
        updates, state = tx.update(jax.grad(loss)(params), state, params)
        params = optax.apply_updates(params, updates)
    return flat(params)


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--out", required=True)
    parser.add_argument("--route", required=True)
    parser.add_argument("--die", action="append", default=[])
    parser.add_argument("--at", type=int, default=4)
    parser.add_argument("--steps", type=int, default=8)
    parser.add_argument("--pause", default="::")
    args = parser.parse_args()
    me = os.environ.get("DATAPARALLEL_ELASTIC_WORKER")
    deaths = {w: int(k or args.at) for w, _, k in (d.partition(":") for d in args.die)}
    pauser, pause_at, pause_file = args.pause.split(":", 2)
    paused = False

    dp.initialize()
    # The routes' states are the inner optimizer's: one state serves every route.
    opts = [
        dp.DistributedOptimizer(optax.sgd(LEARNING_RATE), route=r) for r in args.route.split(",")
    ]

    def stepping(opt: optax.GradientTransformation) -> Any:
        @jax.jit
        def step(params: dict[str, jax.Array], opt_state: Any) -> tuple[dict[str, jax.Array], Any]:
            updates, opt_state = opt.update(jax.grad(loss)(params), opt_state, params)
            return optax.apply_updates(params, updates), opt_state

        return step

    steps = [stepping(opt) for opt in opts]

    @dp.elastic.run
    def train(state: dp.elastic.TreeState) -> None:
        nonlocal paused
        while state.step < args.steps:
            if me in deaths and state.step == deaths[me]:
                os.kill(os.getpid(), signal.SIGKILL)
            if me == pauser and state.step == int(pause_at) and not paused:
                paused = True
                open(pause_file + ".paused", "w").close()
                while not os.path.exists(pause_file):
                    time.sleep(0.05)
            step = steps[int(state.step) % len(steps)]
            state.params, state.opt_state = step(state.params, state.opt_state)
            state.step += 1
            state.commit()

    params = start()
    state = dp.elastic.TreeState(params=params, opt_state=opts[0].init(params), step=0)
    train(state)
    mine = flat(state.params)
    same = all(np.array_equal(mine, other) for other in dp.allgather_object(mine))
    if dp.rank() == 0:
        result = {"size": dp.size(), "step": state.step, "same": same, "params": mine.tolist()}
        with open(args.out, "w") as file:
            json.dump(result, file)


if __name__ == "__main__":
    main()

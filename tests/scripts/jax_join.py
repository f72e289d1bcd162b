"""Rank 0 joins (`dp.join`) while the others go on, after a jitted `DistributedOptimizer` step.

`python jax_join.py CASE [CASE ...]`, each CASE `ROUTE` or `ROUTE:big` or `ROUTE:powersgd`, one
after the other in this one process, each with a new optimizer and step (`big`: the step has a
leaf over the bucket size too, a buffer of its own, sent after the first; `powersgd`: the step
compresses with `dp.Compression.powersgd(rank=1, start_iter=0)`, two reductions, its gradients of
rank 1 so that the results are the same). Each CASE runs two parts:

1. the others make eager allreduces, then join: rank 0 answers them with zeros, every `dp.join`
   returns, and a jitted step after it is right;
2. the others run more jitted steps: a jitted step cannot answer a rank that has joined, so every
   rank raises `RankJoinedError` (the working ranks from the step, rank 0 from `dp.join`), never
   hangs; then the world is still usable (an allreduce; a jitted step, except on the FFI route,
   where JAX keeps the failed step's ordered-effect token).

So a CASE after the first joins after a completed join and after a `RankJoinedError`, with the
steps of the cases before still traced. Each rank prints one line per check, `rank R: case K.P:`
(K the CASE's index, P the part); exits non-zero on the first wrong one.
"""

from __future__ import annotations

import sys

import jax
import jax.numpy as jnp
import numpy as np
import optax

import dataparallel as dp

dp.initialize()
rank, size = dp.rank(), dp.size()
mean = (size + 1) / 2  # of the ranks' gradients, rank + 1
Params = dict[str, jax.Array]


def run(case: int, route: str, option: str) -> None:
    """One CASE: a new optimizer and step on `route`, then the two parts."""
    low_rank = option == "powersgd"
    psgd = (
        dp.Compression.powersgd(rank=1, start_iter=0, min_compression_rate=1) if low_rank else None
    )
    opt = dp.DistributedOptimizer(optax.sgd(1.0), route=route, compression=psgd)  # type: ignore[arg-type]
    params = {"w": jnp.zeros(8), "b": jnp.zeros((2, 3))}
    if option == "big":
        params["big"] = jnp.zeros(100_000)  # 400 kB: over the 256 KiB bucket, reduced alone
    state = opt.init(params)

    @jax.jit
    def step(params: Params, state: optax.OptState) -> tuple[Params, optax.OptState]:
        grads = jax.tree.map(lambda p: jnp.ones_like(p) * (rank + 1.0), params)
        updates, state = opt.update(grads, state, params)
        return optax.apply_updates(params, updates), state

    def stepped(expected: float) -> None:
        """One step, kept once it is seen right (a failed step's outputs hold its error)."""
        nonlocal params, state
        new_params, new_state = step(params, state)
        np.testing.assert_allclose(np.asarray(new_params["w"]), np.full(8, expected))
        params, state = new_params, new_state

    stepped(-mean)  # every rank: the step is traced and runs once

    # Part 1: the others make eager allreduces, then join too; a jitted step after that is right.
    if rank != 0:
        for _ in range(2):
            got = dp.allreduce(np.full(3, float(rank)), op="sum")
            assert got[0] == size * (size - 1) / 2, got  # rank 0 answered with zeros
    dp.join()
    stepped(-2 * mean)
    print(f"rank {rank}: case {case}.1: joined and stepped", flush=True)

    # Part 2: the others run more jitted steps: every rank raises RankJoinedError.
    saw = "nothing"
    try:
        if rank == 0:
            dp.join()
        else:
            for _ in range(3):
                stepped(np.nan)  # never: it raises
    except Exception as error:  # JAX wraps the step's error (JaxRuntimeError); its message is kept
        saw = f"{type(error).__name__}: {error}".replace("\n", " | ")  # the callback's traceback
    print(f"rank {rank}: case {case}.2: {saw}", flush=True)
    assert "RankJoinedError" in saw and "joined (dp.join)" in saw, saw
    total = dp.allreduce(np.ones(1), op="sum")  # the world is usable
    assert total[0] == size, total
    if route != "ffi":  # on the FFI route JAX keeps the failed step's effect token (docs/jax.md)
        stepped(-3 * mean)
    print(f"rank {rank}: case {case}.2: usable after", flush=True)


for index, spec in enumerate(sys.argv[1:], start=1):
    route, _, option = spec.partition(":")
    run(index, route, option)

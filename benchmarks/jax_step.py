"""A jitted Adam step with dp against mpi4jax and raw MPI, and eager tree allreduces against raw.

Run: `OMP_NUM_THREADS=1 .venv/bin/mpiexec -n 2 .venv/bin/python benchmarks/jax_step.py`
(`--batches N`: rounds of the interleaved timing, 15 by default; `--models medium,large`).

For an MLP of 1.86 M parameters (784-1024-1024-10) and one of 8.40 M (1024-2048-2048-1024-10),
batch 64 per rank, every case is timed in short batches taken in turn (`_timing.compare`), so the
machine's drifts spread over all of them:

- `local`: the jitted step of plain `optax.adam`, no communication (the floor);
- `dp callback`: `dp.DistributedOptimizer(optax.adam(...), route="callback")` in the same jitted
  step (one ordered host callback per step, one `Allreduce` per dtype buffer);
- `dp ffi`: the same with `route="ffi"` (dp's XLA FFI call: the engine reads and writes XLA's
  buffers, no host round trip);
- `dp mpi4jax`: the same with `route="mpi4jax"` (mpi4jax's custom call on dp's packed buffer);
- `mpi4jax per leaf`: what an mpi4jax user writes: `mpi4jax.allreduce` on each gradient leaf
  inside `jit`, divided by the size, then Adam (the peer);
- `raw`: one `comm.Allreduce` of a float32 NumPy buffer of the gradient's bytes (no step), in
  place, the same buffer every call (the floor: no JAX arrays read or made);
- `raw out of place`: the same bytes read from one NumPy buffer and written to another, both kept
  from call to call (what an input that may not be written needs at the least: JAX's arrays);
- `raw per leaf from JAX`: what an mpi4py user writes for the same JAX tree: per leaf,
  `comm.Allreduce(np.asarray(leaf), out)` into a NumPy array kept from call to call, divided
  by the size, `jnp.asarray(out)` (JAX arrays are immutable: the result is new memory);
- eager: `dp.allreduce(tree, op="avg")` and `dp.allreduce_gradients(tree)` of the gradient
  tree as JAX arrays, against the raw rows (the same bytes).

A step's overhead is its time minus `local`'s (medians). Printed: milliseconds, overheads and the
ratios the goals are stated in: dp's overhead over mpi4jax's (goal: at most 1), eager over raw
(goal: at most 1.2). Without mpi4jax the cases that need it are skipped, with the reason;
docs/performance.md says how to build it against the `mpich` wheel.
"""

from __future__ import annotations

import argparse
import itertools
from collections.abc import Callable
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
import optax
from _timing import compare
from mpi4py import MPI
from optax_step import BATCH, init_mlp, loss_fn
from optax_step import MODELS as OPTAX_MODELS

import dataparallel as dp
from dataparallel.jax._bridges import mpi4jax_reason

# The same models, batch and loss as optax_step.py (1.86 M and 8.40 M parameters).
MODELS = {name: OPTAX_MODELS[name] for name in ("medium", "large")}


def looped(step: Callable[..., Any], params: Any, state: Any) -> Callable[[], None]:
    carry = [(params, state)]

    def once() -> None:
        carry[0] = jax.block_until_ready(step(*carry[0]))

    return once


def cases_of(sizes: tuple[int, ...], comm: MPI.Comm, m4j: bool) -> dict[str, Callable[[], Any]]:
    params = init_mlp(sizes)
    n = sum(leaf.size for leaf in jax.tree.leaves(params))
    rng = np.random.default_rng(dp.rank())
    x = jnp.asarray(rng.normal(size=(BATCH, sizes[0])), jnp.float32)
    y = jnp.asarray(rng.integers(0, sizes[-1], BATCH), jnp.int32)
    size = dp.size()

    def make_step(opt: Any, reduce: Callable[[Any], Any] | None = None) -> Callable[..., Any]:
        @jax.jit
        def step(p: Any, s: Any) -> Any:
            g = jax.grad(loss_fn)(p, x, y)
            if reduce is not None:
                g = reduce(g)
            u, s = opt.update(g, s, p)
            return optax.apply_updates(p, u), s

        return step

    adam = optax.adam(1e-3)
    cases: dict[str, Callable[[], Any]] = {}
    cases["local"] = looped(make_step(adam), params, adam.init(params))
    routes = ["callback", "ffi", "mpi4jax"] if m4j else ["callback", "ffi"]
    for route in routes:
        dist = dp.DistributedOptimizer(optax.adam(1e-3), route=route)  # type: ignore[arg-type]
        cases[f"dp {route}"] = looped(make_step(dist), params, dist.init(params))
    if m4j:
        import mpi4jax

        peer = comm.Dup()

        def per_leaf(g: Any) -> Any:
            return jax.tree.map(lambda t: mpi4jax.allreduce(t, op=MPI.SUM, comm=peer) / size, g)

        cases["mpi4jax per leaf"] = looped(make_step(adam, per_leaf), params, adam.init(params))
    flat = np.ones(n, np.float32)
    cases["raw"] = lambda: comm.Allreduce(MPI.IN_PLACE, flat, MPI.SUM)
    into = np.empty_like(flat)
    cases["raw out of place"] = lambda: comm.Allreduce(flat, into, MPI.SUM)
    grads = jax.tree.map(jnp.ones_like, params)
    outs = [np.empty(leaf.shape, np.float32) for leaf in jax.tree.leaves(grads)]

    def raw_per_leaf() -> Any:
        res = []
        for leaf, out in zip(jax.tree.leaves(grads), outs, strict=True):
            comm.Allreduce(np.asarray(leaf), out, MPI.SUM)
            np.divide(out, size, out=out)
            res.append(jnp.asarray(out))
        return jax.block_until_ready(res)

    cases["raw per leaf from JAX"] = raw_per_leaf
    cases["eager allreduce"] = lambda: jax.block_until_ready(dp.allreduce(grads, op="avg"))
    cases["eager allreduce_gradients"] = lambda: jax.block_until_ready(
        dp.allreduce_gradients(grads)
    )
    return cases


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--batches", type=int, default=15)
    parser.add_argument("--models", default=",".join(MODELS))
    args = parser.parse_args()
    dp.initialize("mpi")
    comm = MPI.COMM_WORLD.Dup()
    reason = mpi4jax_reason(dp.get_backend())
    if dp.is_main():
        print(f"{dp.size()} ranks, jax {jax.__version__} on {jax.devices()[0].platform}")
        if reason is not None:
            print(f"mpi4jax cases skipped: {reason}")
    for name in args.models.split(","):
        sizes = MODELS[name]
        n = sum(a * b + b for a, b in itertools.pairwise(sizes))
        times = compare(cases_of(sizes, comm, reason is None), comm, batches=args.batches)
        if not dp.is_main():
            continue
        local, raw = times["local"], times["raw"]
        print(f"\n{name}: {n / 1e6:.2f} M parameters, {4 * n / 2**20:.1f} MiB of gradients")
        print(f"{'case':28s} {'ms':>9s} {'overhead ms':>12s}")
        for case, seconds in times.items():
            over = "" if case.startswith(("local", "raw", "eager")) else "overhead"
            extra = f"{(seconds - local) * 1e3:12.3f}" if over else ""
            print(f"{case:28s} {seconds * 1e3:9.3f} {extra}")
        peer = times.get("mpi4jax per leaf")
        for route in ("callback", "ffi", "mpi4jax"):
            mine = times.get(f"dp {route}")
            if mine is None:
                continue
            ratio = f"{(mine - local) / (peer - local):.2f}" if peer is not None else "n/a"
            print(
                f"dp {route} overhead / mpi4jax per leaf overhead = {ratio}; "
                f"/ raw = {(mine - local) / raw:.2f}"
            )
        if peer is not None:
            print(f"mpi4jax per leaf overhead / raw = {(peer - local) / raw:.2f}")
        per_leaf, apart = times["raw per leaf from JAX"], times["raw out of place"]
        for case in ("eager allreduce", "eager allreduce_gradients"):
            print(
                f"{case} / raw = {times[case] / raw:.2f}; / raw out of place = "
                f"{times[case] / apart:.2f}; / raw per leaf from JAX = {times[case] / per_leaf:.2f}"
            )
    dp.finalize()


if __name__ == "__main__":
    main()

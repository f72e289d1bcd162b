"""Cost of `dp.DistributedOptimizer` for optax: the jit callback path next to eager and raw MPI.

Run: `OMP_NUM_THREADS=1 .venv/bin/mpiexec -n 2 .venv/bin/python benchmarks/optax_step.py`

For three MLP gradient trees (small: 10 k parameters in 4 leaves; medium: 1.8 M in 6; large: 8.4 M
in 8), each row is the median of several timed repetitions, every rank in lock step:

- reduce only: the gradient tree averaged across ranks
  - `raw`: one `comm.Allreduce` on a flat float32 NumPy buffer of the same size (the floor);
  - `eager`: `DistributedOptimizer(optax.identity()).update` on concrete JAX arrays;
  - `jit`: the same update inside `jax.jit`: one ordered `io_callback` per call;
  - `echo`: a jitted ordered `io_callback` that returns the tree unchanged, no communication: what
    JAX's staging of the arguments and results through the host costs by itself.
- train step (Adam, batch 64): `local` is a jitted step of plain optax with no communication (the
  compute floor); `jit` is the jitted step with `DistributedOptimizer`; `split` is what a user
  would write without it: jitted gradients, eager `dp.allreduce`, jitted Adam update.

With `--compression` (only these rows; `--models small,medium` to choose models): the jitted
train step uncompressed (`jit`), with `dp.Compression.fp16` and with
`dp.Compression.powersgd(rank=r, start_iter=0)` for r in `--ranks` (default 1,4), in the same
processes; the reference is the uncompressed step. On one host bytes are cheap: these rows show
what the compression costs, not what it saves across a slow link (benchmarks/network.py).

Columns: milliseconds per call; `vs` is the named reference's time divided by this row's time
(below 1: this row is slower).
"""

from __future__ import annotations

import argparse
from collections.abc import Callable
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
import optax
from _timing import timed
from jax.experimental import io_callback
from mpi4py import MPI

import dataparallel as dp

MODELS = {
    "small": (64, 128, 10),
    "medium": (784, 1024, 1024, 10),
    "large": (1024, 2048, 2048, 1024, 10),
}
BATCH = 64


def init_mlp(sizes: tuple[int, ...]) -> list[dict[str, jax.Array]]:
    keys = jax.random.split(jax.random.key(0), len(sizes) - 1)
    return [
        {"w": jax.random.normal(k, (a, b)) / np.sqrt(a), "b": jnp.zeros(b)}
        for a, b, k in zip(sizes[:-1], sizes[1:], keys, strict=True)
    ]


def loss_fn(params: Any, x: jax.Array, y: jax.Array) -> jax.Array:
    for layer in params[:-1]:
        x = jax.nn.relu(x @ layer["w"] + layer["b"])
    logits = x @ params[-1]["w"] + params[-1]["b"]
    return optax.softmax_cross_entropy_with_integer_labels(logits, y).mean()


def ready(tree: Any) -> Any:
    return jax.block_until_ready(tree)


def bench(name: str, sizes: tuple[int, ...], comm: MPI.Comm) -> list[tuple[str, float, str, float]]:
    """Return the rows of one model: name, seconds, reference name, the reference's seconds."""
    params = init_mlp(sizes)
    n = sum(leaf.size for leaf in jax.tree.leaves(params))
    tag = f"{name} ({n / 1e6:.2f} M params)"

    grads = jax.tree.map(jnp.ones_like, params)
    flat = np.ones(n, np.float32)
    raw = timed(lambda: comm.Allreduce(MPI.IN_PLACE, flat, MPI.SUM), comm)
    reducer = dp.DistributedOptimizer(optax.identity())
    state = reducer.init(grads)
    eager = timed(lambda: ready(reducer.update(grads, state)), comm)
    jitted_update = jax.jit(reducer.update)
    jit = timed(lambda: ready(jitted_update(grads, state)), comm)
    leaves = jax.tree.leaves(grads)
    shapes = [jax.ShapeDtypeStruct(leaf.shape, leaf.dtype) for leaf in leaves]
    echo = jax.jit(lambda *xs: io_callback(lambda *a: a, shapes, *xs, ordered=True))
    staging = timed(lambda: ready(echo(*leaves)), comm)
    rows = [
        (f"{tag} reduce raw", raw, "raw", raw),
        (f"{tag} reduce eager", eager, "raw", raw),
        (f"{tag} reduce jit", jit, "eager", eager),
        (f"{tag} echo callback", staging, "jit", jit),
    ]

    rng = np.random.default_rng(dp.rank())
    x = jnp.asarray(rng.normal(size=(BATCH, sizes[0])), jnp.float32)
    y = jnp.asarray(rng.integers(0, sizes[-1], BATCH), jnp.int32)
    adam = optax.adam(1e-3)
    dist = dp.DistributedOptimizer(optax.adam(1e-3))

    def make_step(opt: Any) -> Callable[..., Any]:
        @jax.jit
        def step(p: Any, s: Any) -> Any:
            g = jax.grad(loss_fn)(p, x, y)
            u, s = opt.update(g, s, p)
            return optax.apply_updates(p, u), s

        return step

    grad = jax.jit(jax.grad(loss_fn))

    @jax.jit
    def apply_adam(p: Any, s: Any, g: Any) -> Any:
        u, s = adam.update(g, s, p)
        return optax.apply_updates(p, u), s

    def split_step(p: Any, s: Any) -> Any:
        g = dp.allreduce(grad(p, x, y), op="avg")
        return apply_adam(p, s, g)

    def looped(step: Callable[..., Any], opt: Any) -> Callable[[], None]:
        carry = [(params, opt.init(params))]

        def once() -> None:
            carry[0] = ready(step(*carry[0]))

        return once

    local = timed(looped(make_step(adam), adam), comm)
    dist_t = timed(looped(make_step(dist), dist), comm)
    split = timed(looped(split_step, adam), comm)
    return [
        *rows,
        (f"{tag} step local", local, "local", local),
        (f"{tag} step jit", dist_t, "local", local),
        (f"{tag} step split", split, "jit", dist_t),
    ]


def bench_compression(
    name: str, sizes: tuple[int, ...], comm: MPI.Comm, ranks: list[int]
) -> list[tuple[str, float, str, float]]:
    """The jitted train step (Adam) uncompressed, in fp16 and with PowerSGD at each rank."""
    params = init_mlp(sizes)
    n = sum(leaf.size for leaf in jax.tree.leaves(params))
    tag = f"{name} ({n / 1e6:.2f} M params) step"
    rng = np.random.default_rng(dp.rank())
    x = jnp.asarray(rng.normal(size=(BATCH, sizes[0])), jnp.float32)
    y = jnp.asarray(rng.integers(0, sizes[-1], BATCH), jnp.int32)

    def looped(compression: Any) -> Callable[[], None]:
        opt = dp.DistributedOptimizer(optax.adam(1e-3), compression=compression)

        @jax.jit
        def step(p: Any, s: Any) -> Any:
            g = jax.grad(loss_fn)(p, x, y)
            u, s = opt.update(g, s, p)
            return optax.apply_updates(p, u), s

        carry = [(params, opt.init(params))]

        def once() -> None:
            carry[0] = ready(step(*carry[0]))

        return once

    plain = timed(looped(None), comm)
    rows = [(f"{tag} jit", plain, "jit", plain)]
    rows.append((f"{tag} fp16", timed(looped(dp.Compression.fp16), comm), "jit", plain))
    for r in ranks:
        psgd = dp.Compression.powersgd(rank=r, start_iter=0)
        rows.append((f"{tag} powersgd rank {r}", timed(looped(psgd), comm), "jit", plain))
    return rows


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.partition("\n")[0])
    parser.add_argument("--compression", action="store_true", help="only the compression rows")
    parser.add_argument("--models", default=",".join(MODELS), help="comma-separated model names")
    parser.add_argument("--ranks", default="1,4", help="PowerSGD ranks (with --compression)")
    args = parser.parse_args()
    models = {name: MODELS[name] for name in args.models.split(",")}
    dp.initialize("mpi")
    comm = MPI.COMM_WORLD.Dup()
    if args.compression:
        ranks = [int(r) for r in args.ranks.split(",")]
        rows = [r for name, sz in models.items() for r in bench_compression(name, sz, comm, ranks)]
    else:
        rows = [row for name, sizes in models.items() for row in bench(name, sizes, comm)]

    if dp.is_main():
        print(f"{dp.size()} ranks, jax {jax.__version__} on {jax.devices()[0].platform}")
        print(f"{'case':44s} {'ms':>9s}   vs")
        for case, seconds, ref, ref_seconds in rows:
            print(f"{case:44s} {seconds * 1e3:9.3f}   {ref} / this = {ref_seconds / seconds:.2f}")
    dp.finalize()


if __name__ == "__main__":
    main()

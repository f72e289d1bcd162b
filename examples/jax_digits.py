"""Train a small MLP on scikit-learn's digits with JAX and optax, data-parallel over ranks.

Run it on two processes (or any number; alone it runs as a world of one):

    OMP_NUM_THREADS=1 .venv/bin/mpiexec -n 2 .venv/bin/python examples/jax_digits.py

Each rank trains on its share of every epoch's batches (`dp.DistributedDataLoader`); the jitted
train step averages the gradients across ranks inside `dp.DistributedOptimizer` before Adam sees
them, so every rank takes the same step and the parameters stay identical. The test set is split
too (`dp.DistributedDataContainer`), and the correct counts are summed across ranks.
"""

from __future__ import annotations

import time
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
import optax

import dataparallel as dp

try:
    from sklearn.datasets import load_digits
    from sklearn.model_selection import train_test_split
except ImportError as exc:  # the digits ship with scikit-learn, which dataparallel does not need
    raise SystemExit(
        "This example trains on scikit-learn's digits: pip install 'dataparallel[examples]' "
        "(or pip install scikit-learn)."
    ) from exc

EPOCHS = 20
BATCH_SIZE = 32  # per rank: the global batch is BATCH_SIZE * dp.size()
LEARNING_RATE = 3e-3
SIZES = (64, 128, 10)  # 8x8 pixels -> hidden -> 10 digits

Params = list[dict[str, jax.Array]]


def init_mlp(key: jax.Array, sizes: tuple[int, ...]) -> Params:
    """Return one {"w", "b"} dict per layer, with He-initialized weights."""
    layers = []
    keys = jax.random.split(key, len(sizes) - 1)
    for n_in, n_out, k in zip(sizes[:-1], sizes[1:], keys, strict=True):
        w = jax.random.normal(k, (n_in, n_out)) * jnp.sqrt(2.0 / n_in)
        layers.append({"w": w, "b": jnp.zeros(n_out)})
    return layers


def apply_mlp(params: Params, x: jax.Array) -> jax.Array:
    """Return the logits of a batch `x`: ReLU between layers, none after the last."""
    for layer in params[:-1]:
        x = jax.nn.relu(x @ layer["w"] + layer["b"])
    return x @ params[-1]["w"] + params[-1]["b"]


def loss_fn(params: Params, x: jax.Array, y: jax.Array) -> jax.Array:
    return optax.softmax_cross_entropy_with_integer_labels(apply_mlp(params, x), y).mean()


def main() -> None:
    dp.initialize()
    t0 = time.perf_counter()

    digits = load_digits()  # bundled with scikit-learn: no download
    x = (digits.data / 16.0).astype(np.float32)
    y = digits.target.astype(np.int32)
    # The same split on every rank (fixed random_state), then each rank takes its share.
    x_train, x_test, y_train, y_test = train_test_split(
        x, y, test_size=0.25, random_state=0, stratify=y
    )
    # drop_last keeps every batch the same shape, so the jitted step compiles once.
    loader = dp.DistributedDataLoader(
        (x_train, y_train), BATCH_SIZE, shuffle=True, seed=0, drop_last=True
    )

    # Seeded per rank on purpose: synchronize gives every rank rank 0's initial weights.
    params = init_mlp(jax.random.key(1234 + dp.rank()), SIZES)
    params = dp.synchronize(params)

    optimizer = dp.DistributedOptimizer(optax.adam(LEARNING_RATE))
    opt_state = optimizer.init(params)

    @jax.jit
    def train_step(params: Params, opt_state: Any, x: jax.Array, y: jax.Array) -> Any:
        loss, grads = jax.value_and_grad(loss_fn)(params, x, y)
        updates, opt_state = optimizer.update(grads, opt_state, params)  # grads averaged here
        return optax.apply_updates(params, updates), opt_state, loss

    @jax.jit
    def count_correct(params: Params, x: jax.Array, y: jax.Array) -> jax.Array:
        return jnp.sum(jnp.argmax(apply_mlp(params, x), axis=-1) == y)

    if dp.is_main():
        print(
            f"{dp.size()} rank(s), {len(x_train)} training samples, {len(loader)} batches of "
            f"{BATCH_SIZE} per rank and epoch"
        )
    for epoch in range(EPOCHS):
        loader.set_epoch(epoch)  # a new shuffle each epoch, the same on every rank
        total = 0.0
        for xb, yb in loader:
            params, opt_state, loss = train_step(params, opt_state, xb, yb)
            total += float(loss)
        mean_loss = dp.allreduce(total / len(loader), op="avg")  # over every rank's batches
        if dp.is_main() and (epoch % 5 == 4 or epoch == 0):
            print(f"epoch {epoch + 1:2d}  loss {mean_loss:.4f}")

    x_share, y_share = dp.DistributedDataContainer((x_test, y_test))[:]
    correct = dp.allreduce(int(count_correct(params, x_share, y_share)))
    accuracy = correct / len(x_test)
    if dp.is_main():
        seconds = time.perf_counter() - t0
        print(f"test accuracy {accuracy:.4f} ({correct}/{len(x_test)}) in {seconds:.1f} s")
    dp.finalize()


if __name__ == "__main__":
    main()

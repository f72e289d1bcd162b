"""Low-rank gradient compression (`dp.Compression.powersgd`) for the optax `DistributedOptimizer`.

PowerSGD (Vogels et al., 2019) with the meaning it has on torch's `DistributedOptimizer`
(docs/compression.md), written as JAX operations so that the same code runs eagerly and inside
`jax.jit`, where XLA fuses the compression with the gradient's computation and only the two
reductions leave the program:

1. Each compressed leaf, viewed as a matrix `M` (its first dimension by the rest; with error
   feedback, this rank's residual added first), becomes `P = M Q`. The `P`s travel in one
   reduction with the leaves that are not compressed (`LowRankLayout` tells them apart).
2. Each reduced `P` is orthonormalized (QR, in float32 at least), `Q = M^T P` computed, and the
   `Q`s travel in a second reduction. The gradient becomes `P Q^T`, the average's rank-`rank`
   approximation; each rank keeps `M - P P^T M`, what the projection took from its own matrix.

The state (`PowerSGDState`) stands beside the wrapped transformation's, so whatever saves the
optax state saves it; a state loaded on another rank than its `owner` starts from zero residuals.

Agreement: the settings and the layout are agreed once (`agree`), and every step's first
reduction carries `[1, t, t * t]`, `t` derived from the step count. After the sum,
`(sum t)^2 == n * sum t^2` (`n` the ranks that sent; ranks that have joined send zeros) exactly
when every rank that sent had the same count; otherwise every rank raises
`CollectiveMismatchError` after the step's second reduction (no call left half made). Counts
that differ by a multiple of `TICKETS` pass unseen.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any, NamedTuple, TypedDict

import jax
import jax.numpy as jnp
import numpy as np
import optax
from jax.experimental import io_callback
from jax.typing import ArrayLike, DTypeLike

from dataparallel.arrays.compression import PowerSGDCompressor
from dataparallel.backends.base import Backend
from dataparallel.errors import CollectiveMismatchError
from dataparallel.protocol import handshake

__all__ = ["TICKETS", "LowRankLayout", "PowerSGDState", "Reducer", "low_rank_step"]

TICKETS = 31  # step counts are compared modulo this: t * t * size stays exact in float32
_FLOATS = ("float16", "bfloat16", "float32", "float64")


class Payload(TypedDict, total=False):
    """What one of a step's reductions carries: the check and the uncompressed leaves (the
    first), the `P`s (the first, where the step compresses), the `Q`s (the second)."""

    check: jax.Array
    leaves: list[ArrayLike]
    P: list[jax.Array]
    Q: list[jax.Array]


# Reduces across ranks with the transformation's op (eagerly or traced), keeping the structure.
Reducer = Callable[[Payload], Payload]
# A step's leaves, the new Qs and residuals, and the reduced check.
Stepped = tuple[list[ArrayLike], tuple[jax.Array, ...], tuple[jax.Array, ...], jax.Array]


class PowerSGDState(NamedTuple):
    """State of `distributed_optax(..., compression=dp.Compression.powersgd(...))`.

    Attributes:
        inner_state: the wrapped transformation's state.
        iteration: the updates made so far (int32), the same on every rank.
        qs: each compressed leaf's `Q` (`cols x rank`), in the order of the gradient tree's
            leaves, the same on every rank.
        residuals: this rank's residual of each compressed leaf, in its shape (float32 for
            16-bit leaves).
        owner: the rank these residuals belong to (int32); another rank's are not added.
    """

    inner_state: optax.OptState
    iteration: jax.Array
    qs: tuple[jax.Array, ...]
    residuals: tuple[jax.Array, ...]
    owner: jax.Array


@dataclass(frozen=True)
class LowRankLayout:
    """Which leaves of a gradient tree are compressed, each as `(index, rows, cols, rank)`,
    decided from their shapes and dtypes only, so that `init` and `update` (and every rank)
    decide alike."""

    matrices: tuple[tuple[int, int, int, int], ...]
    count: int  # leaves in the tree

    @classmethod
    def of(cls, leaves: Sequence[ArrayLike], config: PowerSGDCompressor) -> LowRankLayout:
        matrices = []
        for i, leaf in enumerate(leaves):
            shape, dtype = np.shape(leaf), str(np.dtype(jnp.result_type(leaf)))
            if len(shape) < 2 or dtype not in _FLOATS or int(np.prod(shape)) == 0:
                continue
            rows = shape[0]
            cols = int(np.prod(shape)) // rows
            r = min(config.rank, rows, cols)
            if rows * cols > (rows + cols) * r * config.min_compression_rate:  # torch's rule
                matrices.append((i, rows, cols, r))
        return cls(tuple(matrices), len(leaves))

    def plain(self) -> list[int]:
        """The indices of the leaves that travel uncompressed."""
        compressed = {i for i, *_ in self.matrices}
        return [i for i in range(self.count) if i not in compressed]


def _wide(dtype: DTypeLike) -> DTypeLike:
    """The dtype a leaf's matrices are computed in: float64 stays, the rest in float32."""
    return jnp.float64 if np.dtype(dtype) == np.float64 else jnp.float32


def _fresh_q(
    config: PowerSGDCompressor, k: int, cols: int, r: int, step: ArrayLike, dtype: DTypeLike
) -> jax.Array:
    """A `Q` drawn from the seed, the matrix's place `k` and `step`: the same on every rank."""
    key = jax.random.fold_in(jax.random.fold_in(jax.random.key(config.random_seed), k), step)
    return jax.random.normal(key, (cols, r), dtype)


def init_low_rank(
    inner_state: optax.OptState, params: optax.Params, config: PowerSGDCompressor, rank: int
) -> PowerSGDState:
    """The state before the first update: step 0, first `Q`s, zero residuals owned by `rank`."""
    leaves = jax.tree_util.tree_leaves(params)
    layout = LowRankLayout.of(leaves, config)
    qs, residuals = [], []
    for k, (i, _, cols, r) in enumerate(layout.matrices):
        dtype = _wide(jnp.result_type(leaves[i]))
        qs.append(_fresh_q(config, k, cols, r, 0, dtype))
        residuals.append(jnp.zeros(np.shape(leaves[i]), dtype))
    zero = jnp.zeros((), jnp.int32)
    return PowerSGDState(inner_state, zero, tuple(qs), tuple(residuals), zero + rank)


def _check(count: jax.Array) -> jax.Array:
    """The step count's check `[1, t, t * t]` (see the module)."""
    t = (count % TICKETS + 1).astype(jnp.float32)
    return jnp.stack([jnp.ones((), jnp.float32), t, t * t])


def _broken(check: jax.Array, scale: int) -> jax.Array:
    """Whether the reduced check says that the ranks that sent had different step counts
    (`scale`: the ranks an average divided by, to undo it)."""
    s = jnp.round(check * scale).astype(jnp.int32)
    return s[1] * s[1] != s[0] * s[2]


def _mismatch(count: jax.Array | np.ndarray) -> CollectiveMismatchError:
    return CollectiveMismatchError(
        f"Ranks ran PowerSGD updates at different step counts (this rank's: {int(count)}), so "
        "their low-rank bases differ: a rank whose state did not advance (it answered updates "
        "inside dp.join, or loaded another step's checkpoint) stepped with the others. Give every "
        "rank the state of the same step (save and load every rank's, or dp.broadcast rank 0's "
        "PowerSGDState), and call dp.join only after the last update."
    )


def agree(engine: Backend, config: PowerSGDCompressor, layout: LowRankLayout) -> None:
    """Have every rank check that the others compress with the same settings and layout."""
    if engine.size == 1:
        return
    summary = f"optax PowerSGD|{config!r}|{layout.matrices}|{layout.count} leaves"
    handshake(
        engine,
        summary,
        lambda: {
            "collective": "optax PowerSGD update",
            "compression": repr(config),
            "compressed (leaf, rows, cols, rank)": layout.matrices,
            "leaves": layout.count,
        },
    )


def low_rank_step(
    leaves: list[ArrayLike],
    state: PowerSGDState,
    config: PowerSGDCompressor,
    layout: LowRankLayout,
    reduce: Reducer,
    scale: int,
    rank: int,
) -> tuple[list[ArrayLike], PowerSGDState]:
    """Reduce the gradient's `leaves` (compressed once `start_iter` updates are made); return
    them with the new state (its `inner_state` unchanged). Eagerly or traced alike; `scale`:
    what the reducer's average divides by (1 for a sum), `rank`: this rank."""
    traced = any(isinstance(x, jax.core.Tracer) for x in (*leaves, state.iteration))
    fits = len(state.qs) == len(state.residuals) == len(layout.matrices) and all(
        tuple(q.shape) == (cols, r) and tuple(e.shape) == np.shape(leaves[i])
        for q, e, (i, _, cols, r) in zip(state.qs, state.residuals, layout.matrices, strict=False)
    )
    if not fits:
        shapes = [tuple(e.shape) for e in state.residuals]
        wanted = [np.shape(leaves[i]) for i, *_ in layout.matrices]
        raise ValueError(
            f"the PowerSGDState holds bases and residuals for matrices of shapes {shapes}, which "
            f"do not fit the compressed leaves of these gradients ({wanted}): pass the state "
            "that this transformation's init made for the same parameters."
        )

    def exact(count: jax.Array) -> Stepped:
        out = reduce({"check": _check(count), "leaves": list(leaves)})
        return out["leaves"], state.qs, state.residuals, out["check"]

    def compressed(count: jax.Array) -> Stepped:
        return _compressed(leaves, state, count, config, layout, reduce, scale, rank)

    count = state.iteration
    if not traced:
        step = exact if int(count) < config.start_iter or not layout.matrices else compressed
        out, qs, residuals, check = step(count)
        if bool(_broken(check, scale)):
            raise _mismatch(count)
    else:
        if config.start_iter == 0 and layout.matrices:
            out, qs, residuals, check = compressed(count)
        elif not layout.matrices:
            out, qs, residuals, check = exact(count)
        else:
            out, qs, residuals, check = jax.lax.cond(
                count >= config.start_iter, compressed, exact, count
            )
        _raise_if_broken(_broken(check, scale), count, [*out, *qs])
    new = PowerSGDState(state.inner_state, count + 1, tuple(qs), tuple(residuals), state.owner)
    return out, new


def _raise_if_broken(broken: jax.Array, count: jax.Array, after: list[ArrayLike]) -> None:
    """Inside `jit`: raise the mismatch from a host callback where `broken`; the callback takes
    a value of `after`'s last array (a reduced `Q` where the step compressed), so it runs after
    both reductions on every rank."""

    def fail(count: np.ndarray, _: np.ndarray) -> None:
        raise _mismatch(count)

    last = jnp.ravel(after[-1])[:1] if after and np.size(after[-1]) else jnp.zeros(1)
    jax.lax.cond(
        broken,
        lambda: io_callback(fail, None, count, last, ordered=False),
        lambda: None,
    )


def _compressed(
    leaves: list[ArrayLike],
    state: PowerSGDState,
    count: jax.Array,
    config: PowerSGDCompressor,
    layout: LowRankLayout,
    reduce: Reducer,
    scale: int,
    rank: int,
) -> Stepped:
    plain = layout.plain()
    own = state.owner == rank  # another rank's residuals are not this rank's to add
    ms, ps = [], []
    for k, (i, rows, cols, r) in enumerate(layout.matrices):
        wide = _wide(jnp.result_type(leaves[i]))
        g = jnp.asarray(leaves[i]).astype(wide)
        if config.use_error_feedback:
            g = g + jnp.where(own, state.residuals[k], jnp.zeros_like(state.residuals[k]))
        m = g.reshape(rows, cols)
        q = state.qs[k] if config.warm_start else _fresh_q(config, k, cols, r, count, wide)
        ms.append(m)
        ps.append(m @ q.astype(wide))
    first = reduce({"check": _check(count), "leaves": [leaves[i] for i in plain], "P": ps})
    bases = [_orthonormalize(p) for p in first["P"]]
    local = [m.T @ p for m, p in zip(ms, bases, strict=True)]
    reduced = reduce({"Q": local})["Q"]
    out: list[Any] = [None] * layout.count
    for i, x in zip(plain, first["leaves"], strict=True):
        out[i] = x
    residuals = []
    for k, (i, *_) in enumerate(layout.matrices):
        shape, dtype = np.shape(leaves[i]), jnp.result_type(leaves[i])
        out[i] = (bases[k] @ reduced[k].T).reshape(shape).astype(dtype)
        if config.use_error_feedback:  # M - P P^T M: what this rank's own matrix lost
            residuals.append((ms[k] - bases[k] @ local[k].T).reshape(shape))
        else:
            residuals.append(state.residuals[k])
    # The reduced Q is the next step's (warm start): its scale (an average's or a sum's) does
    # not matter, P is orthonormalized.
    qs = tuple(q.astype(old.dtype) for q, old in zip(reduced, state.qs, strict=True))
    return out, qs, tuple(residuals), first["check"]


def _orthonormalize(p: jax.Array) -> jax.Array:
    """An orthonormal basis of the columns of `p` (Householder QR: a column the others already
    span gives a unit vector, not NaN)."""
    wide = p if p.dtype == jnp.float64 else p.astype(jnp.float32)
    q, _ = jnp.linalg.qr(wide)
    return q.astype(p.dtype)

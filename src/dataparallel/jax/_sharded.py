"""`sharded_optax`: optax state sharded across ranks (ZeRO stage 1 for optax).

The face of `dp.DistributedOptimizer(tx, shard_state=True)`. The parameter tree's leaves are laid
end to end per dtype (in tree order) into one flat vector each; rank r owns the r-th of `size`
equal contiguous segments of every vector (padded with fewer than `size` zeros), and the inner
transformation is applied to `{dtype: this rank's segment}`, so its state is about `1 / size` of
the unsharded state. `update` reduce-scatters the gradients (averaged), runs the inner update on
this rank's segment and allgathers the updates' segments back into the tree, one call per dtype
each: eagerly on the host, under `jax.jit` through an ordered host callback on the private
duplicate of the engine, with the inner update left in the compiled program.

The inner transformation must be element-wise (sgd, adam, adamw, rmsprop, ...): it sees segments
of a flat vector, not the leaves. `consolidate_state` gathers a whole state (the same at every
world size) to one rank for a checkpoint; `shard_state` keeps this rank's segments of it.

>>> import jax.numpy as jnp, optax, dataparallel as dp
>>> _ = dp.initialize()
>>> opt = dp.DistributedOptimizer(optax.adam(0.1), shard_state=True)
>>> params = {"w": jnp.ones(3)}
>>> state = opt.init(params)
>>> updates, state = opt.update({"w": jnp.ones(3)}, state, params)
>>> [round(float(u), 3) for u in updates["w"]]
[-0.1, -0.1, -0.1]
"""

from __future__ import annotations

from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
import numpy as np
import optax
from jax.experimental import io_callback

from dataparallel import world
from dataparallel.arrays.actions import parse_op
from dataparallel.backends.base import Backend, ReduceOp
from dataparallel.groups import Group, backend_of
from dataparallel.jax._optax import callback_backend
from dataparallel.types import Op

__all__ = ["ShardedState", "consolidate_state", "shard_state", "sharded_optax"]


class ShardedState(NamedTuple):
    """State of `sharded_optax`: the inner state over `{dtype: this rank's segment}`."""

    inner_state: optax.OptState


def _counts(items: int, size: int) -> list[int]:
    """Equal segments of `items` padded to a multiple of `size`, so that the updates travel by
    plain allgathers (MPICH's `Allgatherv` is far slower: benchmarks/NOTES.md, "Equal
    segments")."""
    return [-(-items // size)] * size


class _Layout(NamedTuple):
    """The flat vectors of a tree: per dtype, its leaves (indices, sizes) and the segments."""

    treedef: jax.tree_util.PyTreeDef
    shapes: list[tuple[int, ...]]
    dtypes: dict[str, list[int]]  # dtype name -> leaf indices, in tree order
    counts: dict[str, list[int]]  # dtype name -> items per rank (equal: the vector is padded)
    items: dict[str, int]  # dtype name -> the leaves' items


def _layout(tree: Any, size: int) -> tuple[_Layout, list[Any]]:
    leaves, treedef = jax.tree_util.tree_flatten(tree)
    dtypes: dict[str, list[int]] = {}
    for i, leaf in enumerate(leaves):
        dtypes.setdefault(str(np.dtype(jnp.result_type(leaf))), []).append(i)
    shapes = [tuple(np.shape(leaf)) for leaf in leaves]
    items = {
        d: sum(int(np.prod(shapes[i], dtype=np.int64)) for i in idx) for d, idx in dtypes.items()
    }
    counts = {d: _counts(n, size) for d, n in items.items()}
    return _Layout(treedef, shapes, dtypes, counts, items), leaves


def _flats(layout: _Layout, leaves: list[Any]) -> dict[str, jax.Array]:
    """The leaves end to end per dtype, padded with zeros to `size` equal segments."""
    out = {}
    for d, idx in layout.dtypes.items():
        flat = jnp.concatenate([jnp.ravel(leaves[i]) for i in idx])
        out[d] = jnp.pad(flat, (0, sum(layout.counts[d]) - layout.items[d]))
    return out


def _segments(layout: _Layout, leaves: list[Any], rank: int) -> dict[str, jax.Array]:
    out = {}
    for d, flat in _flats(layout, leaves).items():
        start = sum(layout.counts[d][:rank])
        out[d] = flat[start : start + layout.counts[d][rank]]
    return out


def sharded_optax(
    inner: optax.GradientTransformation,
    *,
    op: Op = "avg",
    backend: Backend | None = None,
    group: Group | None = None,
) -> optax.GradientTransformationExtraArgs:
    """Wrap `inner` so that each rank keeps the state of its segment of the parameters only.

    Usually reached through `dp.DistributedOptimizer(inner, shard_state=True)`.

    Args:
        inner: an element-wise optax transformation.
        op: `"avg"` (default) or `"sum"`: how gradients combine across ranks.
        backend: the engine (default: the active one).
        group: shard among the ranks of this `dp.new_group` group (default: the world).

    Returns:
        A transformation whose `init(params)` returns a `ShardedState` and whose
        `update(grads, state, params=None)` returns the whole update tree (the same on every
        rank) with the new `ShardedState`, eagerly and inside `jax.jit`.
    """
    if op not in ("avg", "sum"):
        raise ValueError(f"shard_state=True: op={op!r} must be 'avg' or 'sum'.")
    parse_op(op)
    chosen = backend_of(backend, group)
    inner = optax.with_extra_args_support(inner)
    if world.initialized():
        callback_backend(chosen)  # collective: the private engine of the callbacks, everywhere

    def engine() -> Backend:
        return chosen if chosen is not None else world.current().backend

    def init_fn(params: optax.Params) -> ShardedState:
        b = engine()
        layout, leaves = _layout(params, b.size)
        return ShardedState(inner.init(_segments(layout, leaves, b.rank)))

    def update_fn(
        updates: optax.Updates,
        state: optax.OptState,
        params: optax.Params | None = None,
        **extra_args: Any,
    ) -> tuple[optax.Updates, ShardedState]:
        if not isinstance(state, ShardedState):
            raise TypeError(
                "update expected the ShardedState made by this transformation's init, got "
                f"{type(state).__module__}.{type(state).__qualname__}."
            )
        b = engine()
        layout, leaves = _layout(updates, b.size)
        if not leaves:
            return updates, state
        flats = _flats(layout, leaves)
        traced = any(isinstance(x, jax.core.Tracer) for x in flats.values())
        comm = callback_backend(chosen) if traced else b
        names = list(flats)
        scale = 1.0 / b.size if op == "avg" else 1.0

        def scatter(*vectors: np.ndarray) -> list[np.ndarray]:
            return [
                _reduce_scatter(comm, np.asarray(v), layout.counts[d], scale)
                for d, v in zip(names, vectors, strict=True)
            ]

        def gather(*pieces: np.ndarray) -> list[np.ndarray]:
            return [
                _allgather(comm, np.asarray(p), layout.counts[d])
                for d, p in zip(names, pieces, strict=True)
            ]

        mine = [(layout.counts[d][b.rank],) for d in names]
        if traced:
            shapes = [
                jax.ShapeDtypeStruct(s, flats[d].dtype) for s, d in zip(mine, names, strict=True)
            ]
            scattered = io_callback(scatter, shapes, *flats.values(), ordered=True)
        else:
            scattered = [jnp.asarray(x) for x in scatter(*[np.asarray(v) for v in flats.values()])]
        grads = dict(zip(names, scattered, strict=True))
        segments = None
        if params is not None:
            p_layout, p_leaves = _layout(params, b.size)
            segments = _segments(p_layout, p_leaves, b.rank)
        new, inner_state = inner.update(grads, state.inner_state, segments, **extra_args)
        pieces = [new[d] for d in names]
        if traced:
            whole = [jax.ShapeDtypeStruct((sum(layout.counts[d]),), flats[d].dtype) for d in names]
            gathered = io_callback(gather, whole, *pieces, ordered=True)
        else:
            gathered = [jnp.asarray(x) for x in gather(*[np.asarray(p) for p in pieces])]
        out: list[Any] = [None] * len(leaves)
        for d, vector in zip(names, gathered, strict=True):
            at = 0
            for i in layout.dtypes[d]:
                n = int(np.prod(layout.shapes[i], dtype=np.int64))
                out[i] = vector[at : at + n].reshape(layout.shapes[i])
                at += n
        return jax.tree_util.tree_unflatten(layout.treedef, out), ShardedState(inner_state)

    return optax.GradientTransformationExtraArgs(init_fn, update_fn)


def _reduce_scatter(
    comm: Backend, vector: np.ndarray, counts: list[int], scale: float
) -> np.ndarray:
    mine = np.empty(counts[comm.rank], vector.dtype)
    if comm.size == 1:
        mine[...] = vector
    else:
        wide = vector if vector.dtype.name in comm.native_dtypes else vector.astype(np.float32)
        out = mine if wide is vector else np.empty(counts[comm.rank], np.float32)
        comm.reduce_scatter(np.ascontiguousarray(wide), out, counts, ReduceOp.SUM)
        if out is not mine:
            mine[...] = out
    if scale != 1.0:
        mine *= np.asarray(scale, mine.dtype)
    return mine


def _allgather(comm: Backend, piece: np.ndarray, counts: list[int]) -> np.ndarray:
    whole = np.empty(sum(counts), piece.dtype)
    if comm.size == 1:
        whole[...] = piece
        return whole
    comm.allgather(np.ascontiguousarray(piece).view(np.uint8), whole.view(np.uint8))
    return whole


def _is_segment(path: tuple[Any, ...], names: set[str]) -> bool:
    last = path[-1] if path else None
    return isinstance(last, jax.tree_util.DictKey) and last.key in names


def _state_leaves(
    state: ShardedState, params: optax.Params, backend: Backend | None, group: Group | None
) -> tuple[Backend, _Layout, set[str], list[tuple[Any, Any]], Any]:
    """The engine, the parameters' layout, its dtype names and the state's leaves by path."""
    chosen = backend_of(backend, group)
    b = chosen if chosen is not None else world.current().backend
    layout, _ = _layout(params, b.size)
    with_paths, treedef = jax.tree_util.tree_flatten_with_path(state.inner_state)
    return b, layout, set(layout.dtypes), with_paths, treedef


def consolidate_state(
    state: ShardedState,
    params: optax.Params,
    *,
    to: int = 0,
    backend: Backend | None = None,
    group: Group | None = None,
) -> ShardedState | None:
    """Gather a `ShardedState` whole on rank `to`, leaf by leaf (collective); None elsewhere.

    The result's per-dtype vectors hold every item; `shard_state` cuts it again for any world
    size. `params` gives the layout (the same tree as at `init`).
    """
    b, layout, names, with_paths, treedef = _state_leaves(state, params, backend, group)
    out = []
    for path, leaf in with_paths:
        if _is_segment(path, names):
            d = path[-1].key
            whole = _allgather(b, np.asarray(leaf), layout.counts[d])
            out.append(whole[: layout.items[d]])  # the padding is not state
        else:
            out.append(np.asarray(leaf))
    if b.rank != to:
        return None
    return ShardedState(jax.tree_util.tree_unflatten(treedef, [jnp.asarray(x) for x in out]))


def shard_state(
    state: ShardedState,
    params: optax.Params,
    *,
    backend: Backend | None = None,
    group: Group | None = None,
) -> ShardedState:
    """Keep this rank's segments of a consolidated `ShardedState` (saved at any world size).

    `params` gives the layout (the same tree as at `init`).

    Raises:
        ValueError: `state` is not a consolidated `ShardedState` over such parameters.
    """
    if not isinstance(state, ShardedState):
        raise ValueError(
            "shard_state expects the ShardedState from consolidate_state, got "
            f"{type(state).__module__}.{type(state).__qualname__}."
        )
    b, layout, names, with_paths, treedef = _state_leaves(state, params, backend, group)
    out = []
    for path, leaf in with_paths:
        if not _is_segment(path, names):
            out.append(leaf)
            continue
        d = path[-1].key
        part, items = layout.counts[d][0], layout.items[d]
        if np.shape(leaf) != (items,):
            raise ValueError(
                f"shard_state: state{jax.tree_util.keystr(path)} has shape "
                f"{list(np.shape(leaf))}, but the {d} parameters have {items} items in "
                "all: this state is from other parameters (or was not consolidated)."
            )
        padded = jnp.pad(jnp.asarray(leaf), (0, part * b.size - items))
        out.append(padded[b.rank * part : (b.rank + 1) * part])
    return ShardedState(jax.tree_util.tree_unflatten(treedef, out))

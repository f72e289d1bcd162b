"""`sharded_optax`: optax state sharded across ranks (ZeRO stage 1 for optax).

The face of `dp.DistributedOptimizer(tx, shard_state=True)`. The parameter tree's leaves are laid
end to end per dtype into one flat vector each; rank r owns the r-th of `size` equal segments of
every vector, so one reduce-scatter and one allgather per dtype carry a step. The inner
transformation sees the parameters' own tree with each leaf cut down to this rank's slice (empty
where the rank owns none of it), so its state is about `1 / size` of the unsharded state and a
mask or label tree picks leaves as it does unsharded. Under `jax.jit` the calls go through an
ordered host callback on the private duplicate of the engine, the inner update stays compiled.

Slices keep their leaves' places but not their shapes, so the inner transformation must be
element-wise: what cannot run on slices (a global norm, a callable mask) is refused when the
optimizer is built (`dataparallel.jax._elementwise`). Half-precision gradients are summed and
averaged in float32, then rounded once, as unsharded. `consolidate_state` gathers a whole state
(the same at every world size) to one rank; `shard_state` keeps this rank's slices of it.

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

from types import ModuleType
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
import numpy as np
import optax
from jax.experimental import io_callback
from jax.tree_util import KeyPath, PyTreeDef
from jax.typing import ArrayLike

from dataparallel import world
from dataparallel.arrays.actions import parse_op
from dataparallel.arrays.dtypes import scale_in_place
from dataparallel.backends.base import Backend, ReduceOp
from dataparallel.groups import Group, backend_of
from dataparallel.jax._elementwise import refuse_unshardable
from dataparallel.jax._jit import traced_here
from dataparallel.jax._optax import callback_backend
from dataparallel.types import Op

__all__ = ["ShardedState", "consolidate_state", "shard_state", "sharded_optax", "slice_places"]


Segments = dict[str, np.ndarray | jax.Array]  # dtype name -> a flat vector, host or traced


class ShardedState(NamedTuple):
    """State of `sharded_optax`: the inner state over this rank's slices of the parameters."""

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
    offsets: list[int]  # each leaf's first item in its dtype's vector
    names: list[str]  # each leaf's dtype name

    def size(self, i: int) -> int:
        return int(np.prod(self.shapes[i], dtype=np.int64))

    def cut(self, i: int, rank: int) -> tuple[int, int, int]:
        """Leaf `i`'s slice on `rank`: where it starts in the rank's segment, where in the
        leaf, and how many items it has (0: the rank owns none of the leaf)."""
        part = self.counts[self.names[i]][0]
        lo, first = rank * part, self.offsets[i]
        start, end = max(first, lo), min(first + self.size(i), lo + part)
        return start - lo, start - first, max(0, end - start)


def _layout(tree: optax.Params, size: int) -> tuple[_Layout, list[ArrayLike]]:
    leaves, treedef = jax.tree_util.tree_flatten(tree)
    dtypes: dict[str, list[int]] = {}
    names = [str(np.dtype(jnp.result_type(leaf))) for leaf in leaves]
    for i, d in enumerate(names):
        dtypes.setdefault(d, []).append(i)
    shapes = [tuple(np.shape(leaf)) for leaf in leaves]
    offsets = [0] * len(leaves)
    items = {}
    for d, idx in dtypes.items():
        at = 0
        for i in idx:
            offsets[i] = at
            at += int(np.prod(shapes[i], dtype=np.int64))
        items[d] = at
    counts = {d: _counts(n, size) for d, n in items.items()}
    return _Layout(treedef, shapes, dtypes, counts, items, offsets, names), leaves


def _host(leaves: list[ArrayLike]) -> bool:
    """Whether `leaves` are values, not traced: they are then laid out by NumPy on the host, where
    the engine reads them, and JAX compiles nothing (each eager JAX operation on a new shape is a
    program of its own); traced ones by JAX, in the program being traced."""
    return not any(isinstance(leaf, jax.core.Tracer) for leaf in leaves)


def _on_device(tree: optax.Updates) -> optax.Updates:
    """`tree`'s host arrays as JAX arrays (`device_put`, where `jnp.asarray` compiles a copy)."""
    return jax.tree_util.tree_map(jax.device_put, tree)


def _flats(layout: _Layout, leaves: list[ArrayLike], xp: ModuleType) -> Segments:
    """The leaves end to end per dtype, padded with zeros to `size` equal segments (`xp`: NumPy
    for values, `jax.numpy` for traced leaves)."""
    out = {}
    for d, idx in layout.dtypes.items():
        flat = xp.concatenate([xp.ravel(xp.asarray(leaves[i], jnp.dtype(d))) for i in idx])
        out[d] = xp.pad(flat, (0, sum(layout.counts[d]) - layout.items[d]))
    return out


def _segments(layout: _Layout, leaves: list[ArrayLike], rank: int, xp: ModuleType) -> Segments:
    out = {}
    for d, flat in _flats(layout, leaves, xp).items():
        start = sum(layout.counts[d][:rank])
        out[d] = flat[start : start + layout.counts[d][rank]]
    return out


def _slices(layout: _Layout, segments: Segments, rank: int) -> optax.Updates:
    """The tree of this rank's slices of each leaf, cut from its segments."""
    out = []
    for i, d in enumerate(layout.names):
        at, _, n = layout.cut(i, rank)
        out.append(segments[d][at : at + n])
    return jax.tree_util.tree_unflatten(layout.treedef, out)


def _join(layout: _Layout, slices: optax.Updates, rank: int, xp: ModuleType) -> Segments:
    """This rank's segments from its slices (the inverse of `_slices`), padded with zeros: the
    slices of one dtype lie end to end in the segment, in tree order."""
    leaves = layout.treedef.flatten_up_to(slices)
    out = {}
    for d, idx in layout.dtypes.items():
        dtype = jnp.dtype(d)  # bfloat16 too, which NumPy does not know by name
        parts = [
            xp.ravel(xp.asarray(leaves[i])).astype(dtype) for i in idx if layout.cut(i, rank)[2]
        ]
        part = layout.counts[d][rank]
        flat = xp.concatenate(parts) if parts else xp.zeros(0, dtype)
        out[d] = xp.pad(flat, (0, part - flat.shape[0]))
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
        inner: an element-wise optax transformation (a mask or labels as a tree).
        op: `"avg"` (default) or `"sum"`: how gradients combine across ranks.
        backend: the engine (default: the active one).
        group: shard among the ranks of this `dp.new_group` group (default: the world).

    Returns:
        A transformation whose `init(params)` returns a `ShardedState` and whose
        `update(grads, state, params=None)` returns the whole update tree (the same on every
        rank) with the new `ShardedState`, eagerly and inside `jax.jit`.

    Raises:
        ValueError: `op` is not `"avg"` or `"sum"`, or `inner` holds an optax part that cannot
            run on slices of the leaves (`clip_by_global_norm`, a callable mask, `lamb`, ...);
            the message names it and says what to do.
    """
    if op not in ("avg", "sum"):
        raise ValueError(f"shard_state=True: op={op!r} must be 'avg' or 'sum'.")
    parse_op(op)
    refuse_unshardable(inner)
    chosen = backend_of(backend, group)
    inner = optax.with_extra_args_support(inner)
    if world.initialized():
        callback_backend(chosen)  # collective: the private engine of the callbacks, everywhere

    def engine() -> Backend:
        return chosen if chosen is not None else world.current().backend

    def init_fn(params: optax.Params) -> ShardedState:
        b = engine()
        layout, leaves = _layout(params, b.size)
        xp = np if _host(leaves) else jnp
        slices = _slices(layout, _segments(layout, leaves, b.rank, xp), b.rank)
        return ShardedState(inner.init(_on_device(slices) if xp is np else slices))

    def update_fn(
        updates: optax.Updates,
        state: optax.OptState,
        params: optax.Params | None = None,
        **extra_args: object,
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
        traced = not _host(leaves)
        xp = jnp if traced else np
        flats = _flats(layout, leaves, xp)
        comm = callback_backend(chosen) if traced else b
        if traced:
            traced_here()
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
            scattered = scatter(*[np.asarray(v) for v in flats.values()])
        grads = _slices(layout, dict(zip(names, scattered, strict=True)), b.rank)
        mine_params = None
        if params is not None:
            p_layout, p_leaves = _layout(params, b.size)
            p_xp = np if _host(p_leaves) else jnp
            mine_params = _slices(p_layout, _segments(p_layout, p_leaves, b.rank, p_xp), b.rank)
            mine_params = _on_device(mine_params) if p_xp is np else mine_params
        grads = grads if traced else _on_device(grads)
        new, inner_state = inner.update(grads, state.inner_state, mine_params, **extra_args)
        joined = _join(layout, new, b.rank, xp)
        pieces = [joined[d] for d in names]
        if traced:
            whole = [jax.ShapeDtypeStruct((sum(layout.counts[d]),), flats[d].dtype) for d in names]
            gathered = io_callback(gather, whole, *pieces, ordered=True)
        else:
            gathered = gather(*[np.asarray(p) for p in pieces])
        out: list[Any] = [None] * len(leaves)
        for d, vector in zip(names, gathered, strict=True):
            at = 0
            for i in layout.dtypes[d]:
                n = int(np.prod(layout.shapes[i], dtype=np.int64))
                out[i] = vector[at : at + n].reshape(layout.shapes[i])
                at += n
        updates = jax.tree_util.tree_unflatten(layout.treedef, out)
        return updates if traced else _on_device(updates), ShardedState(inner_state)

    return optax.GradientTransformationExtraArgs(init_fn, update_fn)


def _reduce_scatter(
    comm: Backend, vector: np.ndarray, counts: list[int], scale: float
) -> np.ndarray:
    """This rank's segment of the sum of every rank's `vector`, times `scale`. Half precision is
    summed and scaled in float32 and rounded once, as the unsharded optimizer's average is (a
    16-bit sum, or a 16-bit product with a rounded `1 / size`, rounds at every step)."""
    mine = np.empty(counts[comm.rank], vector.dtype)
    half = vector.dtype.name in ("float16", "bfloat16")
    wide = vector.astype(np.float32) if half else vector
    out = mine if wide is vector else np.empty(counts[comm.rank], wide.dtype)
    if comm.size == 1:
        out[...] = wide
    else:
        comm.reduce_scatter(np.ascontiguousarray(wide), out, counts, ReduceOp.SUM)
    if scale != 1.0:
        scale_in_place(out, scale)  # divides by the world size: the exact mean, rounded once
    if out is not mine:
        mine[...] = out
    return mine


def _allgather(comm: Backend, piece: np.ndarray, counts: list[int]) -> np.ndarray:
    whole = np.empty(sum(counts), piece.dtype)
    if comm.size == 1:
        whole[...] = piece
        return whole
    comm.allgather(np.ascontiguousarray(piece).view(np.uint8), whole.view(np.uint8))
    return whole


def _owners(
    state: ShardedState, params: optax.Params
) -> tuple[list[tuple[KeyPath, jax.Array]], list[int | None], PyTreeDef]:
    """The inner state's leaves by path, and for each the parameter (its index in tree order)
    that it is a slice or a whole flat copy of, or None.

    optax keeps per-parameter state in trees of the parameters' structure (`mu`, `nu`,
    `MaskedState`...), so such a leaf's path ends with its parameter's path; the longest such
    ending names it. Only flat (one-dimensional) leaves can be slices.
    """
    param_paths = [path for path, _ in jax.tree_util.tree_flatten_with_path(params)[0]]
    with_paths, treedef = jax.tree_util.tree_flatten_with_path(state.inner_state)
    owners: list[int | None] = []
    for path, leaf in with_paths:
        best: int | None = None
        if np.ndim(leaf) == 1:
            for i, p in enumerate(param_paths):
                ends = len(p) <= len(path) and tuple(path[len(path) - len(p) :]) == tuple(p)
                if ends and (best is None or len(p) > len(param_paths[best])):
                    best = i
        owners.append(best)
    return with_paths, owners, treedef


def _engine(backend: Backend | None, group: Group | None) -> Backend:
    chosen = backend_of(backend, group)
    return chosen if chosen is not None else world.current().backend


def slice_places(
    state: ShardedState,
    params: optax.Params,
    *,
    backend: Backend | None = None,
    group: Group | None = None,
) -> list[tuple[tuple[int, ...], int] | None]:
    """Where each leaf of this rank's `ShardedState` lies in its parameter: for every leaf of
    `state.inner_state`, in `jax.tree_util.tree_flatten_with_path` order, `(shape, start)` where
    the leaf is items `[start, start + leaf.size)` of the row-major order of its parameter, of
    `shape`; None where the leaf is not a slice (a step count: the same on every rank).

    What a checkpoint needs to write a sharded state as pieces of whole tensors, each rank its
    own (`dp.checkpoint.OptaxShards`), without gathering it. `params` gives the layout (the same
    tree as at `init`; shapes and dtypes are all that is read).

    Raises:
        ValueError: a leaf does not have the size of this rank's slice of its parameter (the
            state is from other parameters, or from another world size).
    """
    if not isinstance(state, ShardedState):
        raise ValueError(
            "slice_places expects the ShardedState of dp.DistributedOptimizer(tx, "
            f"shard_state=True), got {type(state).__module__}.{type(state).__qualname__}."
        )
    b = _engine(backend, group)
    layout, _ = _layout(params, b.size)
    with_paths, owners, _ = _owners(state, params)
    out: list[tuple[tuple[int, ...], int] | None] = []
    for (path, leaf), i in zip(with_paths, owners, strict=True):
        if i is None:
            out.append(None)
            continue
        _, at, n = layout.cut(i, b.rank)
        if np.shape(leaf) != (n,):
            raise ValueError(
                f"slice_places: state{jax.tree_util.keystr(path)} has shape "
                f"{list(np.shape(leaf))}, but this rank's slice of its parameter has {n} items "
                f"(rank {b.rank} of {b.size}): pass the parameters the state was made for, at "
                "this world size."
            )
        out.append((tuple(int(d) for d in layout.shapes[i]), at))
    return out


def consolidate_state(
    state: ShardedState,
    params: optax.Params,
    *,
    to: int = 0,
    backend: Backend | None = None,
    group: Group | None = None,
) -> ShardedState | None:
    """Gather a `ShardedState` whole on rank `to`, leaf by leaf (collective); None elsewhere.

    The result is a world of one's state: each per-parameter leaf holds all of its parameter's
    items, flat; `shard_state` cuts it again for any world size. `params` gives the layout (the
    same tree as at `init`).
    """
    b = _engine(backend, group)
    layout, _ = _layout(params, b.size)
    with_paths, owners, treedef = _owners(state, params)
    out = []
    for (path, leaf), i in zip(with_paths, owners, strict=True):
        if i is None:
            out.append(np.asarray(leaf))
            continue
        piece = np.ascontiguousarray(np.asarray(leaf))
        counts = [layout.cut(i, r)[2] for r in range(b.size)]
        if piece.shape != (counts[b.rank],):
            raise ValueError(
                f"consolidate_state: state{jax.tree_util.keystr(path)} has shape "
                f"{list(piece.shape)}, but this rank's slice of its parameter has "
                f"{counts[b.rank]} items: pass the parameters the state was made for."
            )
        whole = np.empty(layout.size(i), piece.dtype)
        if b.size == 1:
            whole[...] = piece
        else:
            width = piece.dtype.itemsize
            b.allgatherv(piece.view(np.uint8), whole.view(np.uint8), [n * width for n in counts])
        out.append(whole)
    if b.rank != to:
        return None
    return ShardedState(_on_device(jax.tree_util.tree_unflatten(treedef, out)))


def shard_state(
    state: ShardedState,
    params: optax.Params,
    *,
    backend: Backend | None = None,
    group: Group | None = None,
) -> ShardedState:
    """Keep this rank's slices of a consolidated `ShardedState` (saved at any world size).

    `params` gives the layout (the same tree as at `init`).

    Raises:
        ValueError: `state` is not a consolidated `ShardedState` over such parameters.
    """
    if not isinstance(state, ShardedState):
        raise ValueError(
            "shard_state expects the ShardedState from consolidate_state, got "
            f"{type(state).__module__}.{type(state).__qualname__}."
        )
    b = _engine(backend, group)
    layout, _ = _layout(params, b.size)
    with_paths, owners, treedef = _owners(state, params)
    flat = [path for path, leaf in with_paths if np.ndim(leaf) == 1]
    if flat and all(i is None for i in owners):
        raise ValueError(
            f"shard_state: no leaf of the state (such as state{jax.tree_util.keystr(flat[0])}) "
            "belongs to a parameter of this tree: this state is from other parameters (or from "
            "an older layout: consolidate it again)."
        )
    out = []
    for (path, leaf), i in zip(with_paths, owners, strict=True):
        if i is None:
            out.append(leaf)
            continue
        if np.shape(leaf) != (layout.size(i),):
            raise ValueError(
                f"shard_state: state{jax.tree_util.keystr(path)} has shape "
                f"{list(np.shape(leaf))}, but its parameter has {layout.size(i)} items: this "
                "state is from other parameters (or was not consolidated)."
            )
        _, at, n = layout.cut(i, b.rank)
        out.append(jax.device_put(np.asarray(leaf)[at : at + n]))  # cut on the host: no program
    return ShardedState(jax.tree_util.tree_unflatten(treedef, out))

"""`distributed_optax`: reduce gradients across ranks, then hand off to an optax transformation.

The optax face of `dp.DistributedOptimizer` (Lux's `DistributedOptimizer`, FluxMPI's
`DistributedOptimizer`): a wrapper transformation in the shape of `optax.apply_if_finite`, whose
state is a NamedTuple carrying the wrapped one's `inner_state`. Each `update` reduces the gradient
tree across ranks (averaging by default), then calls the wrapped transformation on the result:
eagerly through `dp.allreduce`, under `jax.jit` staged out by `_jit.py`.

Each update is a collective, so every rank must run the same updates in the same order, and
tracing one is collective too (the ranks agree on its signature then): the sharp bits of
docs/jax.md. The reductions of jitted steps run on a private duplicate of the backend, created
collectively when the first transformation is built, so a step still in flight never interleaves
with the collectives that the main thread makes meanwhile.

>>> import jax.numpy as jnp, optax, dataparallel as dp
>>> _ = dp.initialize()  # a world of one here
>>> opt = dp.DistributedOptimizer(optax.sgd(0.1))
>>> params = {"w": jnp.ones(2)}
>>> state = opt.init(params)
>>> updates, state = opt.update({"w": jnp.ones(2)}, state, params)
>>> optax.apply_updates(params, updates)["w"].tolist()
[0.8999999761581421, 0.8999999761581421]
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import NamedTuple, TypeVar

import numpy as np

try:
    import jax
    import optax
except ImportError as exc:  # pragma: no cover - exercised only without JAX
    raise ImportError(
        "dp.DistributedOptimizer for optax needs JAX and optax: pip install 'dataparallel[jax]'."
    ) from exc

from dataparallel import world
from dataparallel.arrays.actions import parse_op, validate_reduction
from dataparallel.arrays.compression import Compressing, PowerSGDCompressor, wire_dtype
from dataparallel.backends.base import Backend
from dataparallel.collectives import reductions
from dataparallel.groups import Group, backend_of
from dataparallel.jax import _jit
from dataparallel.jax._bridges import Bridge
from dataparallel.jax._powersgd import (
    LowRankLayout,
    Payload,
    PowerSGDState,
    agree,
    init_low_rank,
    low_rank_step,
)
from dataparallel.types import Op

__all__ = ["DistributedState", "PowerSGDState", "callback_backend", "distributed_optax"]

Tree = TypeVar("Tree")  # a tree of arrays; a reduction gives one of the same structure


class DistributedState(NamedTuple):
    """State of `distributed_optax`: the wrapped transformation's state, unchanged."""

    inner_state: optax.OptState


def distributed_optax(
    inner: optax.GradientTransformation,
    *,
    op: Op = "avg",
    backend: Backend | None = None,
    group: Group | None = None,
    compression: Compressing = None,
    route: Bridge = "auto",
) -> optax.GradientTransformationExtraArgs:
    """Wrap `inner` so that its updates see gradients reduced across all ranks.

    Usually reached through `dp.DistributedOptimizer(inner)`. With more than one MPI rank,
    building the transformation is collective when the world is initialized (see the module's
    sharp bits): every rank must build it.

    Args:
        inner: the optax transformation to hand the reduced gradients to.
        op: `"avg"` (default: Lux, Flashlight, Horovod), `"sum"` (FluxMPI, whose users scale the
            loss by `1 / size()` themselves), or `"prod"`, `"min"`, `"max"`.
        backend: the engine to reduce on (default: the active one, looked up at each update).
        group: reduce among the ranks of this `dp.new_group` group (default: the world).
        compression: `dp.Compression.fp16` or `.bf16`: floating gradients travel as 16-bit
            floats and come back in their dtype (default: none). `dp.Compression.powersgd(...)`
            (with `op="avg"` or `"sum"`): gradients viewed as matrices travel as low-rank
            factors, with error feedback and warm start; the state is then a `PowerSGDState`
            carrying the bases and this rank's residuals (`_powersgd.py`, docs/compression.md).
        route: the bridge by which a jitted update reaches the engine (docs/jax.md):
            `"auto"` (default) takes mpi4jax's custom call where it is installed and the engine
            is MPI on the CPU, else dataparallel's XLA FFI call where JAX runs on one CPU device
            per process, else one ordered host callback; `"mpi4jax"`, `"ffi"` or `"callback"`
            choose.

    Returns:
        An `optax.GradientTransformationExtraArgs`: `init(params)` returns a `DistributedState`
        (a `PowerSGDState` with `dp.Compression.powersgd`),
        `update(updates, state, params=None, **extra_args)` reduces `updates` and returns the
        inner transformation's updates with the new `DistributedState`. Both work eagerly and
        inside `jax.jit`.

    Raises:
        ValueError: `op` is not a reduction, or not `"avg"` or `"sum"` with PowerSGD.
        TypeError: (at `update`) `op="avg"` meets an integer or bool gradient; the message names
            its path (`grads['fc1']['w']`).

    >>> import jax, jax.numpy as jnp, optax, dataparallel as dp
    >>> _ = dp.initialize()
    >>> opt = distributed_optax(optax.adam(1e-3))
    >>> params = {"w": jnp.zeros(3)}
    >>> state = opt.init(params)
    >>> @jax.jit
    ... def step(params, state):
    ...     grads = jax.grad(lambda p: jnp.sum((p["w"] - 1.0) ** 2))(params)
    ...     updates, state = opt.update(grads, state, params)
    ...     return optax.apply_updates(params, updates), state
    >>> params, state = step(params, state)
    >>> type(state).__name__, [round(float(w), 4) for w in params["w"]]
    ('DistributedState', [0.001, 0.001, 0.001])
    """
    parse_op(op)
    if route not in ("auto", "callback", "ffi", "mpi4jax"):
        raise ValueError(f"route={route!r}: use 'auto', 'ffi', 'callback' or 'mpi4jax'.")
    low_rank = compression if isinstance(compression, PowerSGDCompressor) else None
    if low_rank is None:
        wire_dtype(compression)  # a bad one raises here, not at the first update
    elif op not in ("avg", "sum"):
        raise ValueError(
            f"compression=dp.Compression.powersgd(...) approximates an average or a sum of the "
            f"ranks' gradients: op={op!r} is neither; use op='avg' (default) or op='sum'."
        )
    backend = backend_of(backend, group)
    inner = optax.with_extra_args_support(inner)
    if world.initialized():
        callback_backend(backend)  # collective: create the private communicator now, everywhere
    if low_rank is not None:
        return _low_rank_optax(inner, low_rank, op, backend, route)

    def init_fn(params: optax.Params) -> DistributedState:
        return DistributedState(inner_state=inner.init(params))

    def update_fn(
        updates: optax.Updates,
        state: optax.OptState,
        params: optax.Params | None = None,
        **extra_args: object,  # optax's: whatever the inner transformation takes
    ) -> tuple[optax.Updates, DistributedState]:
        if not isinstance(state, DistributedState):
            raise TypeError(
                "update expected the DistributedState made by this transformation's init, got "
                f"{type(state).__module__}.{type(state).__qualname__}: pass the state returned by "
                "the distributed transformation's init (or update), not the inner one's."
            )
        reduced = _allreduce_tree(updates, op, backend, compression, route)
        new_updates, inner_state = inner.update(reduced, state.inner_state, params, **extra_args)
        return new_updates, DistributedState(inner_state=inner_state)

    return optax.GradientTransformationExtraArgs(init_fn, update_fn)


def _low_rank_optax(
    inner: optax.GradientTransformationExtraArgs,
    config: PowerSGDCompressor,
    op: Op,
    backend: Backend | None,
    route: Bridge,
) -> optax.GradientTransformationExtraArgs:
    """`distributed_optax` with PowerSGD: its gradients reduced by `low_rank_step`."""
    agreed: list[LowRankLayout] = []  # the layouts agreed eagerly (once each)

    def engine() -> Backend:
        return backend if backend is not None else world.current().backend

    def init_fn(params: optax.Params) -> PowerSGDState:
        rank = engine().rank if world.initialized() else 0
        return init_low_rank(inner.init(params), params, config, rank)

    def update_fn(
        updates: optax.Updates,
        state: optax.OptState,
        params: optax.Params | None = None,
        **extra_args: object,
    ) -> tuple[optax.Updates, PowerSGDState]:
        if not isinstance(state, PowerSGDState):
            raise TypeError(
                "update expected the PowerSGDState made by this transformation's init, got "
                f"{type(state).__module__}.{type(state).__qualname__}: pass the state returned "
                "by the distributed transformation's init (or update), not the inner one's."
            )
        leaves, treedef = jax.tree_util.tree_flatten(updates)
        layout = LowRankLayout.of(leaves, config)
        here = engine()
        traced = any(isinstance(x, jax.core.Tracer) for x in (*leaves, state.iteration))
        if traced or layout not in agreed:  # once eagerly, at every trace under jit
            agree(here, config, layout)
            if not traced:
                agreed.append(layout)

        def reduce(tree: Payload) -> Payload:
            # The Qs' reduction is the step's second: ranks that join answer the first only.
            return _allreduce_tree(tree, op, backend, None, route, first="Q" not in tree)

        scale = here.size if op == "avg" else 1
        reduced, low = low_rank_step(leaves, state, config, layout, reduce, scale, here.rank)
        grads = jax.tree_util.tree_unflatten(treedef, reduced)
        new_updates, inner_state = inner.update(grads, state.inner_state, params, **extra_args)
        return new_updates, low._replace(inner_state=inner_state)

    return optax.GradientTransformationExtraArgs(init_fn, update_fn)


def _allreduce_tree(
    grads: Tree,
    op: Op,
    backend: Backend | None,
    compression: Compressing,
    bridge: Bridge,
    *,
    first: bool = True,
) -> Tree:
    """Reduce every leaf of `grads` across ranks, eagerly or through an ordered host callback
    (`first`: whether it is the jitted step's first reduction, `_jit.allreduce_traced`)."""
    with_paths, treedef = jax.tree_util.tree_flatten_with_path(grads)
    if not with_paths:
        return grads
    for key, leaf in with_paths:
        validate_reduction(_dtype(leaf), op, None, "grads" + jax.tree_util.keystr(key))
    leaves = original = [leaf for _, leaf in with_paths]
    reduced: Sequence[jax.typing.ArrayLike]
    if any(isinstance(leaf, jax.core.Tracer) for leaf in leaves):
        paths = [("grads" + jax.tree_util.keystr(key), leaf) for key, leaf in with_paths]
        reduced = _jit.reduce_tree_traced(
            paths, str(treedef), op, backend, compression, bridge, first=first
        )
    else:
        # NumPy leaves are copied first: the collectives write them in place, optax never does.
        leaves = [np.array(x) if isinstance(x, np.ndarray) else x for x in leaves]
        # float16 is summed and averaged in float32 and rounded once, as under jit (an engine's
        # own 16-bit sum rounds at every step: several units in the last place at 3 ranks).
        halves = [
            compression is None and op in ("avg", "sum") and _dtype(x) == "float16" for x in leaves
        ]
        leaves = [
            np.asarray(x, np.float32) if h else x for x, h in zip(leaves, halves, strict=True)
        ]
        reduced = reductions.allreduce(leaves, op=op, backend=backend, compression=compression)
        reduced = [
            _narrow(r, x) if h else r for x, r, h in zip(original, reduced, halves, strict=True)
        ]
    return jax.tree_util.tree_unflatten(treedef, reduced)


def _narrow(wide: jax.typing.ArrayLike, leaf: object) -> np.ndarray | jax.Array:
    """`wide` back in float16, a NumPy array if `leaf` was one, else a JAX array."""
    if isinstance(leaf, np.ndarray):
        return np.asarray(wide).astype(np.float16)
    return jax.numpy.asarray(wide, jax.numpy.float16)


def _dtype(leaf: jax.typing.ArrayLike) -> str:
    return str(np.dtype(jax.numpy.result_type(leaf)))


def callback_backend(backend: Backend | None) -> Backend:
    """Return the backend the host callbacks reduce on, duplicating `backend` the first time.

    Collective the first time for a backend of several ranks (`Backend.duplicate`).
    """
    active = world.current()
    return active.private(backend if backend is not None else active.backend)

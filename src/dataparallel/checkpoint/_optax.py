"""`OptaxShards`: optax's sharded state (`shard_state=True`) in a checkpoint, each rank its slices.

`dp.DistributedOptimizer(tx, shard_state=True)` keeps on each rank a flat slice of every
parameter's state (`mu`, `nu`): items `[start, stop)` of the parameter's row-major order, as a
ZeRO optimizer's slices are. A checkpoint writes each slice as `Shards.from_flat` of a tensor of
the parameter's shape, so the saved tensor is the whole state of that parameter (`mu/w` of `w`'s
shape) and loading cuts it again for the layout of the loading world, whatever its size. The
other leaves (the step count) are the same on every rank and are written once.

The slices' places come from `dp.jax.slice_places`, which needs the parameters' tree (the layout
is per dtype, in tree order): hence the pairing of the state with its parameters. JAX arrays are
immutable: loading reads into host buffers and builds a new `ShardedState` from them, which
replaces the `OptaxShards` in the state (as JAX arrays are replaced).
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from typing import TYPE_CHECKING

import numpy as np
import torch

from dataparallel import world
from dataparallel.checkpoint._shards import Shards

if TYPE_CHECKING:
    import jax
    import optax

    from dataparallel.groups import Group
    from dataparallel.jax import ShardedState

__all__ = ["OptaxShards", "host_numpy", "host_tensor", "is_sharded_optax_state"]


def is_sharded_optax_state(value: object) -> bool:
    """A bare `dp.jax.ShardedState`, which a checkpoint cannot write without its parameters."""
    cls = type(value)
    return cls.__name__ == "ShardedState" and cls.__module__.startswith("dataparallel.jax")


def host_tensor(array: jax.typing.ArrayLike) -> torch.Tensor:
    """A writable CPU tensor over a copy of `array` (NumPy or JAX), bfloat16 included (torch
    cannot take NumPy's bfloat16: it crosses as its bits)."""
    data = np.array(array)  # a copy: JAX's host arrays are read-only
    if data.dtype.name == "bfloat16":
        return torch.from_numpy(data.view(np.uint16)).view(torch.bfloat16)
    return torch.from_numpy(data)


def host_numpy(tensor: torch.Tensor, like: jax.Array) -> np.ndarray:
    """The tensor's items as a NumPy array of the dtype of `like` (a JAX array)."""
    dtype = np.dtype(like.dtype)
    if dtype.name == "bfloat16":
        return tensor.view(torch.uint16).numpy().view(dtype)
    return tensor.numpy().astype(dtype, copy=False)


class OptaxShards:
    """A sharded optax state and the parameters that lay it out, for `dp.checkpoint`.

    Put it in a checkpoint's state where the `dp.jax.ShardedState` would stand: every rank
    writes its own slices of each parameter's state, as pieces of a tensor of the parameter's
    shape; the step count is written once. To load, give the state of `opt.init(params)` made
    at the loading world size (any): the entry is replaced, in the dict given and the one
    returned, by the loaded `ShardedState`.

    >>> import jax.numpy as jnp, optax, tempfile, dataparallel as dp
    >>> _ = dp.initialize()
    >>> opt = dp.DistributedOptimizer(optax.adam(0.1), shard_state=True)
    >>> params = {"w": jnp.ones((2, 3))}
    >>> state = opt.init(params)
    >>> _, state = opt.update({"w": jnp.ones((2, 3))}, state, params)
    >>> folder = tempfile.mkdtemp()
    >>> dp.checkpoint.save({"opt": dp.checkpoint.OptaxShards(state, params)}, folder)
    >>> fresh = {"opt": dp.checkpoint.OptaxShards(opt.init(params), params)}
    >>> int(dp.checkpoint.load(fresh, folder)["opt"].inner_state[0].count)
    1

    Args:
        state: the `ShardedState` of `dp.DistributedOptimizer(tx, shard_state=True)`.
        params: the parameters' tree it was made for (shapes and dtypes are all that is read).
        group: the `dp.new_group` group it is sharded over, if not the world; it must hold every
            rank of the world (a checkpoint's pieces cover each tensor once across the world).
    """

    def __init__(
        self, state: ShardedState, params: optax.Params, *, group: Group | None = None
    ) -> None:
        if not is_sharded_optax_state(state):
            raise TypeError(
                "dp.checkpoint.OptaxShards takes the ShardedState of "
                "dp.DistributedOptimizer(tx, shard_state=True), got "
                f"{type(state).__module__}.{type(state).__qualname__}; save any other optax "
                "state as it is."
            )
        self.state = state
        self.params = params
        self.group = group

    def _leaves(self) -> list[tuple[str, jax.Array, tuple[tuple[int, ...], int] | None]]:
        """(key, leaf, place) for every leaf of the inner state; place as `slice_places`'."""
        import jax

        from dataparallel.jax import slice_places

        if self.group is not None and len(self.group.ranks) != world.current().backend.size:
            raise ValueError(
                f"dp.checkpoint.OptaxShards: the state is sharded over a group of "
                f"{len(self.group.ranks)} ranks, the world has {world.current().backend.size}: "
                "every rank writes its pieces, so the group must be the world. Save "
                "dp.jax.consolidate_state(state, params, group=group) instead."
            )
        places = slice_places(self.state, self.params, group=self.group)
        out = []
        seen: set[str] = set()
        with_paths = jax.tree_util.tree_flatten_with_path(self.state.inner_state)[0]
        for (path, leaf), place in zip(with_paths, places, strict=True):
            key = jax.tree_util.keystr(path, simple=True, separator="/") or "state"
            if key in seen:
                raise ValueError(
                    f"dp.checkpoint.OptaxShards: two leaves of the optax state are both named "
                    f"{key!r} (keys that print alike); rename one of the parameters."
                )
            seen.add(key)
            out.append((key, leaf, place))
        return out

    def saved(self) -> dict[str, torch.Tensor | Shards]:
        """What to write: `Shards` of each slice, tensors of the rest."""
        out: dict[str, torch.Tensor | Shards] = {}
        for key, leaf, place in self._leaves():
            tensor = host_tensor(leaf)
            if place is None:
                out[key] = tensor
            elif math.prod(place[0]) == 0:  # a parameter of no item: its empty state, whole
                out[key] = tensor.reshape(place[0])
            else:
                out[key] = Shards.from_flat(place[0], place[1], tensor)
        return out

    def template(self) -> dict[str, torch.Tensor | Shards]:
        """What to fill: host buffers of this rank's slices (as `Shards`) and of the rest."""
        out: dict[str, torch.Tensor | Shards] = {}
        self._buffers: dict[str, torch.Tensor] = {}
        for key, leaf, place in self._leaves():
            buffer = host_tensor(np.zeros(np.shape(leaf), np.dtype(leaf.dtype)))
            self._buffers[key] = buffer
            if place is None:
                out[key] = buffer
            elif math.prod(place[0]) == 0:
                out[key] = buffer.reshape(place[0])
            else:
                out[key] = Shards.from_flat(place[0], place[1], buffer)
        return out

    def loaded(self, filled: Mapping[str, torch.Tensor | Shards]) -> ShardedState:
        """The `ShardedState` of what `template()`'s buffers were filled with (`filled`: the
        template after reading, whose tensors may have been replaced rather than filled)."""
        import jax

        leaves = []
        for key, leaf, _ in self._leaves():
            value = filled[key]
            tensor = self._buffers[key] if isinstance(value, Shards) else value
            # device_put copies, as jnp.asarray would, without compiling a program per shape
            leaves.append(jax.device_put(host_numpy(tensor.reshape(np.shape(leaf)), leaf)))
        treedef = jax.tree_util.tree_structure(self.state.inner_state)
        return type(self.state)(jax.tree_util.tree_unflatten(treedef, leaves))

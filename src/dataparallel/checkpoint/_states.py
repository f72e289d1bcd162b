"""What a checkpoint writes for each thing in a state, and how each is put back.

A state is a dict (nested dicts allowed) of: torch modules, optimizers (plain,
`dp.DistributedOptimizer`'s, and `dp.torch.ZeroRedundancyOptimizer`, whose shards stay where
they are), objects with `state_dict()` and `load_state_dict()` (samplers, schedulers: torch
DCP's `Stateful`), `Shards`, tensors, NumPy and JAX arrays, and picklable values (the step).

`saveable` turns it into a state dict in torch's own layout, the one
`torch.distributed.checkpoint.state_dict.get_state_dict` gives for a model and its optimizer: a
module's `state_dict()`; an optimizer's state keyed by its parameters' names (their names in the
modules of the same state) with `param_groups` naming them too. So a plain torch program reads a
checkpoint's model and optimizer with `get_state_dict` + `torch.distributed.checkpoint.load`, and
a checkpoint it writes so loads here. A ZeRO optimizer's element-wise state (`exp_avg`) is its
`Shards`, each rank's flat slices cut into boxes of the parameter's shape (`Shards.from_flat`);
its other values (`step`) are written once. A module under `dp.torch.fully_shard` (ZeRO-3), known
by its `parameter_shards()`, gives each parameter as this rank's rows (`Shards`), and so does
any optimizer over such parameters for its state of their shape.

`Loading` works the other way: it builds the state dict to fill (`template`) from the
checkpoint's metadata and the objects as they are laid out now, at this world size: modules fill
their own tensors in place, a ZeRO optimizer's `Shards` are this rank's slices of today's layout,
and a fresh optimizer, which has no state yet, gets tensors of the saved sizes and dtypes. After
torch's reader has filled it, `install` hands each object its part (`load_state_dict`), and
returns the state with the values that are not filled in place (numbers, JAX arrays) replaced.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping, MutableMapping
from typing import TYPE_CHECKING, Any, Protocol, TypeGuard

import numpy as np
import torch
from torch.distributed.checkpoint.metadata import (
    BytesStorageMetadata,
    Metadata,
    TensorStorageMetadata,
)

from dataparallel.checkpoint._optax import (
    OptaxShards,
    host_numpy,
    host_tensor,
    is_sharded_optax_state,
)
from dataparallel.checkpoint._shards import Shards

if TYPE_CHECKING:
    import jax

    from dataparallel.torch import ZeroRedundancyOptimizer

__all__ = ["Loading", "saveable", "stepped_storages"]

Path = tuple[str | int, ...]
Saved = TensorStorageMetadata | BytesStorageMetadata  # what the metadata says of an entry
Nested = dict[str | int, Any]  # a state dict built from saved paths: dicts down to tensors


class Stateful(Protocol):
    """What has its own state dict (torch DCP's `Stateful`: samplers, schedulers)."""

    def state_dict(self) -> Mapping[str, object]: ...

    def load_state_dict(self, state_dict: dict[str, object], /) -> None: ...


def _is_zero(value: object) -> TypeGuard[ZeroRedundancyOptimizer]:
    """A ZeRO optimizer (`dp.torch.ZeroRedundancyOptimizer`), known by its local state."""
    return hasattr(value, "local_state_dict") and hasattr(value, "load_local_state_dict")


def _is_stateful(value: object) -> TypeGuard[Stateful]:
    return callable(getattr(value, "state_dict", None)) and callable(
        getattr(value, "load_state_dict", None)
    )


def _is_jax(value: object) -> TypeGuard[jax.Array]:
    return type(value).__module__.startswith(("jax", "jaxlib")) and hasattr(value, "shape")


def _modules(state: Mapping[str, object], path: str = "") -> list[tuple[str, torch.nn.Module]]:
    out = []
    for key, value in state.items():
        if isinstance(value, torch.nn.Module):
            out.append((f"{path}{key}", value))
        elif isinstance(value, Mapping):
            out += _modules(value, f"{path}{key}.")
    return out


def param_names(state: Mapping[str, object]) -> dict[int, str]:
    """Each parameter's name (by `id`), as its module's `state_dict()` names it: with one module
    in the state, its own names (torch's `get_state_dict`'s); with several, each prefixed by the
    module's key in the state, so that they cannot collide."""
    modules = _modules(state)
    names: dict[int, str] = {}
    for key, module in modules:
        for name, tensor in module.state_dict(keep_vars=True).items():
            if isinstance(tensor, torch.Tensor):
                names.setdefault(id(tensor), name if len(modules) == 1 else f"{key}.{name}")
    return names


Placed = dict[int, tuple[tuple[int, ...], tuple[int, ...]]]


def placements(state: Mapping[str, object]) -> Placed:
    """Where each fully sharded parameter (`dp.torch.fully_shard`'s, by `id`) sits: the whole
    parameter's shape and this rank's offsets in it, from its module's `parameter_shards()`."""
    out: Placed = {}
    for _, module in _modules(state):
        shards = getattr(module, "parameter_shards", None)
        if callable(shards):
            for info in shards().values():
                out[id(info.param)] = (tuple(info.shape), tuple(info.offsets))
    return out


def _shards_of(tensor: torch.Tensor, shape: tuple[int, ...], offsets: tuple[int, ...]) -> Shards:
    """A shard of rows as `Shards` (none where this rank holds no row)."""
    pieces = ((offsets, tensor),) if tensor.numel() else ()
    return Shards(shape, tensor.dtype, pieces)


def _module_state(module: torch.nn.Module) -> dict[str, object]:
    """A module's `state_dict()`, its fully sharded parameters as `Shards` (views of them)."""
    sd = module.state_dict()
    shards = getattr(module, "parameter_shards", None)
    if callable(shards):
        for name, info in shards().items():
            if name in sd:
                sd[name] = _shards_of(info.param.detach(), tuple(info.shape), tuple(info.offsets))
    return sd


def _params(optimizer: torch.optim.Optimizer) -> list[torch.Tensor]:
    return [p for group in optimizer.param_groups for p in group["params"]]


def _fqns(optimizer: torch.optim.Optimizer, names: dict[int, str]) -> list[str]:
    """The names of an optimizer's parameters, in order (a parameter that no module of the
    state holds is named by its index, as a plain `state_dict()` names it)."""
    return [names.get(id(p), str(i)) for i, p in enumerate(_params(optimizer))]


def _groups(groups: list[dict[str, Any]], fqns: list[str]) -> list[dict[str, object]]:
    """Param groups with `params` as names (they come as indices)."""
    return [{**g, "params": [fqns[i] for i in g["params"]]} for g in groups]


def _optimizer_state(
    optimizer: torch.optim.Optimizer, names: dict[int, str], placed: Placed
) -> dict[str, object]:
    fqns = _fqns(optimizer, names)
    params = _params(optimizer)
    sd = optimizer.state_dict()
    out = dict(sd)
    out["state"] = {}
    for i, entry in sd["state"].items():
        p = params[int(i)]
        where = placed.get(id(p))
        mine = dict(entry)
        if where is not None:  # a fully sharded parameter: its state of its shard's shape too
            for key, value in entry.items():
                if isinstance(value, torch.Tensor) and value.dim() and value.shape == p.shape:
                    mine[key] = _shards_of(value, *where)
        out["state"][fqns[int(i)]] = mine
    out["param_groups"] = _groups(sd["param_groups"], fqns)
    return out


def _sliced(value: object, start: int, stop: int) -> TypeGuard[torch.Tensor]:
    return isinstance(value, torch.Tensor) and value.dim() == 1 and value.numel() == stop - start


def _zero_state(zero: ZeroRedundancyOptimizer, names: dict[int, str]) -> dict[str, object]:
    fqns = _fqns(zero, names)
    local = zero.local_state_dict()
    state: dict[str, dict[str, object]] = {}
    for k, start, stop, entry in local["pieces"]:
        shape = local["shapes"][k]
        out = state.setdefault(fqns[k], {})
        for key, value in entry.items():
            if _sliced(value, start, stop) and int(np.prod(shape)) > 0:
                out[key] = Shards.from_flat(shape, start, value)
            elif _sliced(value, start, stop):  # a parameter of no item: its empty state, whole
                out[key] = value.reshape(shape)
            else:
                out[key] = value
    return {"state": state, "param_groups": _groups(local["param_groups"], fqns)}


def _bare(value: object) -> TypeError:
    return TypeError(
        "dp.checkpoint: a sharded optax state (dp.jax.ShardedState) is each rank's slices and "
        "is laid out by its parameters: put dp.checkpoint.OptaxShards(state, params) in the "
        "checkpoint's state in its place."
    )


def _value(value: object, names: dict[int, str], placed: Placed) -> object:
    if isinstance(value, Shards | torch.Tensor):
        return value
    if isinstance(value, OptaxShards):
        return value.saved()
    if is_sharded_optax_state(value):
        raise _bare(value)
    if isinstance(value, torch.nn.Module):
        return _module_state(value)
    if _is_zero(value):
        return _zero_state(value, names)
    if isinstance(value, torch.optim.Optimizer):
        return _optimizer_state(value, names, placed)
    if _is_stateful(value):
        return _tree(value.state_dict(), names, placed)
    if isinstance(value, np.ndarray):
        return torch.from_numpy(np.ascontiguousarray(value))
    if _is_jax(value):
        return host_tensor(value)
    if isinstance(value, Mapping):
        return _tree(value, names, placed)
    return value


def _tree(state: Mapping[str, object], names: dict[int, str], placed: Placed) -> dict[str, object]:
    return {str(key): _value(value, names, placed) for key, value in state.items()}


def saveable(state: Mapping[str, object]) -> dict[str, object]:
    """The state dict to write for `state` (see the module's notes); tensors are the live ones."""
    if not isinstance(state, Mapping):
        raise TypeError(
            "dp.checkpoint: the state is a dict of what to save ({'model': model, "
            f"'optimizer': optimizer, 'step': step}}), got {type(state).__name__}."
        )
    return _tree(state, param_names(state), placements(state))


def _storages(tensors: Iterable[object]) -> set[int]:
    out = set()
    for t in tensors:
        if isinstance(t, torch.Tensor) and t.numel():
            out.add(t.untyped_storage().data_ptr())
    return out


def stepped_storages(state: Mapping[str, object]) -> set[int]:
    """The memory (storages, by address) of what changes only in a step of an optimizer of the
    state: its parameters and its state. `async_save` copies these on its thread, and the next
    `step()` of any torch optimizer waits for the copy first."""
    out: set[int] = set()

    def visit(tree: Mapping[str, object]) -> None:
        for value in tree.values():
            if _is_zero(value):
                out.update(_storages(_params(value)))
                for _, _, _, entry in value.local_state_dict()["pieces"]:
                    out.update(_storages(entry.values()))
            elif isinstance(value, torch.optim.Optimizer):
                out.update(_storages(_params(value)))
                for entry in value.state.values():
                    out.update(_storages(entry.values()))
            elif isinstance(value, Mapping):
                visit(value)

    visit(state)
    return out


class Loading:
    """One load: the state dict to fill from a checkpoint, then each object given its part."""

    def __init__(self, state: Mapping[str, object], metadata: Metadata) -> None:
        if not isinstance(state, Mapping):
            raise TypeError(
                "dp.checkpoint.load: the state is a dict of what to load into ({'model': "
                f"model, ...}}), as given to save, got {type(state).__name__}."
            )
        self.state = state
        self.names = param_names(state)
        self.placed = placements(state)
        # every saved entry by its path in the nested state dict (torch's flattening keeps it)
        planner_data = metadata.planner_data or {}
        self.saved: dict[Path, Saved] = {
            tuple(planner_data.get(key, (key,))): md
            for key, md in metadata.state_dict_metadata.items()
        }
        # a ZeRO optimizer's flat slices, which its `Shards` view: (id, name, key) -> slice
        self.flats: dict[tuple[int, str, str], torch.Tensor] = {}
        self.template = self._tree(state, ())

    # -- what to fill ---------------------------------------------------------------------------

    def _under(self, prefix: Path) -> dict[Path, Saved]:
        """The saved entries below `prefix`, by their paths relative to it."""
        n = len(prefix)
        return {path[n:]: md for path, md in self.saved.items() if path[:n] == prefix}

    def _missing(self, prefix: Path, what: str) -> KeyError:
        key = ".".join(map(str, prefix))
        return KeyError(
            f"dp.checkpoint.load: the checkpoint holds nothing under {key!r} ({what}); it holds "
            f"{sorted({str(p[0]) for p in self.saved})} at its top. Load into a state with the "
            "keys it was saved with."
        )

    def _from_metadata(self, prefix: Path, what: str) -> dict[str, Any]:
        """A nested dict of everything saved below `prefix`: empty tensors of the saved sizes
        and dtypes, None for the values written whole (filled by the reader)."""
        entries = self._under(prefix)
        if not entries:
            raise self._missing(prefix, what)
        out: Nested = {}
        for path, md in entries.items():
            _put(out, path, _empty(md))
        return _lists(out)

    def _optimizer(self, value: torch.optim.Optimizer, prefix: Path) -> dict[str, Any]:
        part = self._from_metadata(prefix, type(value).__name__)
        # a fully sharded parameter's state: this rank's rows of what was saved
        for p, name in zip(_params(value), _fqns(value, self.names), strict=True):
            where = self.placed.get(id(p))
            entry = part.get("state", {}).get(name)
            if where is None or not isinstance(entry, dict):
                continue
            for key, saved in entry.items():
                if isinstance(saved, torch.Tensor) and saved.dim() and saved.shape == where[0]:
                    mine = torch.empty(p.shape, dtype=saved.dtype, device=p.device)
                    entry[key] = _shards_of(mine, *where)
        return part

    def _zero(self, zero: ZeroRedundancyOptimizer, prefix: Path) -> dict[str, object]:
        fqns = _fqns(zero, self.names)
        local = zero.local_state_dict()
        entries = self._under(prefix)
        if not entries:
            raise self._missing(prefix, type(zero).__name__)
        params = _params(zero)
        device = params[0].device if params else torch.device("cpu")  # its state's, too
        state: dict[str, dict[str, object]] = {}
        for k, start, stop, _ in local["pieces"]:
            shape = tuple(local["shapes"][k])
            out = state.setdefault(fqns[k], {})
            for path, md in entries.items():
                if len(path) != 3 or path[:2] != ("state", fqns[k]):
                    continue
                key = str(path[2])
                if isinstance(md, TensorStorageMetadata) and tuple(md.size) == shape and shape:
                    flat = torch.empty(stop - start, dtype=md.properties.dtype, device=device)
                    self.flats[id(zero), fqns[k], key] = flat
                    if int(np.prod(shape)) > 0:
                        out[key] = Shards.from_flat(shape, start, flat)
                    else:
                        out[key] = flat.reshape(shape)
                else:
                    out[key] = _empty(md)
        groups: Nested = {}
        for path, md in entries.items():
            if path and path[0] == "param_groups":
                _put(groups, path[1:], _empty(md))
        return {"state": state, "param_groups": _lists(groups)}

    def _value(self, value: object, prefix: Path) -> object:
        if isinstance(value, Shards | torch.Tensor):
            return value
        if isinstance(value, OptaxShards):
            if not self._under(prefix):
                raise self._missing(prefix, "OptaxShards")
            return value.template()
        if is_sharded_optax_state(value):
            raise _bare(value)
        if isinstance(value, torch.nn.Module):
            return _module_state(value)
        if _is_zero(value):
            return self._zero(value, prefix)
        if isinstance(value, torch.optim.Optimizer):
            return self._optimizer(value, prefix)
        if _is_stateful(value):
            part = self._from_metadata(prefix, type(value).__name__)
            _overlay_shards(part, value.state_dict())  # its own boxes, filled in place
            return part
        if isinstance(value, np.ndarray):
            return (
                torch.from_numpy(value) if value.flags.writeable else torch.from_numpy(value.copy())
            )
        if _is_jax(value):
            return host_tensor(value)
        if isinstance(value, Mapping):
            return self._tree(value, prefix)
        return value

    def _tree(self, state: Mapping[str, object], prefix: Path) -> dict[str, object]:
        return {str(k): self._value(v, (*prefix, str(k))) for k, v in state.items()}

    # -- each object given its part -------------------------------------------------------------

    def install(self) -> Mapping[str, object]:
        """Hand every object its loaded part; return the state, its values replaced where they
        cannot be filled in place (the given dicts are updated too)."""
        return self._install(self.state, self.template)

    def _install(
        self, state: Mapping[str, object], filled: Mapping[str, Any]
    ) -> Mapping[str, object]:
        out = state if isinstance(state, MutableMapping) else dict(state)
        for key, value in state.items():
            part = filled[str(key)]
            if isinstance(value, torch.nn.Module):
                if not callable(getattr(value, "parameter_shards", None)):
                    value.load_state_dict(part)  # (a fully sharded one is filled in place)
            elif isinstance(value, OptaxShards):
                value.state = value.loaded(part)
                out[key] = value.state
            elif _is_zero(value):
                self._load_zero(value, part)
            elif isinstance(value, torch.optim.Optimizer):
                _load_optimizer(value, part, self.names)
            elif _is_stateful(value):
                value.load_state_dict(part)
            elif isinstance(value, np.ndarray):
                if not value.flags.writeable:
                    out[key] = part.numpy()
            elif _is_jax(value):
                import jax

                out[key] = jax.device_put(host_numpy(part, value))  # a copy, no program compiled
            elif isinstance(value, Mapping):
                out[key] = self._install(value, part)
            elif not isinstance(value, Shards | torch.Tensor):
                out[key] = part
        return out

    def _load_zero(self, zero: ZeroRedundancyOptimizer, part: Mapping[str, Any]) -> None:
        fqns = _indices(part, zero, self.names)
        states = []
        for k, _, _, _ in zero.local_state_dict()["pieces"]:
            entry = part["state"].get(fqns[k], {})
            mine: dict[str, object] = {}
            for key, value in entry.items():
                flat = self.flats.get((id(zero), fqns[k], key))
                if flat is not None:
                    mine[key] = flat
                elif isinstance(value, torch.Tensor):
                    mine[key] = value.clone()  # each piece steps its own (`step`)
                else:
                    mine[key] = value
            states.append(mine)
        zero.load_local_state_dict(states, part["param_groups"])


def _overlay_shards(part: dict[str, Any], current: Mapping[str, object]) -> None:
    """Put in `part` the `Shards` that `current` (an object's `state_dict()` now) holds at the
    same places: each rank reads its own boxes, not the whole tensor."""
    for key, value in current.items():
        if isinstance(value, Shards) and key in part:
            part[key] = value
        elif isinstance(value, Mapping) and isinstance(part.get(key), dict):
            _overlay_shards(part[key], value)


def _empty(md: Saved) -> torch.Tensor | None:
    if isinstance(md, TensorStorageMetadata):
        return torch.empty(md.size, dtype=md.properties.dtype)
    assert isinstance(md, BytesStorageMetadata)
    return None


def _put(tree: Nested, path: Path, value: torch.Tensor | None) -> None:
    for key in path[:-1]:
        tree = tree.setdefault(key, {})
    tree[path[-1]] = value


def _lists(tree: object) -> Any:
    """Dicts keyed 0..n-1 by ints (a saved list: `param_groups`) back into lists."""
    if not isinstance(tree, dict):
        return tree
    out = {k: _lists(v) for k, v in tree.items()}
    if out and all(isinstance(k, int) for k in out) and sorted(out) == list(range(len(out))):
        return [out[i] for i in range(len(out))]
    return out


def _indices(
    part: Mapping[str, Any], optimizer: torch.optim.Optimizer, names: dict[int, str]
) -> list[str]:
    """The optimizer's parameter names, checked against the saved param groups'."""
    fqns = _fqns(optimizer, names)
    saved = [list(g["params"]) for g in part["param_groups"]]
    mine = [[fqns[i] for i in range(a, a + len(g["params"]))] for a, g in _starts(optimizer)]
    if saved != mine:
        raise ValueError(
            f"dp.checkpoint.load: the {type(optimizer).__name__} was saved over the parameters "
            f"{saved}, this one holds {mine}. Load into an optimizer over the same model (its "
            "parameters are named by the modules of the state)."
        )
    return fqns


def _starts(optimizer: torch.optim.Optimizer) -> list[tuple[int, dict[str, Any]]]:
    out, at = [], 0
    for group in optimizer.param_groups:
        out.append((at, group))
        at += len(group["params"])
    return out


def _load_optimizer(
    optimizer: torch.optim.Optimizer, part: Mapping[str, Any], names: dict[int, str]
) -> None:
    fqns = _indices(part, optimizer, names)
    index = {name: i for i, name in enumerate(fqns)}
    params = _params(optimizer)
    sd = dict(part)
    sd["state"] = {}
    for name, entry in part["state"].items():
        i = index[name]
        sd["state"][i] = {
            key: _held(value, params[i]) if isinstance(value, Shards) else value
            for key, value in entry.items()
        }
    sd["param_groups"] = [
        {**g, "params": [index[name] for name in g["params"]]} for g in part["param_groups"]
    ]
    optimizer.load_state_dict(sd)


def _held(shards: Shards, param: torch.Tensor) -> torch.Tensor:
    """The state of a fully sharded parameter's shard, from its `Shards` (one piece, or none
    where this rank holds no row)."""
    if shards.pieces:
        return shards.pieces[0][1]
    return torch.empty(param.shape, dtype=shards.dtype)

"""`synchronize_torch`: make every rank hold a root's module or optimizer state, in place."""

from __future__ import annotations

from collections.abc import Mapping
from typing import Literal, TypeAlias, TypedDict, TypeVar

import torch
from torch import nn

from dataparallel import world
from dataparallel.backends.base import Backend
from dataparallel.collectives import broadcasts, objects
from dataparallel.config import Settings
from dataparallel.protocol import verify_same_call

__all__ = ["synchronize_torch"]

_S = TypeVar("_S", bound="nn.Module | torch.optim.Optimizer")

# How root describes an entry of a param group or of a parameter's state, for the other ranks:
# ("tensor", dtype, shape, on the parameter's device) or ("plain", value).
_TensorSpec: TypeAlias = tuple[Literal["tensor"], str, tuple[int, ...], bool]
_Spec: TypeAlias = _TensorSpec | tuple[Literal["plain"], object]
_Entries: TypeAlias = dict[str, _Spec]


class _OptimizerSpec(TypedDict):
    groups: list[_Entries]  # per param group
    state: list[_Entries | None]  # per parameter (None: no state on root)


def synchronize_torch(obj: _S, *, root: int = 0, backend: Backend | None = None) -> _S:
    """Make every rank hold `root`'s state of a module or an optimizer, in place; return it.

    - `nn.Module`: parameters and buffers, broadcast in fused buckets.
    - `torch.optim.Optimizer` (a `DistributedOptimizer` too): the hyper-parameters of every
      param group (lr, momentum, betas, ...: numbers, strings, tuples of them, and tensors) and
      the per-parameter state. State that exists on root only (Adam's moments before the other
      ranks' first step) is created on the others first, from root's shapes and dtypes; state
      that root lacks is removed. Entries of other types are kept as each rank has them.

    `dp.synchronize(model)` and `dp.synchronize(optimizer)` call this.

    >>> import torch, dataparallel as dp
    >>> _ = dp.initialize()
    >>> model = dp.synchronize(torch.nn.Linear(2, 2))   # rank 0's initial weights everywhere
    """
    if isinstance(obj, nn.Module):
        tensors = [*obj.parameters(), *obj.buffers()]
        broadcasts.broadcast(tensors, root=root, backend=backend)
        return obj
    if isinstance(obj, torch.optim.Optimizer):
        _synchronize_optimizer(obj, root, backend)
        return obj
    raise TypeError(
        "synchronize_torch takes a torch.nn.Module or a torch.optim.Optimizer, got "
        f"{type(obj).__module__}.{type(obj).__qualname__}."
    )


def _is_plain(value: object) -> bool:
    if value is None or isinstance(value, (bool, int, float, complex, str)):
        return True
    if isinstance(value, (tuple, list)):
        return all(_is_plain(v) for v in value)
    return False


def _describe_tensor(t: torch.Tensor, param: torch.Tensor | None) -> _TensorSpec:
    on_param = param is not None and t.device == param.device
    return ("tensor", str(t.dtype).removeprefix("torch."), tuple(t.shape), on_param)


def _describe_entries(entries: Mapping[str, object], param: torch.Tensor | None) -> _Entries:
    out: _Entries = {}
    for key, value in entries.items():
        if key == "params":
            continue
        if isinstance(value, torch.Tensor):
            out[key] = _describe_tensor(value, param)
        elif _is_plain(value):
            out[key] = ("plain", value)
    return out


def _ensure_tensor(
    entries: dict[str, object], key: str, spec: _TensorSpec, param: torch.Tensor | None
) -> torch.Tensor:
    _, dtype_name, shape, on_param = spec
    dtype = getattr(torch, dtype_name)
    device = param.device if (on_param and param is not None) else torch.device("cpu")
    current = entries.get(key)
    if (
        not isinstance(current, torch.Tensor)
        or current.dtype != dtype
        or tuple(current.shape) != tuple(shape)
        or current.device != device
    ):
        current = torch.zeros(shape, dtype=dtype, device=device)
        entries[key] = current
    return current


def _apply_entries(
    entries: dict[str, object], spec: _Entries, param: torch.Tensor | None, prune: bool
) -> list[torch.Tensor]:
    """Give `entries` root's plain values and tensor slots; return the tensors to broadcast."""
    tensors = []
    for key, entry in spec.items():
        if entry[0] == "plain":
            entries[key] = entry[1]
        else:
            tensors.append(_ensure_tensor(entries, key, entry, param))
    if prune:
        for key in [k for k in entries if k not in spec]:
            del entries[key]
    return tensors


def _synchronize_optimizer(opt: torch.optim.Optimizer, root: int, backend: Backend | None) -> None:
    b = backend if backend is not None else world.current().backend
    groups = opt.param_groups
    params = [p for g in groups for p in g["params"]]
    call = {
        "collective": "synchronize(optimizer)",
        "root": root,
        "param_groups": [
            [f"{str(p.dtype).removeprefix('torch.')}{list(p.shape)}" for p in g["params"]]
            for g in groups
        ],
    }
    settings = world.current().settings if world.initialized() else Settings.from_env()
    if settings.check:
        verify_same_call(b, call)
    spec: _OptimizerSpec | None = None
    if b.rank == root:
        spec = {
            "groups": [_describe_entries(g, None) for g in groups],
            "state": [
                _describe_entries(opt.state[p], p) if p in opt.state else None for p in params
            ],
        }
    spec = objects.broadcast_object(spec, root=root, backend=b)
    assert spec is not None
    tensors: list[torch.Tensor] = []
    for group, group_spec in zip(groups, spec["groups"], strict=True):
        tensors += _apply_entries(group, group_spec, None, prune=False)
    for p, state_spec in zip(params, spec["state"], strict=True):
        if state_spec is None:
            opt.state.pop(p, None)
            continue
        entries = opt.state[p]
        tensors += _apply_entries(entries, state_spec, p, prune=True)
    with torch.no_grad():
        broadcasts.broadcast(tensors, root=root, backend=b)

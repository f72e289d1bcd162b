"""Which `GradientSync` reduces a parameter, and the gradient hooks that call it."""

from __future__ import annotations

import weakref
from collections.abc import Callable
from typing import TYPE_CHECKING, Any

import torch

if TYPE_CHECKING:
    from dataparallel.torch._gradsync import GradientSync

# Which GradientSync reduces a parameter: id(param) -> (weakref to param, weakref to sync).
_owners: dict[int, tuple[weakref.ref[torch.Tensor], weakref.ref[GradientSync]]] = {}


def _claim(param: torch.Tensor, sync: GradientSync) -> GradientSync | None:
    """Make `sync` the one that reduces `param`; return the previous owner, if another."""
    key = id(param)
    previous = _owners.get(key)

    def forget(ref: weakref.ref[torch.Tensor], key: int = key) -> None:
        entry = _owners.get(key)
        if entry is not None and entry[0] is ref:
            del _owners[key]

    _owners[key] = (weakref.ref(param, forget), weakref.ref(sync))
    if previous is not None and previous[0]() is param:
        old = previous[1]()
        if old is not None and old is not sync:
            return old
    return None


def _owner(param: torch.Tensor) -> GradientSync | None:
    entry = _owners.get(id(param))
    if entry is None or entry[0]() is not param:
        return None
    return entry[1]()


def _make_hook(sync: weakref.ref[GradientSync], index: int) -> Callable[[torch.Tensor], None]:
    def hook(_: torch.Tensor) -> None:
        target = sync()
        if target is not None:
            target._on_grad(index)

    return hook


def _remove_hooks(handles: list[Any]) -> None:
    for handle in handles:
        handle.remove()
    handles.clear()

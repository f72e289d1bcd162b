"""Which `GradientSync` reduces a parameter, and the gradient hooks that tell it.

A parameter is reduced by one `GradientSync` only: the one created last over it. Wrapping the
same parameters again (a new `DistributedOptimizer` in a re-run notebook cell, or a
`DistributedOptimizer` over a `DataParallelModel`'s parameters) moves their reduction to the new
wrapper; the old one stops reducing them. Gradients are never reduced twice. The hooks hold
their `GradientSync` weakly: a wrapper that is dropped stops reducing. A wrapper of a world that
`dp.finalize()` ended owns nothing any more: its hooks tell it nothing, and the next world's
wrappers take the parameters over.
"""

from __future__ import annotations

import weakref
from collections.abc import Callable
from typing import TYPE_CHECKING, Protocol

import torch

from dataparallel import caches

if TYPE_CHECKING:
    from torch.utils.hooks import RemovableHandle

__all__ = ["GradientReceiver", "claim", "make_hook", "owner", "remove_hooks"]


class GradientReceiver(Protocol):
    """What a hook calls when a parameter's gradient is final (`GradientSync` is one)."""

    def on_grad(self, index: int) -> None: ...

    def refresh(self) -> bool: ...


# Which receiver reduces a parameter: id(param) -> (weakref to param, weakref to receiver).
# `dp.finalize()` clears it: the receivers of the world it ends own nothing any more, and their
# hooks (which tell only a parameter's owner) fall silent; the next world's wrappers claim afresh.
_owners: dict[int, tuple[weakref.ref[torch.Tensor], weakref.ref[GradientReceiver]]] = {}
caches.register(_owners.clear)


def claim(param: torch.Tensor, sync: GradientReceiver) -> GradientReceiver | None:
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


def owner(param: torch.Tensor) -> GradientReceiver | None:
    entry = _owners.get(id(param))
    if entry is None or entry[0]() is not param:
        return None
    return entry[1]()


def make_hook(
    sync: Callable[[], GradientReceiver | None], index: int
) -> Callable[[torch.Tensor], None]:
    """Return a post-accumulate-grad hook that tells `sync` (held weakly) of parameter `index`
    while `sync` owns the parameter (`claim`; no longer once `dp.finalize()` ended its world)."""

    def hook(param: torch.Tensor) -> None:
        entry = _owners.get(id(param))  # `owner(param)`, inlined: this runs for every gradient
        target = sync()
        if target is not None and entry is not None and entry[1]() is target:
            target.on_grad(index)

    return hook


def remove_hooks(handles: list[RemovableHandle]) -> None:
    for handle in handles:
        handle.remove()
    handles.clear()

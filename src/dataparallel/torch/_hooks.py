"""Which `GradientSync` reduces a parameter, and `GradientHooks`, the one hook engine that tells it.

A parameter is reduced by one `GradientSync` only: the one created last over it. Wrapping the
same parameters again (a new `DistributedOptimizer` in a re-run notebook cell, or a
`DistributedOptimizer` over a `DataParallelModel`'s parameters) moves their reduction to the new
wrapper; the old one stops reducing them. Gradients are never reduced twice. The hooks hold
their `GradientSync` weakly: a wrapper that is dropped stops reducing. A wrapper of a world that
`dp.finalize()` ended owns nothing any more: its hooks tell it nothing, and the next world's
wrappers take the parameters over.

`GradientHooks`, the one hook engine, carries both reducers, `GradientSync` (a fused allreduce
per bucket) and `ZeroRedundancyOptimizer(stage=2)` (a reduce-scatter per bucket into this rank's
shard): buckets go out strictly in their order once all their members are ready, so that every
rank makes the same calls in the same order whatever order its hooks fire in.
"""

from __future__ import annotations

import weakref
from collections.abc import Callable
from typing import TYPE_CHECKING, Protocol

import torch

from dataparallel import caches

if TYPE_CHECKING:
    from torch.utils.hooks import RemovableHandle

__all__ = [
    "GradientHooks",
    "GradientReceiver",
    "claim",
    "make_hook",
    "owner",
    "remove_hooks",
    "unclaimed_or",
]


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


def unclaimed_or(sync: GradientReceiver, params: list[torch.Tensor]) -> list[bool]:
    """Whether each of `params` is reduced by `sync` or by none (`owner`), in one call: asked
    of every parameter at every step."""
    mine = (None, sync)
    out = []
    for p in params:
        entry = _owners.get(id(p))
        out.append(entry is None or entry[0]() is not p or entry[1]() in mine)
    return out


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


class GradientHooks:
    """The hooks of a reducer's parameters, its callback at the end of each pass, and which of
    its buckets are ready. The hooks hold the reducer weakly, as `make_hook`'s do; the callbacks
    and launches it hands over are held only for the call."""

    def __init__(self, receiver: GradientReceiver) -> None:
        self._receiver = weakref.ref(receiver)
        self._handles: list[RemovableHandle] = []
        self.close = weakref.finalize(receiver, remove_hooks, self._handles)
        self.queued = False  # this pass's callback is queued
        self.buckets_of: list[list[int]] = []  # each parameter's buckets (in a ZeRO slab: several)
        self._sizes: list[int] = []  # each bucket's members
        self.ready: list[bool] = []
        self._pending: list[int] = []  # each bucket's members not ready yet
        self.next = 0  # the next bucket to launch

    def hook(self, params: list[torch.Tensor]) -> set[GradientReceiver]:
        """Hook the trainable ones of `params` (by index), claimed for the reducer; return the
        reducers that held some of them before."""
        remove_hooks(self._handles)
        receiver, displaced = self._receiver(), set()
        assert receiver is not None  # called by the reducer itself
        for index, p in enumerate(params):
            if p.requires_grad:
                if (old := claim(p, receiver)) is not None:
                    displaced.add(old)
                hook = make_hook(self._receiver, index)
                self._handles.append(p.register_post_accumulate_grad_hook(hook))
        return displaced

    def lay_out(self, buckets: list[list[int]], params: int) -> None:
        """The buckets in launch order, each by its members' indices among `params`."""
        self.buckets_of = [[] for _ in range(params)]
        for b, members in enumerate(buckets):
            for index in members:
                self.buckets_of[index].append(b)
        self._sizes = [len(members) for members in buckets]
        self.clear()

    def clear(self) -> None:
        """No parameter ready, no bucket launched."""
        self.ready = [False] * len(self.buckets_of)
        self._pending = list(self._sizes)
        self.next = 0

    def queue(self, end_of_pass: Callable[[], None]) -> bool:
        """Queue `end_of_pass` on autograd's engine unless `queued`; return whether it did (this
        is the pass's first gradient)."""
        if self.queued:
            return False
        torch.autograd.Variable._execution_engine.queue_callback(end_of_pass)
        self.queued = True
        return True

    def mark(self, index: int) -> bool:
        """Parameter `index` is ready; return False if it was already."""
        if self.ready[index]:
            return False
        self.ready[index] = True
        for b in self.buckets_of[index]:
            self._pending[b] -= 1
        return True

    def launch_ready(self, launch: Callable[[int], None]) -> None:
        """Launch in order the buckets whose members are all ready, up to the first that is not."""
        while self.next < len(self._pending) and self._pending[self.next] == 0:
            launch(self.next)
            self.next += 1

    def launch_rest(self, launch: Callable[[int], None]) -> None:
        """Mark every parameter ready (those without a gradient send zeros), launch the rest."""
        for index, ready in enumerate(self.ready):
            if not ready:
                self.mark(index)
        self.launch_ready(launch)

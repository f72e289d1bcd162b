"""Which parameters a `GradientSync` reduces, and in which buckets: its plan.

The parameters are those its source returns that require gradients and that no newer
`GradientSync` has claimed (`_hooks.py`); each gets a post-accumulate-grad hook. The plan is
made again when they change (`refresh`, at the start of every step, on every rank alike), and
once after the first step, in the order rank 0's gradients arrived (`_rebuild`, as DDP). The
layout itself (buckets, the summary every step's handshake compares) is `_buckets.layout`'s.
`GradientSync` (`_gradsync.py`) is a `GradientPlan` that reduces a step's gradients over it
(launched as they come: `_gradlaunch.GradientLaunch`, between the two).
"""

from __future__ import annotations

import weakref
from collections.abc import Callable
from typing import TYPE_CHECKING

import torch

from dataparallel import world
from dataparallel.backends.base import Backend
from dataparallel.collectives import objects
from dataparallel.torch._buckets import (
    Bucket,
    NamedParams,
    arrival_order,
    layout,
    on_host,
    signature,
)
from dataparallel.torch._feedback import ErrorFeedback
from dataparallel.torch._hooks import claim, make_hook, remove_hooks
from dataparallel.torch._hooks import owner as owner_of
from dataparallel.torch._sparse import SparseGrads

if TYPE_CHECKING:
    from torch.utils.hooks import RemovableHandle

    from dataparallel.torch._buckets import Options

__all__ = ["GradientPlan"]


class GradientPlan:
    """The parameters of a `GradientSync`, their hooks and their buckets (the base it stands on).

    `GradientSync.__init__` sets every attribute below, then makes the first plan (`_replan`).
    """

    owner: str
    backend: Backend
    bucket_bytes: int
    _source: Callable[[], NamedParams]  # the parameters, named, in registration order
    _params: NamedParams  # those reduced, in registration order
    _handles: list[RemovableHandle]  # their hooks
    _feedback: ErrorFeedback | None  # residuals, kept by parameter index
    _sparse: SparseGrads
    _options: Options
    _buckets: list[Bucket]
    _bucket_of: list[int]  # each parameter's bucket (-1: none, a gathered sparse gradient)
    _summary: str  # what every step's handshake compares (`_buckets.summarize`)
    _signature: list[tuple[int, torch.dtype, torch.device]]
    _host: bool  # every parameter on the host: buckets may go to the communication thread
    _begins_early: bool  # a step's handshake begins at its first gradient
    _rebuilt: bool  # rebucketed in the order of a first step's arrivals
    _arrival: list[int]  # this step's parameters, in the order their gradients came

    if TYPE_CHECKING:  # `GradientLaunch`'s (`_gradlaunch.py`): a hook's call, a new step's state

        def on_grad(self, index: int) -> None: ...

        def _clear(self) -> None: ...

    @property
    def parameters(self) -> list[torch.Tensor]:
        """The parameters this object reduces, in registration order."""
        return [p for _, p in self._params]

    @property
    def buckets(self) -> list[list[torch.Tensor]]:
        """The parameters of each bucket, in the order the buckets are launched."""
        return [[self._params[i][1] for i in b.members] for b in self._buckets]

    def _current(self) -> NamedParams:
        """The parameters to reduce now: trainable ones that no newer GradientSync has claimed."""
        mine = (None, self)
        return [(n, p) for n, p in self._source() if p.requires_grad and owner_of(p) in mine]

    def _replan(self, params: NamedParams, order: list[int] | None) -> None:
        """Reduce `params`, bucketed in `order` (default: reverse registration order)."""
        if [id(p) for _, p in params] != [id(p) for _, p in self._params]:
            remove_hooks(self._handles)
            self._params = list(params)
            ref = weakref.ref(self)
            displaced = set()
            for index, (_, p) in enumerate(self._params):
                old = claim(p, self)
                if old is not None:
                    displaced.add(old)
                self._handles.append(p.register_post_accumulate_grad_hook(make_hook(ref, index)))
            self._rebuilt = False
            if self._feedback is not None:
                self._feedback.clear()  # residuals are kept by index
            for old in displaced:
                old.refresh()
        if order is None:
            order = list(range(len(self._params)))[::-1]
        order = self._sparse.dense_order(order)
        full = world.current().settings.check if world.initialized() else True
        self._buckets, self._bucket_of, self._summary = layout(
            self.owner, self._options, self._params, order, self.bucket_bytes, full
        )
        self._signature = signature(self._params)
        self._host = on_host(self._params)  # only host buckets go to the communication thread
        # Where the engine moves calls on by itself (Gloo), the step's handshake begins at its
        # first gradient, so that its rendezvous overlaps backward (issue 21: at 3 Gloo ranks
        # on 2 cores a blocking one made the step 1.16x DDP's, 1.02x without it).
        self._begins_early = self._host and self.backend.progresses and self.backend.size > 1

    def refresh(self) -> bool:
        """Take parameters added, removed, frozen, unfrozen or converted since into account.

        Called at the start of every step (`reset`); call it on every rank alike. Returns whether
        the plan changed (the current step then starts over).
        """
        current = self._current()
        if signature(current) == self._signature:
            return False
        self._replan(current, None)
        self._clear()
        return True

    def _rebuild(self) -> None:
        """Rebucket once, in the order rank 0's gradients arrived in its first step (as DDP)."""
        self._rebuilt = True
        order = arrival_order(self._arrival, len(self._params))
        if self.backend.size > 1:
            order = objects.broadcast_object(order, root=0, backend=self.backend)
        if sorted(order) == list(range(len(self._params))):
            self._replan(self._params, order)

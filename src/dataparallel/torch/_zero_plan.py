"""Which parameters a `ZeroRedundancyOptimizer` shards, and how: its plan.

Each param group is checked against every rank's (`_zero_args.verify_params`) and laid out
(`_zero_layout.plan_group`: flat buffers, buckets, this rank's pieces) as it comes, at
construction and at `add_param_group`, on every rank alike. What stands over the layout is made
again with it: the inner optimizer's group of pieces, stage 2's reducer (`_zero_grads`) and the
forward hooks of `overlap_with_forward` (`_zero_overlap`). `ZeroRedundancyOptimizer` (`_zero.py`)
is a `ZeroPlan` that steps the pieces and exchanges the updated slices over it.
"""

from __future__ import annotations

from typing import Any

import torch

from dataparallel.backends.base import Backend
from dataparallel.torch._zero_args import Stage, one_device, refuse_reduced, verify_params
from dataparallel.torch._zero_gather import SliceGather
from dataparallel.torch._zero_grads import GradientShards
from dataparallel.torch._zero_layout import Bucket, Flat, Piece, plan_group
from dataparallel.torch._zero_overlap import ForwardOverlap
from dataparallel.torch._zero_state import copy_options

__all__ = ["ZeroPlan"]


class ZeroPlan(torch.optim.Optimizer):
    """The layout of a `ZeroRedundancyOptimizer`'s parameters (the base it stands on).

    `ZeroRedundancyOptimizer.__init__` sets every attribute below, then plans each group.
    """

    backend: Backend
    stage: Stage
    bucket_bytes: int
    optim: torch.optim.Optimizer  # the inner optimizer, over this rank's pieces
    _class: type[torch.optim.Optimizer]  # its class
    _initialized: bool  # torch's Optimizer.__init__ has added the groups given
    _device: torch.device | None  # the parameters' (set by the first)
    _staged: bool  # every engine call goes through host buffers
    _overlap: bool  # stage 2's buckets go to the communication thread
    _params: list[torch.Tensor]  # every group's parameters, in order
    _names: list[str]  # theirs in error messages
    _flats: list[Flat]
    _buckets: list[Bucket]
    _pieces: list[list[Piece]]  # this rank's, group by group
    _shards: GradientShards | None  # stage 2's reducer
    _gather: SliceGather | None  # the exchange of updated slices, planned at the next step
    _model: torch.nn.Module | None  # `overlap_with_forward`'s
    _forward: ForwardOverlap | None  # its hooks

    def _plan(self, g: int) -> None:
        """Check group `g` against every rank's, and lay it out (collective)."""
        group = self.param_groups[g]
        first = len(self._params)
        named = [(f"param_groups[{g}]['params'][{i}]", p) for i, p in enumerate(group["params"])]
        if self._device is None and named:  # the first parameter's: every engine call staged?
            self._staged = self._staged or named[0][1].device.type != "cpu"
        self._device = one_device(named, self._device)
        if self.stage == 2:
            refuse_reduced(named)
        verify_params(self.backend, self._class, self.stage, self.bucket_bytes, named)
        self._names += [name for name, _ in named]
        self._params += [p for _, p in named]
        flats, buckets, pieces = plan_group(
            g,
            list(enumerate(group["params"], start=first)),
            self.backend.rank,
            self.backend.size,
            self.bucket_bytes,
            len(self._flats),
            self._device if self._device is not None else torch.device("cpu"),
        )
        for flat in flats:
            flat.buckets = [b + len(self._buckets) for b in flat.buckets]
        self._flats += flats
        self._buckets += buckets
        self._pieces.append(pieces)
        self._gather = None

    def _inner_group(self, g: int) -> dict[str, Any]:
        options = {k: v for k, v in self.param_groups[g].items() if k != "params"}
        return {**options, "params": [piece.tensor for piece in self._pieces[g]]}

    def _reshard(self) -> None:
        """(Re)make the stage-2 reducer over the current layout."""
        if self.stage != 2:
            return
        joining = None
        if self._shards is not None:
            self._shards.land()
            self._shards.close()
            joining = self._shards.join_pass
        self._shards = GradientShards(
            self._params,
            self._flats,
            self._buckets,
            self.backend,
            average=True,
            overlap=self._overlap,
            staged=self._staged,
        )
        self._shards.join_pass = joining

    def _hook_forward(self) -> None:
        """(Re)place the hooks that land the exchange in the model's forward, over the layout."""
        if self._model is None:
            return
        if self._forward is not None:
            self._forward.close()
        self._forward = ForwardOverlap(self._model, self._params, self._buckets)

    def _settle(self) -> None:
        """Wait for the exchange of the last step's slices, if it is still in flight."""
        if self._forward is not None:
            self._forward.land()

    @property
    def pieces(self) -> list[Piece]:
        """This rank's pieces, over all param groups (what `.optim` steps)."""
        return [piece for pieces in self._pieces for piece in pieces]

    def add_param_group(self, param_group: dict[str, Any]) -> None:
        """Add a param group, sharded as the others (on every rank alike: it is collective)."""
        super().add_param_group(param_group)
        if not self._initialized:
            return  # torch's Optimizer.__init__ adds the groups; __init__ lays them out
        self._settle()
        g = len(self.param_groups) - 1
        self._plan(g)
        self.optim.add_param_group(self._inner_group(g))
        copy_options(self.optim.param_groups[-1:], self.param_groups[-1:])
        self._reshard()
        self._hook_forward()

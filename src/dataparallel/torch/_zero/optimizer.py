"""`ZeroRedundancyOptimizer`: optimizer state sharded across ranks (ZeRO stages 1 and 2).

torch's class and signature (`torch.distributed.optim.ZeroRedundancyOptimizer`), over this
library's engines, with slices instead of whole parameters: every rank steps a contiguous
segment of every bucket (`layout`), so shards are balanced whatever the parameters' sizes, and
the updated segments come back with one allgather per bucket, merged into one call on Gloo
(`gather`; torch's: one broadcast per rank). `stage=2` reduce-scatters the gradients itself
during backward (`gradients`). Each param group is checked against every rank's and laid out
as it comes, at construction and at `add_param_group`, on every rank alike; what stands over the
layout (the inner optimizer's group of pieces, stage 2's reducer, the forward hooks of
`overlap_with_forward`) is made again with it. Checkpoints: `state`; under `dp.torch.join`:
`join`. Parameters on a device (CUDA) keep their buffers, shards and state there; every engine
call is staged through host buffers. Usage, semantics and departures: docs/zero.md.
"""

from __future__ import annotations

import inspect
import weakref
from collections.abc import Callable, Iterable, Mapping, Sequence
from typing import Any, Literal, NoReturn, SupportsIndex, TypedDict

import numpy as np
import torch

from dataparallel import world
from dataparallel.backends.base import Backend, ReduceOp
from dataparallel.config import Settings
from dataparallel.groups import Group, backend_of
from dataparallel.protocol import verify_same_call
from dataparallel.torch._buckets import overlaps
from dataparallel.torch._hooks import owner as owner_of
from dataparallel.torch._zero.gather import ForwardOverlap, SliceGather
from dataparallel.torch._zero.gradients import GradientShards
from dataparallel.torch._zero.join import ZeroJoin, refuse_unjoined
from dataparallel.torch._zero.layout import Bucket, Piece, Slab, lay_out_group
from dataparallel.torch._zero.state import (
    consolidate,
    consolidated_groups,
    copy_options,
    load,
    with_options,
)

__all__ = ["Stage", "ZeroRedundancyOptimizer"]

Stage = Literal[1, 2]
Named = list[tuple[str, torch.Tensor]]


class LocalState(TypedDict):
    """This rank's own state (`ZeroRedundancyOptimizer.local_state_dict`)."""

    pieces: list[tuple[int, int, int, dict[str, object]]]  # (param, start, stop, its state)
    shapes: list[tuple[int, ...]]  # every parameter's
    param_groups: list[dict[str, object]]  # the options, `params` as indices


class ZeroRedundancyOptimizer(torch.optim.Optimizer):
    """Shard `optimizer_class`'s state across ranks: each rank steps its slice of the parameters.

    The parameters of each (param group, dtype) are laid end to end in one slab (each
    parameter's `.data` becomes a view of it) cut into buckets of `bucket_bytes`; rank r owns
    the r-th of `size` equal contiguous segments of every bucket. `.optim` is this rank's
    `optimizer_class` over its pieces (1-D views of the slabs, one parameter each), so
    its state is about `1 / size` of the unsharded state. `step()` steps them, then allgathers
    the updated segments (one call per bucket; on Gloo buckets merged into one call up to
    25 MiB): every rank ends the step with all parameters.

    - `stage=1`: gradients are reduced by a model wrapper (`dp.torch.DataParallelModel`, DDP,
      or `dp.allreduce_gradients`) before `step()`, which reads `param.grad`.
    - `stage=2`: give it the unwrapped model's parameters: it reduce-scatters the gradients in
      buckets started from gradient hooks during backward, keeps its slice (averaged over
      ranks), and frees `param.grad` as each bucket is packed. Every backward pass is reduced;
      passes before a `step()` accumulate into the slice. Parameters that a wrapper reduces
      are refused.

    Both: mixed dtypes, parameters without a gradient (a parameter that no rank gave a
    gradient is skipped by the inner optimizer, as in one process), gradient accumulation,
    `clip_grad_norm_` (the norm over every rank's slice), learning-rate schedulers (they set
    `param_groups`, copied into `.optim` at each step), `add_param_group` (on every rank).
    The inner optimizer must be element-wise (SGD, Adam, AdamW, RMSprop, Adagrad, ...): it sees
    slices, not whole parameters. Parameters on one device: the host, or a GPU, where the slab
    buffers, the shards and the inner optimizer's state stay, and every engine call goes through
    host buffers (pinned), one copy each way per bucket (MPI and Gloo are not CUDA-aware).

    Checkpoints: `consolidate_state_dict(to=0)` on every rank, then `state_dict()` on rank
    `to`: the state of a plain `optimizer_class` over the same parameters (torch's format),
    which loads into `optimizer_class` in one process, or into a `ZeroRedundancyOptimizer` at
    any world size (`load_state_dict` on every rank).

    Args:
        params: parameters or param groups, identical in structure on every rank (checked:
            `CollectiveMismatchError` names the parameter that differs).
        optimizer_class: the class of the inner optimizer (`torch.optim.Adam`).
        stage: 1 (optimizer state sharded) or 2 (gradients too).
        group: shard among the ranks of this `dp.new_group` group (default: the world).
        bucket_bytes: bucket size (default: `default_bucket_bytes`, 25 MiB at stage 1, 1 MiB at
            stage 2).
        backend: the engine (default: the active one).
        overlap_with_forward: the model (or its wrapper) whose forward runs after `step()`:
            `step()` then only starts the exchange of the updated slices (its calls as without
            it), and each call is waited for just before the first module holding parameters
            of its buckets runs (forward pre-hooks), the rest at the end of the forward. The
            model's `state_dict()` and `load_state_dict()`, this optimizer's methods (but
            `zero_grad`, which reads no parameter) and `dp.finalize()` wait too. A parameter
            read anywhere else between `step()` and the end of the next forward (a norm
            logged, a parent's forward reading a child's weight) may be the old value: the
            limit of the opt-in (docs/zero.md). Not torch's `overlap_with_ddp`, which steps
            inside DDP's communication hook.
        **defaults: `optimizer_class`'s options (`lr=1e-3`, ...).

    >>> import torch, dataparallel as dp
    >>> _ = dp.initialize()
    >>> model = torch.nn.Linear(4, 2)
    >>> opt = dp.torch.ZeroRedundancyOptimizer(model.parameters(), torch.optim.Adam, stage=2)
    >>> model(torch.ones(3, 4)).sum().backward()   # reduce-scattered while backward runs
    >>> opt.step()
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
    _slabs: list[Slab]
    _buckets: list[Bucket]
    _pieces: list[list[Piece]]  # this rank's, group by group
    _shards: GradientShards | None  # stage 2's reducer
    _gather: SliceGather | None  # the exchange of updated slices, made at the next step
    _model: torch.nn.Module | None  # `overlap_with_forward`'s
    _forward: ForwardOverlap | None  # its hooks

    def __init__(
        self,
        params: Iterable[torch.Tensor] | Iterable[dict[str, Any]],
        optimizer_class: type[torch.optim.Optimizer],
        *,
        stage: Stage = 1,
        group: Group | None = None,
        bucket_bytes: int | None = None,
        backend: Backend | None = None,
        overlap_with_forward: torch.nn.Module | None = None,
        _staged: bool = False,
        **defaults: Any,
    ) -> None:
        self._class = inner_class(optimizer_class)
        check_options(stage, bucket_bytes)
        refuse_wrapper_options(self._class, defaults)
        self._initialized = False
        # The parameters' device (set by the first), and whether engine calls go through host
        # buffers: for device parameters, or forced for host ones (`_staged`: the tests' way to
        # run the device path without a device).
        self._device: torch.device | None = None
        self._staged = _staged
        super().__init__(params, defaults)
        active = world.current()
        chosen = backend_of(backend, group)
        self.backend: Backend = chosen if chosen is not None else active.backend
        self._on_world = chosen is None or chosen is active.backend  # carried to a new world
        self._world = weakref.ref(active)
        self.stage: Stage = stage
        self.bucket_bytes = bucket_bytes or default_bucket_bytes(stage, active.settings)
        self._overlap = overlaps(self.backend.local_size, active.settings.overlap)
        self._params: list[torch.Tensor] = []
        self._names: list[str] = []
        self._slabs: list[Slab] = []
        self._buckets: list[Bucket] = []
        self._pieces: list[list[Piece]] = []
        self._shards: GradientShards | None = None
        # Buckets merged into one allgather up to this many bytes (`gather`): on engines that
        # move calls on their own threads (Gloo), where each call is a rendezvous; MPI's
        # per-bucket calls are faster unmerged (benchmarks/NOTES.md).
        self._merge_bytes = active.settings.thread_bucket_bytes if self.backend.progresses else 0
        # ... and each of those allgathers made as `size` broadcasts, which Gloo's threads carry
        # at once, faster than Gloo's ring allgather.
        self._broadcasts = self.backend.progresses
        self._gather: SliceGather | None = None  # made at the first step after a layout
        self._consolidated: dict[str, Any] | None = None
        self._have_grads = False
        self._join: ZeroJoin | None = None  # inside a `dp.torch.join` block (`join`)
        for g in range(len(self.param_groups)):
            self._lay_out(g)
        inner = [self._inner_group(g) for g in range(len(self.param_groups))]
        self.optim: torch.optim.Optimizer = self._class(inner, **defaults)
        copy_options(self.optim.param_groups, self.param_groups)
        self._reshard()
        # `overlap_with_forward`: the exchange lands in the model's forward (`gather`).
        self._model = overlap_with_forward
        self._forward: ForwardOverlap | None = None
        self._hook_forward()
        self._initialized = True

    # -- the layout -------------------------------------------------------------------------

    def _lay_out(self, g: int) -> None:
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
        slabs, buckets, pieces = lay_out_group(
            g,
            list(enumerate(group["params"], start=first)),
            self.backend.rank,
            self.backend.size,
            self.bucket_bytes,
            len(self._slabs),
            self._device if self._device is not None else torch.device("cpu"),
        )
        for slab in slabs:
            slab.buckets = [b + len(self._buckets) for b in slab.buckets]
        self._slabs += slabs
        self._buckets += buckets
        self._pieces.append(pieces)
        self._gather = None

    def _inner_group(self, g: int) -> dict[str, object]:
        """Group `g` for the inner optimizer: its options, over this rank's pieces."""
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
            self._slabs,
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
        self._lay_out(g)
        self.optim.add_param_group(self._inner_group(g))
        copy_options(self.optim.param_groups[-1:], self.param_groups[-1:])
        self._reshard()
        self._hook_forward()

    # -- a step ---------------------------------------------------------------------------------

    def _gradients(self) -> None:
        """Give every piece its gradient (None where no rank had one); once per step."""
        if self._have_grads:
            return
        try:
            self._check_moved()
        except RuntimeError:
            if self._shards is not None:  # every rank started them: they complete before it raises
                self._shards.land()
            raise
        if self._shards is not None:
            had = self._shards.wait()
            for pieces in self._pieces:
                for piece in pieces:
                    grad = self._params[piece.param].grad
                    if piece.start == piece.stop and grad is not None:  # no item, no bucket
                        piece.tensor.grad = grad.reshape(-1)
                    elif had[piece.param]:
                        shard = self._shards.shards[piece.slab]
                        n = piece.stop - piece.start
                        piece.tensor.grad = shard[piece.shard_at : piece.shard_at + n]
                    else:
                        piece.tensor.grad = None
        else:
            for pieces in self._pieces:
                for piece in pieces:
                    grad = self._params[piece.param].grad
                    if grad is not None and grad.layout != torch.strided:
                        raise TypeError(
                            f"ZeroRedundancyOptimizer: {self._names[piece.param]} has a "
                            f"{grad.layout} gradient; only dense gradients are sharded."
                        )
                    piece.tensor.grad = (
                        None if grad is None else grad.reshape(-1)[piece.start : piece.stop]
                    )
        self._have_grads = True

    def _check_moved(self) -> None:
        """Raise `RuntimeError` naming a parameter that is no longer a view of its slab (a
        `model.float()`, `.double()` or `.to(...)` after the optimizer was made gave it new
        data): the step would update the slab, not the parameter."""
        for slab in self._slabs:
            base, size = slab.data.data_ptr(), slab.data.element_size()
            for k, at in slab.offsets.items():
                p = self._params[k]
                if p.dtype == slab.dtype and (p.numel() == 0 or p.data_ptr() == base + at * size):
                    continue
                raise RuntimeError(
                    f"ZeroRedundancyOptimizer: {self._names[k]} is no longer the tensor it "
                    f"laid out ({str(slab.dtype).removeprefix('torch.')} on "
                    f"{slab.data.device}, now {str(p.dtype).removeprefix('torch.')} on "
                    f"{p.device}): the model was converted (model.float(), .double(), "
                    ".to(...)) after the optimizer was made, so a step would not reach it. "
                    "Convert the model first, then make the optimizer."
                )

    def step(self, closure: Callable[[], float] | None = None) -> float | None:  # type: ignore[override]
        """Step this rank's slice with the reduced gradients, then allgather every slice.

        A `closure` is evaluated once, with gradients enabled, before the step (optimizers that
        evaluate it several times, as LBFGS, are not supported: they are not element-wise).
        """
        self._settle()
        loss = None
        if closure is not None:
            with torch.enable_grad():
                loss = closure()
        if self._join is not None:
            self._join.tell("step")
        elif self.stage == 1:
            refuse_unjoined(self)
        self._gradients()
        copy_options(self.param_groups, self.optim.param_groups)
        self.optim.step()
        self._allgather()
        self._end_step()
        return loss

    def _allgather(self) -> None:
        """Bring every rank's updated segments to every rank (`SliceGather`: one allgather per
        bucket, consecutive ones merged up to `_merge_bytes`)."""
        if self.backend.size == 1:
            return  # the pieces are views of the parameters: nothing to bring
        if self._gather is None:
            self._gather = SliceGather(
                self._slabs,
                self._buckets,
                self.backend,
                self._merge_bytes,
                self._broadcasts,
                self._staged,
            )
        if self._forward is not None:
            self._forward.start(self._gather)  # lands in the next forward
        else:
            self._gather.run()

    def _end_step(self) -> None:
        for pieces in self._pieces:
            for piece in pieces:
                piece.tensor.grad = None
        self._have_grads = False
        if self._shards is not None:
            self._shards.reset()

    def zero_grad(self, set_to_none: bool = True) -> None:
        """Zero the gradients and begin accumulating a new step's.

        With `stage=2`, reduce-scatters in flight complete first (every rank started them).
        """
        if self._join is not None:
            self._join.tell("discard")
        self._end_step()
        super().zero_grad(set_to_none)

    def clip_grad_norm_(
        self, max_norm: float, norm_type: float = 2.0, error_if_nonfinite: bool = False
    ) -> torch.Tensor:
        """Clip the gradients by their norm over every rank's slice (collective).

        `torch.nn.utils.clip_grad_norm_(model.parameters(), ...)` cannot be used with
        `stage=2` (a rank holds only its slice of the gradients); this computes the same norm
        across shards, scales this rank's slice, and returns the total norm. Call it after
        backward and before `step()`, on every rank.
        """
        self._settle()
        if self._join is not None:
            self._join.tell("clip", (float(max_norm), float(norm_type), error_if_nonfinite))
        self._gradients()
        grads = [(p.param, p.tensor.grad) for p in self.pieces if p.tensor.grad is not None]
        norm = clip_slices(
            grads, len(self._params), max_norm, float(norm_type), error_if_nonfinite, self.backend
        )
        return torch.tensor(norm, device=self._device)

    # -- memory figures ------------------------------------------------------------------------

    @property
    def state_bytes(self) -> int:
        """Bytes of optimizer state this rank holds (tensors of `.optim.state`)."""
        self._settle()
        return sum(
            v.nbytes
            for state in self.optim.state.values()
            for v in state.values()
            if isinstance(v, torch.Tensor)
        )

    @property
    def gradient_bytes(self) -> int:
        """Bytes of gradients this rank keeps between steps: with `stage=2` its shards and the
        send buffers; with `stage=1` every parameter's `.grad`."""
        self._settle()
        if self._shards is not None:
            return self._shards.gradient_bytes
        return sum(p.grad.nbytes for p in self._params if p.grad is not None)

    # -- checkpoints ---------------------------------------------------------------------------

    def consolidate_state_dict(self, to: int | None = 0) -> None:
        """Gather the whole state on rank `to`, bucket by bucket (collective: every rank calls).

        Rank `to` then holds one full copy (`state_dict()` returns it); the others nothing.
        `to=None`: every rank holds one (what an elastic commit keeps: `dp.elastic.TorchState`).
        """
        self._settle()
        self._consolidated = consolidate(self, to)

    def state_dict(self) -> dict[str, Any]:
        """Return the state consolidated on this rank, in a plain `optimizer_class`'s format.

        Raises:
            RuntimeError: `consolidate_state_dict(to=this rank)` was not called first.
        """
        if self._consolidated is None:
            raise RuntimeError(
                "Optimizer state has not been consolidated on this rank. Call "
                f"consolidate_state_dict(to={self.backend.rank}) on every rank first."
            )
        self._settle()
        return with_options(self._consolidated, self.param_groups)

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        """Load a consolidated state (this optimizer's, at any world size, or a plain
        `optimizer_class`'s): every rank keeps its slice. Call it on every rank with the same
        dict.

        Raises:
            ValueError: the state dict belongs to an optimizer over other parameters.
        """
        self._settle()
        load(self, state_dict)
        self._consolidated = None

    def local_state_dict(self) -> LocalState:
        """Return this rank's own state, without communicating: what a sharded checkpoint
        (`dataparallel.checkpoint`) writes where it lies, each rank its pieces.

        `{"pieces": [(index, start, stop, state)], "shapes": [...], "param_groups": [...]}`:
        for each of this rank's pieces, its parameter's index (among every group's parameters,
        in order), the items `[start, stop)` of that flattened parameter it holds, and the inner
        optimizer's state of it (tensors of the piece's items, flat, and values such as
        `step`); every parameter's shape; the param groups' options, with `params` as indices.
        The tensors are the live state, not copies.
        """
        self._settle()
        pieces = [
            (p.param, p.start, p.stop, dict(self.optim.state.get(p.tensor, {})))
            for p in self.pieces
        ]
        shapes = [tuple(p.shape) for p in self._params]
        return {
            "pieces": pieces,
            "shapes": shapes,
            "param_groups": with_options(
                {"state": {}, "param_groups": consolidated_groups(self.param_groups)},
                self.param_groups,
            )["param_groups"],
        }

    def load_local_state_dict(
        self, states: Sequence[Mapping[str, object]], groups: Sequence[Mapping[str, object]]
    ) -> None:
        """Take this rank's state back: `states[i]` is the state of `pieces[i]` (as
        `local_state_dict` gives it, flat tensors of the piece's items), `groups` the param
        groups' options (their `params` are ignored). The inverse of `local_state_dict`, at
        this world size's layout, whatever the layout of the rank that wrote them."""
        self._settle()
        pieces = self.pieces
        if len(states) != len(pieces):
            raise ValueError(
                f"ZeroRedundancyOptimizer.load_local_state_dict: {len(states)} states for "
                f"{len(pieces)} pieces on rank {self.backend.rank}."
            )
        self.optim.state.clear()
        for piece, state in zip(pieces, states, strict=True):
            if state:
                self.optim.state[piece.tensor] = dict(state)
        for group, target in zip(groups, self.param_groups, strict=True):
            target.update({k: v for k, v in group.items() if k != "params"})
        copy_options(self.param_groups, self.optim.param_groups)
        self._consolidated = None

    # -- elastic runs --------------------------------------------------------------------------

    @property
    def outlived(self) -> bool:
        """Whether the world this optimizer was laid out on is gone (an elastic re-form)."""
        return not world.initialized() or self._world() is not world.current()

    def rebind_world(self) -> None:
        """Lay the parameters out again over the world made since, in its size (after an
        elastic run re-formed it: `dp.elastic.TorchState.sync` calls this on every rank at the
        same point, then loads the committed, consolidated state, of which each rank keeps its
        new slices). Collective, as construction is: a newcomer's construction meets it. The
        inner optimizer starts empty; the parameters keep their values.

        Raises:
            ValueError: it shards over a group (`group=`/`backend=`), gone with its world.
        """
        if not self._on_world:
            raise ValueError(
                "ZeroRedundancyOptimizer shards over a group, which went with its world: only "
                "one over the whole world is carried over to a re-formed world."
            )
        if self._forward is not None:
            self._forward.drop()  # its exchange belonged to the world that is gone
        if self._shards is not None:
            self._shards.close()
            self._shards = None
        active = world.current()
        self._world = weakref.ref(active)
        self.backend = active.backend
        self._overlap = overlaps(self.backend.local_size, active.settings.overlap)
        self._merge_bytes = active.settings.thread_bucket_bytes if self.backend.progresses else 0
        self._broadcasts = self.backend.progresses
        self._params, self._names, self._slabs, self._buckets, self._pieces = [], [], [], [], []
        self._consolidated, self._have_grads = None, False
        for g in range(len(self.param_groups)):
            self._lay_out(g)
        inner = [self._inner_group(g) for g in range(len(self.param_groups))]
        self.optim = self._class(inner, **self.defaults)
        copy_options(self.optim.param_groups, self.param_groups)
        self._reshard()
        self._hook_forward()

    def __repr__(self) -> str:
        return (
            f"ZeroRedundancyOptimizer({self._class.__name__}, stage={self.stage}, "
            f"bucket_bytes={self.bucket_bytes}, rank={self.backend.rank}/{self.backend.size})"
        )

    def __reduce_ex__(self, protocol: SupportsIndex) -> NoReturn:
        raise TypeError(
            "A ZeroRedundancyOptimizer cannot be pickled (it holds a shard); save "
            "consolidate_state_dict() + state_dict() instead."
        )


# -- what it is made with, checked before anything is laid out ----------------------------------


def default_bucket_bytes(stage: Stage, settings: Settings) -> int:
    """Stage 1: `Settings.thread_bucket_bytes` (25 MiB, DDP's size): its buckets cost no buffer
    (the allgathers land in the parameters), and every bucket is two calls (a reduce by the
    wrapper, an allgather), each about as dear whatever its size on a busy node. Stage 2: 4 x
    `Settings.bucket_bytes` (1 MiB): each bucket in flight is a send buffer of its size, which
    counts against the gradient memory stage 2 saves (benchmarks/zero.py, docs/zero.md)."""
    return settings.thread_bucket_bytes if stage == 1 else 4 * settings.bucket_bytes


def inner_class(cls: object) -> type[torch.optim.Optimizer]:
    """`cls`, a subclass of `torch.optim.Optimizer`; else `TypeError`."""
    if isinstance(cls, type) and issubclass(cls, torch.optim.Optimizer):
        return cls
    if isinstance(cls, torch.optim.Optimizer):
        raise TypeError(
            "ZeroRedundancyOptimizer(params, optimizer_class, ...) takes the optimizer's class "
            f"and its options, not an optimizer: give {type(cls).__name__}, lr=... instead of "
            f"{type(cls).__name__}(params, lr=...)."
        )
    raise TypeError(
        "ZeroRedundancyOptimizer: optimizer_class must be a subclass of torch.optim.Optimizer "
        f"(torch.optim.Adam, ...), got {cls!r}."
    )


def check_options(stage: object, bucket_bytes: object) -> None:
    """Raise `ValueError` for a stage other than 1 or 2, or a bucket size not a positive int."""
    if stage not in (1, 2):
        raise ValueError(f"ZeroRedundancyOptimizer: stage={stage!r} must be 1 or 2.")
    if bucket_bytes is not None and (
        isinstance(bucket_bytes, bool) or not isinstance(bucket_bytes, int) or bucket_bytes < 1
    ):
        raise ValueError(
            f"ZeroRedundancyOptimizer: bucket_bytes={bucket_bytes!r} must be a positive int."
        )


# `dp.DistributedOptimizer`'s (and Horovod's) options, which `**defaults` would hand the inner
# optimizer: what to use instead, or None where it has no counterpart here.
WRAPPER_OPTIONS: dict[str, str | None] = {
    "compression": "compress the gradients' reduction on the wrapper at stage 1 "
    "(dp.torch.DataParallelModel(model, compression=...)), or keep the optimizer unsharded "
    "(dp.DistributedOptimizer(optimizer, compression=...)); ZeRO's own exchanges travel in the "
    "parameters' dtype",
    "backward_passes_per_step": "run the backward passes before one step() (they accumulate: "
    "docs/zero.md)",
    "op": None,
    "sparse_as_dense": None,
    "named_parameters": None,
    "gradient_predivide_factor": None,
}


def refuse_wrapper_options(
    cls: type[torch.optim.Optimizer], defaults: Mapping[str, object]
) -> None:
    """Raise `TypeError` for a gradient-reduction option among `defaults` that `cls` does not
    take, naming it and what to use instead (else `cls(...)` fails far from the call)."""
    taken = inspect.signature(cls.__init__).parameters
    if any(p.kind is inspect.Parameter.VAR_KEYWORD for p in taken.values()):
        return
    for name, instead in WRAPPER_OPTIONS.items():
        if name in defaults and name not in taken:
            raise TypeError(
                f"ZeroRedundancyOptimizer takes no {name}=: it is an option of "
                "dp.DistributedOptimizer's gradient reduction, and the rest of the keywords go "
                f"to {cls.__name__}. " + (f"Instead, {instead}." if instead else "Leave it out.")
            )


def one_device(named: Named, device: torch.device | None) -> torch.device | None:
    """The device of every parameter in `named` and of those before (`device`, None if none
    came before); `ValueError` names the first parameter on another."""
    for name, p in named:
        if device is None:
            device = p.device
        elif p.device != device:
            raise ValueError(
                f"ZeroRedundancyOptimizer: {name} is on {p.device}, the parameters before "
                f"it on {device}; it shards the parameters of one device. Move the "
                "model to one device first, or use one optimizer per device."
            )
    return device


def verify_params(
    backend: Backend,
    cls: type[torch.optim.Optimizer],
    stage: Stage,
    bucket_bytes: int,
    named: Named,
) -> None:
    """Check that every rank lays out the same parameters the same way (collective):
    `CollectiveMismatchError` names the parameter that differs."""
    call: dict[str, object] = {
        "collective": "ZeroRedundancyOptimizer parameters",
        "optimizer_class": f"{cls.__module__}.{cls.__qualname__}",
        "stage": stage,
        "bucket_bytes": bucket_bytes,
    }
    for name, p in named:
        call[name] = f"{str(p.dtype).removeprefix('torch.')}{list(p.shape)}"
    verify_same_call(backend, call)


def refuse_reduced(params: Named) -> None:
    """Raise `ValueError` for a parameter whose gradients a model wrapper already reduces."""
    for name, p in params:
        reducer = owner_of(p)
        if reducer is not None and not isinstance(reducer, GradientShards):
            who = getattr(reducer, "owner", type(reducer).__name__)
            raise ValueError(
                f"ZeroRedundancyOptimizer(stage=2): {name} is already reduced by a {who}; "
                "stage 2 reduce-scatters the gradients itself, so they would be reduced twice. "
                "Give stage=2 the unwrapped model's parameters, or use stage=1 under the "
                "wrapper."
            )


# -- `clip_grad_norm_`: the norm over every rank's slice ---------------------------------------


def clip_slices(
    owned: list[tuple[int, torch.Tensor]],
    params: int,
    max_norm: float,
    norm_type: float,
    error_if_nonfinite: bool,
    backend: Backend,
) -> float:
    """Scale `owned` (this rank's slices, each with its parameter's index among `params`) so
    that the norm of order `norm_type` over every rank's is at most `max_norm`, and return that
    norm (collective): torch's, NaN and infinities included.

    Raises:
        RuntimeError: the norm is not finite and `error_if_nonfinite`.
    """
    grads = [g for _, g in owned]
    if norm_type in (float("inf"), float("-inf")):
        norm = extreme_slices(grads, norm_type > 0, backend)
    elif norm_type == 0.0:
        # torch's order 0 counts the parameters whose gradient has a non-zero item (NaN
        # included): the counts of a parameter's slices are summed across ranks first.
        counts = np.zeros(params, np.float64)
        for param, g in owned:
            counts[param] += float(torch.count_nonzero(g))
        if backend.size > 1:
            backend.allreduce(counts, ReduceOp.SUM)
        norm = float(np.count_nonzero(counts))
    else:
        local = sum(float(g.double().abs().pow(norm_type).sum()) for g in grads)
        total = np.array([local], np.float64)
        if backend.size > 1:
            backend.allreduce(total, ReduceOp.SUM)
        norm = float(total[0]) ** (1.0 / norm_type)
    if error_if_nonfinite and not np.isfinite(norm):
        raise RuntimeError(
            f"The total norm of order {norm_type} of the gradients is {norm}: not finite, "
            "so they cannot be clipped (error_if_nonfinite=True)."
        )
    # torch's `clamp(coefficient, max=1.0)`: a NaN norm scales every gradient by NaN, as in
    # one process (`coefficient < 1.0` would be False for NaN and skip it).
    coefficient = max_norm / (norm + 1e-6)
    if not coefficient >= 1.0:
        for g in grads:
            g.mul_(coefficient)
    return norm


def extreme_slices(grads: list[torch.Tensor], top: bool, backend: Backend) -> float:
    """The largest (`top`) or smallest magnitude over every rank's slices, NaN if any is NaN,
    0.0 if no rank has an item (torch's norms of order inf and -inf; collective).

    Python's `max` and the engines' MAX and MIN keep or drop a NaN by where it stands, so
    whether some rank saw one travels beside the value, with whether some rank had an item.
    """
    sign = 1.0 if top else -1.0  # the smallest magnitude as the largest of the negated
    local = [float(g.abs().amax() if top else g.abs().amin()) * sign for g in grads if g.numel()]
    nan = any(np.isnan(v) for v in local)
    values = [v for v in local if not np.isnan(v)]
    total = np.array([max(values, default=-np.inf), float(nan), float(bool(local))], np.float64)
    if backend.size > 1:
        backend.allreduce(total, ReduceOp.MAX)
    if total[1]:
        return float("nan")
    return float(total[0]) * sign if total[2] else 0.0

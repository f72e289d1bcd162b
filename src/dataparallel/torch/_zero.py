"""`ZeroRedundancyOptimizer`: optimizer state sharded across ranks (ZeRO stages 1 and 2).

torch's class and signature (`torch.distributed.optim.ZeroRedundancyOptimizer`), over this
library's engines, with slices instead of whole parameters: every rank steps a contiguous
segment of every bucket (`_zero_layout.py`), so shards are balanced whatever the parameters'
sizes, and the updated segments come back with one allgather per bucket, merged into one call
on Gloo (`_zero_gather.py`; torch's: one broadcast per rank). `stage=2` reduce-scatters the
gradients itself during backward (`_zero_grads.py`). Its parameters' layout, group by group, and
what stands over it: `_zero_plan.py`. Checkpoints: `_zero_state.py`. What it is made with,
checked: `_zero_args.py`; the norm `clip_grad_norm_` clips by: `_zero_clip.py`.
Parameters on a device (CUDA) keep their buffers, shards and state there; every engine call is
staged through host buffers. Usage, semantics and departures: docs/zero.md.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable
from typing import Any, NoReturn, SupportsIndex

import torch

from dataparallel import world
from dataparallel.backends.base import Backend
from dataparallel.groups import Group, backend_of
from dataparallel.torch._buckets import overlaps
from dataparallel.torch._zero_args import Stage, check_options, default_bucket_bytes, inner_class
from dataparallel.torch._zero_clip import clip_slices
from dataparallel.torch._zero_gather import SliceGather
from dataparallel.torch._zero_grads import GradientShards
from dataparallel.torch._zero_join import ZeroJoin, refuse_unjoined
from dataparallel.torch._zero_layout import Bucket, Flat, Piece
from dataparallel.torch._zero_overlap import ForwardOverlap
from dataparallel.torch._zero_plan import ZeroPlan
from dataparallel.torch._zero_state import consolidate, copy_options, load, with_options

__all__ = ["ZeroRedundancyOptimizer"]


class ZeroRedundancyOptimizer(ZeroPlan):
    """Shard `optimizer_class`'s state across ranks: each rank steps its slice of the parameters.

    The parameters of each (param group, dtype) are laid end to end in one flat buffer (each
    parameter's `.data` becomes a view of it) cut into buckets of `bucket_bytes`; rank r owns
    the r-th of `size` equal contiguous segments of every bucket. `.optim` is this rank's
    `optimizer_class` over its pieces (1-D views of the flat buffers, one parameter each), so
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
    slices, not whole parameters. Parameters on one device: the host, or a GPU, where the flat
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
        self.stage: Stage = stage
        self.bucket_bytes = bucket_bytes or default_bucket_bytes(stage, active.settings)
        self._overlap = overlaps(self.backend.local_size, active.settings.overlap)
        self._params: list[torch.Tensor] = []
        self._names: list[str] = []
        self._flats: list[Flat] = []
        self._buckets: list[Bucket] = []
        self._pieces: list[list[Piece]] = []
        self._shards: GradientShards | None = None
        # Buckets merged into one allgather up to this many bytes (`_zero_gather.py`): on
        # engines that move calls on their own threads (Gloo), where each call is a rendezvous
        # (stage 2 on Gloo 0.97-0.99x torch's ZeRO + DDP merged, 1.01-1.07x not); MPI's
        # per-bucket calls were faster there (0.64x against 0.67x merged).
        self._merge_bytes = active.settings.thread_bucket_bytes if self.backend.progresses else 0
        # ... and each of those allgathers made as `size` broadcasts, which Gloo's threads carry
        # at once (3 ranks, 6 MB: 3.3-3.9 ms against 4.3-4.6 for Gloo's allgather).
        self._broadcasts = self.backend.progresses
        self._gather: SliceGather | None = None  # planned at the first step after a layout
        self._consolidated: dict[str, Any] | None = None
        self._have_grads = False
        self._join: ZeroJoin | None = None  # inside a `dp.torch.join` block (`_zero_join.py`)
        for g in range(len(self.param_groups)):
            self._plan(g)
        inner = [self._inner_group(g) for g in range(len(self.param_groups))]
        self.optim: torch.optim.Optimizer = self._class(inner, **defaults)
        copy_options(self.optim.param_groups, self.param_groups)
        self._reshard()
        # `overlap_with_forward`: the exchange lands in the model's forward (`_zero_overlap.py`).
        self._model = overlap_with_forward
        self._forward: ForwardOverlap | None = None
        self._hook_forward()
        self._initialized = True

    # -- a step ---------------------------------------------------------------------------------

    def _gradients(self) -> None:
        """Give every piece its gradient (None where no rank had one); once per step."""
        if self._have_grads:
            return
        if self._shards is not None:
            had = self._shards.wait()
            for pieces in self._pieces:
                for piece in pieces:
                    if had[piece.param]:
                        shard = self._shards.shards[piece.flat]
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
                self._flats,
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
        grads = [p.tensor.grad for p in self.pieces if p.tensor.grad is not None]
        norm = clip_slices(grads, max_norm, float(norm_type), error_if_nonfinite, self.backend)
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

    def consolidate_state_dict(self, to: int = 0) -> None:
        """Gather the whole state on rank `to`, bucket by bucket (collective: every rank calls).

        Rank `to` then holds one full copy (`state_dict()` returns it); the others nothing.
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

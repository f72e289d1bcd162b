"""`ZeroRedundancyOptimizer` under `dp.torch.join`: a rank that ran out of data shadows each step.

A ZeRO rank owns a slice of every parameter, so a rank that has joined cannot just answer the
others' reductions with zeros (`dp.join`): it must step its slice and send it in every exchange
of updated slices, as torch's `_ZeROJoinHook` runs `step()`. It does so from `dp.join`'s loop
(`collectives.join.answer`): the working ranks describe each ZeRO action in a handshake's
`ZeroReplay`, and the joined rank makes it on its own optimizer:

- stage 1 (`dp.torch.DataParallelModel` reduces the gradients): the wrapper's step handshake
  carries, beside its reduction, what the joined rank keeps of it (`"grads"`): it reduces its
  zeros with the others' gradients and sets the results (the world's average) as its `.grad`.
- stage 2: inside the block every backward pass begins with a handshake (`"pass"`); the joined
  rank makes the pass's reduce-scatters (and its check) with zeros, no parameter having had a
  gradient, and keeps its slice of the average.
- then, only while some rank has joined (the working ranks learnt it from those handshakes),
  `clip_grad_norm_` (`"clip"`), `step()` (`"step"`) and `zero_grad()` before a step
  (`"discard"`) each begin with a handshake, and the joined rank makes the same call.

So every rank ends every step with the same parameters, the joined ranks counting as zeros in
the average (Horovod's and `dp.join`'s rule). Outside a block nothing of this runs; inside, with
no rank joined, stage 2 pays one handshake a pass and stage 1 nothing (the wrapper's own).
A stage-1 optimizer left out of a block whose wrapper met a joined rank refuses at `step()` on
every rank (`ZeroRefusal`), instead of pairing its exchange with the joined rank's answers.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from functools import partial
from typing import Literal, Protocol

import torch

from dataparallel.arrays.families.torch import TorchFamily
from dataparallel.arrays.pool import BufferPool
from dataparallel.arrays.replay import Replay
from dataparallel.backends.base import Backend
from dataparallel.collectives.jitted import Refusal
from dataparallel.errors import RankJoinedError
from dataparallel.protocol import Started, digest, handshake, start_handshake
from dataparallel.torch._gradsync import GradientSync
from dataparallel.torch._hooks import owner
from dataparallel.torch._zero.gradients import GradientShards

__all__ = ["Sharded", "ZeroJoin", "ZeroRefusal", "ZeroReplay", "refuse_unjoined"]

What = Literal["grads", "pass", "clip", "step", "discard"]
Clip = tuple[float, float, bool]  # clip_grad_norm_'s max_norm, norm_type, error_if_nonfinite
_NO_CLIP: Clip = (0.0, 2.0, False)
_TORCH = TorchFamily()  # how a result becomes a tensor like its parameter


class Sharded(Protocol):
    """What this module uses of a `ZeroRedundancyOptimizer` (`optimizer`, which imports this)."""

    backend: Backend
    _params: list[torch.Tensor]
    _shards: GradientShards | None
    _join: ZeroJoin | None

    @property
    def stage(self) -> int: ...

    def step(self, closure: Callable[[], float] | None = None) -> float | None: ...

    def zero_grad(self, set_to_none: bool = True) -> None: ...

    def _settle(self) -> None: ...

    def clip_grad_norm_(
        self, max_norm: float, norm_type: float = 2.0, error_if_nonfinite: bool = False
    ) -> torch.Tensor: ...


@dataclass(frozen=True)
class ZeroReplay(Replay):
    """A ZeRO action for the ranks that have joined to make on their own optimizer.

    Attributes:
        optimizer: which of the block's ZeRO optimizers (their order in `dp.torch.join(...)`).
        what: the action (module notes).
        clip: `clip_grad_norm_`'s arguments (`"clip"`).
        reduction: the wrapper's reduction, made on zeros and kept (`"grads"`).
        names: the parameters it reduces, in its order: (name, index in its flag vector).
        late: parameters reduced after the flag vector (trainable since its buckets were made).
    """

    optimizer: int = 0
    what: What = "step"
    clip: Clip = _NO_CLIP
    reduction: Replay | None = None
    names: tuple[tuple[str, int], ...] = ()
    late: tuple[str, ...] = ()

    def run(self, backend: Backend, pool: BufferPool | None = None) -> None:
        raise RankJoinedError(
            "This rank joined with dp.join() while the others step a ZeroRedundancyOptimizer "
            "inside dp.torch.join(...): a joined rank must step its slice of the parameters, "
            "which only dp.torch.join(model, optimizer) does. Leave the loop with the same "
            "dp.torch.join block on every rank."
        )


class ZeroRefusal(Refusal):
    """What the working ranks send the joined ones when a ZeRO optimizer is outside the block."""

    @staticmethod
    def error(rank: int) -> RankJoinedError:
        return RankJoinedError(
            f"rank {rank} has joined while the other ranks step a ZeroRedundancyOptimizer that "
            f"was not given to dp.torch.join: {_FIX}"
        )


_FIX = (
    "a ZeRO rank that has joined must still step its slice of the parameters, so the step "
    "failed on every rank. Give the optimizer to the block: with dp.torch.join(model, "
    "optimizer) (stage 1), dp.torch.join(optimizer) (stage 2)."
)


def refuse_unjoined(opt: Sharded) -> None:
    """At a stage-1 `step()` outside a block: raise `RankJoinedError` on every rank if the
    wrapper that reduced the gradients met a rank that has joined (which could not answer the
    exchange of slices); nothing otherwise (one dictionary look-up)."""
    sync = next((owner(p) for p in opt._params if p.requires_grad), None)
    if not isinstance(sync, GradientSync) or not sync.met_joined:
        return
    call = {"collective": "ZeroRedundancyOptimizer.step", "joined": "not in dp.torch.join"}
    handshake(opt.backend, "ZeRO met ranks that have joined", call, replay=lambda _: ZeroRefusal())
    raise RankJoinedError(
        "Some ranks have joined (dp.torch.join) while this rank steps a "
        f"ZeroRedundancyOptimizer that was not given to the block: {_FIX}"
    )


class ZeroJoin:
    """One ZeRO optimizer's part in a `dp.torch.join` block, on every rank.

    Args:
        opt: the optimizer.
        index: its position among the block's ZeRO optimizers.
        syncs: the block's gradient reducers (stage 1 needs the one that reduces its parameters).

    Raises:
        ValueError: stage 1 without the wrapper that reduces its gradients in the block.
    """

    def __init__(self, opt: Sharded, index: int, syncs: list[GradientSync]) -> None:
        self.opt, self.index = opt, index
        self.pending = False  # working side: a rank has joined during this step
        self.sync: GradientSync | None = None
        if opt.stage == 1:
            owners = {id(owner(p)) for p in opt._params}
            self.sync = next((s for s in syncs if id(s) in owners), None)
            if self.sync is None:
                raise ValueError(
                    "dp.torch.join: a ZeroRedundancyOptimizer(stage=1) steps with gradients a "
                    "model wrapper reduces, and a joined rank must take its share of them: give "
                    "the dp.torch.DataParallelModel over its parameters to the same block, "
                    "dp.torch.join(model, optimizer) (torch's DDP cannot join here), or use "
                    "stage=2."
                )
            if self.sync.low_rank:
                raise ValueError(
                    "dp.torch.join: a ZeroRedundancyOptimizer(stage=1) cannot be joined while its "
                    "gradients are reduced with dp.Compression.powersgd (a joined rank would have "
                    "to keep the low-rank basis and step its slice at once): join the model alone, "
                    "dp.torch.join(model), with a plain optimizer, or use compression=None or "
                    "dp.Compression.fp16 with ZeRO."
                )

    # -- every rank -------------------------------------------------------------------------

    def attach(self) -> None:
        self.opt._join = self
        if self.sync is not None:
            self.sync.then_replay = self._grads
            self.sync.on_join = self._joined
        elif self.opt._shards is not None:
            self.opt._shards.join_pass = self._pass

    def settle(self) -> None:
        """Land an exchange left in flight (`overlap_with_forward`: a joined rank runs no
        forward), so that every rank's parameters are current after the block."""
        self.opt._settle()

    def detach(self) -> None:
        self.opt._join = None
        self.pending = False
        if self.sync is not None:
            self.sync.then_replay = self.sync.on_join = None
        elif self.opt._shards is not None:
            self.opt._shards.join_pass = None

    # -- the working ranks ------------------------------------------------------------------

    def _joined(self) -> None:
        self.pending = True

    def _grads(self, reduction: Replay) -> ZeroReplay:
        """Stage 1: the wrapper's replay, and which parameters its arrays are (`_take`)."""
        assert self.sync is not None
        params, buckets = self.sync._params, self.sync._buckets
        names = tuple((params[i][0], i) for b in buckets for i in b.members)
        laid_out = {id(p) for _, p in params}
        late = tuple(n for n, p in self.sync._current() if id(p) not in laid_out)
        return ZeroReplay(
            None, optimizer=self.index, what="grads", reduction=reduction, names=names, late=late
        )

    def _pass(self) -> Callable[[], None] | None:
        """Stage 2, a pass's first gradient: tell the joined ranks (and learn of them). Begun
        here and finished (the returned call) before the pass's first bucket on engines that
        progress alone (Gloo); made at once on MPI (one call in flight at a time)."""
        b = self.opt.backend
        started = start_handshake(b, _summary("pass", self.index)) if b.progresses else None
        if started is None:
            self._tell("pass", always=True)
            return None
        return partial(self._tell, "pass", always=True, started=started)

    def tell(self, what: What, clip: Clip = _NO_CLIP) -> None:
        """Before `clip_grad_norm_`, `step()`, `zero_grad()`: have the joined ranks make it."""
        self._tell(what, clip)
        if what in ("step", "discard"):
            self.pending = False

    def _tell(
        self,
        what: What,
        clip: Clip = _NO_CLIP,
        *,
        always: bool = False,
        started: Started | None = None,
    ) -> None:
        if not (self.pending or always) or self.opt.backend.size == 1:
            return
        replay = ZeroReplay(None, optimizer=self.index, what=what, clip=clip)
        call = {"collective": f"ZeroRedundancyOptimizer {what}", "optimizer": self.index}
        handshake(
            self.opt.backend,
            _summary(what, self.index),
            call,
            replay=lambda _: replay,
            on_joined=self._joined,
            started=started,
        )

    # -- a rank that has joined -------------------------------------------------------------

    def answer(self, replay: ZeroReplay, backend: Backend, pool: BufferPool) -> None:
        """Make `replay`'s action on this rank's optimizer (it has joined: no gradient)."""
        self.pending = False  # it tells no one: its calls answer the working ranks' handshakes
        opt = self.opt
        if replay.what == "grads":
            self._take(replay, backend, pool)
        elif replay.what == "pass":
            assert opt._shards is not None
            opt._shards.shadow_pass()
        elif replay.what == "clip":
            opt.clip_grad_norm_(*replay.clip)
        elif replay.what == "step":
            opt.step()
            opt.zero_grad()
        else:
            opt.zero_grad()

    def _take(self, replay: ZeroReplay, backend: Backend, pool: BufferPool) -> None:
        """Stage 1: make the wrapper's reduction on zeros; its results (the world's average of
        the working ranks' gradients) become this rank's `.grad`, as the wrapper's would."""
        assert self.sync is not None and replay.reduction is not None
        assert replay.reduction.action is not None and replay.reduction.then is None
        arrays = replay.reduction.reduce_zeros(backend, pool)
        named = dict(self.sync._params) | dict(self.sync._current())
        k = len(replay.names)  # then the flag vector, if any bucket was laid out, then the late
        flags = arrays[k] if k else None
        late = arrays[k + 1 :] if k else arrays
        given = [(name, i, arrays[j]) for j, (name, i) in enumerate(replay.names)]
        given += [(name, -1, a) for name, a in zip(replay.late, late, strict=True)]
        for name, i, values in given:
            p = named[name]
            if i >= 0 and flags is not None and flags[i] == 0:
                p.grad = None  # no rank had a gradient: None, as the wrapper leaves it
                continue
            # The zeros' memory itself on the host, bfloat16 read from its bits (`TorchFamily`).
            p.grad = _TORCH.adopt(p, values).reshape(p.shape)


def _summary(what: What, index: int) -> int:
    return digest(f"ZeroRedundancyOptimizer|{what}|{index}")

"""Gradient reduction during `backward()`: `GradientSync`, under `DataParallelModel` and
`DistributedOptimizer` (`_model`, `_optimizer`).

A post-accumulate-grad hook on every parameter (`_hooks.GradientHooks`, the hook engine that
ZeRO's stage 2 stands on too) tells `on_grad` when its gradient is final for the pass; its
bucket (fixed members, as DDP's: `_buckets`) is ready once all its members are, and ready
buckets go out while backward runs, on the communication thread, or all at its end (the mode,
`_buckets.Modes`). Why every rank makes the same calls:

- Buckets are launched strictly in bucket order: a ready bucket waits for the ones before it, so
  ranks whose hooks fire in different orders still make the same calls in the same order.
- At the end of the pass that completes a step (a callback queued on the autograd engine), every
  parameter whose hook did not fire contributes its gradient, or zeros, and the remaining buckets
  are launched: every rank has started every bucket before `backward()` returns. A parameter no
  rank used keeps `grad=None` (flags travel with the last bucket), as in one process.
- Every step begins with a handshake (`protocol.handshake`) before its first bucket: a step that
  does not line up with the other ranks' raises `CollectiveMismatchError` on every rank instead of
  hanging. Ranks that have joined (`dp.join`) answer it by replaying the step's buckets with zeros.
  A step that every rank promised goes without one (`_may_promise`).
- A backward that failed midway is completed at the next step, flagged abandoned (`reset`).

Once reduced, a packed gradient takes its bucket's memory as its own where it can (`_adopt`).
The parameters are re-read at every step (`refresh`) and rebucketed once after the first, in the
order rank 0's gradients arrived (as DDP). Sparse gradients: `_sparse`. Sharp bits:
docs/sharp-bits.md.
"""

from __future__ import annotations

import contextlib
import time
import weakref
from collections.abc import Callable, Iterator, Mapping
from enum import Enum
from functools import partial
from typing import TYPE_CHECKING, Any, TypedDict, cast

import numpy as np
import torch

from dataparallel import world
from dataparallel.arrays.actions import Reduction, reduction
from dataparallel.arrays.comm_thread import Leaf, Pack, Router, leaf_of
from dataparallel.arrays.compression import PowerSGDCompressor, wire_dtype
from dataparallel.arrays.families import Family
from dataparallel.arrays.families.torch import TorchFamily
from dataparallel.arrays.fusion import HOST_KEY, Deliver, Fusion
from dataparallel.arrays.replay import Add, Replay
from dataparallel.backends.base import Backend
from dataparallel.collectives import objects
from dataparallel.errors import CollectiveMismatchError, RankFailedError
from dataparallel.protocol import (
    GATHER_LIMIT,
    Started,
    digest,
    handshake,
    handshakes,
    owe,
    owed,
    start_handshake,
)
from dataparallel.torch._buckets import (
    JOINING,
    MADE,
    PROMISES,
    WORDS,
    Bucket,
    Modes,
    ModeTrial,
    NamedParams,
    StepTemplate,
    arrival_order,
    check_options,
    describe,
    grad_family,
    kept_flags,
    layout,
    message,
    on_host,
    replay_of,
    signature,
)
from dataparallel.torch._feedback import ErrorFeedback
from dataparallel.torch._hooks import GradientHooks, unclaimed_or
from dataparallel.torch._powersgd import LowRank, PowerSGDReplay, q_lag
from dataparallel.torch._sparse import SparseGrads
from dataparallel.types import Op, WireDtype

if TYPE_CHECKING:
    from dataparallel.torch._buckets import Compressing, Options

__all__ = ["FeedbackState", "GradientSync", "State"]


class FeedbackState(TypedDict):
    """One rank's error-feedback residuals, by parameter name, and whose they are."""

    rank: int
    size: int
    residuals: dict[str, torch.Tensor]


class LowRankState(TypedDict):
    """What every rank of a PowerSGD reduction holds alike: its step count and bases."""

    iteration: int
    q: dict[str, torch.Tensor]


class State(Enum):
    """Where a step's reduction is: open to gradients, launched, done, or failed its handshake."""

    OPEN = "open"
    LAUNCHED = "launched"
    DONE = "done"
    FAILED = "failed"


class GradientSync:
    """Reduce the gradients of a set of parameters across ranks while `backward()` runs.

    What reduces the gradients of `DataParallelModel` and `DistributedOptimizer`: use those. A
    step's reduction is started by the hooks of its last backward pass, completed by `wait()`,
    and a new step begins with `reset()`.

    Args:
        params: returns the parameters to reduce, named, in registration order (those that do
            not require gradients are skipped). It is called again at every step, so parameters
            added, frozen or unfrozen later are taken into account (identically on every rank,
            since every rank's code changes them identically).
        op: `"avg"` (default) or `"sum"`.
        bucket_bytes: flush threshold (default `DATAPARALLEL_BUCKET_BYTES`).
        passes: backward passes per step; gradients are accumulated locally in between.
        wait_after_backward: complete the reduction at the end of every step's last backward
            pass (`DataParallelModel`), instead of at `wait()` (`DistributedOptimizer.step`).
        owner: the name used in error messages.
        backend: the engine to use (default: the active one).
        compression: `dp.Compression.fp16`/`.bf16`: floating gradients travel in 16 bits;
            `dp.Compression.powersgd(...)`: matrices travel as low-rank factors (`_powersgd`).
        sparse_as_dense: make sparse gradients dense (else gathered: `_sparse.py`).
    """

    owner: str
    backend: Backend
    bucket_bytes: int
    passes: int  # backward passes per step
    overlap: bool  # buckets go to the communication thread as they are ready
    wait_after_backward: bool  # the step completes at the end of its last pass
    enabled: bool  # False for the backward of a forward run inside `no_sync()`
    _source: Callable[[], NamedParams]  # the parameters, named, in registration order
    _params: NamedParams  # those reduced, in registration order
    _hooks: GradientHooks  # their hooks, this pass's callback, which buckets are ready
    _feedback: ErrorFeedback | None  # residuals, kept by parameter index
    _low: LowRank | None  # PowerSGD's state (`dp.Compression.powersgd`)
    _sparse: SparseGrads
    _options: Options
    _buckets: list[Bucket]
    _summary: str  # what every step's handshake compares (`_buckets.summarize`)
    _template: StepTemplate  # what every step of the layout sends, made with it
    _signature: list[tuple[int, torch.dtype, torch.device]]
    _host: bool  # every parameter on the host: buckets may go to the communication thread
    _begins_early: bool  # a step's handshake begins at its first gradient
    _rebuilt: bool  # rebucketed in the order of a first step's arrivals
    _arrival: list[int]  # this step's parameters, in the order their gradients came
    _router: Router
    _action: Reduction  # what the buckets' calls do (replayed by ranks that have joined)
    _wire: WireDtype | None  # their compression
    # Set by `dp.torch.join` for a ZeroRedundancyOptimizer stepping with these gradients: what
    # its joined ranks do after the reduction, and a call when some rank has joined.
    then_replay: Callable[[Replay], Replay] | None
    on_join: Callable[[], None] | None
    met_joined: bool  # whether the last step's handshake met a rank that has joined
    feedback_in_state: bool  # the wrappers' state dicts carry the residuals (`feedback_kept_out`)
    join_index: int  # its place in a `dp.torch.join` block (set by it; PowerSGD's replays)

    def __init__(
        self,
        params: Callable[[], NamedParams],
        *,
        op: Op = "avg",
        bucket_bytes: int | None = None,
        passes: int = 1,
        wait_after_backward: bool = False,
        owner: str = "GradientSync",
        backend: Backend | None = None,
        compression: Compressing = None,
        sparse_as_dense: bool = False,
    ) -> None:
        check_options(owner, op, passes, bucket_bytes)
        # What `remade` makes again: the world's engine is named None, so that it is the next's.
        self._made = {
            "op": op,
            "bucket_bytes": bucket_bytes,
            "passes": passes,
            "wait_after_backward": wait_after_backward,
            "owner": owner,
            "compression": compression,
            "sparse_as_dense": sparse_as_dense,
        }
        wire, self._sparse = wire_dtype(compression, stateful=True), SparseGrads(sparse_as_dense)
        feedback = wire is not None and getattr(compression, "error_feedback", False)
        self._feedback = ErrorFeedback(wire) if feedback and wire is not None else None
        self._low = LowRank(compression) if isinstance(compression, PowerSGDCompressor) else None
        trainable = [(n, p) for n, p in params() if p.requires_grad]
        low = self._low is not None

        def engines(active: world.World, over: Backend) -> tuple[world.World, Backend, Modes]:
            # Collective (World.private, offloadable): every rank makes it at the same point.
            private = active.private(over)
            return active, private, Modes(over, private, trainable, active.settings, low_rank=low)

        self._on_world = backend is None or backend is world.current().backend
        if self._on_world:  # an elastic run's world re-forms here if a member is lost meanwhile
            active, private, self._modes = world.form(lambda w: engines(w, w.backend))
            self.backend = active.backend
        else:
            assert backend is not None
            active, private, self._modes = engines(world.current(), backend)
            self.backend = backend
        self._world = weakref.ref(active)
        self.op, self.passes, self.owner = op, passes, owner
        self.overlap = self._modes.first()
        self._given = bucket_bytes
        self.bucket_bytes = bucket_bytes or self._modes.bucket_bytes(
            self.overlap, self._modes.offload
        )
        self._options: Options = {"op": op, "bucket_bytes": self.bucket_bytes}
        self._options["backward_passes_per_step"] = passes
        if wire is not None or sparse_as_dense:  # described only when set, as they change calls
            self._options |= {"compression": wire, "sparse_as_dense": sparse_as_dense}
        if self._low is not None:
            self._options |= {"compression": repr(compression), "sparse_as_dense": sparse_as_dense}
            self._low.world = self.backend.size if op == "sum" else 1
            self._low.lag = q_lag(self.backend)
        self.wait_after_backward = wait_after_backward
        # Packed gradients become views of their bucket (`_adopt`) only on engines that move
        # calls on by themselves: on MPI, adopting the few small gradients its packed buckets
        # hold made whole steps slower than copying them back (the pool's buffers were reused,
        # the cause was not found; figures in benchmarks/NOTES.md).
        self._views = self.backend.progresses
        # False for the backward of a forward run inside DataParallelModel.no_sync().
        self.enabled = True
        self.steps = 0  # completed reductions (observable for tests)
        self.then_replay = self.on_join = None  # set by `dp.torch.join`
        self.met_joined = False
        self.feedback_in_state = True  # the wrappers' state dicts carry the residuals
        self.join_index = 0
        action, pool = reduction(op, None, self.backend.size), active.buffers
        self._action, self._wire = action, wire  # replayed by ranks that have joined
        fusion_on = partial(
            Fusion, action=action, bucket_bytes=self.bucket_bytes, pool=pool, compression=wire
        )
        self._router = Router(fusion_on, self.backend, private, active.comm_thread)
        self._source = params
        self._params: NamedParams = []
        self._hooks = GradientHooks(self)
        self._buckets: list[Bucket] = []
        self._rebuilt = False
        self._filled: list[int] = []
        self._arrival: list[int] = []
        self._layouts = 0  # layouts made so far (a promise holds for one)
        self._promise: Callable[[bool], None] | None = None  # what this rank owes (`protocol.owe`)
        self._promised_layout = self._promising_layout = -1
        self._quiet = -1  # the engine's handshakes when the last step ended (`_may_promise`)
        self._lay_out(trainable, None)
        self._clear()

    # -- the parameters, their hooks and buckets --------------------------------------------

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
        trainable = [(n, p) for n, p in self._source() if p.requires_grad]
        mine = unclaimed_or(self, [p for _, p in trainable])
        return [named for named, ours in zip(trainable, mine, strict=True) if ours]

    def _lay_out(self, params: NamedParams, order: list[int] | None) -> None:
        """Reduce `params`, bucketed in `order` (default: reverse registration order)."""
        self._layouts += 1
        if [id(p) for _, p in params] != [id(p) for _, p in self._params]:
            self._params = list(params)
            displaced = self._hooks.hook([p for _, p in self._params])
            self._rebuilt = False
            if self._feedback is not None:
                self._feedback.clear()  # residuals are kept by index
            if self._low is not None:
                self._low.clear()
            for old in displaced:
                old.refresh()
        if order is None:
            order = list(range(len(self._params)))[::-1]
        order = self._sparse.dense_order(order)
        full = world.current().settings.check if world.initialized() else True
        self._buckets, self._summary = layout(
            self.owner, self._options, self._params, order, self.bucket_bytes, full
        )
        self._hooks.lay_out([b.members for b in self._buckets], len(self._params))
        self._signature = signature(self._params)
        self._template = StepTemplate(self._params, self._summary, self.backend.size, self._buckets)
        if self._low is not None:
            self._low.lay_out(self._params, [b.members for b in self._buckets])
        self._host = on_host(self._params)  # only host buckets go to the communication thread
        # Where the engine moves calls on by itself (Gloo), the step's handshake begins at its
        # first gradient, so that its rendezvous overlaps backward instead of adding to the step.
        self._begins_early = self._host and self.backend.progresses and self.backend.size > 1

    def refresh(self, current: NamedParams | None = None) -> bool:
        """Take parameters added, removed, frozen, unfrozen or converted since into account.

        Called at the start of every step (`reset`); call it on every rank alike. Returns whether
        the buckets changed (the current step then starts over). `current`: the parameters to
        reduce, walked just before (`_current`) with no user code since.
        """
        if current is None:
            current = self._current()
        if signature(current) == self._signature:
            return False
        self._lay_out(current, None)
        self._clear()
        return True

    def _rebuild(self) -> None:
        """Rebucket once, in the order rank 0's gradients arrived in its first step (as DDP)."""
        self._rebuilt = True
        order = arrival_order(self._arrival, len(self._params))
        if self.backend.size > 1:
            order = objects.broadcast_object(order, root=0, backend=self.backend)
        if sorted(order) == list(range(len(self._params))):
            self._lay_out(self._params, order)

    @property
    def _trial(self) -> ModeTrial | None:
        """The trial timing the modes, if this reduction times them (`_buckets.Modes`)."""
        return self._modes.trial

    @property
    def outlived(self) -> bool:
        """Whether the world this was made on is gone (`dp.finalize()`, an elastic re-form)."""
        return not world.initialized() or self._world() is not world.current()

    def remade(self) -> GradientSync:
        """Return a `GradientSync` like this one on the world made since (an elastic run
        re-formed it), and remove this one's hooks. Collective, as construction is.

        Raises:
            ValueError: this one reduces over a group (`group=`/`backend=`), gone with its world.
        """
        if not self._on_world:
            raise ValueError(
                f"{self.owner} reduces over a group, which went with its world: only a "
                "DistributedOptimizer of the whole world is carried over to a re-formed world."
            )
        self._hooks.close()
        residuals = self.feedback_state()  # before the new one claims the parameters
        low_rank = self.low_rank_state()
        made = GradientSync(self._source, **self._made)  # type: ignore[arg-type]
        made.load_feedback_state(residuals, own=True)  # this process's, carried over
        made.load_low_rank_state(low_rank)
        return made

    # -- error feedback: this rank's residuals, in checkpoints and elastic commits -------------

    @contextlib.contextmanager
    def feedback_kept_out(self) -> Iterator[None]:
        """Inside the block, the wrappers' `state_dict()` carries no residuals and their
        `load_state_dict()` leaves them as they are: what `dp.elastic.TorchState` synchronizes
        from rank 0 and rolls back is the shared state; each rank's residuals it keeps itself."""
        previous, self.feedback_in_state = self.feedback_in_state, False
        try:
            yield
        finally:
            self.feedback_in_state = previous

    def feedback_state(self) -> FeedbackState | None:
        """This rank's error-feedback residuals (copies), by parameter name, with the rank and
        world size they belong to; None without error feedback.

        What `DistributedOptimizer.state_dict()` and `DataParallelModel.state_dict()` carry, so
        that a run resumed from each rank's own checkpoint continues exactly.
        """
        kept = self._residuals()
        if kept is None:
            return None
        residuals = {self._params[i][0]: r.detach().clone() for i, r in sorted(kept.items())}
        return {"rank": self.backend.rank, "size": self.backend.size, "residuals": residuals}

    def load_feedback_state(self, state: Mapping[str, Any] | None, *, own: bool = False) -> None:
        """Take the residuals of `state` (`feedback_state()`'s) if they are this rank's: saved
        at this rank of a world of this size, or `own` (this process's, saved in an earlier
        world of an elastic run). Otherwise, or without `state`, start again with none: another
        rank's residuals are what its rounding dropped, not this one's.

        Raises:
            ValueError: a residual names no parameter reduced here, or has another shape.
        """
        kept = self._residuals()
        if kept is None:
            return
        kept.clear()
        if state is None:
            return
        if not own and (state["rank"], state["size"]) != (self.backend.rank, self.backend.size):
            return
        index = {name: i for i, (name, _) in enumerate(self._params)}
        for name, residual in state["residuals"].items():
            i = index.get(name, -1)
            param = self._params[i][1] if i >= 0 else None
            if param is None or tuple(residual.shape) != tuple(param.shape):
                found = "no such parameter" if param is None else f"shape {tuple(param.shape)}"
                raise ValueError(
                    f"{self.owner}: the error-feedback residual of {name!r} (shape "
                    f"{tuple(residual.shape)}) fits no parameter reduced here ({found}): "
                    "load a state saved from the same model and optimizer."
                )
            kept[i] = residual.detach().to(param.device, copy=True)

    def _residuals(self) -> dict[int, torch.Tensor] | None:
        """The residuals kept, by parameter index (None: no error feedback)."""
        if self._feedback is not None:
            return self._feedback.residuals
        if self._low is not None and self._low.config.use_error_feedback:
            return self._low.residuals
        return None

    @property
    def low_rank(self) -> bool:
        """Whether gradients are compressed by PowerSGD (`dp.Compression.powersgd`)."""
        return self._low is not None

    def low_rank_state(self) -> LowRankState | None:
        """PowerSGD's state that every rank holds alike (its step count, each matrix's `Q`, by
        parameter name), or None without PowerSGD: what the wrappers' state dicts carry beside
        the shared optimizer state, so that any rank's checkpoint, or rank 0's state in an
        elastic run, sets every rank's."""
        if self._low is None:
            return None
        return self._low.shared_state(self._params)  # type: ignore[return-value]

    def load_low_rank_state(self, state: Mapping[str, Any] | None) -> None:
        """Take `low_rank_state()`'s; None (a state saved without PowerSGD) starts it afresh.

        Raises:
            ValueError: a basis names no matrix compressed here, or has another shape.
        """
        if self._low is None:
            return
        if state is None:
            self._low.qs.clear()
            self._low.iteration = 0
            return
        self._low.load_shared_state(state, self._params, self.owner)

    def answer_low_rank(self, replay: PowerSGDReplay, backend: Backend, pool: Any) -> None:
        """Answer a compressed step of the other ranks (this rank has joined: `dp.torch.join`)."""
        assert self._low is not None
        buckets = [b.members for b in self._buckets]
        self._low.answer(replay, self._params, buckets, backend, pool)

    @property
    def calls(self) -> int:
        """Communication calls made so far."""
        return self._router.calls

    @property
    def bucket_backend(self) -> Backend:
        """The engine this step's buckets travel on (`arrays/comm_thread.py`)."""
        return self._router.fusion.backend

    # -- one step ----------------------------------------------------------------------------

    def _clear(self) -> None:
        """Begin a new step's state: no gradient yet, no bucket launched, no handshake made."""
        self._state: State = State.OPEN
        self._passes = 0
        self._hooks.queued = False
        self._hooks.clear()
        self._filled.clear()
        self._arrival.clear()
        self._flags: np.ndarray | None = None
        self._sparse.seen.clear()
        self._agreed = self._abandoned = self._joined = False
        self._keeping = False  # this step is the one every rank promised (`_agree`)
        self._take_back_pending()  # a step discarded before its end
        self._early: Started | None = None  # this step's handshake, begun at its first gradient
        self._router.discard()  # left by a step that failed; nothing otherwise
        self._router.trace(world.current().timeline if world.initialized() else None)
        self._started_at = 0.0
        self._began = 0.0  # when this step's first gradient came (for ModeTrial)
        # This step sends low-rank factors (PowerSGD past its `start_iter`).
        self._compressing = self._low is not None and self._low.active()
        if self._low is not None:
            self._low.discard()

    @property
    def in_flight(self) -> bool:
        """Whether this step's reduction has started and not finished."""
        return self._state == State.LAUNCHED

    @property
    def done(self) -> bool:
        """Whether this step's reduction has completed (`wait()` ran, `reset()` did not yet)."""
        return self._state == State.DONE

    @property
    def started(self) -> bool:
        """Whether a backward pass of this step has run (or its reduction has started)."""
        return self._state != State.OPEN or self._passes > 0 or self._hooks.queued

    def on_grad(self, index: int) -> None:
        """Take note that parameter `index`'s gradient is final for this pass (its hook fired)."""
        if not self.enabled:
            return
        if self._state == State.FAILED:  # the last step's handshake failed: this is a new step
            self._clear()
        if self._state != State.OPEN:
            raise RuntimeError(message("late gradient", self.owner, self.passes))
        hooks = self._hooks
        if not hooks.queued and hooks.queue(self._end_of_pass) and not self._began:
            self._began = time.perf_counter()
        if self._passes + 1 < self.passes or hooks.ready[index]:
            return
        if hooks.next > 0:
            self._router.progress()
        hooks.mark(index)
        self._arrival.append(index)
        if len(self._arrival) == 1 and self._begins_early and not self._promised():
            self._early = start_handshake(
                self.backend, self._step_summary(), self._template.records
            )
        if self.overlap:  # a gathered sparse gradient is in no bucket: reduced in wait()
            hooks.launch_ready(self._launch)

    def _end_of_pass(self) -> None:
        self._hooks.queued = False
        self._passes += 1
        if self._passes >= self.passes:
            current = self._launch_rest()
            if self.wait_after_backward:
                try:
                    self.wait()
                finally:
                    self._reset(current)  # no user code ran since the walk: it serves both

    def _launch_rest(self) -> NamedParams | None:
        """Launch every bucket not launched yet; parameters without a gradient send zeros.
        Return the parameters to reduce now (`_current`), walked to find the late ones."""
        if self._state != State.OPEN:
            return None
        self._hooks.launch_rest(self._launch)
        if self._compressing:  # the last buckets' Qs, in one call
            self._router.run(partial(self._low_rank_call, len(self._buckets), [], None))
        self._state = State.LAUNCHED
        # Parameters trainable since the buckets were laid out (identical on every rank).
        current = self._current()
        laid_out = self._template.laid_out
        late = [(n, p) for n, p in current if id(p) not in laid_out]
        if late:
            self._agree()
            if self._keeping:  # made without a handshake: one for the late call, which a rank
                self._agree_late(late)  # that kept its promise on zeros did not make
            leaves = []
            for name, p in late:
                if p.grad is None:
                    p.grad = torch.zeros_like(p)
                leaves.append(leaf_of(grad_family(self.owner, name, p.grad), p.grad))
            self._router.send(leaves)
        return current

    def _agree(self) -> None:
        """Make this step's handshake: every rank reduces the same parameters, now."""
        if self._agreed:
            return
        self._agreed = True
        if self.backend.size == 1:
            return
        self.met_joined = False
        if self._promised():  # every rank promised this step: no handshake (`_may_promise`)
            owe(self.backend, None)
            self._promise, self._keeping = None, True
            self._router.begin(joined=False, offload=self.overlap and self._host)
            return
        try:
            options: Any = self._options
            if self._low is not None:
                options = {**options, "powersgd_iteration": self._low.iteration}
            summary, records = self._step_summary(), self._template.records
            if records is not None and self._early is None:
                records.record["digest"] = summary
            handshake(
                self.backend,
                summary,
                partial(describe, self.owner, options, self._params),
                records=records,
                replay=self._replay,
                on_joined=self._note_joined,
                started=self._early,
            )
        except CollectiveMismatchError:
            self._state = State.FAILED
            raise
        self._router.begin(joined=self._joined, offload=self.overlap and self._host)

    def _agree_late(self, late: NamedParams) -> None:
        """A step every rank promised has parameters trainable since its layout: make their call's
        handshake, which a rank that kept its promise on zeros (without them: it cannot know
        them) meets with its own call's (every rank raises `CollectiveMismatchError`) or, having
        joined, answers with their call on zeros."""
        self._take_back_pending()  # no promise past a step with these: its layout changes
        self._promising_layout = -1
        described = describe(self.owner, self._options, late)
        replay = replay_of([], [], late, self._action, self.bucket_bytes, self._wire)
        try:
            handshake(
                self.backend,
                f"{self._summary}|late|{sorted(described.items())}",
                {**described, "collective": f"{self.owner} gradient reduction, late parameters"},
                replay=lambda _: replay,
                on_joined=self._note_joined,
            )
        except CollectiveMismatchError:
            self._state = State.FAILED
            raise
        if self._joined:  # the call goes where a joined rank answers: the world's engine
            self._router.finish()  # (the step's buckets land first, on their own lane)
            self._router.begin(joined=True, offload=False)

    def _step_summary(self) -> int:
        """The digest this step's handshake compares: of the layout, and PowerSGD's step count."""
        if self._low is None:
            return self._template.digest
        return digest(self._summary + self._low.describe())

    # -- a step made without a handshake, as every rank promised ------------------------------
    # Once every rank has promised, in the words of a step's flags, that its next call is the same
    # step again (nothing else called on the engine between two steps, the layout unchanged), that
    # step goes without a handshake, as Horovod's response cache skips its negotiation: a rank
    # that calls something else first keeps its promise on zeros (`protocol.owe`), and the ranks
    # that made the step raise `CollectiveMismatchError` at its end (or, where it joins, count it
    # as joined).

    def _may_promise(self) -> bool:
        """Whether this rank promises, in this step's flags, that its next call on the engine is
        this step again: nothing but this step's own handshake was made on the engine since the
        last step ended (a step between others' calls would be made on zeros time and again),
        this reduction is one whose calls its layout alone decides (no PowerSGD, gathered sparse
        gradients, nor `dp.torch.join`'s calls after it), and no other promise is held. Up to
        `GATHER_LIMIT` ranks: the words are counted in the bucket's dtype, exact in 16 bits up
        to 256."""
        b = self.backend
        return (
            1 < b.size <= GATHER_LIMIT
            and self._low is None
            and not self._sparse.members
            and self.then_replay is None
            and self.on_join is None
            and not self._abandoned
            and not self._joined
            and owed(b) is None
            and handshakes(b) == self._quiet + (0 if self._keeping else 1)
        )

    def _promised(self) -> bool:
        """Whether this step is the one every rank promised (its layout the promised one)."""
        promise = self._promise
        return (
            promise is not None
            and owed(self.backend) is promise
            and self._layouts == self._promised_layout
            and self.then_replay is None  # `dp.torch.join` began since: its ranks must handshake
            and self.on_join is None
        )

    def _owe(self) -> None:
        """Every rank promised the next step (`_may_promise`): hold the promise, unless the
        layout changed since (on every rank alike) or another reduction holds one."""
        if self._layouts != self._promising_layout or self._joined or owed(self.backend):
            return
        params, buckets = list(self._params), [list(b.members) for b in self._buckets]
        self._promise = partial(self._keep_on_zeros, params, buckets)
        self._promised_layout = self._layouts
        owe(self.backend, self._promise)

    def _take_back_pending(self) -> None:
        """Take back the promise this step's flags sent, where it is still pending on the step's
        end (`_end_then_keep`): a promise held since, or another reduction's, stays."""
        if owed(self.backend) == self._end_then_keep:
            owe(self.backend, None)

    def _end_then_keep(self, joining: bool) -> None:
        """This rank is about to make another call after sending its promise, before `wait()`:
        end the step (which holds the promise if every rank made it), then keep the promise."""
        self.wait()
        promise = self._promise
        if promise is not None and owed(self.backend) is promise:
            owe(self.backend, None)
            promise(joining)

    def _keep_on_zeros(self, params: NamedParams, buckets: list[list[int]], joining: bool) -> None:
        """This rank is about to make another call (`protocol.settle`) than the step it
        promised: make that step's calls on zeros, as the other ranks make them, flagged as not
        made (or as joining), so that they learn it at the step's end."""
        self._promise = None  # `settle` took it
        router = self._router
        router.begin(joined=False, offload=False)
        for b, members in enumerate(buckets):
            leaves = []
            for i in members:
                name, p = params[i]
                zeros = torch.zeros_like(p)
                leaves.append(leaf_of(grad_family(self.owner, name, zeros), zeros))
            last = b == len(buckets) - 1
            router.put(leaves, kept_flags(len(params), joining) if last else None)
        router.finish()  # parameters trainable since: their call begins with a handshake

    def _words(self) -> np.ndarray | None:
        """How many ranks said each of the words after this step's flags (`_buckets.WORDS`)."""
        if self._flags is None:
            return None
        scale = self._action.scale or 1.0
        return np.rint(self._flags[-WORDS:] / scale)

    def _someone_else(self, words: np.ndarray) -> None:
        """Some rank kept its promise of this step on zeros: it joined (its zeros are what it
        answers with; noted as a handshake notes it), or it makes another call: raise
        `CollectiveMismatchError` on every rank, with its call, through a handshake no other
        call can agree with."""
        if words[MADE] + words[JOINING] == self.backend.size:
            self._note_joined()
            return
        self._state = State.FAILED
        done = "this step, made without a handshake as every rank promised at the last"
        call = {**describe(self.owner, self._options, self._params), "made": done}
        handshake(self.backend, f"{self._summary}|made as promised", call)
        raise CollectiveMismatchError(  # unreachable: that handshake's digest is no other call's
            f"{self.owner}: a rank made another call than the gradient reduction all promised."
        )

    def _note_joined(self) -> None:
        self._joined = True  # no rebuild this step
        self.met_joined = True
        if self.on_join is not None:
            self.on_join()

    def _replay(self, _: bool) -> Replay:
        """This step's buckets (and late parameters), for ranks that have joined (`dp.join`)."""
        params, action, wire = self._params, self._action, self._wire
        if self._compressing and self._low is not None:
            return self._low_rank_replay()
        made = replay_of(params, self._buckets, self._current(), action, self.bucket_bytes, wire)
        return made if self.then_replay is None else self.then_replay(made)

    def _low_rank_replay(self) -> PowerSGDReplay:
        """A compressed step's calls: each bucket's uncompressed members, its `P`s and the `Q`s
        due in its call (`extra`), then the last buckets' `Q`s (`_low_rank_call`); the joined
        rank's `dp.torch.join` keeps the `Q`s (`_join`)."""
        low = self._low
        assert low is not None
        buckets: list[Bucket] = []
        extra: list[list[Add]] = []
        compressed = low.compressed([b.members for b in self._buckets])
        ps: list[Add | None] = []  # each bucket's P array
        for bucket, members in zip(self._buckets, compressed, strict=True):
            kept = [i for i in bucket.members if i not in low.matrices]
            buckets.append(Bucket(kept, bucket.key))
            total = sum(low.matrices[i].rows * low.matrices[i].rank for i in members)
            device, dtype = bucket.key
            key = HOST_KEY if device == "cpu" else ("torch", device)
            ps.append((key, dtype, (total,)) if members else None)
        n = len(self._buckets)
        qs: dict[int, int] = {}  # each compressed bucket's Q: its place among the arrays given
        given = 0  # arrays given before this bucket's extra

        def q_adds(b: int) -> list[Add]:
            due = low.due(b, n)
            for at, c in enumerate(due):
                qs[c] = given + at
            return [low.q_add(compressed[c], p) for c in due if (p := ps[c]) is not None]

        for b, bucket in enumerate(buckets):
            p = ps[b]
            mine: list[Add] = [] if p is None else [p]
            given += len(bucket.members) + len(mine)
            q = q_adds(b)  # (reads `given`: the Qs follow this bucket's members and its P)
            extra.append(mine + q)
            given += len(q)
        made = replay_of(
            self._params, buckets, self._current(), self._action, self.bucket_bytes, extra=extra
        )
        flushes = list(made.flushes[:n])
        given += 1 if n else 0  # the flags, with the last bucket
        last = q_adds(n)
        if last:
            flushes.append(tuple(last))
        flushes.extend(made.flushes[n:])  # the late parameters'
        return PowerSGDReplay(
            made.action,
            tuple(flushes),
            made.bucket_bytes,
            made.async_op,
            made.contiguous,
            None,
            None,
            sync=self.join_index,
            qs=tuple(qs[c] for c in sorted(qs)),
        )

    def _launch(self, b: int) -> None:
        self._agree()
        timeline = self._router.fusion.timeline
        if b == 0 and timeline is not None:
            self._started_at = timeline.now()
        leaves: list[Leaf] = []
        delivers: list[Deliver | None] = []
        template, low = self._template, self._low if self._compressing else None
        pack = self._pack(b) if low is None and self._feedback is None else None
        members = [] if pack is not None else self._buckets[b].members
        compressed, computed_now = [], set()
        for i in members:
            name, p = self._params[i]
            grad = p.grad
            computed = grad is not None
            if grad is None:
                grad = p.grad = torch.zeros_like(p)
                self._filled.append(i)
            elif grad.layout != torch.strided:
                grad = self._sparse.densify(i, p)
            if computed and self._feedback is not None:
                self._feedback.apply(i, grad)
            leaf = template.leaf(self.owner, name, i, grad)
            if low is not None and i in low.matrices:
                compressed.append(i)
                if computed:
                    computed_now.add(i)
                continue
            leaves.append(leaf)
            family = leaf[0]
            adopt = self._views and _alone(grad)
            delivers.append(partial(_adopt, family, grad) if adopt else None)
        if low is not None and compressed:  # the Ps of the bucket's matrices, in its call
            factors = low.first(b, compressed, self._params, computed_now)
            leaves.append(leaf_of(grad_family(self.owner, "PowerSGD P", factors), factors))
            delivers.append(None)
        last = b == len(self._buckets) - 1
        if last:  # the flags travel with the last bucket
            promises = self._may_promise()
            self._promising_layout = self._layouts if promises else -1
            if promises:  # a call before `wait()` finds whether all did, and keeps it (`_owe`)
                owe(self.backend, self._end_then_keep)
            self._flags = template.flags(self._filled, self._abandoned, self._sparse.seen, promises)
        flags = self._flags if last else None
        if low is None:
            self._router.send(leaves, flags, delivers, pack)
        else:  # PowerSGD's calls copy their results back (`_low_rank_call`)
            self._router.run(partial(self._low_rank_call, b, leaves, flags))

    def _pack(self, b: int) -> Pack | None:
        """Bucket `b`'s gradients as one pack (`Fusion.add_pack`), where it holds host
        parameters whose gradients are each as the layout planned them (`HostPack.gradients`),
        seen through host views (`TorchFamily.host_views`) and, packed with others, may all
        become their own memory in the bucket (`_all_alone`); else None (each gradient goes its
        own way). One alone is reduced in place, on any engine."""
        plan = self._template.packs[b]
        if plan is None or (grads := plan.gradients()) is None:
            return None
        if len(grads) > 1 and not (self._views and _all_alone(grads)):
            return None  # (before the views: a bfloat16 one shares its gradient's storage)
        family = plan.family
        if family is None:
            name = self._params[self._buckets[b].members[0]][0]
            family = plan.family = cast("TorchFamily", grad_family(self.owner, name, grads[0]))
        works = family.host_views(grads)
        if works is None:
            return None
        deliver = partial(family.adopt_into, grads, plan.places)
        return family, cast("list[object]", grads), works, plan.name, deliver

    def reset(self) -> None:
        """Begin a new step (a step whose last backward pass raised midway is completed first,
        flagged abandoned, so every rank's messages still line up).

        A rank whose backward failed after its gradients began to go out so completes the step's
        messages at its next `zero_grad()`/`step()`: the other ranks' `step()` raises
        `RankFailedError` instead of applying an incomplete average.
        """
        self._reset(None)

    def _reset(self, current: NamedParams | None) -> None:
        """`reset`, given the parameters to reduce if they were walked just before (`refresh`)."""
        if self._state == State.OPEN and (self._arrival or self._early is not None):
            self._abandoned = True
            self.wait()
            current = None
        if not self.refresh(current):
            self._clear()

    def wait(self) -> None:
        """Complete this step's reduction: launch what is left, wait, and write the results.

        Afterwards every parameter's `.grad` holds the reduction over ranks; a parameter that
        had no gradient on any rank keeps `grad=None`. Calling it again before `reset()` does
        nothing.
        """
        if self._state == State.DONE:
            return
        if self._state == State.FAILED:
            raise RuntimeError(message("failed", self.owner, self.passes))
        self._take_back_pending()  # calls from here on are every rank's
        self._launch_rest()
        self._router.finish()
        if self._low is not None:
            self._low_rank_finish()
        if self._sparse.members:
            self._agree()  # made already, unless every parameter is gathered
            self._sparse.reduce(self._params, self.backend, self.op == "avg")
        words = self._words()
        if self._keeping and words is not None and words[MADE] < self.backend.size:
            self._someone_else(words)
        if self._flags is not None:
            n = len(self._params)
            for i in self._filled:
                if self._flags[i] == 0:  # no rank had a gradient: keep None, as one process would
                    self._params[i][1].grad = None
            if self._sparse.learn(self._params, self._flags[n + 1 : 2 * n + 1]):
                self._options["sparse"] = sorted(self._sparse.members)
                self._lay_out(self._params, [i for b in self._buckets for i in b.members])
        self._state = State.DONE
        self.steps += 1
        timeline = self._router.fusion.timeline
        if timeline is not None and self._started_at:
            timeline.complete(
                f"{self.owner} gradients", self._started_at, buckets=len(self._buckets)
            )
        if not self._rebuilt and not self._joined:
            self._rebuild()
        if not self._joined:  # on every rank alike: collective
            mode = self._modes.switch(self._began)
            if mode is not None:
                self._switch(mode)
        self._quiet = handshakes(self.backend)
        if words is not None and words[PROMISES] == self.backend.size:
            self._owe()
        if self._flags is not None and self._flags[len(self._params)] > 0 and not self._abandoned:
            raise RankFailedError(message("abandoned", self.owner, self.passes))

    def _low_rank_call(self, b: int, leaves: list[Any], flags: np.ndarray | None) -> None:
        """Send bucket `b`'s call in a compressed step (`b` = the bucket count: the call after
        the last bucket's), with the `Q`s due in it, and the phases of PowerSGD around it, as
        torch's hook runs them per bucket: the buckets whose `Q`s are due have their averaged
        `P`s back (their calls are `LowRank.lag` calls older): their `Q`s are computed (in one
        order on every rank); the buckets whose `Q`s are back have their gradients written
        (before the call, those landed with the `P`s; after it, all, when no call is left in
        flight). On the thread the step's calls are made on (`Router.run`), so that on the
        communication thread it runs beside backward, and only the last buckets' phases are left
        after it."""
        low, router = self._low, self._router
        assert low is not None
        fusion, n = router.fusion, len(self._buckets)
        newest = b - low.lag if b < n else n - 1  # the newest bucket whose call must have landed
        due = low.due(b, n)
        if (due or low.back(newest)) and newest >= 0:
            fusion.land_before(low.sent[newest])
            low.finish_back(newest)
        for c in due:
            q = low.second(c)
            leaves.append(leaf_of(grad_family(self.owner, "PowerSGD Q", q), q))
            low.q_in[c] = b
        if leaves or flags is not None:
            router.put(leaves, flags)
        low.sent[b] = fusion.calls
        if not fusion.in_flight:  # every call has landed (MPI, on the thread): every Q is back
            low.finish_back()

    def _low_rank_finish(self) -> None:
        """With every call back: write the gradients of the buckets whose `Q`s came last; count
        the step (on every rank alike)."""
        low = self._low
        assert low is not None
        if self._compressing:
            try:
                low.finish_back()
            finally:
                low.discard()
        low.iteration += 1

    def _switch(self, overlap: bool) -> None:
        """Reduce on the communication thread (True) or after backward from the next step on,
        with that mode's bucket size; every rank switches at the same step (`ModeTrial`)."""
        self.overlap = overlap
        if self._given is None:
            self.bucket_bytes = self._modes.bucket_bytes(overlap, True)
            self._options["bucket_bytes"] = self.bucket_bytes
            for fusion in (self._router.base, self._router.private):
                if fusion is not None:
                    fusion.bucket_bytes = self.bucket_bytes
        self._lay_out(self._params, [i for b in self._buckets for i in b.members])


def _adopt(family: Family, grad: torch.Tensor, place: np.ndarray) -> None:
    """Make `grad` use `place`, its reduced values in its bucket's memory (`Fusion.add`), as its
    memory instead of copying them into it (DDP's `gradient_as_bucket_view`, without its fixed
    buffer: the bucket's memory is lent until no gradient uses it). The same tensor object, so
    that whoever holds it sees the result; given only gradients nothing else sees the memory of
    (`_alone`): a flat buffer the user made the gradients views of is written into, as before.
    Only on engines that move calls on by themselves (Gloo, NCCL; `GradientSync._views`).
    """
    with torch.no_grad():
        values = cast("torch.Tensor", family.adopt(grad, place))  # `place`'s memory itself
        grad.set_(values.view(grad.shape))  # type: ignore[call-overload]


def _alone(t: torch.Tensor) -> bool:
    """Whether `t` is contiguous, all of its storage, and the only tensor using it (no view of
    it, nor it a view of a larger buffer); False wherever that cannot be told (`_use_count`)."""
    return _all_alone([t])


def _all_alone(ts: list[torch.Tensor]) -> bool:
    """Whether each of `ts` is `_alone`, in one loop (a pack's gradients, at every step)."""
    count = _USE_COUNT
    if count is None:
        return False
    for t in ts:
        if not t.is_contiguous() or t.storage_offset() != 0:
            return False
        storage = t.untyped_storage()
        if storage.nbytes() != t.nbytes or count(storage._cdata) != 2:  # `t`, and `storage` here
            return False
    return True


def _use_count() -> Callable[[int], int] | None:
    """How many tensors (and storage objects) use a storage: torch's private
    `torch._C._storage_Use_Count` (the storage's reference count), since torch has no public
    way to tell whether a tensor is the only one seeing its memory, and a gradient that a view
    also sees (a flat buffer the user made the gradients views of) must be written into, never
    moved. Checked once on a tensor and its view: where the function is absent, raises, or
    counts otherwise (another torch), None, and every gradient is copied back."""
    count = getattr(torch._C, "_storage_Use_Count", None)
    if count is None:
        return None
    try:
        t = torch.empty(4)
        storage = t.untyped_storage()
        alone = count(storage._cdata)
        view = t.view(2, 2)
        shared = count(storage._cdata)
        del view
    except Exception:  # a torch whose private function takes other arguments
        return None
    return count if (alone, shared) == (2, 3) else None


_USE_COUNT = _use_count()

"""Gradient reduction during `backward()`: `GradientSync`.

`DataParallelModel` (`_model`) and `DistributedOptimizer` (`_optimizer`) are two faces of it. A
post-accumulate-grad hook on every parameter marks its bucket ready when its gradient is final;
ready buckets go out while backward keeps running, handed to the communication thread, or all at
its end (`overlap`, and each mode's bucket size: `_modes.py`; `arrays/comm_thread.py`). The first
bucket holds at most 1 MiB, so the first message leaves early in backward (`_buckets.assign`).

Buckets have fixed members, as DDP's do, rebuilt once after the first step (`_buckets.py`; the
parameters, their hooks and buckets: `_gradplan.py`). How a step's buckets go out, in the same
calls on every rank, each step beginning with a handshake: `_gradlaunch.py`. A rank whose
backward failed after its gradients began to go out completes the step's messages at its next
`zero_grad()`/`step()`, flagging it abandoned: the other ranks' `step()` raises
`RankFailedError` instead of applying an incomplete average.

One `GradientSync` reduces a parameter: the last made over it (`_hooks.py`). Sparse gradients:
`_sparse.py`. Sharp bits: docs/sharp-bits.md.
"""

from __future__ import annotations

import weakref
from collections.abc import Callable
from functools import partial
from typing import TYPE_CHECKING

from dataparallel import world
from dataparallel.arrays.actions import reduction
from dataparallel.arrays.comm_thread import Router
from dataparallel.arrays.compression import wire_dtype
from dataparallel.arrays.fusion import Fusion
from dataparallel.backends.base import Backend
from dataparallel.errors import RankFailedError
from dataparallel.torch._buckets import Bucket, NamedParams, check_options, message
from dataparallel.torch._feedback import ErrorFeedback
from dataparallel.torch._gradlaunch import GradientLaunch, State
from dataparallel.torch._hooks import remove_hooks
from dataparallel.torch._modes import Modes
from dataparallel.torch._sparse import SparseGrads
from dataparallel.torch._tuning import ModeTrial
from dataparallel.types import Op

if TYPE_CHECKING:
    from torch.utils.hooks import RemovableHandle

    from dataparallel.torch._buckets import Compressing, Options

__all__ = ["GradientSync"]


class GradientSync(GradientLaunch):
    """Reduce the gradients of a set of parameters across ranks while `backward()` runs.

    The engine under `DataParallelModel` and `DistributedOptimizer`; use those. A step's
    reduction is started by the hooks of its last backward pass, completed by `wait()`, and a
    new step begins with `reset()`.

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
        compression: `dp.Compression.fp16`/`.bf16`: floating gradients travel in 16 bits.
        sparse_as_dense: make sparse gradients dense (else gathered: `_sparse.py`).
    """

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
        active = world.current()
        self._on_world = backend is None or backend is active.backend
        self._world = weakref.ref(active)
        self.backend = backend if backend is not None else active.backend
        self.op, self.passes, self.owner = op, passes, owner
        # Collective (World.private, offloadable): every rank makes it at the same point.
        private = active.private(self.backend)
        trainable = [(n, p) for n, p in params() if p.requires_grad]
        self._modes = Modes(self.backend, private, trainable, active.settings)  # `_modes.py`
        self.overlap = self._modes.first()
        self._given = bucket_bytes
        self.bucket_bytes = bucket_bytes or self._modes.bucket_bytes(
            self.overlap, self._modes.offload
        )
        self._options: Options = {"op": op, "bucket_bytes": self.bucket_bytes}
        self._options["backward_passes_per_step"] = passes
        if wire is not None or sparse_as_dense:  # described only when set, as they change calls
            self._options |= {"compression": wire, "sparse_as_dense": sparse_as_dense}
        self.wait_after_backward = wait_after_backward
        # False for the backward of a forward run inside DataParallelModel.no_sync().
        self.enabled = True
        self.steps = 0  # completed reductions (observable for tests)
        self.then_replay = self.on_join = None  # set by `dp.torch.join` (`_gradlaunch.py`)
        self.met_joined = False
        action, pool = reduction(op, None, self.backend.size), active.buffers
        self._action, self._wire = action, wire  # replayed by ranks that have joined
        fusion_on = partial(
            Fusion, action=action, bucket_bytes=self.bucket_bytes, pool=pool, compression=wire
        )
        self._router = Router(fusion_on, self.backend, private, active.comm_thread)
        self._source = params
        self._params: NamedParams = []
        self._handles: list[RemovableHandle] = []
        self._cleanup = weakref.finalize(self, remove_hooks, self._handles)
        self._buckets: list[Bucket] = []
        self._bucket_of: list[int] = []
        self._rebuilt = False
        self._replan(trainable, None)
        self._clear()

    @property
    def _trial(self) -> ModeTrial | None:
        """The trial timing the modes, if this reduction times them (`_modes.py`)."""
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
        self._cleanup()
        return GradientSync(self._source, **self._made)  # type: ignore[arg-type]

    @property
    def calls(self) -> int:
        """Communication calls made so far."""
        return self._router.calls

    @property
    def bucket_backend(self) -> Backend:
        """The engine this step's buckets travel on (`arrays/comm_thread.py`)."""
        return self._router.fusion.backend

    # -- one step ----------------------------------------------------------------------------

    def reset(self) -> None:
        """Begin a new step (a step whose last backward pass raised midway is completed first,
        flagged abandoned, so every rank's messages still line up)."""
        if self._state == State.OPEN and (self._arrival or self._early is not None):
            self._abandoned = True
            self.wait()
        if not self.refresh():
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
        self._launch_rest()
        self._router.finish()
        if self._sparse.members:
            self._agree()  # made already, unless every parameter is gathered
            self._sparse.reduce(self._params, self.backend, self.op == "avg")
        if self._flags is not None:
            for i in self._filled:
                if self._flags[i] == 0:  # no rank had a gradient: keep None, as one process would
                    self._params[i][1].grad = None
            if self._sparse.learn(self._params, self._flags[len(self._params) + 1 :]):
                self._options["sparse"] = sorted(self._sparse.members)
                self._replan(self._params, [i for b in self._buckets for i in b.members])
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
        if self._flags is not None and self._flags[len(self._params)] > 0 and not self._abandoned:
            raise RankFailedError(message("abandoned", self.owner, self.passes))

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
        self._replan(self._params, [i for b in self._buckets for i in b.members])

"""How a step's gradients go out while backward runs: `GradientSync`'s launching half.

A post-accumulate-grad hook on every parameter (`_hooks.py`) calls `on_grad` when its gradient
is final for the pass; the parameter's bucket is then ready once all its members are. Why every
rank makes the same calls:

- Buckets are launched strictly in bucket order: a ready bucket waits for the ones before it. So
  ranks whose hooks fire in different orders still make the same calls in the same order.
- At the end of the pass that completes a step (a callback queued on the autograd engine), every
  parameter whose hook did not fire (unused in this step on this rank) contributes its current
  gradient, or zeros when it has none, and the remaining buckets are launched. Every rank has
  then started every bucket before `backward()` returns, so collectives the user makes between
  `backward()` and `step()` stay in the same order on every rank. A parameter no rank used keeps
  `grad=None` (flags travel with the last bucket): optimizers skip it, as in one process.
- Every step's reduction begins with a handshake (`protocol.handshake`) before its first bucket,
  so a step that does not line up with the other ranks' (a rank skipped one) raises
  `CollectiveMismatchError` on every rank instead of hanging or mixing buffers. Ranks that have
  joined (`dp.join`) answer it by replaying the step's buckets with zeros (`_replay`).

`GradientSync` (`_gradsync.py`) is a `GradientLaunch`: it makes it, completes a step (`wait`)
and begins the next (`reset`).
"""

from __future__ import annotations

import time
from collections.abc import Callable
from enum import Enum
from functools import partial
from typing import TYPE_CHECKING

import numpy as np
import torch

from dataparallel import world
from dataparallel.arrays.actions import Reduction
from dataparallel.arrays.comm_thread import Router
from dataparallel.arrays.replay import Replay
from dataparallel.errors import CollectiveMismatchError
from dataparallel.protocol import Started, handshake, start_handshake
from dataparallel.torch._buckets import describe, grad_family, message, replay_of, step_flags
from dataparallel.torch._gradplan import GradientPlan
from dataparallel.types import WireDtype

__all__ = ["GradientLaunch", "State"]


class State(Enum):
    """Where a step's reduction is: open to gradients, launched, done, or failed its handshake."""

    OPEN = "open"
    LAUNCHED = "launched"
    DONE = "done"
    FAILED = "failed"


class GradientLaunch(GradientPlan):
    """A step's state, and its buckets launched as gradients come (the half `GradientSync`
    stands on; `GradientSync.__init__` sets every attribute below, then begins a step)."""

    passes: int  # backward passes per step
    overlap: bool  # buckets go to the communication thread as they are ready
    wait_after_backward: bool  # the step completes at the end of its last pass
    enabled: bool  # False for the backward of a forward run inside `no_sync()`
    _router: Router
    _action: Reduction  # what the buckets' calls do (replayed by ranks that have joined)
    _wire: WireDtype | None  # their compression
    # Set by `dp.torch.join` for a ZeroRedundancyOptimizer stepping with these gradients
    # (`_zero_join.py`): what its joined ranks do after the reduction, and a call when some
    # rank has joined.
    then_replay: Callable[[Replay], Replay] | None
    on_join: Callable[[], None] | None
    met_joined: bool  # whether the last step's handshake met a rank that has joined

    if TYPE_CHECKING:  # `GradientSync`'s: a step completed, and the next begun

        def wait(self) -> None: ...

        def reset(self) -> None: ...

    def _clear(self) -> None:
        """Begin a new step's state: no gradient yet, no bucket launched, no handshake made."""
        self._state: State = State.OPEN
        self._passes = 0
        self._queued = False
        self._ready = [False] * len(self._params)
        self._pending = [len(b.members) for b in self._buckets]
        self._next = 0
        self._filled: list[int] = []
        self._arrival: list[int] = []
        self._flags: np.ndarray | None = None
        self._sparse.seen.clear()
        self._agreed = self._abandoned = self._joined = False
        self._early: Started | None = None  # this step's handshake, begun at its first gradient
        self._router.discard()  # left by a step that failed; nothing otherwise
        self._router.trace(world.current().timeline if world.initialized() else None)
        self._started_at = 0.0
        self._began = 0.0  # when this step's first gradient came (for ModeTrial)

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
        return self._state != State.OPEN or self._passes > 0 or self._queued

    def on_grad(self, index: int) -> None:
        """Take note that parameter `index`'s gradient is final for this pass (its hook fired)."""
        if not self.enabled:
            return
        if self._state == State.FAILED:  # the last step's handshake failed: this is a new step
            self._clear()
        if self._state != State.OPEN:
            raise RuntimeError(message("late gradient", self.owner, self.passes))
        if not self._queued:
            torch.autograd.Variable._execution_engine.queue_callback(self._end_of_pass)
            self._queued = True
            if not self._began:
                self._began = time.perf_counter()
        if self._passes + 1 < self.passes or self._ready[index]:
            return
        if self._next > 0:
            self._router.progress()
        self._ready[index] = True
        self._arrival.append(index)
        if not self._arrival[1:] and self._begins_early:
            self._early = start_handshake(self.backend, self._summary)
        b = self._bucket_of[index]
        if b < 0:  # a gathered sparse gradient: reduced in wait()
            return
        self._pending[b] -= 1
        if b == self._next and self._pending[b] == 0 and self.overlap:
            self._launch_ready()

    def _end_of_pass(self) -> None:
        self._queued = False
        self._passes += 1
        if self._passes >= self.passes:
            self._launch_rest()
            if self.wait_after_backward:
                try:
                    self.wait()
                finally:
                    self.reset()

    def _launch_ready(self) -> None:
        while self._next < len(self._buckets) and self._pending[self._next] == 0:
            self._launch(self._next)
            self._next += 1

    def _launch_rest(self) -> None:
        """Launch every bucket not launched yet; parameters without a gradient send zeros."""
        if self._state != State.OPEN:
            return
        for index, ready in enumerate(self._ready):
            if not ready:
                self._ready[index] = True
                if self._bucket_of[index] >= 0:
                    self._pending[self._bucket_of[index]] -= 1
        self._launch_ready()
        self._state = State.LAUNCHED
        # Parameters that became trainable after this step's plan (identical on every rank).
        planned = {id(p) for _, p in self._params}
        late = [(n, p) for n, p in self._current() if id(p) not in planned]
        if late:
            self._agree()
            leaves = []
            for name, p in late:
                if p.grad is None:
                    p.grad = torch.zeros_like(p)
                leaves.append((grad_family(self.owner, name, p.grad), p.grad))
            self._router.send(leaves)

    def _agree(self) -> None:
        """Make this step's handshake: every rank reduces the same parameters, now."""
        if self._agreed:
            return
        self._agreed = True
        if self.backend.size == 1:
            return
        self.met_joined = False
        try:
            handshake(
                self.backend,
                self._summary,
                partial(describe, self.owner, self._options, self._params),
                replay=self._replay,
                on_joined=self._note_joined,
                started=self._early,
            )
        except CollectiveMismatchError:
            self._state = State.FAILED
            raise
        self._router.begin(joined=self._joined, offload=self.overlap and self._host)

    def _note_joined(self) -> None:
        self._joined = True  # no rebuild this step
        self.met_joined = True
        if self.on_join is not None:
            self.on_join()

    def _replay(self, _: bool) -> Replay:
        """This step's buckets (and late parameters), for ranks that have joined (`dp.join`)."""
        params, action, wire = self._params, self._action, self._wire
        made = replay_of(params, self._buckets, self._current(), action, self.bucket_bytes, wire)
        return made if self.then_replay is None else self.then_replay(made)

    def _launch(self, b: int) -> None:
        self._agree()
        timeline = self._router.fusion.timeline
        if b == 0 and timeline is not None:
            self._started_at = timeline.now()
        leaves = []
        for i in self._buckets[b].members:
            name, p = self._params[i]
            computed = p.grad is not None
            if p.grad is None:
                p.grad = torch.zeros_like(p)
                self._filled.append(i)
            self._sparse.densify(i, p)
            if computed and self._feedback is not None:
                self._feedback.apply(i, p.grad)
            leaves.append((grad_family(self.owner, name, p.grad), p.grad))
        if b == len(self._buckets) - 1:  # the flags travel with the last bucket
            n = len(self._params)
            self._flags = step_flags(n, self._filled, self._abandoned, self._sparse.flags(n))
        self._router.send(leaves, self._flags if b == len(self._buckets) - 1 else None)

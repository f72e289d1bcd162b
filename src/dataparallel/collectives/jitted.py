"""How a rank that has joined (`dp.join`) meets the jitted steps of the ranks still working.

A jitted `DistributedOptimizer` step (`jax/_jit.py`) reduces on the engine's private duplicate,
without a handshake, so the join loop (which answers handshakes on the engine) never sees it.
Instead, a rank that joins while jitted steps exist posts, on the private duplicate, the same
engine call as a step's first one (its first buffer: the packed leaves, then the order check's
`t` and `t * t`), of zeros, from a thread (`Answer`), while its join loop goes on:

- a working rank's next jitted step meets it: the order check sums to fewer ranks' `t` than the
  world has, so every working rank stops before the step's other buffers, makes one handshake
  on the engine (`refuse`), which sends the joined ranks a `Refusal`, and raises
  `RankJoinedError`; the joined ranks raise it from `dp.join`. No call is left half made: the
  world stays usable.
- the others join too: their answers meet it, all zeros, and `dp.join` returns as usual.

Each rank posts one answer per `dp.join`, so the k-th answers meet. Which call it posts:
`step_of` decides, alike on every rank that joins at the same point; where it cannot tell,
nothing is posted and a jitted step after a join waits. The steps are registered per engine by
`jax/_jit.py` when it traces a packed step (`register_step`); `dp.finalize()` clears them.
"""

from __future__ import annotations

import threading
from collections.abc import Callable
from dataclasses import dataclass, field

import numpy as np

from dataparallel import caches
from dataparallel.arrays.replay import Replay
from dataparallel.backends.base import Backend
from dataparallel.errors import RankJoinedError
from dataparallel.protocol import Describe, handshake

__all__ = [
    "Answer",
    "JittedStep",
    "Refusal",
    "agreed",
    "ran",
    "refuse",
    "register_step",
    "step_of",
]

_FIX = (
    "Call dp.join() only after the last jitted step on every rank, give every rank the same "
    "number of steps (dp.data's samplers), or make the uneven tail's updates eagerly (outside "
    "jax.jit), which ranks that have joined answer."
)


@dataclass(frozen=True)
class JittedStep:
    """A jitted step's first engine call: on `private`, `length` items of `dtype`, the order
    check's `t` and `t * t` last; `call` makes it (in place, a sum) as the step does (mpi4jax's
    calls are not counted by the MPI engine's `CallBoard`, so neither is the answer to them)."""

    private: Backend
    length: int
    dtype: str
    call: Callable[[np.ndarray], None] = field(compare=False)


@dataclass
class _Traced:
    """What one engine's jitted steps tell a rank that joins (`step_of`)."""

    steps: set[JittedStep] = field(default_factory=set)  # the first calls traced
    unseen: set[JittedStep] = field(default_factory=set)  # those whose runs the host never sees
    ran: set[JittedStep] = field(default_factory=set)  # those run since the world last agreed
    settle: Callable[[], None] | None = None  # waits for the steps dispatched to finish


# Per engine (its id).
_traced: dict[int, _Traced] = {}
caches.register(_traced.clear)


def register_step(
    engine: Backend, step: JittedStep, *, seen: bool = True, settle: Callable[[], None]
) -> None:
    """Note that a jitted step whose first engine call is `step` was traced on `engine`. `seen`:
    whether the host notes its runs (`ran`); `settle`: waits until every step dispatched so far
    has run (JAX runs them asynchronously), so that the runs noted are all of them."""
    traced = _traced.setdefault(id(engine), _Traced())
    traced.steps.add(step)
    if not seen:
        traced.unseen.add(step)
    traced.settle = settle


def ran(engine: Backend, step: JittedStep) -> None:
    """Note that a step beginning with `step` runs on `engine` (on the host, before its first
    call: once per step, so it costs a set's lookup).

    Called by the callback and FFI bridges; mpi4jax's calls never reach the host, so where one
    of its steps begins otherwise, the runs cannot tell (`register_step`'s `seen`).
    """
    traced = _traced.get(id(engine))
    if traced is not None and step not in traced.ran:
        traced.ran.add(step)


def agreed(engine: Backend) -> None:
    """Every rank of `engine` is at the same point (a `dp.join` returned, or a jitted step met
    ranks that have joined, on every rank): the steps run before no longer tell what runs next."""
    traced = _traced.get(id(engine))
    if traced is not None:
        traced.ran.clear()


def step_of(engine: Backend) -> JittedStep | None:
    """The first call that the next jitted step on `engine` makes, or None where it cannot be
    told: the one first call of every step traced, else of every step run since the world last
    agreed (`agreed`) when no step the host cannot see begins otherwise; None where neither
    tells (or nothing was traced). Waits first for the steps dispatched to run.

    Every step traced in the world may begin with the same call (first buffers of one length and
    dtype). Where they differ (a second optimizer, a new model), the steps run since the world
    last agreed (a `dp.join` that returned, or a `RankJoinedError` on every rank) may all begin
    with the same one: ranks make the same steps in the same order, so every rank that joins at
    the same point chooses alike, and a program that moves from one step to another (a new phase
    of training) is answered. A working rank that moves to a step of another first call after a
    rank joined meets an answer of another size, and fails in the engine as ranks running steps
    of different sizes do. Steps of several first calls run since, alternating, tell nothing.
    """
    traced = _traced.get(id(engine))
    if traced is None:
        return None
    if traced.settle is not None:
        traced.settle()
    if len(traced.steps) == 1:
        return next(iter(traced.steps))
    if len(traced.ran) == 1 and traced.unseen <= traced.ran:
        return next(iter(traced.ran))
    return None


class Answer:
    """A joined rank's answer to the jitted steps: `step`'s first call, of zeros, on a thread."""

    def __init__(self, step: JittedStep) -> None:
        self._buf = np.zeros(step.length, step.dtype)
        self._error: BaseException | None = None
        self._thread = threading.Thread(
            target=self._run, args=(step.call,), name="dp-join-jitted", daemon=True
        )
        self._thread.start()

    def _run(self, call: Callable[[np.ndarray], None]) -> None:
        try:
            call(self._buf)
        except BaseException as error:  # raised by `finish`, on the join loop's thread
            self._error = error

    def finish(self) -> None:
        """Wait for the answer: every rank has joined, so theirs meet it (raise its error)."""
        self._thread.join()
        if self._error is not None:
            raise self._error


class Refusal(Replay):
    """What the working ranks send the joined ones when a jitted step met their answers."""

    def __init__(self) -> None:
        super().__init__(None)

    def run(self, backend: Backend, pool: object = None) -> None:
        """Nothing to make: the joined ranks raise `error` instead."""

    @staticmethod
    def error(rank: int) -> RankJoinedError:
        return RankJoinedError(
            f"rank {rank} has joined (dp.join) while other ranks still run jitted "
            "DistributedOptimizer steps: a jitted step cannot answer a rank that has joined, "
            f"so the step failed on the working ranks and dp.join fails here. {_FIX}"
        )


def refuse(engine: Backend, joined: int, call: Describe) -> RankJoinedError:
    """On a working rank whose jitted step met `joined` answers: tell the joined ranks (one
    handshake on `engine`, made alike by every working rank), and return the error to raise."""
    handshake(engine, "jitted step met ranks that have joined", call, replay=lambda _: Refusal())
    agreed(engine)
    return RankJoinedError(
        f"{joined} of the {engine.size} ranks have joined (dp.join) while this rank runs jitted "
        "DistributedOptimizer steps: a jitted step cannot answer a rank that has joined, so it "
        f"fails here (before sending its other buffers) and dp.join fails there. {_FIX}"
    )

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

Each rank posts one answer per `dp.join`, so the k-th answers meet. The answer is a step's first
call only where every step traced in the world begins with the same call (first buffers of one
length and dtype); where two differ, nothing is posted (`step_of` says None) and a jitted step
after a join waits, as before. Registered per engine by `jax/_jit.py` when it traces a packed
step; `dp.finalize()` clears it.
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

__all__ = ["Answer", "JittedStep", "Refusal", "refuse", "register_step", "step_of"]

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


# Per engine (its id): the first call of every jitted step traced on it, or None where they differ.
_steps: dict[int, JittedStep | None] = {}
caches.register(_steps.clear)


def register_step(engine: Backend, step: JittedStep) -> None:
    """Note that a jitted step whose first engine call is `step` was traced on `engine`."""
    known = _steps.setdefault(id(engine), step)
    if known is not None and known != step:
        _steps[id(engine)] = None


def step_of(engine: Backend) -> JittedStep | None:
    """The first call of every jitted step traced on `engine`, or None (none, or they differ)."""
    return _steps.get(id(engine))


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
    return RankJoinedError(
        f"{joined} of the {engine.size} ranks have joined (dp.join) while this rank runs jitted "
        "DistributedOptimizer steps: a jitted step cannot answer a rank that has joined, so it "
        f"fails here (before sending its other buffers) and dp.join fails there. {_FIX}"
    )

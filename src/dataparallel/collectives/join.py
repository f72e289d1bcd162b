"""`join`: uneven inputs. A rank that has run out of data keeps answering the others' reductions.

Horovod's `hvd.join()` and the idea of DDP's `Join`: a rank that calls `join()` takes part in
every handshake of the ranks still working (`protocol.joined_round`), marked as joined. From their
handshake it learns what they send next (a `Replay`) and makes the same engine calls with zeros:
their allreduces, reduce-scatters, gradient steps (`DistributedOptimizer`, `DataParallelModel`),
reducers' flushes and barriers complete, and averages divide by the whole world's size, as in
Horovod (the joined ranks count, with zeros). Collectives that cannot be answered so (gathers,
broadcasts, objects, all-to-all) raise `RankJoinedError` on the ranks that made them, and the
joined ranks keep waiting. `join()` returns when every rank has joined, on every rank alike, with
the rank that joined last.
"""

from __future__ import annotations

from collections.abc import Callable

from dataparallel.arrays.pool import BufferPool
from dataparallel.arrays.replay import Replay
from dataparallel.backends.base import Backend
from dataparallel.collectives._call import context
from dataparallel.collectives.jitted import Answer, Refusal, agreed, step_of
from dataparallel.groups import Group, backend_of
from dataparallel.protocol import joined_round

__all__ = ["answer", "join"]

# How a joined rank makes what the working ranks described (`Replay.run`, or a caller's own
# answer for replays it knows: `dp.torch.join`'s ZeRO steps).
Run = Callable[[Replay, Backend, BufferPool], None]


def join(*, backend: Backend | None = None, group: Group | None = None) -> int:
    """Say that this rank has no more data; answer the others' reductions until all have joined.

    Collective, in a loose sense: every rank calls it once, when it runs out of data, and may
    do so while others still train. Until then this rank contributes zeros to the others'
    allreduces, reduce-scatters, gradient steps and reducer flushes, and takes part in their
    barriers; an average still divides by the whole world's size (Horovod's rule), so the ranks
    still training see `sum of their values / size()`. Other collectives made meanwhile raise
    `RankJoinedError` on the ranks that made them.

    Args:
        backend: the engine to use (default: the active one).
        group: join among the ranks of this `dp.new_group` group (default: the world).

    Returns:
        The rank that joined last (the same on every rank; the highest of those that joined
        last together).

    Raises:
        RankJoinedError: another rank ran a jitted `DistributedOptimizer` step after this one
            joined (a jitted step cannot be answered; it raises there too, `jitted.py`).

    >>> import dataparallel as dp
    >>> _ = dp.initialize("single")
    >>> dp.join()
    0
    """
    return answer(backend_of(backend, group))


def answer(backend: Backend | None, run: Run = Replay.run) -> int:
    """`join`'s loop on `backend` (None: the active one): answer every handshake, making each
    replay with `run` (default: `Replay.run`), until every rank has joined."""
    ctx = context(backend)
    b = ctx.backend
    if b.size == 1:
        return 0
    step = step_of(b)  # jitted steps were traced: answer them too (`jitted.py`)
    jitted = Answer(step) if step is not None else None
    newcomer = True
    while True:
        done, last, replay = joined_round(b, newcomer)
        newcomer = False
        if isinstance(replay, Refusal):  # a jitted step met this rank's answer
            agreed(b)
            if jitted is not None and type(replay) is Refusal:
                jitted.finish()  # met by that step: wait for it to return, so that nothing
                # of it runs beside this rank's next call on the private duplicate
            raise replay.error(b.rank)
        if done:
            agreed(b)  # every rank is here: the steps run before tell nothing (`jitted.py`)
            if jitted is not None:
                jitted.finish()
            return last
        if replay is not None:
            run(replay, b, ctx.buffers)

"""`dp.torch.join`: a training loop over uneven data that neither hangs nor skews the average.

DDP's `Join` context manager, over `dp.join`: wrap the loop, and a rank that leaves it first
(it ran out of batches) keeps answering the other ranks' gradient steps with zeros until every
rank has left.
"""

from __future__ import annotations

from types import TracebackType

from torch import nn, optim

from dataparallel.arrays.pool import BufferPool
from dataparallel.arrays.replay import Replay
from dataparallel.backends.base import Backend
from dataparallel.collectives.join import answer
from dataparallel.torch._gradsync import GradientSync
from dataparallel.torch._zero.fully_shard import FullyShardedModule
from dataparallel.torch._zero.join import ZeroJoin, ZeroReplay
from dataparallel.torch._zero.optimizer import ZeroRedundancyOptimizer

__all__ = ["Join", "join"]


def _gradient_sync(joinable: object) -> GradientSync:
    sync = getattr(joinable, "gradient_sync", None)
    if not isinstance(sync, GradientSync):
        raise TypeError(
            "dp.torch.join takes the dp.torch.DataParallelModel or dp.DistributedOptimizer whose "
            "gradients the loop reduces, and dp.torch.ZeroRedundancyOptimizer, got "
            f"{type(joinable).__module__}.{type(joinable).__qualname__}."
        )
    return sync


class Join:
    """The context manager `dp.torch.join` returns; `last` is the rank that left last.

    On a normal exit from the block, the step still in flight (if any) is completed, then this
    rank joins (`dp.join`): until every rank has left its block, it takes part in the others'
    gradient steps with zeros (the average still divides by the whole world's size, as with
    Horovod's `join`), reductions and barriers, and steps its slice of each ZeRO optimizer
    given (`_zero.join`). An exception leaving the block is not held back.
    """

    def __init__(self, *joinables: nn.Module | optim.Optimizer, enable: bool = True) -> None:
        if any(isinstance(j, FullyShardedModule) for j in joinables):
            raise ValueError(
                "dp.torch.join cannot take a fully_shard model: a rank that has left its loop "
                "would have to answer every module's gathers and reduce-scatters in the others' "
                "order, which it cannot know. Give every rank as many batches "
                "(dp.DistributedDataLoader does) when the model is fully sharded."
            )
        zeros = [j for j in joinables if isinstance(j, ZeroRedundancyOptimizer)]
        self._syncs = [_gradient_sync(j) for j in joinables if j not in zeros]
        self._zeros = [ZeroJoin(z, i, self._syncs) for i, z in enumerate(zeros)]
        backends = {id(s.backend): s.backend for s in self._syncs}
        backends |= {id(z.backend): z.backend for z in zeros}
        if len(backends) > 1:
            raise ValueError(
                "dp.torch.join: the model and optimizers given reduce over different groups; "
                "join them in separate blocks."
            )
        self._backend: Backend | None = next(iter(backends.values()), None)
        self.enable = enable
        self.last: int | None = None

    def __enter__(self) -> Join:
        if self.enable:
            for z in self._zeros:
                z.attach()
        return self

    def __exit__(
        self,
        kind: type[BaseException] | None,
        error: BaseException | None,
        traceback: TracebackType | None,
    ) -> None:
        if not self.enable:
            return
        try:
            if error is not None:
                return
            for sync in self._syncs:
                if sync.in_flight:
                    sync.wait()
                    sync.reset()
            self.last = answer(self._backend, self._answer)
            for z in self._zeros:
                z.settle()
        finally:
            for z in self._zeros:
                z.detach()

    def _answer(self, replay: Replay, backend: Backend, pool: BufferPool) -> None:
        if isinstance(replay, ZeroReplay) and replay.optimizer < len(self._zeros):
            self._zeros[replay.optimizer].answer(replay, backend, pool)
        else:
            replay.run(backend, pool)


def join(*joinables: nn.Module | optim.Optimizer, enable: bool = True) -> Join:
    """Train over uneven data: a rank that finishes its batches first answers the others' steps.

    Args:
        joinables: the `dp.torch.DataParallelModel` and/or `dp.DistributedOptimizer` whose
            gradients the loop reduces (their group is the one joined), and any
            `dp.torch.ZeroRedundancyOptimizer` the loop steps (stage 1 with the wrapper that
            reduces its gradients: `join(model, optimizer)`; stage 2 alone: `join(optimizer)`).
        enable: join at the end of the block (False: a plain block, for even data).

    Returns:
        A context manager; after the block, its `last` is the rank that left its block last.

    >>> import torch, dataparallel as dp
    >>> _ = dp.initialize()
    >>> model = dp.torch.DataParallelModel(torch.nn.Linear(2, 1))
    >>> opt = torch.optim.SGD(model.parameters(), lr=0.1)
    >>> with dp.torch.join(model) as joined:
    ...     for x in torch.ones(3 + dp.rank(), 4, 2):     # more batches on higher ranks
    ...         opt.zero_grad()
    ...         model(x).sum().backward()
    ...         opt.step()
    >>> joined.last == dp.size() - 1
    True
    """
    return Join(*joinables, enable=enable)

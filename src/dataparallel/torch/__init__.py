"""PyTorch integration: gradient reduction during `backward()`, model wrapping, state broadcast.

- `_gradsync`: the one implementation of overlapped gradient reduction, under
  `DataParallelModel` and `DistributedOptimizer`; its buckets and modes (`_buckets`) and the
  registry of which reducer owns a parameter (`_hooks`).
- `DataParallelModel` (`_model`): a module wrapper that averages gradients during `backward()`.
- `synchronize_torch` (`_synchronize`): broadcast a module's or an optimizer's state from a root.
- `distributed_torch_optimizer` (`_optimizer`): the PyTorch face of `dp.DistributedOptimizer`.
- `allreduce`, `allgather`, `broadcast`, `alltoall`, `reducescatter` (`_autograd`): collectives
  that autograd differentiates, with Horovod's gradients.
- `SyncBatchNorm` (`_syncbn`): batch normalization over every rank's batch.
- Sparse gradients in `GradientSync` (`_sparse`): gathered and coalesced, or made dense.
- `join` (`_join`): uneven data; a rank that leaves its loop first answers the others' steps.
- `ZeroRedundancyOptimizer` (`_zero`, a package): optimizer state (and gradients) sharded
  across ranks; `fully_shard` (`_zero.fully_shard`): parameters too (ZeRO stage 3).

Loaded on first access to `dp.torch`, so that `import dataparallel` does not import PyTorch.
"""

from __future__ import annotations

try:
    import torch as _torch  # noqa: F401 - fail here, with what to install, not deep in a submodule
except ImportError as exc:
    raise ModuleNotFoundError(
        "dp.torch needs PyTorch, which is not installed here: pip install 'dataparallel[torch]' "
        "(or pip install torch).",
        name="torch",
    ) from exc

from dataparallel.torch._autograd import Splits as Splits
from dataparallel.torch._autograd import allgather, allreduce, alltoall, broadcast, reducescatter
from dataparallel.torch._buckets import Compressing as Compressing
from dataparallel.torch._buckets import NamedParams as NamedParams
from dataparallel.torch._join import Join, join
from dataparallel.torch._model import DataParallelModel
from dataparallel.torch._optimizer import distributed_torch_optimizer
from dataparallel.torch._syncbn import SyncBatchNorm
from dataparallel.torch._synchronize import synchronize_torch
from dataparallel.torch._zero.fully_shard import FullyShardedModule, ParameterShard, fully_shard
from dataparallel.torch._zero.optimizer import ZeroRedundancyOptimizer

__all__ = [
    "DataParallelModel",
    "FullyShardedModule",
    "Join",
    "ParameterShard",
    "SyncBatchNorm",
    "ZeroRedundancyOptimizer",
    "allgather",
    "allreduce",
    "alltoall",
    "broadcast",
    "distributed_torch_optimizer",
    "fully_shard",
    "join",
    "reducescatter",
    "synchronize_torch",
]

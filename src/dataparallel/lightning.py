"""Lightning's `Trainer` over this library: `Trainer(strategy=DataParallelStrategy())`.

Lightning removed its Horovod strategy in 2.0; `strategy="ddp"` reduces gradients with torch's
`DistributedDataParallel` whatever launched the job. `DataParallelStrategy` is a Lightning
`ParallelStrategy` whose every distributed act goes through this library instead:

- **the processes**: whatever launched them (`dataparallel run`, mpiexec, torchrun, srun) and
  `dp.initialize()` found; `DataParallelEnvironment` hands Lightning the world's rank, size,
  local rank and node, so Lightning launches nothing and needs no address or port of its own;
- **the gradients**: the model is wrapped in `dp.torch.DataParallelModel` (reduced in buckets
  while backward runs, with its `compression=`, `bucket_bytes=`, `sparse_as_dense=`), unless
  `configure_optimizers` returns optimizers that reduce their gradients themselves
  (`dp.DistributedOptimizer`, `dp.torch.ZeroRedundancyOptimizer(stage=2)`): then the model
  stays bare. `dp.torch.ZeroRedundancyOptimizer(stage=1)` works under the wrapper; Lightning
  consolidates its state on rank 0 for checkpoints (`consolidate_state_dict`);
- **the strategy's collectives** (`reduce`, `all_gather`, `broadcast`, `barrier`, and so
  `self.log(..., sync_dist=True)`, `ModelCheckpoint`'s agreement on paths, early stopping's
  decisions): `dp.allreduce`, `dp.allgather` (`dp.torch.allgather` with `sync_grads=True`),
  `dp.broadcast_object`, `dp.barrier`;
- **the data**: Lightning's `DistributedSampler` injection, with the world's rank and size;
- **checkpoints**: written by rank 0 only (Lightning's `Strategy.save_checkpoint`).

torch's own default group exists beside the world (`dp.initialize()` makes it), so code that
calls `torch.distributed` directly, torchmetrics among it, still works.
"""

from __future__ import annotations

import contextlib
import socket
from collections.abc import Iterator
from typing import Any

try:
    import pytorch_lightning as pl
except ImportError as exc:
    raise ModuleNotFoundError(
        "dataparallel.lightning needs PyTorch Lightning, which is not installed here: "
        "pip install 'dataparallel[lightning]' (or pip install pytorch-lightning).",
        name="pytorch_lightning",
    ) from exc
import torch
from lightning_fabric.plugins import CheckpointIO, ClusterEnvironment
from lightning_fabric.utilities.types import ReduceOp
from pytorch_lightning.core.optimizer import LightningOptimizer
from pytorch_lightning.plugins.precision import Precision
from pytorch_lightning.strategies import ParallelStrategy, StrategyRegistry
from pytorch_lightning.trainer.states import TrainerFn
from pytorch_lightning.utilities.rank_zero import rank_zero_only

from dataparallel import world
from dataparallel.collectives.gathers import allgather
from dataparallel.collectives.objects import allgather_object, barrier, broadcast_object
from dataparallel.collectives.reductions import allreduce
from dataparallel.groups import Group
from dataparallel.torch import DataParallelModel, ZeroRedundancyOptimizer, synchronize_torch
from dataparallel.torch import allgather as differentiable_allgather
from dataparallel.types import Op

__all__ = ["DataParallelEnvironment", "DataParallelStrategy"]


class DataParallelEnvironment(ClusterEnvironment):
    """Lightning's view of this library's world: its rank, size, local rank and node.

    The launcher made the processes (`creates_processes_externally`), and the world they formed
    is the truth: Lightning's attempts to set the rank or the size are refused unless they agree
    with it. The node of a rank is its host's place among the world's hosts in the order of
    their lowest ranks, learnt once at construction (collective: every rank makes one).
    """

    def __init__(self) -> None:
        hosts: list[str] = allgather_object(socket.gethostname())
        order = list(dict.fromkeys(hosts))  # each host once, by its lowest rank
        self._node_rank = order.index(hosts[world.rank()])
        self._nodes = len(order)

    @property
    def creates_processes_externally(self) -> bool:
        return True

    @property
    def main_address(self) -> str:
        # torch's group is made by `dp.initialize()` over the world's own rendezvous; Lightning
        # reads these only to make one itself, which this strategy never asks it to.
        return "127.0.0.1"

    @property
    def main_port(self) -> int:
        return 0

    @staticmethod
    def detect() -> bool:
        return world.initialized()

    def world_size(self) -> int:
        return world.size()

    def set_world_size(self, size: int) -> None:
        if size != world.size():
            raise ValueError(_launched_differently("world size", size, world.size()))

    def global_rank(self) -> int:
        return world.rank()

    def set_global_rank(self, rank: int) -> None:
        if rank != world.rank():
            raise ValueError(_launched_differently("global rank", rank, world.rank()))

    def local_rank(self) -> int:
        return world.local_rank()

    def node_rank(self) -> int:
        return self._node_rank

    @property
    def nodes(self) -> int:
        """The number of hosts the world spans."""
        return self._nodes

    def validate_settings(self, num_devices: int, num_nodes: int) -> None:
        if num_nodes not in (1, self._nodes):
            raise ValueError(
                f"Trainer(num_nodes={num_nodes}), but the job spans {self._nodes} "
                f"host{'s' if self._nodes > 1 else ''}: with DataParallelStrategy the launcher "
                "decides the processes; leave num_nodes at its default."
            )


def _launched_differently(what: str, asked: int, actual: int) -> str:
    return (
        f"Lightning asked for {what} {asked}, but the job was launched with {actual}: with "
        "DataParallelStrategy the launcher (dataparallel run -n N, mpiexec -n N, torchrun) "
        "decides the processes; give the Trainer devices=1 (the default on CPU) and no num_nodes."
    )


class DataParallelStrategy(ParallelStrategy):
    """Train with Lightning's `Trainer` over this library's world and gradient reduction.

    Launch the script as any other of this library's (`dataparallel run -n 4 train.py`,
    `mpiexec -n 4 python train.py`, `torchrun --nproc-per-node 4 train.py`): each process is one
    rank with one device, and the strategy calls `dp.initialize()` if the script did not.

    Args:
        compression: `dp.Compression.fp16` or `.bf16` (`.fp16_feedback`, `.bf16_feedback`: with
            error feedback): gradients travel as 16-bit floats (`dp.torch.DataParallelModel`).
        bucket_bytes: the gradient buckets' size (default `DATAPARALLEL_BUCKET_BYTES`).
        sparse_as_dense: reduce sparse gradients as dense ones.
        accelerator: Lightning's, as for `DDPStrategy` (default: the Trainer's).
        parallel_devices: Lightning's (default: the Trainer's `devices`, one per process).
        checkpoint_io: Lightning's (default: the Trainer's plugin, else torch's files).
        precision_plugin: Lightning's (default: the Trainer's `precision`).

    Differences from `strategy="ddp"`: the processes are never launched by Lightning (run the
    script under a launcher); buffers (BatchNorm statistics) are broadcast when the model is
    wrapped, not at every forward (`dp.synchronize(model)` makes them equal again);
    `reduce`/`all_gather` take a `dp.new_group` group, not a torch one.

    >>> import pytorch_lightning as pl, dataparallel as dp
    >>> from dataparallel.lightning import DataParallelStrategy
    >>> trainer = pl.Trainer(strategy=DataParallelStrategy(), accelerator="cpu", logger=False)
    >>> trainer.world_size == dp.size()
    True
    """

    strategy_name = "dataparallel"

    def __init__(
        self,
        *,
        compression: Any = None,
        bucket_bytes: int | None = None,
        sparse_as_dense: bool = False,
        accelerator: pl.accelerators.Accelerator | None = None,
        parallel_devices: list[torch.device] | None = None,
        checkpoint_io: CheckpointIO | None = None,
        precision_plugin: Precision | None = None,
    ) -> None:
        if not world.initialized():
            world.initialize()
        super().__init__(
            accelerator=accelerator,
            parallel_devices=parallel_devices,
            cluster_environment=DataParallelEnvironment(),
            checkpoint_io=checkpoint_io,
            precision_plugin=precision_plugin,
        )
        self._compression = compression
        self._bucket_bytes = bucket_bytes
        self._sparse_as_dense = sparse_as_dense
        self._num_nodes = 1
        rank_zero_only.rank = world.rank()  # type: ignore[attr-defined]

    # -- where this process is ---------------------------------------------------------------

    @property
    def root_device(self) -> torch.device:
        devices = self.parallel_devices or [torch.device("cpu")]
        if devices[0].type == "cpu":
            return torch.device("cpu")
        index = world.device()
        return torch.device(devices[0].type, index if index is not None else self.local_rank)

    @property
    def num_nodes(self) -> int:
        return self._num_nodes

    @num_nodes.setter
    def num_nodes(self, num_nodes: int) -> None:
        # The Trainer hands its `num_nodes` here; the world decides, so only agreement is kept.
        assert isinstance(self.cluster_environment, DataParallelEnvironment)
        self.cluster_environment.validate_settings(1, num_nodes)
        self._num_nodes = self.cluster_environment.nodes

    @property
    def is_distributed(self) -> bool:
        """Lightning injects a `DistributedSampler` where this is true."""
        return True

    @property
    def distributed_sampler_kwargs(self) -> dict[str, Any]:
        return {"num_replicas": world.size(), "rank": world.rank()}

    def set_world_ranks(self) -> None:
        """Called by the Trainer: make Lightning's rank-zero-only utilities this world's."""
        devices = self.parallel_devices or []
        if len(devices) > 1 and devices[0].type == "cpu":
            raise ValueError(
                f"Trainer(devices={len(devices)}) on CPU: with DataParallelStrategy each process "
                "is one rank with one device, and the launcher makes the processes "
                f"(dataparallel run -n {len(devices) * world.size()} ...). Leave devices at 1."
            )
        rank_zero_only.rank = world.rank()  # type: ignore[attr-defined]
        with contextlib.suppress(ImportError):
            from lightning_utilities.core.rank_zero import rank_zero_only as utils_rank_zero_only

            utils_rank_zero_only.rank = world.rank()  # type: ignore[attr-defined]

    # -- the model and its optimizers --------------------------------------------------------

    def setup(self, trainer: pl.Trainer) -> None:
        """Move the model, make the optimizers, then wrap the model unless they reduce."""
        assert self.accelerator is not None and self.model is not None
        self.accelerator.setup(trainer)
        fitting = trainer.state.fn == TrainerFn.FITTING
        if fitting and self._layer_sync:
            self.model = self._layer_sync.apply(self.model)
        self.model = self.precision_plugin.convert_module(self.model)
        self.model_to_device()
        if fitting:
            self.setup_optimizers(trainer)
            self._wrap_model(trainer)
        else:  # nothing to reduce: make every rank's parameters rank 0's, as DDP does
            synchronize_torch(self.model, root=0)
        self.setup_precision_plugin()

    def _wrap_model(self, trainer: pl.Trainer) -> None:
        inner = [_unwrapped(o) for o in self.optimizers]
        reducing = [_reduces_itself(o) for o in inner]
        if any(reducing) and not all(reducing):
            names = [type(o).__name__ for o in inner]
            raise ValueError(
                f"configure_optimizers returned {names}: some reduce their gradients themselves "
                "(DistributedOptimizer, ZeroRedundancyOptimizer(stage=2)) and some do not, so "
                "some gradients would not be reduced. Return only plain optimizers (the "
                "strategy reduces the gradients) or only self-reducing ones."
            )
        for optimizer in inner:
            passes = getattr(optimizer, "backward_passes_per_step", None)
            accumulate = trainer.accumulate_grad_batches
            if passes is not None and passes != accumulate:
                raise ValueError(
                    f"DistributedOptimizer(backward_passes_per_step={passes}) under "
                    f"Trainer(accumulate_grad_batches={accumulate}): they must be equal, or "
                    "return the plain optimizer and let the strategy reduce the gradients."
                )
        assert self.model is not None
        if any(reducing):
            synchronize_torch(self.model, root=0)
            return
        self.model = DataParallelModel(
            self.model,
            bucket_bytes=self._bucket_bytes,
            compression=self._compression,
            sparse_as_dense=self._sparse_as_dense,
        )

    def model_to_device(self) -> None:
        assert self.model is not None
        self.model.to(self.root_device)

    @contextlib.contextmanager
    def block_backward_sync(self) -> Iterator[None]:
        """Accumulate locally in the backward passes Lightning accumulates (`no_sync`)."""
        if isinstance(self.model, DataParallelModel):
            with self.model.no_sync():
                yield
        else:
            yield

    def teardown(self) -> None:
        if isinstance(self.model, DataParallelModel):
            self.model = self.lightning_module  # dropped: its gradient hooks fall silent
        if self.lightning_module is not None and self._layer_sync and self.model is not None:
            trainer = self.lightning_module._trainer
            if trainer is not None and trainer.state.fn == TrainerFn.FITTING:
                self.model = self._layer_sync.revert(self.model)
        super().teardown()

    # -- the strategy's collectives ----------------------------------------------------------

    def reduce(
        self,
        tensor: Any,
        group: Any | None = None,
        reduce_op: ReduceOp | str | None = "mean",
    ) -> Any:
        """Reduce `tensor` over the world (or a `dp.new_group` group), in place, as DDP's.

        Anything but a tensor comes back unchanged. `"mean"` of an integer tensor is the sum
        divided by the size in the tensor's dtype, as under `strategy="ddp"` with Gloo.
        """
        if not isinstance(tensor, torch.Tensor):
            return tensor
        op = _op(reduce_op)
        chosen = _group(group, "reduce")
        data = tensor.detach()
        if op == "avg" and not torch.is_floating_point(data):
            allreduce(data, "sum", group=chosen)
            data.copy_(data / world.size(chosen))
        else:
            allreduce(data, op, group=chosen)
        return tensor

    def all_gather(
        self, tensor: torch.Tensor, group: Any | None = None, sync_grads: bool = False
    ) -> torch.Tensor:
        """Return every rank's `tensor` stacked on a new first axis, in rank order.

        With `sync_grads`, gradients flow back to each rank's `tensor` summed over the ranks'
        gradients of its row, as torch's differentiable `all_gather`.
        """
        chosen = _group(group, "all_gather")
        row = tensor.contiguous().unsqueeze(0)
        if not sync_grads:
            with torch.no_grad():
                return allgather(row, group=chosen)
        # `dp.torch.allgather` averages the gradients (Horovod's); scaling the backward by the
        # size, and not the forward, gives torch's sum.
        size = world.size(chosen)
        row = row * size - (row * (size - 1)).detach()
        return differentiable_allgather(row, group=chosen)

    def broadcast(self, obj: Any, src: int = 0) -> Any:
        return broadcast_object(obj, root=src)

    def barrier(self, name: str | None = None) -> None:
        barrier()

    @classmethod
    def register_strategies(cls, strategy_registry: Any) -> None:
        strategy_registry.register(
            cls.strategy_name, cls, description="this library's world and gradient reduction"
        )


def _unwrapped(optimizer: torch.optim.Optimizer) -> torch.optim.Optimizer:
    if isinstance(optimizer, LightningOptimizer):
        return optimizer._optimizer
    return optimizer


def _reduces_itself(optimizer: torch.optim.Optimizer) -> bool:
    """Whether `optimizer` reduces its parameters' gradients (the model then stays bare)."""
    if isinstance(optimizer, ZeroRedundancyOptimizer):
        return optimizer.stage == 2
    return hasattr(type(optimizer), "gradient_sync")  # dp.DistributedOptimizer's classes


_OPS: dict[str, Op] = {
    "mean": "avg",
    "avg": "avg",
    "sum": "sum",
    "max": "max",
    "min": "min",
    "product": "prod",
    "prod": "prod",
}


def _op(reduce_op: ReduceOp | str | None) -> Op:
    if reduce_op is None:
        return "avg"
    if isinstance(reduce_op, str):
        name = reduce_op.lower()
    else:
        torch_ops = {
            ReduceOp.SUM: "sum",
            ReduceOp.AVG: "avg",
            ReduceOp.MAX: "max",
            ReduceOp.MIN: "min",
            ReduceOp.PRODUCT: "prod",
        }
        name = next((n for o, n in torch_ops.items() if reduce_op == o), repr(reduce_op))
    if name not in _OPS:
        raise ValueError(
            f"DataParallelStrategy.reduce: reduce_op={reduce_op!r} is not one of "
            f"{sorted(_OPS)} (or torch's ReduceOp SUM, AVG, MAX, MIN, PRODUCT)."
        )
    return _OPS[name]


def _group(group: Any, what: str) -> Group | None:
    if group is None or isinstance(group, Group):
        return group
    with contextlib.suppress(ImportError):
        from torch.distributed import GroupMember

        if group is GroupMember.WORLD:
            return None
    raise ValueError(
        f"DataParallelStrategy.{what}: group={group!r} is not a dp.new_group group; pass one of "
        "those, or None for the world."
    )


# `Trainer(strategy="dataparallel")` once this module is imported (Lightning registers only
# its own strategies by itself).
DataParallelStrategy.register_strategies(StrategyRegistry)

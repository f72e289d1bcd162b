"""`Trainer.fit` with `DataParallelStrategy` and with `strategy="ddp"`, in the same processes.

Usage: `lightning_strategy.py CHECKPOINT_DIR`, under any launcher (each process one rank).

The same tiny model is fitted on the same data set (Lightning's own `DistributedSampler`
injection splits it) in four ways, each once with `DataParallelStrategy()` and once with
`strategy="ddp"` (which finds torch's group that `dp.initialize()` made), and every rank prints
`FIT variant=V strategy=S rank=R losses=... weights=... logged=L` (its batches' losses, the
parameters after the fit, and the `sync_dist` mean of the last step's loss):

- `plain`: SGD with momentum, 3 steps;
- `accumulate`: the same with `accumulate_grad_batches=2`;
- `zero1`, `zero2`: `configure_optimizers` returns `dp.torch.ZeroRedundancyOptimizer` over SGD
  with momentum, stage 1 (the strategy's model wrapper reduces) and stage 2 (it reduces
  itself); the `ddp` runs of these use torch's plain SGD, the numbers to match.

Then the `plain` fit with `DataParallelStrategy` saves a checkpoint in CHECKPOINT_DIR through a
`CheckpointIO` that prints `SAVED rank=R path=P` where it writes; every rank loads it back and
prints `LOADED rank=R same=True|False` (its weights against the checkpoint's). Last, the
strategy's collectives against torch.distributed's on the same values: `COLLECTIVES rank=R ok`.
Then, in a `Trainer` of one CPU device and no strategy, `configure_optimizers` returning
`dp.DistributedOptimizer(SGD)` and `dataparallel.horovod.torch.DistributedOptimizer(SGD)`
(`lightning_fit.optimizer_fit`: its lines end with `optimizer=dp` or `optimizer=horovod`).
"""

import os
import sys
from pathlib import Path

import pytorch_lightning as pl
import torch
from lightning_fabric.plugins import TorchCheckpointIO
from lightning_fabric.utilities.distributed import _all_gather_ddp_if_available, _sync_ddp

import dataparallel as dp
from dataparallel.lightning import DataParallelStrategy

STEPS, PER_RANK, FEATURES, LR, MOMENTUM = 3, 4, 3, 0.1, 0.5


def say(line: str) -> None:
    sys.stdout.write(line + "\n")
    sys.stdout.flush()


def numbers(values: list[float]) -> str:
    return ",".join(f"{v:.9g}" for v in values)


class Tiny(pl.LightningModule):
    def __init__(self, zero: int) -> None:
        super().__init__()
        torch.manual_seed(dp.rank())  # different on every rank: the strategy must broadcast
        self.layer = torch.nn.Linear(FEATURES, 1)
        self.zero = zero
        self.losses: list[float] = []

    def training_step(self, batch: list[torch.Tensor], index: int) -> torch.Tensor:
        x, y = batch
        loss = ((self.layer(x) - y) ** 2).mean()
        self.losses.append(loss.item())
        self.log("loss", loss, sync_dist=True)  # the strategy's reduce, every step
        return loss

    def configure_optimizers(self) -> torch.optim.Optimizer:
        if self.zero:
            return dp.torch.ZeroRedundancyOptimizer(
                self.parameters(), torch.optim.SGD, stage=self.zero, lr=LR, momentum=MOMENTUM
            )
        return torch.optim.SGD(self.parameters(), lr=LR, momentum=MOMENTUM)


class Saving(TorchCheckpointIO):
    def save_checkpoint(self, checkpoint, path, storage_options=None):  # type: ignore[no-untyped-def]
        say(f"SAVED rank={dp.rank()} path={Path(path).name}")
        super().save_checkpoint(checkpoint, path, storage_options)


def loader(size: int, batches: int) -> torch.utils.data.DataLoader:
    g = torch.Generator().manual_seed(1)
    rows = batches * PER_RANK * size
    data = torch.utils.data.TensorDataset(
        torch.randn(rows, FEATURES, generator=g), torch.randn(rows, 1, generator=g)
    )
    return torch.utils.data.DataLoader(data, batch_size=PER_RANK)  # the sampler: Lightning's


def fit(variant: str, which: str, **extra: object) -> tuple[pl.Trainer, Tiny]:
    accumulate = 2 if variant == "accumulate" else 1
    zero = {"zero1": 1, "zero2": 2}.get(variant, 0) if which == "dataparallel" else 0
    if which == "dataparallel":
        strategy, placement = DataParallelStrategy(), {"devices": 1}
    else:  # Lightning checks devices x nodes against the launcher's world
        placement = {"devices": dp.local_size(), "num_nodes": dp.size() // dp.local_size()}
        strategy = "ddp"
    trainer = pl.Trainer(
        strategy=strategy,
        accelerator="cpu",
        **placement,  # type: ignore[arg-type]
        max_steps=STEPS,
        accumulate_grad_batches=accumulate,
        logger=False,
        enable_progress_bar=False,
        enable_model_summary=False,
        enable_checkpointing=False,
        **extra,  # type: ignore[arg-type]
    )
    assert trainer.world_size == dp.size() and trainer.global_rank == dp.rank()
    model = Tiny(zero)
    trainer.fit(model, loader(dp.size(), STEPS * accumulate))
    weights = torch.cat([p.detach().flatten() for p in model.layer.parameters()]).tolist()
    logged = float(trainer.callback_metrics["loss"])
    say(
        f"FIT variant={variant} strategy={which} rank={dp.rank()} losses={numbers(model.losses)} "
        f"weights={numbers(weights)} logged={logged:.9g}"
    )
    return trainer, model


def collectives(strategy: DataParallelStrategy) -> None:
    """The strategy's collectives give what torch.distributed's (DDP's) give."""
    rank, size = dp.rank(), dp.size()
    for op in ("mean", "sum", "max", "min", torch.distributed.ReduceOp.SUM, None):
        for dtype in (torch.float32, torch.int64):
            ours = torch.arange(3, dtype=dtype) * (rank + 1) + 1
            theirs = ours.clone()
            assert strategy.reduce(ours, reduce_op=op) is ours
            _sync_ddp(theirs, reduce_op="mean" if op is None else op)
            assert torch.equal(ours, theirs), (op, dtype, ours, theirs)
    assert strategy.reduce("not a tensor") == "not a tensor"
    row = torch.full((2, 3), float(rank))
    gathered = strategy.all_gather(row)
    assert torch.equal(gathered, _all_gather_ddp_if_available(row)), gathered
    assert gathered.shape == (size, 2, 3)
    grads = []
    for gather in (strategy.all_gather, _all_gather_ddp_if_available):
        leaf = torch.full((2,), float(rank + 1), requires_grad=True)
        out = gather(leaf, sync_grads=True)
        (out * torch.arange(1.0, size + 1).unsqueeze(1)).sum().backward()
        grads.append(leaf.grad)
    assert torch.equal(grads[0], grads[1]), grads
    assert strategy.broadcast({"from": rank}, src=size - 1) == {"from": size - 1}
    strategy.barrier("end")
    assert strategy.reduce_boolean_decision(rank == 0, all=False) is True
    assert strategy.reduce_boolean_decision(rank == 0, all=True) is (size == 1)
    say(f"COLLECTIVES rank={rank} ok")


if __name__ == "__main__":
    dp.initialize()
    for variant in ("plain", "accumulate", "zero1", "zero2"):
        for which in ("dataparallel", "ddp"):
            fit(variant, which)
    folder = Path(sys.argv[1])
    trainer, model = fit("plain", "dataparallel", plugins=[Saving()])
    trainer.save_checkpoint(folder / "last.ckpt")
    trainer.strategy.barrier()
    saved = torch.load(folder / "last.ckpt", weights_only=False)
    same = all(
        torch.equal(saved["state_dict"][name], p.detach()) for name, p in model.named_parameters()
    )
    say(f"LOADED rank={dp.rank()} same={same} files={sorted(os.listdir(folder))}")
    assert isinstance(trainer.strategy, DataParallelStrategy)
    collectives(trainer.strategy)
    from lightning_fit import optimizer_fit

    for optimizer in ("dp", "horovod"):
        optimizer_fit(optimizer, f"optimizer={optimizer}")

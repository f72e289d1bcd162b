"""Lightning's `Trainer.fit` of a tiny model under `dataparallel run`, against one process.

Usage: `lightning_fit.py WHICH [NODES DEVICES]`:
- `dp`: `configure_optimizers` returns `dp.DistributedOptimizer(SGD)`, after `dp.initialize()`;
- `horovod`: it returns `dataparallel.horovod.torch.DistributedOptimizer(SGD)` (same world);
  both fit with a `Trainer` of one CPU device per rank, the optimizer averaging the gradients;
- `ddp`: a plain Lightning script, `Trainer(strategy="ddp", num_nodes=NODES, devices=DEVICES)`:
  Lightning finds its rank and node in the launcher's variables and makes torch's group itself.

Each rank fits on its share of a fixed data set (rank r: rows r, r + size, ..., four per step)
for `STEPS` steps and prints `STEP rank=R step=I loss=L` (its share's loss), then
`WEIGHTS rank=R values=...` (weight, then bias, after the last step) and `LIGHTNING rank=R
global_rank=G node_rank=N world_size=W` (the Trainer's view). Rank 0 also prints the same fit
by one process on the whole batch with plain torch: `REFERENCE step=I loss=L` and
`REFERENCE weights=...`. `optimizer_fit(which, label)` is the `dp`/`horovod` fit for a job that
runs it among other checks (`lightning_strategy.py`): each of its lines ends with `label`.
"""

import sys

import pytorch_lightning as pl
import torch

STEPS, PER_RANK, FEATURES, LR = 3, 4, 3, 0.1


def say(line: str) -> None:
    """Print `line` in one write (mpiexec interleaves the ranks' output by writes)."""
    sys.stdout.write(line + "\n")
    sys.stdout.flush()


def data(size: int) -> tuple[torch.Tensor, torch.Tensor]:
    """The whole data set: STEPS batches of PER_RANK rows for each of `size` ranks."""
    g = torch.Generator().manual_seed(1)
    rows = STEPS * PER_RANK * size
    return torch.randn(rows, FEATURES, generator=g), torch.randn(rows, 1, generator=g)


def first_layer() -> torch.nn.Linear:
    torch.manual_seed(0)
    return torch.nn.Linear(FEATURES, 1)


def numbers(layer: torch.nn.Linear) -> str:
    """The layer's parameters, weight then bias, as printed."""
    values = torch.cat([p.detach().flatten() for p in layer.parameters()])
    return ",".join(f"{v:.9g}" for v in values.tolist())


def reference(size: int, label: str = "") -> None:
    """One process, the whole batch of every step (the ranks' rows of that step), plain torch."""
    x, y = data(size)
    layer = first_layer()
    sgd = torch.optim.SGD(layer.parameters(), lr=LR)
    for step in range(STEPS):
        rows = [r + size * (step * PER_RANK + i) for r in range(size) for i in range(PER_RANK)]
        sgd.zero_grad()
        loss = ((layer(x[rows]) - y[rows]) ** 2).mean()
        loss.backward()
        sgd.step()
        say(f"REFERENCE step={step} loss={loss.item():.9g} {label}")
    say(f"REFERENCE weights={numbers(layer)} {label}")


class Tiny(pl.LightningModule):
    def __init__(self, which: str, rank: int, label: str = "") -> None:
        super().__init__()
        self.layer = first_layer()
        self.which, self.rank, self.label = which, rank, label

    def training_step(self, batch: list[torch.Tensor], index: int) -> torch.Tensor:
        x, y = batch
        loss = ((self.layer(x) - y) ** 2).mean()
        say(f"STEP rank={self.rank} step={index} loss={loss.item():.9g} {self.label}")
        return loss

    def configure_optimizers(self) -> torch.optim.Optimizer:
        sgd = torch.optim.SGD(self.parameters(), lr=LR)
        if self.which == "dp":
            import dataparallel as dp

            return dp.DistributedOptimizer(sgd)
        if self.which == "horovod":
            import dataparallel.horovod.torch as hvd

            return hvd.DistributedOptimizer(sgd, named_parameters=self.named_parameters())
        return sgd


QUIET = {"enable_checkpointing": False, "enable_progress_bar": False, "enable_model_summary": False}
COMMON = {"accelerator": "cpu", "max_steps": STEPS, "logger": False, **QUIET}


def fit(trainer: pl.Trainer, which: str, rank: int, size: int, label: str = "") -> None:
    """Fit on this rank's share, printing the lines the module's docstring names."""
    say(
        f"LIGHTNING rank={rank} global_rank={trainer.global_rank} node_rank={trainer.node_rank} "
        f"world_size={trainer.world_size} {label}"
    )
    x, y = data(size)
    share = torch.utils.data.TensorDataset(x[rank::size], y[rank::size])
    model = Tiny(which, rank, label)
    trainer.fit(model, torch.utils.data.DataLoader(share, batch_size=PER_RANK))
    say(f"WEIGHTS rank={rank} values={numbers(model.layer)} {label}")
    if rank == 0:
        reference(size, label)


def optimizer_fit(which: str, label: str = "") -> None:
    """Fit with `which`'s optimizer (`dp` or `horovod`) in a `Trainer` of one CPU device."""
    import dataparallel as dp

    dp.initialize()
    fit(pl.Trainer(devices=1, **COMMON), which, dp.rank(), dp.size(), label)  # type: ignore[arg-type]


if __name__ == "__main__":
    which = sys.argv[1]
    if which == "ddp":
        nodes, devices = int(sys.argv[2]), int(sys.argv[3])
        trainer = pl.Trainer(
            strategy="ddp",
            num_nodes=nodes,
            devices=devices,
            use_distributed_sampler=False,
            **COMMON,  # type: ignore[arg-type]
        )
        fit(trainer, which, trainer.global_rank, trainer.world_size)
        # The group is left to `dataparallel run`, as a plain script leaves it (its exit hook
        # destroys it: `launch/runner.py`).
    else:
        optimizer_fit(which)

"""`dataparallel.lightning.DataParallelStrategy` under a real `Trainer.fit`, against DDP's.

`scripts/lightning_strategy.py` fits the same model on the same data with the strategy and with
`strategy="ddp"` in the same processes (plain SGD with momentum, gradient accumulation, ZeRO
stages 1 and 2), saves a checkpoint and checks the strategy's collectives against
torch.distributed's. Here each job's printout is read back: every rank's losses and weights
must be DDP's, the checkpoint written by rank 0 alone; then `dp.DistributedOptimizer` and
Horovod's, returned by `configure_optimizers` without the strategy, must each fit as one process
does. Jobs at MPI 2 ranks and Gloo 3 (each engine and each size; `--matrix=full` adds MPI 3 and
Gloo 2), in the world of one; the argument checks run in it and in two of the multi-rank worlds
(`heavy`).
"""

from __future__ import annotations

import importlib.util
import re
from pathlib import Path

import pytest
from _jobs import outer_world_size, run_job
from _lightning import assert_fits_like_one_process, needs_lightning

SCRIPTS = Path(__file__).parent / "scripts"
VARIANTS = ("plain", "accumulate", "zero1", "zero2")

pytestmark = [
    needs_lightning,
    # Lightning's advice on this machine (srun is installed; tiny loaders without workers).
    pytest.mark.filterwarnings("ignore:The `srun` command is available"),
    pytest.mark.filterwarnings("ignore:The '.*dataloader' does not have many workers"),
]


def fits(output: str) -> dict[tuple[str, str, int], dict[str, list[float]]]:
    """Read the `FIT` lines: (variant, strategy, rank) -> losses, weights, logged."""
    found: dict[tuple[str, str, int], dict[str, list[float]]] = {}
    for line in output.splitlines():
        line = re.sub(r"^\[rank \d+\] ", "", line)
        if not line.startswith("FIT "):
            continue
        fields = dict(pair.split("=", 1) for pair in line.split()[1:])
        key = (fields["variant"], fields["strategy"], int(fields["rank"]))
        assert key not in found or key == ("plain", "dataparallel", int(fields["rank"])), line
        found.setdefault(
            key,
            {k: [float(v) for v in fields[k].split(",")] for k in ("losses", "weights", "logged")},
        )
    return found


spawns = [
    pytest.mark.spawns,
    pytest.mark.skipif(
        outer_world_size() > 1, reason="launches its own jobs: run this file in a world of one"
    ),
]


def _backend(name: str) -> pytest.MarkDecorator:
    missing = name == "mpi" and importlib.util.find_spec("mpi4py") is None
    return pytest.mark.skipif(missing, reason="needs mpi4py")


# A job fits eight times: the world of one runs each engine and each size once (MPI at 2 ranks,
# Gloo at 3); `--matrix=full` or naming a case runs the other two.
@pytest.mark.matrix(strength=1)
@pytest.mark.parametrize(
    ("backend", "ranks"),
    [
        pytest.param(b, n, marks=[*spawns, _backend(b)], id=f"{b}-{n}")
        for b in ("mpi", "gloo")
        for n in (2, 3)
    ],
)
def test_fits_like_ddp(backend: str, ranks: int, tmp_path: Path) -> None:
    done = run_job(
        [SCRIPTS / "lightning_strategy.py", tmp_path],
        ranks=ranks,
        backend=backend,
        job_timeout=280,
        timeout=300,
    )
    output = done.stdout + done.stderr
    assert done.returncode == 0, output
    found = fits(done.stdout)
    assert len(found) == len(VARIANTS) * 2 * ranks, output
    for variant in VARIANTS:
        reference = found[(variant, "ddp", 0)]
        assert len(reference["losses"]) == 3 * (2 if variant == "accumulate" else 1)
        for rank in range(ranks):
            ours, ddp = found[(variant, "dataparallel", rank)], found[(variant, "ddp", rank)]
            # Each rank's own batches: the same losses; the same weights on every rank.
            assert ours["losses"] == pytest.approx(ddp["losses"], rel=1e-5), (variant, output)
            assert ours["weights"] == pytest.approx(reference["weights"], rel=1e-5, abs=1e-7)
            assert ours["logged"] == pytest.approx(reference["logged"], rel=1e-5)
        # The ranks fitted different batches (the sampler was injected), yet agree on weights.
        first, second = (found[(variant, "dataparallel", r)]["losses"] for r in (0, 1))
        assert first != second, output
    # Rank 0 alone wrote the checkpoint; every rank read back its own weights from it.
    saved = re.findall(r"SAVED rank=(\d+) path=(\S+)", done.stdout)
    assert saved == [("0", "last.ckpt")], output
    assert sorted(p.name for p in tmp_path.iterdir()) == ["last.ckpt"]
    loaded = re.findall(r"LOADED rank=(\d+) same=(\w+)", done.stdout)
    assert sorted(loaded) == [(str(r), "True") for r in range(ranks)], output
    assert sorted(re.findall(r"COLLECTIVES rank=(\d+) ok", done.stdout)) == [
        str(r) for r in range(ranks)
    ], output
    # `configure_optimizers` returns our optimizer, in a Trainer of one device and no strategy:
    # it failed at `Trainer.fit` once (Lightning's re-classing), and Horovod's optimizer after
    # `dp.initialize()` alone reduced nothing. One process's fit on the whole batch, each.
    for optimizer in ("dp", "horovod"):
        label = f"optimizer={optimizer}"
        lines = "\n".join(line for line in done.stdout.splitlines() if line.endswith(label))
        assert_fits_like_one_process(lines, ranks)


# The argument checks below import Lightning on every rank (seconds each) and check what no
# engine changes: `heavy` runs them in two of the multi-rank worlds (conftest.py).
@pytest.fixture
def strategy_class():  # type: ignore[no-untyped-def]
    import dataparallel as dp
    from dataparallel.lightning import DataParallelStrategy

    dp.initialize()
    return DataParallelStrategy


def _trainer(strategy: object, **options: object):  # type: ignore[no-untyped-def]
    import pytorch_lightning as pl

    quiet = {"logger": False, "enable_progress_bar": False, "enable_model_summary": False}
    return pl.Trainer(strategy=strategy, accelerator="cpu", max_steps=1, **quiet, **options)  # type: ignore[arg-type]


@pytest.mark.heavy
def test_the_launcher_decides_the_processes(strategy_class) -> None:  # type: ignore[no-untyped-def]
    import dataparallel as dp

    with pytest.raises(ValueError, match=r"Trainer\(devices=2\) on CPU.*Leave devices at 1"):
        _trainer(strategy_class(), devices=2)
    with pytest.raises(ValueError, match=r"num_nodes=5.*spans 1 host.*leave num_nodes"):
        _trainer(strategy_class(), num_nodes=5)
    trainer = _trainer("dataparallel")  # the registered name
    assert isinstance(trainer.strategy, strategy_class)
    assert (trainer.world_size, trainer.global_rank) == (dp.size(), dp.rank())
    assert trainer.strategy.distributed_sampler_kwargs == {
        "num_replicas": dp.size(),
        "rank": dp.rank(),
    }


@pytest.mark.heavy
def test_bad_collective_arguments(strategy_class) -> None:  # type: ignore[no-untyped-def]
    import torch

    strategy = _trainer(strategy_class()).strategy
    with pytest.raises(ValueError, match=r"reduce_op='median' is not one of"):
        strategy.reduce(torch.ones(2), reduce_op="median")
    with pytest.raises(ValueError, match=r"all_gather: group=.* is not a dp.new_group group"):
        strategy.all_gather(torch.ones(2), group="everyone")


@pytest.mark.heavy
def test_optimizers_that_reduce_and_others_are_refused(strategy_class) -> None:  # type: ignore[no-untyped-def]
    import pytorch_lightning as pl
    import torch

    import dataparallel as dp

    class Two(pl.LightningModule):
        def __init__(self) -> None:
            super().__init__()
            self.a, self.b = torch.nn.Linear(2, 1), torch.nn.Linear(2, 1)
            self.automatic_optimization = False

        def training_step(self, batch, index):  # type: ignore[no-untyped-def]
            return None

        def configure_optimizers(self):  # type: ignore[no-untyped-def]
            reducing = dp.DistributedOptimizer(torch.optim.SGD(self.a.parameters(), lr=0.1))
            return reducing, torch.optim.SGD(self.b.parameters(), lr=0.1)

    data = torch.utils.data.DataLoader(torch.utils.data.TensorDataset(torch.ones(4, 2)))
    refused = r"some reduce their gradients themselves.*and some do not"
    with pytest.raises(ValueError, match=refused):
        _trainer(strategy_class(), enable_checkpointing=False).fit(Two(), data)

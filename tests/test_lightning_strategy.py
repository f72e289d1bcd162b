"""`dataparallel.lightning.DataParallelStrategy` under a real `Trainer.fit`, against DDP's.

`scripts/lightning_strategy.py` fits the same model on the same data with the strategy and with
`strategy="ddp"` in the same processes (plain SGD with momentum, gradient accumulation, ZeRO
stages 1 and 2), saves a checkpoint and checks the strategy's collectives against
torch.distributed's. Here each job's printout is read back: every rank's losses and weights
must be DDP's, the checkpoint written by rank 0 alone. Jobs at 2 and 3 ranks, MPI and Gloo;
the file runs in a world of one (it launches its own jobs), and the argument checks run in any.
"""

from __future__ import annotations

import importlib.util
import re
from pathlib import Path

import pytest
from _jobs import outer_world_size, run_job
from _lightning import needs_lightning

SCRIPTS = Path(__file__).parent / "scripts"
VARIANTS = ("plain", "accumulate", "zero1", "zero2")

pytestmark = needs_lightning


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

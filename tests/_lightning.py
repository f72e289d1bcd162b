"""What `scripts/lightning_fit.py` prints, read back and checked (`test_lightning_strategy.py`,
`test_cli.py`), and the mark of the tests that need Lightning."""

from __future__ import annotations

import importlib.util
import re

import pytest

needs_lightning = pytest.mark.skipif(
    importlib.util.find_spec("pytorch_lightning") is None,
    reason="needs pytorch-lightning (pip install -c constraints.txt -e '.[test]')",
)


def lightning_fit(output: str) -> tuple[dict[int, list[float]], dict[int, list[float]]]:
    """Read `scripts/lightning_fit.py`'s lines: the losses by step and the weights, by rank (-1:
    the one-process reference's)."""
    losses: dict[int, list[float]] = {}
    weights: dict[int, list[float]] = {}
    for line in output.splitlines():
        line = re.sub(r"^\[rank \d+\] ", "", line)
        fields = dict(pair.split("=", 1) for pair in line.split()[1:] if "=" in pair)
        rank = int(fields.get("rank", -1))
        if line.startswith(("STEP ", "REFERENCE step=")):
            losses.setdefault(rank, []).append(float(fields["loss"]))
        elif line.startswith(("WEIGHTS ", "REFERENCE weights=")):
            values = fields.get("values", fields.get("weights", ""))
            weights[rank] = [float(v) for v in values.split(",")]
    return losses, weights


def assert_fits_like_one_process(output: str, size: int) -> None:
    """Every rank ends with the reference's weights; each step's losses average to its loss."""
    losses, weights = lightning_fit(output)
    assert sorted(weights) == [-1, *range(size)], output
    reference = losses.pop(-1)
    for rank in range(size):
        assert weights[rank] == pytest.approx(weights[-1], rel=1e-5, abs=1e-6), output
    mean = [sum(each) / size for each in zip(*losses.values(), strict=True)]
    assert len(mean) == len(reference) == 3 and mean == pytest.approx(reference, rel=1e-5)

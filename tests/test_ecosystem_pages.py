"""The ecosystem pages' Python blocks run as written: in order, one session per page, at 1 and 3
ranks, as `test_readme.py` runs the README's.

`docs/ecosystems/*.md` (Lightning, Hugging Face's Trainer and accelerate, torchmetrics,
torch.distributed.checkpoint): each page is one program split into blocks, and each ends by
asserting what its library promises (the same weights on every rank, the metric over every
rank's items, the checkpoint's state back). One job per world size runs every page whose
libraries are installed (`_readme.py`, each page in its own namespace); a page whose library is
missing is left out and said so in the skip of its own test.
"""

from __future__ import annotations

import importlib.util
from pathlib import Path

import pytest
from _jobs import outer_world_size, run_job
from _readme import blocks

HERE = Path(__file__).parent
PAGES = HERE.parent / "docs" / "ecosystems"
NEEDS = {
    "lightning.md": ("torch", "pytorch_lightning"),
    "huggingface.md": ("torch", "transformers", "accelerate"),
    "torchmetrics.md": ("torch", "torchmetrics"),
    "checkpoint.md": ("torch",),
}


def _runnable() -> list[Path]:
    return [
        PAGES / name
        for name, modules in NEEDS.items()
        if all(importlib.util.find_spec(m) is not None for m in modules)
    ]


def test_every_page_has_a_program() -> None:
    assert sorted(p.name for p in PAGES.glob("*.md")) == sorted(NEEDS)
    for name in NEEDS:
        found = blocks((PAGES / name).read_text(encoding="utf-8"))
        assert found and all(b.source.strip() and b.min_ranks == 1 for b in found), name
        assert any("assert " in b.source for b in found), f"{name} checks nothing"


@pytest.mark.spawns
@pytest.mark.skipif(outer_world_size() > 1, reason="launches its own jobs: run in a world of one")
@pytest.mark.skipif(importlib.util.find_spec("mpi4py") is None, reason="the jobs run under MPI")
@pytest.mark.parametrize("ranks", [1, 3], ids=["1-rank", "3-ranks"])
def test_pages_run_as_written(ranks: int, tmp_path: Path) -> None:
    pages = _runnable()
    missing = sorted(set(NEEDS) - {p.name for p in pages})
    if not pages:
        pytest.skip(f"none of the pages' libraries is installed ({missing})")
    target = [HERE / "_readme.py", *pages]
    # In a scratch folder: the Hugging Face page writes its output_dir where it runs.
    if ranks == 1:
        job = run_job(target, launcher="python", timeout=300, cwd=tmp_path)
    else:
        job = run_job(target, ranks=ranks, job_timeout=280, timeout=300, cwd=tmp_path)
    assert job.returncode == 0, job.stdout + job.stderr
    for page in pages:
        verdicts = [line for line in job.stdout.splitlines() if line.startswith(f"{page.name} ")]
        expected = [
            f"{page.name} block {k} (line {b.line}): ok"
            for k, b in enumerate(blocks(page.read_text(encoding="utf-8")), 1)
        ]
        assert verdicts == expected, job.stdout + job.stderr
    if missing:
        pytest.skip(f"ran {[p.name for p in pages]}; left out {missing}: library not installed")

"""The docs' Python blocks run as written: in order, one session per page, at 1 and 3 ranks.

The README's, the quickstart page's, the page for mpi4jax's users (`docs/migrate/mpi4jax.md`,
whose run on Gloo is `test_jax_jit_collectives.py`'s) and the ecosystem pages'
(`docs/ecosystems/*.md`: Lightning, Hugging Face's Trainer and accelerate, torchmetrics,
torch.distributed.checkpoint; each page one program that ends by asserting what its library
promises), all in the same two jobs: one start-up per world size, not one per page.

`_readme.py` extracts them; each job runs all of them (a block that says `# on N ranks or more`
is skipped below N, and says so; an ecosystem page whose libraries are missing is left out, and
the test says so in its skip). The jobs are real (`dataparallel run`, MPI), so this test is
marked `spawns` and runs in the world of one, each job under `_jobs.run_job`'s time limit.
"""

from __future__ import annotations

import importlib.util
from pathlib import Path

import pytest
from _jobs import outer_world_size, run_job
from _readme import ECOSYSTEM_PAGES, ECOSYSTEMS, blocks

HERE = Path(__file__).parent
README = HERE.parent / "README.md"
QUICKSTART = HERE.parent / "docs" / "quickstart.md"
MPI4JAX = HERE.parent / "docs" / "migrate" / "mpi4jax.md"


def test_every_python_block_is_found() -> None:
    for page, least in ((README, 7), (QUICKSTART, 3), (MPI4JAX, 4)):
        text = page.read_text(encoding="utf-8")
        found = blocks(text)
        assert len(found) == text.count("```python\n") >= least
        assert all(b.source.strip() for b in found)
    # One block says it needs 2 ranks: the process groups' (`# on 2 ranks or more`).
    assert [b.min_ranks for b in blocks(README.read_text(encoding="utf-8"))].count(2) == 1


spawns = [
    pytest.mark.spawns,
    pytest.mark.skipif(
        outer_world_size() > 1,
        reason="launches its own multi-process jobs: run this file in a world of one",
    ),
    pytest.mark.skipif(
        any(importlib.util.find_spec(m) is None for m in ("torch", "jax", "optax", "mpi4py")),
        reason="the blocks use torch, JAX, optax; the jobs run under MPI",
    ),
]


def ecosystem_pages() -> tuple[list[Path], list[str]]:
    """Return the ecosystem pages whose libraries are installed, and the names of the others."""
    runnable, missing = [], []
    for name, modules in ECOSYSTEM_PAGES.items():
        if all(importlib.util.find_spec(m) is not None for m in modules):
            runnable.append(ECOSYSTEMS / name)
        else:
            missing.append(name)
    return runnable, missing


@pytest.mark.parametrize("ranks", [pytest.param(n, marks=spawns, id=f"{n}-ranks") for n in (1, 3)])
def test_blocks_run_as_written(ranks: int, tmp_path: Path) -> None:
    # One job per world size runs every page (each in its own namespace): one start-up, not one
    # per page. A world of one (a plain `python script.py`), and 3 ranks: every block, the one
    # that needs 2 ranks or more too, on a world whose size is not a power of two. In a scratch
    # folder: the Hugging Face page writes its output_dir where it runs.
    pages, missing = ecosystem_pages()
    pages = [README, QUICKSTART, MPI4JAX, *pages]
    target = [HERE / "_readme.py", *pages]
    if ranks == 1:
        job = run_job(target, launcher="python", timeout=300, cwd=tmp_path)
    else:
        job = run_job(target, ranks=ranks, job_timeout=280, timeout=300, cwd=tmp_path)
    assert job.returncode == 0, job.stdout + job.stderr
    skipped = "skipped (needs {} ranks, the world has 1)"
    for page in pages:
        verdicts = [line for line in job.stdout.splitlines() if line.startswith(f"{page.name} ")]
        expected = [
            f"{page.name} block {k} (line {b.line}): "
            + ("ok" if ranks >= b.min_ranks else skipped.format(b.min_ranks))
            for k, b in enumerate(blocks(page.read_text(encoding="utf-8")), 1)
        ]
        assert verdicts == expected, job.stdout + job.stderr
    if missing:
        pytest.skip(f"ran {[p.name for p in pages]}; left out {missing}: library not installed")

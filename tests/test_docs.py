"""The documentation site: it builds with no warning and no broken link, and documents every name.

`mkdocs build --strict` (mkdocs.yml: broken links and anchors, pages left out of the navigation
and docstrings that disagree with their signatures are warnings, so failures) runs once into a
temporary folder; the API pages it writes must hold an entry for every public name: `dp.__all__`,
`dp.print`, the lazily loaded data names, `dp.torch`'s, `dp.jax`'s, and the Horovod drop-in's.
Skipped, with the reason, where the docs extra is not installed.
"""

from __future__ import annotations

import importlib.util
import re
import runpy
import shutil
from pathlib import Path

import pytest
from _jobs import outer_world_size, run_job

import dataparallel as dp

ROOT = Path(__file__).resolve().parents[1]


needs_mkdocs = pytest.mark.skipif(
    any(importlib.util.find_spec(m) is None for m in ("mkdocs", "material", "mkdocstrings")),
    reason="needs the docs extra: pip install -e '.[docs]' (make test installs it)",
)


@pytest.fixture(scope="module")
def site(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """Build the site once for this file; return its folder."""
    out = tmp_path_factory.mktemp("site")
    job = run_job(
        ["-m", "mkdocs", "build", "--strict", "--config-file", ROOT / "mkdocs.yml", "-d", out],
        launcher="python",
        env={"NO_MKDOCS_2_WARNING": "1"},
        timeout=300,
        cwd=ROOT,
    )
    assert job.returncode == 0, job.stdout + job.stderr
    assert "WARNING" not in job.stderr, job.stderr
    return out


def _ids(page: Path) -> set[str]:
    return set(re.findall(r'id="([^"]+)"', page.read_text(encoding="utf-8")))


def _public(module: str) -> list[str]:
    __import__(module)
    names = __import__(module, fromlist=["__all__"]).__all__
    return [f"{module}.{name}" for name in names]


pytestmark = [
    pytest.mark.spawns,
    pytest.mark.skipif(outer_world_size() > 1, reason="builds once, in the world of one"),
]


@needs_mkdocs
def test_site_builds_strict_and_documents_every_public_name(site: Path) -> None:
    pages = {
        "dataparallel": [
            *_public("dataparallel"),
            "dataparallel.print",
            "dataparallel.__version__",
            "dataparallel.data.DistributedDataContainer",
            "dataparallel.data.DistributedDataLoader",
        ],
        "torch": _public("dataparallel.torch") if importlib.util.find_spec("torch") else [],
        "jax": _public("dataparallel.jax") if importlib.util.find_spec("jax") else [],
        "elastic": _public("dataparallel.elastic"),
        "lightning": (
            _public("dataparallel.lightning")
            if importlib.util.find_spec("pytorch_lightning")
            else []
        ),
        "horovod": [
            *_public("dataparallel.horovod"),  # run, __version__, HOROVOD_API_VERSION
            *(_public("dataparallel.horovod.torch") if importlib.util.find_spec("torch") else []),
        ],
    }
    for page, names in pages.items():
        ids = _ids(site / "api" / page / "index.html")
        missing = [name for name in names if name not in ids]
        assert not missing, f"api/{page}.md documents no {missing}"
    assert len(pages["dataparallel"]) == len(dp.__all__) + 4
    # The guides and the migration pages are there, and the plot.
    for page in ("quickstart", "launching", "slurm", "failures", "performance", "gpu"):
        assert (site / page / "index.html").exists(), page
    for page in ("horovod", "ddp", "fluxmpi", "lux", "flashlight"):
        assert (site / "migrate" / page / "index.html").exists(), page
    for page in ("lightning", "huggingface", "torchmetrics", "checkpoint"):
        assert (site / "ecosystems" / page / "index.html").exists(), page
    assert (site / "figures" / "train_step.svg").exists()


@needs_mkdocs
def test_a_broken_link_fails_the_build(tmp_path: Path) -> None:
    # The same configuration, on a copy of the docs with one link that leads nowhere.
    shutil.copytree(ROOT / "docs", tmp_path / "docs")
    shutil.copy(ROOT / "mkdocs.yml", tmp_path / "mkdocs.yml")
    with (tmp_path / "docs" / "failures.md").open("a", encoding="utf-8") as page:
        page.write("\nSee [the missing page](missing.md).\n")
    job = run_job(
        ["-m", "mkdocs", "build", "--strict", "-d", tmp_path / "site"],
        launcher="python",
        env={"NO_MKDOCS_2_WARNING": "1", "PYTHONPATH": str(ROOT / "src")},
        timeout=300,
        cwd=tmp_path,
    )
    assert job.returncode != 0
    assert "missing.md" in job.stderr and "not found" in job.stderr, job.stderr


def test_the_performance_figure_is_drawn_from_the_page() -> None:
    plot = runpy.run_path(str(ROOT / "tools" / "plot_figures.py"))
    expected = plot["svg"](plot["read_ratios"](plot["PAGE"].read_text(encoding="utf-8")))
    assert plot["FIGURE"].read_text(encoding="utf-8") == expected, (
        "docs/figures/train_step.svg is stale: run python tools/plot_figures.py"
    )

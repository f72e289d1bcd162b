"""The package as published: an sdist whose tests run from it, and a wheel with its license.

The sdist and the wheel are built (`python -m build --no-isolation`, setuptools from the test
extra) from a copy of this source tree, so the tree itself is left as it was. From the unpacked
sdist, every test file is collected (each imports its helpers: `conftest.py`, `_jobs.py`, ...)
and a few tests run; the files the README and the docs point to are there.
"""

from __future__ import annotations

import importlib.util
import shutil
import tarfile
import zipfile
from pathlib import Path

import pytest
from _jobs import outer_world_size, run_job

ROOT = Path(__file__).resolve().parents[1]
# What the sdist ships beside the package, and why: the tests and what they read, and what the
# README and the docs point to. (.ci/ and .gitignore stay out: they serve the repository.)
SHIPPED = ("tests", "docs", "examples", "benchmarks", "tools")
_IGNORE = shutil.ignore_patterns(
    ".venv",
    ".git",
    "__pycache__",
    "*.egg-info",
    ".*_cache",
    ".hypothesis",
    "build",
    "dist",
    "site",
    "*.pyc",
    "checkpoints",
    "*.pt",
    "*.whl",
    "*.tar.gz",
)

pytestmark = [
    pytest.mark.spawns,
    pytest.mark.skipif(
        outer_world_size() > 1, reason="builds and runs processes: runs in the world of one"
    ),
    pytest.mark.skipif(
        importlib.util.find_spec("build") is None, reason="needs build: the test extra has it"
    ),
]


def _files(root: Path, folder: str) -> set[str]:
    return {
        p.relative_to(root).as_posix()
        for p in (root / folder).rglob("*")
        if p.is_file() and "__pycache__" not in p.parts and p.suffix != ".pyc"
    }


@pytest.fixture(scope="module")
def built(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, Path, Path]:
    """Return the source copy, the sdist and the wheel, built once for this file."""
    tmp = tmp_path_factory.mktemp("package")
    source = tmp / "source"
    shutil.copytree(ROOT, source, ignore=_IGNORE)
    job = run_job(
        ["-m", "build", "--no-isolation", "--outdir", tmp / "dist", source],
        launcher="python",
        timeout=300,
    )
    assert job.returncode == 0, job.stdout + job.stderr
    (sdist,) = (tmp / "dist").glob("dataparallel-*.tar.gz")
    (wheel,) = (tmp / "dist").glob("dataparallel-*.whl")
    return source, sdist, wheel


def test_sdist_ships_the_tests_their_helpers_docs_and_examples(
    built: tuple[Path, Path, Path],
) -> None:
    source, sdist, _ = built
    with tarfile.open(sdist) as tar:
        top = tar.getnames()[0].split("/")[0]
        names = {name.removeprefix(f"{top}/") for name in tar.getnames()}
    for folder in SHIPPED:
        missing = _files(source, folder) - names
        assert not missing, f"{folder}/ files left out of the sdist: {sorted(missing)}"
    for name in ("LICENSE", "README.md", "Makefile", "constraints.txt", "mkdocs.yml"):
        assert name in names


def test_wheel_carries_the_license_and_the_metadata(built: tuple[Path, Path, Path]) -> None:
    _, _, wheel = built
    with zipfile.ZipFile(wheel) as whl:
        names = whl.namelist()
        (metadata,) = [n for n in names if n.endswith(".dist-info/METADATA")]
        text = whl.read(metadata).decode()
    assert any(n.endswith(".dist-info/licenses/LICENSE") for n in names)
    assert "dataparallel/py.typed" in names
    assert "License-Expression: MIT" in text
    assert "Classifier: Topic :: System :: Distributed Computing" in text
    assert "Provides-Extra: examples" in text and "Provides-Extra: docs" in text
    assert not any(n.startswith("tests/") for n in names)  # the tests travel in the sdist only


def test_tests_run_from_the_unpacked_sdist(built: tuple[Path, Path, Path], tmp_path: Path) -> None:
    _, sdist, _ = built
    with tarfile.open(sdist) as tar:
        tar.extractall(tmp_path, filter="data")
    (unpacked,) = tmp_path.iterdir()
    env = {"PYTHONPATH": str(unpacked / "src")}
    # Every test file imports from the sdist alone (the issue found 20 of 31 that did not).
    collect = run_job(
        ["-m", "pytest", "--collect-only", "-q", "-p", "no:cacheprovider"],
        launcher="python",
        env=env,
        cwd=unpacked,
        timeout=300,
    )
    assert collect.returncode == 0, collect.stdout[-3000:] + collect.stderr[-3000:]
    assert "error" not in collect.stdout.splitlines()[-1], collect.stdout[-3000:]
    collected = {line.split("::")[0] for line in collect.stdout.splitlines() if "::" in line}
    assert collected == {
        p.relative_to(unpacked).as_posix() for p in unpacked.glob("tests/test_*.py")
    }
    # A few tests run, from the sdist's own code.
    job = run_job(
        [
            "-m",
            "pytest",
            "-q",
            "-x",
            "tests/test_config.py",
            "tests/test_readme.py::test_every_python_block_is_found",
        ],
        launcher="python",
        env=env,
        cwd=unpacked,
        timeout=300,
    )
    assert job.returncode == 0, job.stdout + job.stderr
    assert " passed" in job.stdout.splitlines()[-1]

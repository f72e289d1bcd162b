"""The package's modules as files, for the tests that read the source instead of running it
(`test_layers.py`, `test_glossary.py`)."""

from __future__ import annotations

from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
SRC = ROOT / "src"
PACKAGE = SRC / "dataparallel"


def module_name(path: Path) -> str:
    """`src/dataparallel/torch/_zero/__init__.py` -> `dataparallel.torch._zero`."""
    parts = list(path.relative_to(SRC).with_suffix("").parts)
    if parts[-1] == "__init__":
        parts.pop()
    return ".".join(parts)


MODULES = {module_name(p): p for p in sorted(PACKAGE.rglob("*.py"))}

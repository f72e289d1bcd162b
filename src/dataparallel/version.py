"""This package's version, read once from its installed metadata (pyproject.toml's number)."""

from __future__ import annotations

import importlib.metadata

__all__ = ["VERSION"]

try:
    VERSION = importlib.metadata.version("dataparallel")
except importlib.metadata.PackageNotFoundError:  # a source tree on sys.path, not installed
    VERSION = "0+unknown"

"""Names whose dataparallel counterparts are still to come (placeholder until merged)."""

from __future__ import annotations

import importlib


def __getattr__(name: str) -> object:
    if name == "SyncBatchNorm":
        return getattr(importlib.import_module("dataparallel.torch"), name)
    raise AttributeError(f"dataparallel.horovod.torch.{name} is not available yet.")

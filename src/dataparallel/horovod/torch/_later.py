"""Names whose dataparallel counterparts are still to come (placeholder until merged)."""

from __future__ import annotations

import dataparallel as dp


def __getattr__(name: str) -> object:
    if name == "Compression":
        return dp.Compression  # type: ignore[attr-defined]
    if name == "SyncBatchNorm":
        return dp.torch.SyncBatchNorm
    raise AttributeError(name)

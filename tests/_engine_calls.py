"""Counting the engine calls a reduction makes: one backend's `allreduce` and `allreduce_into`
wrapped (monkeypatched for one test), each call's size in items recorded."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import numpy as np
import pytest

from dataparallel.backends.base import Backend


@dataclass
class EngineCalls:
    in_place: list[int] = field(default_factory=list)  # `allreduce` calls
    into: list[int] = field(default_factory=list)  # `allreduce_into` calls
    calls: list[int] = field(default_factory=list)  # both, in the order they were made
    into_writable: list[bool] = field(default_factory=list)  # each `allreduce_into`'s send buffer


def count_engine_calls(monkeypatch: pytest.MonkeyPatch, backend: Backend) -> EngineCalls:
    """Record `backend`'s reductions from now on. An engine's `allreduce_into` may be a copy and
    an `allreduce` (Gloo): that is one call, counted as `allreduce_into`."""
    counts = EngineCalls()
    real, real_into = backend.allreduce, backend.allreduce_into
    inside: list[bool] = []

    def allreduce(buf: np.ndarray, op: Any) -> None:
        if not inside:
            counts.in_place.append(buf.size)
            counts.calls.append(buf.size)
        real(buf, op)

    def allreduce_into(send: np.ndarray, recv: np.ndarray, op: Any) -> None:
        counts.into.append(send.size)
        counts.calls.append(send.size)
        counts.into_writable.append(bool(send.flags.writeable))
        inside.append(True)
        try:
            real_into(send, recv, op)
        finally:
            inside.pop()

    monkeypatch.setattr(backend, "allreduce", allreduce)
    monkeypatch.setattr(backend, "allreduce_into", allreduce_into)
    return counts

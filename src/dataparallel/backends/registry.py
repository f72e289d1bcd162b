"""Which engine a process uses: the names, the one auto-selection rule, and loading by name.

Engines are imported only when chosen, so a missing package (mpi4py, torch, CuPy) fails with
`BackendUnavailableError` for the engine that needs it, and never at `import dataparallel`.
"""

from __future__ import annotations

import importlib
import sys
from typing import Literal, cast

from dataparallel.backends.base import Backend
from dataparallel.config import Settings
from dataparallel.errors import BackendUnavailableError

__all__ = ["BACKENDS", "BackendName", "choose", "load"]

BackendName = Literal["mpi", "gloo", "nccl", "single"]

BACKENDS: dict[str, str] = {
    "mpi": "dataparallel.backends.mpi:MPIBackend",
    "gloo": "dataparallel.backends.gloo:GlooBackend",
    "nccl": "dataparallel.backends.nccl:NCCLBackend",
    "single": "dataparallel.backends.single:SingleBackend",
}


def choose(backend: str, init_method: str | None, settings: Settings) -> BackendName:
    """Return the engine to use for `dp.initialize(backend, init_method=...)`.

    `"auto"` picks MPI with `init_method="mpi"`, under an MPI launcher, or when MPI is already
    initialized; Gloo with another `init_method`, under torchrun's variables or when
    `torch.distributed` is initialized (over its processes); else a world of one. NCCL's host
    fallback is chosen by the same rule.

    >>> choose("auto", "tcp://h:1", Settings()), choose("auto", "mpi", Settings())
    ('gloo', 'mpi')
    """
    if backend not in ("auto", *BACKENDS):
        raise ValueError(
            f"backend={backend!r} is not known: use 'auto', "
            + ", ".join(repr(n) for n in BACKENDS)
            + "."
        )
    if backend != "auto":
        return cast(BackendName, backend)
    if init_method == "mpi":
        return "mpi"
    if init_method is not None:
        return "gloo"
    if settings.mpi_launched or _mpi_already_initialized():
        return "mpi"
    if settings.torchrun_launched or _torch_distributed_initialized():
        return "gloo"
    return "single"


def _torch_distributed_initialized() -> bool:
    """Whether the program (or `dataparallel run --min-np`'s runner) made torch's default group."""
    dist = sys.modules.get("torch.distributed")
    return bool(dist is not None and dist.is_available() and dist.is_initialized())


def _mpi_already_initialized() -> bool:
    mpi = sys.modules.get("mpi4py.MPI")
    return bool(mpi is not None and mpi.Is_initialized())


def load(name: str) -> type[Backend]:
    """Import and return the engine class registered under `name`."""
    module_name, _, attr = BACKENDS[name].partition(":")
    try:
        module = importlib.import_module(module_name)
    except ModuleNotFoundError as exc:
        if not exc.name or not exc.name.startswith("dataparallel"):
            raise
        raise BackendUnavailableError(f"The {name!r} backend is not available yet.") from exc
    cls: type[Backend] = getattr(module, attr)
    return cls

"""Every environment variable dataparallel reads, read here and nowhere else.

`Settings.from_env()` validates the values at once, so a typo fails with the list of valid values
instead of being silently ignored.

| variable | meaning | default |
| --- | --- | --- |
| `DATAPARALLEL_CHECK` | `0` compares only what decides the messages (dtypes, sizes) | `1` |
| `DATAPARALLEL_DEBUG` | `1` logs every collective, prefixed with its rank, to stderr | `0` |
| `DATAPARALLEL_TIMELINE` | path of a Chrome-trace JSON file to record every collective in | unset |
| `DATAPARALLEL_CUDA_AWARE_MPI` | `0`/`1` overrides the detection of CUDA-aware MPI | detected |
| `DATAPARALLEL_BUCKET_BYTES` | default fusion bucket size in bytes | `DEFAULT_BUCKET_BYTES` |
| | ... and the limit of gradient buckets on the communication thread | `THREAD_BUCKET_BYTES` |
| `DATAPARALLEL_TIMEOUT` | seconds before a blocked collective fails | none |
| `DATAPARALLEL_OVERLAP` | `1`/`0`: reduce gradients during / after backward | timed |
| `DATAPARALLEL_RUN_DIR` | set by `dataparallel run`: where each rank notes how it ended | unset |

The launchers' own variables are read here too: torchrun's `RANK`, `WORLD_SIZE`, `LOCAL_RANK`,
`LOCAL_WORLD_SIZE`, `MASTER_ADDR`, `MASTER_PORT`, the ones by which an MPI launcher reveals itself,
the rank it gives (`PMI_RANK`, `OMPI_COMM_WORLD_RANK`, `PMIX_RANK`: `Settings.mpi_rank`) and the
number of processes it started (`PMI_SIZE`, `OMPI_COMM_WORLD_SIZE`, `PMIX_SIZE`:
`Settings.mpi_size`).
`GLOO_SOCKET_IFNAME` (torch's) is read to know whether the user chose Gloo's network interface.
"""

from __future__ import annotations

import os
from collections.abc import Mapping
from dataclasses import dataclass

__all__ = [
    "DEFAULT_BUCKET_BYTES",
    "MPI_LAUNCHER_VARIABLES",
    "MPI_RANK_VARIABLES",
    "MPI_SIZE_VARIABLES",
    "RUN_DIR_VARIABLE",
    "THREAD_BUCKET_BYTES",
    "Settings",
]

# Chosen by measurement (benchmarks/bucket_size.py, docs/performance.md): on 2 ranks over shared
# memory, packing costs as much as sending, so buckets pay off for small arrays only. 256 KiB was
# best or within 10% of best on a gradient-shaped tree (160 arrays, 32 MiB), where 4 MiB took
# 1.9x as long; trees of many small arrays favour bigger buckets (1 MiB+). Networks and GPUs, where
# latency is dearer and copies cheaper, favour bigger ones still (DDP: 25 MiB, Horovod: 64 MiB).
DEFAULT_BUCKET_BYTES = 256 * 1024
# Gradient buckets handed to the communication thread are bigger (DDP's size): each is a
# rendezvous of the ranks' threads, and fewer of them won at 1-14 M parameters, 25 MiB against
# 4 MiB and 256 KiB (benchmarks/NOTES.md). An upper limit: `_buckets.bucket_bytes_for` cuts a
# model into about 8 buckets so that some leave during backward (issue 24).
THREAD_BUCKET_BYTES = 25 * 1024 * 1024

# Set by MPICH/Hydra (PMI_*), Open MPI (OMPI_*), PMIx-based launchers and Slurm's srun --mpi.
MPI_LAUNCHER_VARIABLES = (
    "PMI_RANK",
    "PMI_SIZE",
    "PMIX_RANK",
    "OMPI_COMM_WORLD_SIZE",
    "MPI_LOCALNRANKS",
    "HYDI_CONTROL_FD",
)
# The rank an MPI launcher gives each process (MPICH/Hydra, Open MPI, PMIx), first found wins.
MPI_RANK_VARIABLES = ("PMI_RANK", "OMPI_COMM_WORLD_RANK", "PMIX_RANK")
# The number of processes it started, first found wins.
MPI_SIZE_VARIABLES = ("PMI_SIZE", "OMPI_COMM_WORLD_SIZE", "PMIX_SIZE")
# Set by `dataparallel run` for its ranks (`Settings.run_dir`).
RUN_DIR_VARIABLE = "DATAPARALLEL_RUN_DIR"

_TRUE = ("1", "true", "yes", "on")
_FALSE = ("0", "false", "no", "off")


def _flag(env: Mapping[str, str], name: str, default: bool | None) -> bool | None:
    raw = env.get(name, "").strip().lower()
    if raw == "":
        return default
    if raw in _TRUE:
        return True
    if raw in _FALSE:
        return False
    raise ValueError(f"{name}={env[name]!r} is not a valid flag: use one of {_TRUE + _FALSE}.")


def _number(env: Mapping[str, str], name: str, kind: type[int] | type[float]) -> int | float | None:
    raw = env.get(name, "").strip()
    if raw == "":
        return None
    expected = "a positive integer" if kind is int else "a positive number"
    try:
        value = kind(raw)
    except ValueError:
        raise ValueError(f"{name}={raw!r} is not valid: use {expected}.") from None
    if not value > 0:  # also rejects nan
        raise ValueError(f"{name}={raw!r} is not valid: use {expected}.")
    return value


def _int(env: Mapping[str, str], name: str) -> int | None:
    raw = env.get(name, "").strip()
    if raw == "":
        return None
    try:
        return int(raw)
    except ValueError:
        raise ValueError(f"{name}={raw!r} is not an integer.") from None


def _first_int(env: Mapping[str, str], names: tuple[str, ...]) -> int | None:
    return next((_int(env, name) for name in names if env.get(name, "").strip()), None)


@dataclass(frozen=True)
class Settings:
    """The process's configuration, as read from its environment once."""

    check: bool = True
    debug: bool = False
    timeline: str | None = None
    cuda_aware_mpi: bool | None = None
    bucket_bytes: int = DEFAULT_BUCKET_BYTES
    thread_bucket_bytes: int = THREAD_BUCKET_BYTES
    timeout: float | None = None
    # Gradients reduced during backward (True), after it (False), or chosen per machine (None).
    overlap: bool | None = None
    # Launcher-provided topology (torchrun / dataparallel run --backend gloo).
    rank: int | None = None
    world_size: int | None = None
    local_rank: int | None = None
    local_world_size: int | None = None
    master_addr: str | None = None
    master_port: int | None = None
    # Gloo's network interface(s), when the user chose them (torch reads the variable itself).
    gloo_socket_ifname: str | None = None
    # True when an MPI launcher (mpiexec, srun) started this process.
    mpi_launched: bool = False
    # The rank that MPI launcher gave this process, and the number of processes it started,
    # known before MPI is initialized.
    mpi_rank: int | None = None
    mpi_size: int | None = None
    # Where `dataparallel run` asks its ranks to note how they ended (launch/_rundir.py).
    run_dir: str | None = None

    @property
    def torchrun_launched(self) -> bool:
        """Whether torchrun-style rendezvous variables are all present."""
        return (
            self.rank is not None and self.world_size is not None and self.master_addr is not None
        )

    @property
    def launched_size(self) -> int | None:
        """The number of processes a launcher says the job has (MPI's, else `WORLD_SIZE`)."""
        if self.mpi_launched and self.mpi_size is not None:
            return self.mpi_size
        return self.world_size

    @classmethod
    def from_env(cls, env: Mapping[str, str] | None = None) -> Settings:
        """Read and validate the settings from `env` (default: `os.environ`)."""
        env = os.environ if env is None else env
        bucket = _number(env, "DATAPARALLEL_BUCKET_BYTES", int)
        timeout = _number(env, "DATAPARALLEL_TIMEOUT", float)
        return cls(
            check=bool(_flag(env, "DATAPARALLEL_CHECK", True)),
            debug=bool(_flag(env, "DATAPARALLEL_DEBUG", False)),
            timeline=env.get("DATAPARALLEL_TIMELINE") or None,
            cuda_aware_mpi=_flag(env, "DATAPARALLEL_CUDA_AWARE_MPI", None),
            bucket_bytes=int(bucket) if bucket is not None else DEFAULT_BUCKET_BYTES,
            thread_bucket_bytes=int(bucket) if bucket is not None else THREAD_BUCKET_BYTES,
            timeout=float(timeout) if timeout is not None else None,
            overlap=_flag(env, "DATAPARALLEL_OVERLAP", None),
            rank=_int(env, "RANK"),
            world_size=_int(env, "WORLD_SIZE"),
            local_rank=_int(env, "LOCAL_RANK"),
            local_world_size=_int(env, "LOCAL_WORLD_SIZE"),
            master_addr=env.get("MASTER_ADDR") or None,
            master_port=_int(env, "MASTER_PORT"),
            gloo_socket_ifname=env.get("GLOO_SOCKET_IFNAME") or None,
            mpi_launched=any(name in env for name in MPI_LAUNCHER_VARIABLES),
            mpi_rank=_first_int(env, MPI_RANK_VARIABLES),
            mpi_size=_first_int(env, MPI_SIZE_VARIABLES),
            run_dir=env.get(RUN_DIR_VARIABLE) or None,
        )

"""Every environment variable dataparallel reads, read here and nowhere else.

`Settings.from_env()` validates them at once: a typo fails with the valid values, not silently.
`Settings` lists dataparallel's own variables, with what each means and its default. The
launchers' own variables (torchrun's, an MPI launcher's, Slurm's inside an srun step) are read
here too: see the comments above `MPI_LAUNCHER_VARIABLES`.
"""

from __future__ import annotations

import os
from collections.abc import Mapping
from dataclasses import dataclass

from dataparallel.slurm import SlurmJob

__all__ = [
    "BEACON_VARIABLE",
    "DEFAULT_BUCKET_BYTES",
    "DEFAULT_LINK_TIMEOUT",
    "ELASTIC_STORE_VARIABLE",
    "ELASTIC_TIMEOUT_VARIABLE",
    "ELASTIC_WORKER_VARIABLE",
    "LINK_TIMEOUT_VARIABLE",
    "MIN_LINK_TIMEOUT",
    "MPI_LAUNCHER_VARIABLES",
    "MPI_RANK_VARIABLES",
    "MPI_SIZE_VARIABLES",
    "PREFIXED_VARIABLE",
    "RUN_DIR_VARIABLE",
    "SILENCE_FLOOR",
    "THREAD_BUCKET_BYTES",
    "Settings",
    "beat_interval",
    "connect_limit",
    "silence_limit",
]

# Chosen by measurement (benchmarks/bucket_size.py; benchmarks/NOTES.md, "The default bucket
# size"): over shared memory packing costs as much as sending, so buckets pay off for small arrays
# only, and trees of many small arrays favour bigger ones. Networks and GPUs, where latency is
# dearer and copies cheaper, favour bigger ones still (DDP takes 25 MiB, Horovod 64 MiB).
DEFAULT_BUCKET_BYTES = 256 * 1024
# Gradient buckets handed to the communication thread are bigger (DDP's size): each is a
# rendezvous of the ranks' threads, and fewer of them won (benchmarks/NOTES.md, "The default
# bucket size"). An upper limit: `dp.torch` cuts a model into about 8 buckets so that some leave
# during backward.
THREAD_BUCKET_BYTES = 25 * 1024 * 1024

# The launchers' own variables: torchrun's `RANK`, `WORLD_SIZE`, `LOCAL_RANK`, `LOCAL_WORLD_SIZE`,
# `MASTER_ADDR`, `MASTER_PORT`; `GLOO_SOCKET_IFNAME` (torch's), read to know whether the user chose
# Gloo's network interface; `TORCHELASTIC_USE_AGENT_STORE` (torchrun's), which says that torchrun's
# agent already serves a store on `MASTER_PORT`; the ones below, by which an MPI launcher reveals
# itself and gives each process its rank and the world's size before MPI is initialized; and
# Slurm's (`slurm.py`, docs/slurm.md), which in a step started without MPI stand in for torchrun's,
# so that `srun -n N python train.py` forms one Gloo world.
#
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
# Set by `dataparallel run --min-np` for its workers (`Settings.elastic_*`, dataparallel.elastic).
ELASTIC_STORE_VARIABLE = "DATAPARALLEL_ELASTIC_STORE"
ELASTIC_WORKER_VARIABLE = "DATAPARALLEL_ELASTIC_WORKER"
ELASTIC_TIMEOUT_VARIABLE = "DATAPARALLEL_ELASTIC_TIMEOUT"
LINK_TIMEOUT_VARIABLE = "DATAPARALLEL_LINK_TIMEOUT"
# Set by `dataparallel run --backend mpi` across hosts: where its beacon listens (launch/beacon.py).
BEACON_VARIABLE = "DATAPARALLEL_BEACON"
# `dataparallel run --link-timeout`'s default: seconds of silence after which a host is gone,
# and the least it takes: a loaded machine's stalls must not pass for a lost link
# (docs/elastic.md, *Measured*).
DEFAULT_LINK_TIMEOUT = 5
MIN_LINK_TIMEOUT = 0.5
# The least a process cut off from the launcher waits before it leaves (`silence_limit`), seconds.
SILENCE_FLOOR = 5.0


def silence_limit(link_timeout: float) -> float:
    """How long a process on another host than the launcher hears nothing from it (a rank: the
    launcher's beats on its ssh line; an elastic worker: the launcher's store) before it takes
    its link for down and leaves: far longer than the link timeout. The launcher decides a loss
    within the link timeout itself (its ssh; an elastic run's heartbeats), and ends the job or
    drops the host, so the process's leaving only tidies up a host cut off from it, and may come
    late; leaving early would end a healthy run wherever a busy machine delays the launcher's
    side (its thread, its ssh, the host's sshd, the store's replies)."""
    return max(SILENCE_FLOOR, 3 * link_timeout)


def connect_limit(link_timeout: float) -> float:
    """How long an elastic round's Gloo group may take to connect its members, who all arrived
    in the round before (`elastic/forming.py`): one that has not connected to another by then
    cannot reach it. As long as a silence takes to be believed (`silence_limit`): the members
    connect at once, but a busy machine delays some, and a group given up on falsely leaves its
    workers waiting for a round that nothing opens."""
    return silence_limit(link_timeout)


def beat_interval(link_timeout: float) -> float:
    """How often the launcher's side of a link to a remote rank beats on it (and the rank's
    side, where it beats back): several beats within the link timeout, so that one late beat
    is not a lost link, and at most once a second."""
    return min(1.0, link_timeout / 5)


# Set by launchers that prefix every output line with `[rank R] ` (`Settings.prefixed`).
PREFIXED_VARIABLE = "DATAPARALLEL_PREFIXED"

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
    """The process's configuration, as read from its environment once (`from_env`).

    dataparallel's own variables:

    | variable | meaning | default |
    | --- | --- | --- |
    | `DATAPARALLEL_CHECK` | `0` compares only what decides the messages (dtypes, sizes) | `1` |
    | `DATAPARALLEL_DEBUG` | `1` logs every collective, prefixed with its rank, to stderr | `0` |
    | `DATAPARALLEL_TIMELINE` | Chrome-trace JSON file to record every collective in | unset |
    | `DATAPARALLEL_CUDA_AWARE_MPI` | `0`/`1` overrides the detection of CUDA-aware MPI | detected |
    | `DATAPARALLEL_BUCKET_BYTES` | default fusion bucket size in bytes | `DEFAULT_BUCKET_BYTES` |
    | | ... and the limit of gradient buckets on the communication thread | `THREAD_BUCKET_BYTES` |
    | `DATAPARALLEL_TIMEOUT` | seconds before a blocked collective fails | none |
    | `DATAPARALLEL_OVERLAP` | `1`/`0`: reduce gradients during / after backward | timed |
    | `DATAPARALLEL_HIERARCHICAL` | `1`/`0`: Gloo allreduces by host, or in a ring | topology |
    | `DATAPARALLEL_MPI_SLEEP` | `1`/`0`: MPICH's waits sleep between polls, or only yield | cores |
    | `DATAPARALLEL_RUN_DIR` | set by `dataparallel run`: where ranks note how they ended | unset |
    | `DATAPARALLEL_ELASTIC_STORE` | set by `run --min-np`: its store (host:port) | unset |
    | `DATAPARALLEL_ELASTIC_WORKER` | ... and this worker's id there | unset |
    | `DATAPARALLEL_ELASTIC_TIMEOUT` | ... and seconds a worker awaits a re-formed world | `600` |
    | `DATAPARALLEL_LINK_TIMEOUT` | seconds a host may not answer: keep-alive, link watch | `5` |
    | | (3x it, 5 s at least: a process cut off from the launcher leaves) | |
    | `DATAPARALLEL_BEACON` | `run -H`, MPI: its line to the ranks, `SECRET@HOST:PORT` | unset |
    | `DATAPARALLEL_PREFIXED` | set by launchers that prefix every line with the rank | unset |
    | `DATAPARALLEL_TORCH_DISTRIBUTED` | `0`: no `torch.distributed` alongside the world | `1` |
    """

    check: bool = True
    debug: bool = False
    timeline: str | None = None
    cuda_aware_mpi: bool | None = None
    bucket_bytes: int = DEFAULT_BUCKET_BYTES
    thread_bucket_bytes: int = THREAD_BUCKET_BYTES
    timeout: float | None = None
    # Gradients reduced during backward (True), after it (False), or chosen per machine (None).
    overlap: bool | None = None
    # Gloo's big allreduces in three steps through the hosts (True), one ring (False), or by
    # the topology (None): three steps where the hosts interleave in rank order, and on one host
    # whose ranks share /dev/shm the steps inside it through shared memory (`Hierarchy.build`).
    hierarchical: bool | None = None
    # MPICH's waits sleep between polls (True), only yield, a core's worth of CPU (False), or
    # sleep where a machine runs more ranks than it has cores (None).
    mpi_sleep: bool | None = None
    # Launcher-provided topology (torchrun / dataparallel run --backend gloo), or Slurm's step
    # where it stands in for torchrun's variables (`ranks_from_slurm`).
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
    # Where `dataparallel run` asks its ranks to note how they ended (launch/process.py).
    run_dir: str | None = None
    # Elastic runs: the launcher's store (host, port), this worker's id, how long a worker
    # waits for the world to re-form, and how long its store may be silent before the worker
    # takes itself for cut off (dataparallel.elastic).
    elastic_store: tuple[str, int] | None = None
    elastic_worker: str | None = None
    elastic_timeout: float = 600.0
    link_timeout: float = float(DEFAULT_LINK_TIMEOUT)
    # The launcher prefixes every output line with the rank (dp.print then leaves its own out).
    prefixed: bool = False
    # Whether to initialize torch.distributed alongside the world when torch is installed.
    torch_distributed: bool = True
    # torchrun's agent serves the store on MASTER_PORT (TORCHELASTIC_USE_AGENT_STORE=True).
    agent_store: bool = False
    # The Slurm job this process runs in (None outside Slurm).
    slurm: SlurmJob | None = None
    # Whether rank, world size and the local ones were read from Slurm's step (no torchrun's).
    ranks_from_slurm: bool = False

    @property
    def torchrun_launched(self) -> bool:
        """Whether torchrun-style rendezvous variables are all present."""
        return (
            self.rank is not None and self.world_size is not None and self.master_addr is not None
        )

    @property
    def group_timeout(self) -> float | None:
        """Seconds a Gloo group made for this process waits: the setting's timeout, else, in an
        elastic worker, as long as its round may take to form (`elastic_timeout`); None leaves
        torch's own default."""
        if self.timeout is not None:
            return self.timeout
        return self.elastic_timeout if self.elastic_worker is not None else None

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
        mpi_launched = any(name in env for name in MPI_LAUNCHER_VARIABLES)
        slurm = _slurm(env)
        # In an srun step without MPI, Slurm's variables stand in for torchrun's.
        by_slurm = slurm is not None and slurm.in_step and not mpi_launched and "RANK" not in env
        step = slurm if by_slurm else None
        master_port = _int(env, "MASTER_PORT")
        return cls(
            check=bool(_flag(env, "DATAPARALLEL_CHECK", True)),
            debug=bool(_flag(env, "DATAPARALLEL_DEBUG", False)),
            timeline=env.get("DATAPARALLEL_TIMELINE") or None,
            cuda_aware_mpi=_flag(env, "DATAPARALLEL_CUDA_AWARE_MPI", None),
            bucket_bytes=int(bucket) if bucket is not None else DEFAULT_BUCKET_BYTES,
            thread_bucket_bytes=int(bucket) if bucket is not None else THREAD_BUCKET_BYTES,
            timeout=float(timeout) if timeout is not None else None,
            overlap=_flag(env, "DATAPARALLEL_OVERLAP", None),
            hierarchical=_flag(env, "DATAPARALLEL_HIERARCHICAL", None),
            mpi_sleep=_flag(env, "DATAPARALLEL_MPI_SLEEP", None),
            rank=step.procid if step else _int(env, "RANK"),
            world_size=step.ntasks if step else _int(env, "WORLD_SIZE"),
            local_rank=step.localid if step else _int(env, "LOCAL_RANK"),
            local_world_size=step.local_size if step else _int(env, "LOCAL_WORLD_SIZE"),
            master_addr=env.get("MASTER_ADDR") or (step.master_addr if step else None),
            master_port=master_port if master_port or not step else step.port,
            gloo_socket_ifname=env.get("GLOO_SOCKET_IFNAME") or None,
            mpi_launched=mpi_launched,
            mpi_rank=_first_int(env, MPI_RANK_VARIABLES),
            mpi_size=_first_int(env, MPI_SIZE_VARIABLES),
            run_dir=env.get(RUN_DIR_VARIABLE) or None,
            elastic_store=_address(env, ELASTIC_STORE_VARIABLE),
            elastic_worker=env.get(ELASTIC_WORKER_VARIABLE) or None,
            elastic_timeout=float(_number(env, ELASTIC_TIMEOUT_VARIABLE, float) or 600.0),
            link_timeout=float(_number(env, LINK_TIMEOUT_VARIABLE, float) or DEFAULT_LINK_TIMEOUT),
            prefixed=bool(_flag(env, PREFIXED_VARIABLE, False)),
            torch_distributed=bool(_flag(env, "DATAPARALLEL_TORCH_DISTRIBUTED", True)),
            agent_store=env.get("TORCHELASTIC_USE_AGENT_STORE", "").lower() == "true",
            slurm=slurm,
            ranks_from_slurm=by_slurm,
        )


def _address(env: Mapping[str, str], name: str) -> tuple[str, int] | None:
    raw = env.get(name, "").strip()
    if raw == "":
        return None
    host, _, port = raw.rpartition(":")
    if not host or not port.isdigit():
        raise ValueError(f"{name}={raw!r} is not an address: use HOST:PORT.")
    return host, int(port)


def _slurm(env: Mapping[str, str]) -> SlurmJob | None:
    """Read the Slurm job (and step, and task) this process runs in, or None outside Slurm."""
    job = _int(env, "SLURM_JOB_ID")
    if job is None:
        return None
    step = _int(env, "SLURM_STEP_ID") if env.get("SLURM_STEP_ID") else _int(env, "SLURM_STEPID")
    in_step = step is not None
    pmi = "pmi2" if "PMI_FD" in env else "pmix" if "PMIX_NAMESPACE" in env else None
    return SlurmJob(
        job_id=job,
        ntasks=_int(env, "SLURM_STEP_NUM_TASKS" if in_step else "SLURM_NTASKS")
        or _int(env, "SLURM_NTASKS"),
        step_id=step,
        procid=_int(env, "SLURM_PROCID") if in_step else None,
        localid=_int(env, "SLURM_LOCALID") if in_step else None,
        nodeid=_int(env, "SLURM_NODEID") if in_step else None,
        nodelist=(env.get("SLURM_STEP_NODELIST") if in_step else None)
        or env.get("SLURM_JOB_NODELIST")
        or env.get("SLURM_NODELIST"),
        tasks_per_node=(env.get("SLURM_STEP_TASKS_PER_NODE") if in_step else None)
        or env.get("SLURM_TASKS_PER_NODE"),
        pmi=pmi,
    )

"""`dataparallel info`: what is installed and usable here, and why a backend is not.

Every probe is guarded: a missing or broken package is reported with its reason, never raised. MPI
is probed in a child process (with a time limit), since initializing a misconfigured MPI can hang
or crash the process that does it.
"""

from __future__ import annotations

import importlib
import importlib.metadata
import importlib.util
import json
import os
import platform
import subprocess
import sys
from collections.abc import Callable
from dataclasses import dataclass, field
from types import ModuleType
from typing import TypedDict

from dataparallel.config import MPI_LAUNCHER_VARIABLES, MPI_RANK_VARIABLES, Settings

__all__ = ["Report", "collect", "main"]

_MPI_PROBE_SECONDS = 60

# Run in a fresh interpreter: initialize MPI as a world of one and describe it as JSON.
_MPI_PROBE = r"""
import ctypes, json
out = {}
try:
    import mpi4py
    out["mpi4py"] = mpi4py.__version__
    from mpi4py import MPI
    out["library"] = " ".join(MPI.Get_library_version().strip().splitlines()[0].split())
    name, version = MPI.get_vendor()
    out["vendor"] = name + " " + ".".join(map(str, version))
    out["standard"] = "%d.%d" % MPI.Get_version()
    levels = {MPI.THREAD_SINGLE: "single", MPI.THREAD_FUNNELED: "funneled",
              MPI.THREAD_SERIALIZED: "serialized", MPI.THREAD_MULTIPLE: "multiple"}
    out["thread"] = "MPI_THREAD_" + levels.get(MPI.Query_thread(), "unknown").upper()
    try:
        query = ctypes.CDLL(MPI.__file__).MPIX_Query_cuda_support
    except (OSError, AttributeError):
        out["cuda"] = None
    else:
        query.restype = ctypes.c_int
        out["cuda"] = bool(query())
except Exception as exc:
    out["error"] = type(exc).__name__ + ": " + str(exc)
print(json.dumps(out))
"""


class _Facts(TypedDict, total=False):
    """What one probe learns for the next: why MPI is unusable, the frameworks, the engines."""

    mpi: str
    torch: ModuleType
    cupy: ModuleType
    gloo: bool
    nccl_reason: str | None
    nccl: bool
    gpus: int


class _MpiProbe(TypedDict, total=False):
    """What `_MPI_PROBE` prints (as JSON): versions, or the error."""

    error: str
    mpi4py: str
    library: str
    vendor: str
    standard: str
    thread: str
    cuda: bool | None


@dataclass
class Report:
    """What `dataparallel info` found: titled sections of (name, description) rows."""

    sections: dict[str, list[tuple[str, str]]] = field(default_factory=dict)
    facts: _Facts = field(default_factory=lambda: _Facts())

    def add(self, section: str, name: str, value: str) -> None:
        """Append the row `name: value` to `section`."""
        self.sections.setdefault(section, []).append((name, value))

    def render(self) -> str:
        """Return the report as aligned text."""
        width = max((len(n) for rows in self.sections.values() for n, _ in rows), default=0)
        lines: list[str] = []
        for title, rows in self.sections.items():
            lines.append(title)
            lines.extend(f"  {name.ljust(width)}  {value}" for name, value in rows)
        return "\n".join(lines)


def _guard(report: Report, section: str, name: str, probe: Callable[[], str]) -> None:
    """Add `probe()` as a row, or the reason it failed."""
    try:
        value = probe()
    except ImportError as exc:
        value = f"not installed ({exc.name or exc})"
    except Exception as exc:  # a broken install must not stop the report
        value = f"unusable: {type(exc).__name__}: {exc}"
    report.add(section, name, value)


def _version(dist: str) -> str:
    try:
        return importlib.metadata.version(dist)
    except importlib.metadata.PackageNotFoundError:
        return "unknown (not installed as a distribution)"


def _probe_python(report: Report) -> None:
    section = "dataparallel"
    report.add(section, "version", _version("dataparallel"))
    report.add(section, "Python", f"{platform.python_version()} ({sys.executable})")
    report.add(section, "platform", platform.platform())
    _guard(report, section, "NumPy", lambda: importlib.import_module("numpy").__version__)


def _probe_mpi(report: Report) -> None:
    from dataparallel.launch.mpi import find_mpiexec

    section = "MPI"
    facts = report.facts
    if importlib.util.find_spec("mpi4py") is None:
        facts["mpi"] = "mpi4py is not installed: pip install 'dataparallel[mpi]'"
        report.add(section, "mpi4py", "not installed: pip install 'dataparallel[mpi]'")
        return
    mpi = _run_mpi_probe()
    if "error" in mpi:
        facts["mpi"] = f"MPI does not start: {mpi['error']}"
        report.add(section, "mpi4py", mpi.get("mpi4py", "unknown"))
        report.add(section, "MPI", f"unusable: {mpi['error']}")
    else:
        report.add(section, "mpi4py", mpi["mpi4py"])
        report.add(section, "library", f"{mpi['library']} ({mpi['vendor']}, MPI {mpi['standard']})")
        report.add(section, "thread level", mpi["thread"])
        cuda = mpi["cuda"]
        detected = "unknown (no MPIX_Query_cuda_support)" if cuda is None else _yes(cuda)
        override = Settings.from_env().cuda_aware_mpi
        if override is not None:
            detected += f"; DATAPARALLEL_CUDA_AWARE_MPI={int(override)} overrides it"
        report.add(section, "CUDA-aware", detected)
    try:
        path, warning = find_mpiexec()
        report.add(section, "mpiexec", path if warning is None else f"{path} (warning: {warning})")
    except Exception as exc:
        facts.setdefault("mpi", str(exc))
        report.add(section, "mpiexec", f"not found: {exc}")


def _run_mpi_probe() -> _MpiProbe:
    # A probe started inside an MPI job must not take itself for one of its ranks.
    hidden = set(MPI_LAUNCHER_VARIABLES) | set(MPI_RANK_VARIABLES)
    env = {k: v for k, v in os.environ.items() if k not in hidden}
    try:
        done = subprocess.run(
            [sys.executable, "-c", _MPI_PROBE],
            capture_output=True,
            text=True,
            timeout=_MPI_PROBE_SECONDS,
            env=env,
            check=False,
        )
    except subprocess.TimeoutExpired:
        return {"error": f"MPI_Init did not finish within {_MPI_PROBE_SECONDS}s"}
    lines = done.stdout.strip().splitlines()
    try:
        result: _MpiProbe = json.loads(lines[-1])
    except (IndexError, ValueError):
        tail = (done.stderr.strip().splitlines() or ["no output"])[-1]
        return {"error": f"the probe exited with status {done.returncode}: {tail}"}
    return result


def _yes(flag: bool) -> str:
    return "yes" if flag else "no"


def _probe_frameworks(report: Report) -> None:
    section = "frameworks"
    facts = report.facts

    def torch() -> str:
        import torch

        facts["torch"] = torch
        cuda = f"CUDA {torch.version.cuda}" if torch.version.cuda else "CPU build"
        gpus = torch.cuda.device_count() if torch.cuda.is_available() else 0
        return f"{torch.__version__} ({cuda}, {gpus} GPU(s) visible)"

    def jax() -> str:
        import jax

        return f"{jax.__version__} (default backend: {jax.default_backend()})"

    def cupy() -> str:
        import cupy

        facts["cupy"] = cupy
        return f"{cupy.__version__} ({cupy.cuda.runtime.getDeviceCount()} GPU(s))"

    _guard(report, section, "torch", torch)
    _guard(report, section, "jax", jax)
    _guard(report, section, "optax", lambda: importlib.import_module("optax").__version__)
    _guard(report, section, "cupy", cupy)
    _guard(report, section, "optree", lambda: importlib.import_module("optree").__version__)
    _guard(report, section, "tqdm", lambda: importlib.import_module("tqdm").__version__)


def _probe_engines(report: Report) -> None:
    section = "engines"
    facts = report.facts
    torch = facts.get("torch")

    def gloo() -> str:
        if torch is None:
            raise ImportError(name="torch")
        ok = torch.distributed.is_available() and torch.distributed.is_gloo_available()
        facts["gloo"] = ok
        return "available (torch.distributed)" if ok else "not built into this torch"

    def nccl() -> str:
        found = []
        if torch is not None:
            dist = torch.distributed
            if dist.is_available() and dist.is_nccl_available():
                version = ".".join(map(str, torch.cuda.nccl.version()))
                found.append(f"torch.distributed (NCCL {version})")
        if facts.get("cupy") is not None:
            try:
                from cupy.cuda import nccl as cupy_nccl

                found.append(f"cupy.cuda.nccl (NCCL {cupy_nccl.get_version()})")
            except ImportError:
                pass
        from dataparallel.backends.nccl import unavailable_reason

        # dataparallel's NCCL backend runs on cupy.cuda.nccl (docs/gpu.md): that decides.
        facts["nccl_reason"] = unavailable_reason()
        facts["nccl"] = facts["nccl_reason"] is None
        return ", ".join(found) if found else "not available"

    def gpus() -> str:
        from dataparallel.gpus import cuda_device_count

        count = cuda_device_count()
        facts["gpus"] = count
        return f"{count} (CUDA driver)" if count else "none (no CUDA driver or no device)"

    _guard(report, section, "Gloo", gloo)
    _guard(report, section, "NCCL", nccl)
    _guard(report, section, "GPUs", gpus)


def _probe_launchers(report: Report) -> None:
    import shutil

    section = "launchers"
    settings = Settings.from_env()
    slurm = settings.slurm
    srun = shutil.which("srun")
    if slurm is None:
        where = f"srun at {srun}, not in a job" if srun else "not found (no srun on PATH)"
    else:
        tasks = f"{slurm.ntasks} task(s)" if slurm.ntasks is not None else "tasks unknown"
        nodes = f" on {slurm.nodelist}" if slurm.nodelist else ""
        where = f"job {slurm.job_id}, {tasks}{nodes}"
        if slurm.in_step:
            where += f"; step {slurm.step_id}, this is task {slurm.procid}"
            where += f" (PMI: {slurm.pmi})" if slurm.pmi else " (no PMI: Gloo, or srun --mpi=pmi2)"
    report.add(section, "Slurm", where)
    if settings.mpi_launched:
        started = f"rank {settings.mpi_rank} of {settings.mpi_size}, started by an MPI launcher"
    elif settings.rank is not None:
        by = "Slurm's step" if settings.ranks_from_slurm else "RANK and WORLD_SIZE (torchrun's)"
        started = f"rank {settings.rank} of {settings.world_size}, from {by}"
    else:
        started = "not started as a rank (a world of one)"
    report.add(section, "this process", started)


def _probe_backends(report: Report) -> None:
    facts = report.facts
    reasons = {
        "mpi": facts.get("mpi"),
        "gloo": None if facts.get("gloo") else "needs torch with Gloo: pip install torch",
        "nccl": facts.get("nccl_reason", "not probed"),
        "single": None,
    }
    for name, reason in reasons.items():
        if importlib.util.find_spec(f"dataparallel.backends.{name}") is None:
            reason = f"not in this build (dataparallel/backends/{name}.py is missing)"
        report.add("backends", name, "usable" if reason is None else f"not usable: {reason}")


def collect() -> Report:
    """Probe the installation and return the report."""
    report = Report()
    probes = (_probe_python, _probe_mpi, _probe_frameworks, _probe_engines, _probe_launchers)
    for probe in (*probes, _probe_backends):
        try:
            probe(report)
        except Exception as exc:  # the report goes on whatever one probe does
            report.add("errors", probe.__name__, f"{type(exc).__name__}: {exc}")
    return report


def main() -> int:
    """Print the report; return 0."""
    print(collect().render(), flush=True)
    return 0

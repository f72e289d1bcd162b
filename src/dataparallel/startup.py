"""What `dp.initialize` checks and installs around the engine it makes (`world.py`): the
timeout it was given, MPI not finalized, a Slurm job's process outside its step, a world of one
where the launcher started several; the notes it leaves for `dataparallel run`; the excepthook
that ends the whole job on an uncaught exception, and what puts it back at `dp.finalize()`."""

from __future__ import annotations

import math
import numbers
import sys
from collections.abc import Callable
from types import TracebackType

from dataparallel import runnotes
from dataparallel.backends.base import Backend
from dataparallel.config import Settings
from dataparallel.errors import BackendUnavailableError

__all__ = [
    "abort_on_uncaught_exceptions",
    "check_mpi_not_finalized",
    "check_not_alone",
    "check_slurm_step",
    "excepthook_restorer",
    "seconds",
    "world_note",
]


def seconds(timeout: object) -> float:
    """Return `timeout` as seconds, refusing what is not a positive, finite number."""
    if isinstance(timeout, bool) or not isinstance(timeout, numbers.Real):
        raise TypeError(
            f"timeout={timeout!r} is not a number: give the seconds a blocked collective may "
            "wait (e.g. timeout=60), or None for no limit."
        )
    seconds = float(timeout)
    if not (seconds > 0 and math.isfinite(seconds)):
        raise ValueError(
            f"timeout={timeout!r} is not valid: give a positive, finite number of seconds "
            "(e.g. timeout=60), or None for no limit."
        )
    return seconds


def check_mpi_not_finalized() -> None:
    """Refuse MPI once `MPI_Finalize` has run here: no MPI call is allowed after it (MPICH ends
    the process on the first one), and MPI cannot be initialized again."""
    mpi = sys.modules.get("mpi4py.MPI")
    if mpi is None or not mpi.Is_finalized():
        return
    raise BackendUnavailableError(
        "The 'mpi' backend cannot start: MPI was finalized in this process (MPI.Finalize()), and "
        "the MPI standard allows no MPI call after it, MPI_Init included. dp.finalize() leaves MPI "
        "initialized, so that dp.initialize('mpi') can make a world again: do not finalize MPI "
        "yourself until the last world is done. To form worlds again after MPI has ended (elastic "
        "training), use Gloo: start the job with `dataparallel run --backend gloo` and call "
        "dp.initialize('gloo')."
    )


def check_not_alone(made: Backend, name: str, settings: Settings) -> None:
    """Refuse an engine that formed a world of one while the launcher started several processes.

    Each process would be rank 0 of its own world and every collective would return its own
    values: a job that looks fine and trains N unrelated models.
    """
    announced = settings.launched_size
    if name == "single" or made.size != 1 or announced is None or announced <= 1:
        return
    made.close()
    if settings.mpi_launched:
        source = f"the MPI launcher started {announced} processes (PMI_SIZE or its kin)"
        hint = (
            "mpiexec belongs to another MPI library than mpi4py's: start the job with the "
            "matching one (`dataparallel run` finds it; `dataparallel info` shows both)."
            if name == "mpi"
            else "under an MPI launcher, call dp.initialize() (it picks MPI)."
        )
    elif settings.slurm is not None and settings.slurm.in_step and settings.rank is not None:
        source = f"srun started {announced} tasks (SLURM_STEP_NUM_TASKS={announced})"
        hint = "start the step with `srun --mpi=pmi2` for MPI, or call dp.initialize() (Gloo)."
    else:
        source = f"the launcher started {announced} processes (WORLD_SIZE={announced})"
        hint = (
            "this process was not started by an MPI launcher: call dp.initialize() to use the "
            "launcher's engine (Gloo), or start the job with `dataparallel run --backend mpi`."
            if name == "mpi"
            else "give the launcher's rank and world size, or call dp.initialize()."
        )
    raise BackendUnavailableError(
        f"The {name!r} engine formed a world of one, but {source}: each process would be rank 0 "
        f"of its own world, training alone. {hint[0].upper()}{hint[1:]}"
    )


def check_slurm_step(settings: Settings) -> None:
    """Refuse a world of one in a Slurm job of several tasks, outside any srun step.

    A batch script or an salloc shell that runs `python train.py` itself starts one process where
    the job asked for N: the other N-1 tasks' resources sit idle and the model trains alone.
    """
    slurm = settings.slurm
    if slurm is None or slurm.in_step or slurm.ntasks is None or slurm.ntasks <= 1:
        return
    raise BackendUnavailableError(
        f"This process runs in Slurm job {slurm.job_id} of {slurm.ntasks} tasks "
        f"(SLURM_NTASKS={slurm.ntasks}) but was not started as one of them: it would train "
        "alone. Start it with `srun python SCRIPT` (each task a rank) or `dataparallel run "
        "SCRIPT` (which uses the allocation); for a world of one on purpose, call "
        "dp.initialize('single')."
    )


def abort_on_uncaught_exceptions(made: Backend, active: Callable[[], bool]) -> None:
    """Make an uncaught exception end the whole job, not only this rank, while `active()` says
    that `made` is still the world's engine.

    Otherwise the other ranks wait forever in their next collective (mpi4py's `python -m mpi4py`
    and `dataparallel run` do the same; under them, their own handler acts first). The traceback is
    printed as usual, once, then the backend aborts the job. `finalize` unwraps it
    (`excepthook_restorer`).
    """
    previous = sys.excepthook

    def abort_the_job(
        kind: type[BaseException], error: BaseException, tb: TracebackType | None
    ) -> None:
        previous(kind, error, tb)
        if active():
            sys.stderr.write(f"[rank {made.rank}] uncaught {kind.__name__}: ending the job\n")
            sys.stderr.flush()
            made.abort(1)

    sys.excepthook = abort_the_job


def excepthook_restorer(before: Callable[..., object]) -> Callable[[], None]:
    """Return what puts `sys.excepthook` back to `before`, as it was when `initialize` began.

    Between the two, the world wrapped it (`abort_on_uncaught_exceptions`) and so did
    `torch.distributed.init_process_group` (Gloo), which never unwraps it: each world made again
    would wrap it once more. A hook that the program set after `initialize` is left in place (the
    world's wrapper under it no longer aborts: its world is gone).
    """
    installed = sys.excepthook

    def restore() -> None:
        if sys.excepthook is installed:
            sys.excepthook = before

    return restore


def world_note(
    settings: Settings, rank: int | None, world_size: int | None
) -> Callable[[str], None]:
    """Return how this rank notes its way through `initialize` for `dataparallel run`, which
    ends a job whose ranks wait there for one that has ended (`runnotes.py`). A world of a size
    of its own choosing (`world_size=`) is not the launcher's: nothing is noted."""
    folder = settings.run_dir
    if rank is None:
        rank = settings.mpi_rank if settings.mpi_rank is not None else settings.rank
    if folder is None or rank is None or world_size is not None:
        return lambda _: None
    return lambda state: runnotes.note_world(folder, rank, state)

"""`dp.progress`: a progress bar on the main rank only, the plain iterable everywhere else."""

from __future__ import annotations

import sys
from collections.abc import Iterable
from typing import TypeVar

__all__ = ["progress"]

T = TypeVar("T")


def _on_main_rank() -> bool:
    """Return whether this process should draw bars: rank 0, or a process outside any job.

    With the world initialized, that is `dp.is_main()`. Before `dp.initialize()`, the rank that a
    launcher gave the process (torchrun's `RANK`, an MPI launcher's `PMI_RANK`, ...) decides, so
    a job whose script never initializes still draws one bar, not one per rank.
    """
    world = sys.modules.get("dataparallel.world")
    if world is not None and world.initialized():
        return bool(world.is_main())
    from dataparallel.config import Settings

    settings = Settings.from_env()
    rank = settings.rank if settings.rank is not None else settings.mpi_rank
    return rank is None or rank == 0


def progress(iterable: Iterable[T], /, **kwargs: object) -> Iterable[T]:
    """Wrap `iterable` in a `tqdm` progress bar on the main rank; return it unchanged elsewhere.

    On the other ranks the very object passed in comes back, so `len()`, indexing and its other
    methods still work and nothing is printed. tqdm is imported only on the main rank.

    Args:
        iterable: what to iterate over.
        **kwargs: passed to `tqdm.auto.tqdm` (`desc=`, `total=`, `leave=`, `file=`, ...).

    Returns:
        A `tqdm` bar over `iterable` on rank 0 (or outside any job), else `iterable` itself.

    >>> for batch in progress(range(3), desc="epoch 0", disable=True):
    ...     pass

    Note: unlike a bare `tqdm`, which draws one bar per process and garbles the terminal, this
    draws one for the whole job, as Horovod's examples do with `if hvd.rank() == 0`. Calls on the
    bar itself (`bar.set_postfix(loss=...)`) exist on the main rank only: guard them with
    `dp.is_main()`.
    """
    if not _on_main_rank():
        return iterable
    from tqdm.auto import tqdm

    return tqdm(iterable, **kwargs)

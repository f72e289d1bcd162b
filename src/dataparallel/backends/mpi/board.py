"""Leaving an MPI world: a rank that finishes while another waits for it ends the job, never hangs.

Under MPI, a rank that returns from its script (or calls `sys.exit(0)`) while another rank waits in
a collective would wait in `MPI_Finalize` for ever, and so would the other: Gloo's peers see the
connection close, MPI's see nothing. So each rank keeps a count of the collectives it has started,
in memory the others can read (an MPI window, `CallBoard`), and leaving is collective:

- every collective call adds one to the caller's count (a store into its own memory, no message);
- a rank that leaves (`dp.finalize()`, or its end) starts a barrier and, while it waits, reads the
  others' counts. When every rank has arrived, it leaves. When another rank has started more
  collectives than this one ever will, that rank is waiting for a call that will never come:
  this rank names both and ends the job (`MPI_Abort`), at once rather than after a timeout.

A rank that is merely slower to finish is waited for, for as long as it takes. Counts are read
with passive-target RMA, which needs MPI's unified memory model (MPICH and Open MPI have it);
where it is missing, leaving is a plain barrier.
"""

from __future__ import annotations

import itertools
import time
from types import ModuleType
from typing import Protocol

import numpy as np

__all__ = ["CallBoard"]

# Seconds between two looks at the others' counts while waiting to leave: none at all for the
# first `_SPIN_S` (ranks that finish together leave in microseconds), then from `_FIRST_LOOK_S`
# growing to `_LAST_LOOK_S`, so that a long wait costs no CPU.
_SPIN_S, _FIRST_LOOK_S, _LAST_LOOK_S = 0.002, 0.001, 0.05


# What the board uses of mpi4py's objects (this module names no framework: `backend.py` hands
# it them).
class Communicator(Protocol):
    def Dup(self) -> Communicator: ...
    def Get_rank(self) -> int: ...
    def Get_size(self) -> int: ...
    def Barrier(self) -> None: ...
    def Ibarrier(self) -> Testable: ...
    def Free(self) -> None: ...


class Testable(Protocol):
    """mpi4py's `MPI.Request`, MPI's own request object (the barrier's): the board tests it."""

    def Test(self) -> bool: ...


class Window(Protocol):
    def Lock_all(self, assertion: int) -> None: ...
    def Get(self, origin: np.ndarray, target_rank: int) -> None: ...
    def Flush(self, rank: int) -> None: ...
    def Unlock_all(self) -> None: ...
    def Free(self) -> None: ...


class CallBoard:
    """Each rank's count of collectives started, readable by every other rank (collective).

    Args:
        mpi: `mpi4py.MPI`.
        comm: the communicator whose ranks keep counts (duplicated here).
    """

    def __init__(self, mpi: ModuleType, comm: Communicator) -> None:
        self._mpi = mpi
        self._comm = comm.Dup()
        self.rank, self.size = self._comm.Get_rank(), self._comm.Get_size()
        # A counter's `next` is atomic (engines may be used from several threads, e.g. jax's
        # host callbacks): a lost count would read as a rank that made one call less.
        self._next = itertools.count(1).__next__
        self._win: Window | None = None
        # This rank's count, seen as a memoryview: a store costs less than through NumPy.
        self._count = _stand_in()
        if self.size > 1:
            win = mpi.Win.Allocate(8, 8, comm=self._comm)
            if win.Get_attr(mpi.WIN_MODEL) == mpi.WIN_UNIFIED:
                self._win = win
                self._count = memoryview(win.tomemory()).cast("B").cast("q")
                self._count[0] = 0
            else:
                win.Free()
        self._comm.Barrier()  # every count exists before anyone reads one

    def tick(self) -> None:
        """Count one collective started by this rank."""
        self._count[0] = self._next()

    def leave(self, timeout: float | None = None) -> str | None:
        """Wait until every rank leaves (collective); return a reason to end the job instead.

        The reason is a message naming a rank that waits in a collective this one will never
        join, or (past `timeout` seconds) the fact that the others never came.
        """
        calls = self._next() - 1  # every call this rank has started, now that it is leaving
        self._count[0] = calls
        if self.size == 1:
            return None
        request = self._comm.Ibarrier()
        win, counts = self._win, np.zeros(1, np.int64)
        if win is not None:
            win.Lock_all(self._mpi.MODE_NOCHECK)
        try:
            started, pause = time.monotonic(), 0.0
            while not request.Test():
                if win is not None:
                    for peer in range(self.size):
                        if peer == self.rank:
                            continue
                        win.Get(counts, peer)
                        win.Flush(peer)
                        if counts[0] > calls:
                            return self._waiting(calls, peer, int(counts[0]))
                if timeout is not None and time.monotonic() - started > timeout:
                    return (
                        f"rank {self.rank} has finished, and waited {timeout:g} s for the other "
                        "ranks to finish too (DATAPARALLEL_TIMEOUT): one is stuck or has died."
                    )
                time.sleep(pause)  # sleep(0) yields to other threads
                if time.monotonic() - started > _SPIN_S:
                    pause = min(max(2 * pause, _FIRST_LOOK_S), _LAST_LOOK_S)
        finally:
            if win is not None:
                win.Unlock_all()
        return None

    def _waiting(self, calls: int, peer: int, peer_calls: int) -> str:
        return (
            f"rank {self.rank} has finished (its script ended, or it called dp.finalize()) "
            f"after {calls} collective call(s), but rank {peer} has started call number "
            f"{peer_calls}, which rank {self.rank} will never join: rank {peer} would wait for "
            f"ever. Every rank must make the same collective calls; look for what made rank "
            f"{self.rank} finish early (a return, a sys.exit, a skipped step). Ending the job."
        )

    def free(self) -> None:
        """Release the window and the communicator (collective: after `leave`)."""
        if self._win is not None:
            self._win.Free()
            self._win = None
            self._count = _stand_in()
        if self._comm != self._mpi.COMM_NULL:
            self._comm.Free()


def _stand_in() -> memoryview:
    """Return a count of one's own, for a world of one or a window gone."""
    return memoryview(bytearray(8)).cast("q")

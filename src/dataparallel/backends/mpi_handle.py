"""An MPI request in flight (`MPIHandle`), and waiting for one (`wait_request`): in MPI, or,
with a timeout, by testing it until the deadline and then raising `CollectiveTimeoutError`."""

from __future__ import annotations

import time
from typing import TYPE_CHECKING

from dataparallel.errors import CollectiveTimeoutError

if TYPE_CHECKING:
    from mpi4py import MPI

__all__ = ["MPIHandle", "wait_request"]


def wait_request(request: MPI.Request, timeout: float | None, what: str, rank: int) -> None:
    """Wait for an MPI request; past `timeout` seconds raise `CollectiveTimeoutError`."""
    if timeout is None:
        request.Wait()
        return
    deadline = time.monotonic() + timeout
    while not request.Test():
        if time.monotonic() > deadline:
            raise CollectiveTimeoutError(
                f"rank {rank}: {what} did not complete within {timeout:g} s. Another rank is not "
                "making the same call: it is stuck, has died, or called a different collective. "
                "Every rank must make the same collective calls in the same order; raise the "
                "limit with DATAPARALLEL_TIMEOUT or dp.initialize(timeout=...) if it is too short."
            )
        time.sleep(0)  # let other Python threads (e.g. a progress bar) run while we poll


class MPIHandle:
    """An MPI request in flight; waited for against the engine's timeout."""

    __slots__ = ("_rank", "_request", "_timeout", "_what")

    def __init__(self, request: MPI.Request, timeout: float | None, what: str, rank: int) -> None:
        self._request, self._timeout, self._what, self._rank = request, timeout, what, rank

    def wait(self) -> None:
        wait_request(self._request, self._timeout, self._what, self._rank)

    def test(self) -> bool:
        return bool(self._request.Test())

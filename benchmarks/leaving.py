"""What the MPI engine's call count costs (`backends/mpi/board.py`), measured side by side.

Run: `OMP_NUM_THREADS=1 dataparallel run -n 2 benchmarks/leaving.py`

Every MPI collective stores one count into memory the other ranks can read, so that a rank that
finishes while another waits for it ends the job instead of hanging. Rows (medians of 45 batches
taken in turn with the other cases, every rank in lock step):
- an 8-byte engine allreduce and a 4-byte `dp.allreduce`, with the count and with it replaced by
  a no-op (the ratio is the cost of counting: above 1, counting costs that much);
- leaving: an engine made and closed (a duplicate communicator, the counts' window, the leaving
  barrier) next to the same communicator made and freed with a plain barrier.
"""

from __future__ import annotations

from collections.abc import Callable

import numpy as np
from _timing import compare
from mpi4py import MPI

import dataparallel as dp
from dataparallel.backends.base import ReduceOp
from dataparallel.backends.mpi import MPIBackend


def without_count(engine: MPIBackend, fn: Callable[[], object]) -> Callable[[], object]:
    """Return `fn` run with the engine's count replaced by a function that does nothing."""
    board = engine._board  # the benchmark measures exactly this

    def run() -> object:
        real = board.tick
        board.tick = lambda: None  # type: ignore[method-assign]
        try:
            return fn()
        finally:
            board.tick = real  # type: ignore[method-assign]

    return run


def plain_dup_free(comm: MPI.Comm) -> None:
    dup = comm.Dup()
    dup.Barrier()
    dup.Free()


def engine_made_and_closed(comm: MPI.Comm) -> None:
    MPIBackend(comm).close()


def main() -> None:
    engine = dp.initialize("mpi")
    assert isinstance(engine, MPIBackend)
    comm = MPI.COMM_WORLD
    word, small = np.ones(1), np.ones(1, np.float32)

    def engine_call() -> None:
        engine.allreduce(word, ReduceOp.SUM)

    def dp_call() -> None:
        dp.allreduce(small)

    times = compare(
        {
            "engine allreduce 8 B, counted": engine_call,
            "engine allreduce 8 B, not counted": without_count(engine, engine_call),
            "dp.allreduce 4 B, counted": dp_call,
            "dp.allreduce 4 B, not counted": without_count(engine, dp_call),
            "engine made and closed (leaving)": lambda: engine_made_and_closed(comm),
            "Dup + Barrier + Free": lambda: plain_dup_free(comm),
        },
        comm,
    )
    if comm.Get_rank() == 0:
        print(f"{comm.Get_size()} ranks, MPI: {MPI.Get_library_version().splitlines()[0]}")
        for name, seconds in times.items():
            print(f"{name:36s} {seconds * 1e6:10.2f} us")
        for counted, reference in (
            ("engine allreduce 8 B, counted", "engine allreduce 8 B, not counted"),
            ("dp.allreduce 4 B, counted", "dp.allreduce 4 B, not counted"),
            ("engine made and closed (leaving)", "Dup + Barrier + Free"),
        ):
            print(f"ratio {counted} / {reference}: {times[counted] / times[reference]:.3f}")


if __name__ == "__main__":
    main()

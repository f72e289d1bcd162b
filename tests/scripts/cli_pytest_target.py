"""A test file for `dataparallel run -m pytest`: every rank runs it in one MPI world."""

from mpi4py import MPI


def test_world_of_two() -> None:
    comm = MPI.COMM_WORLD
    assert comm.Get_size() == 2
    assert comm.allreduce(1) == 2

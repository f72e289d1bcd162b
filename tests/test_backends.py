"""The engines' protocol over flat buffers (`dataparallel.backends`), at any world size.

The protocol tests run on the session's backend (MPI, Gloo or single); the world of one and the
MPI backend's own errors are also tested directly.
"""

from __future__ import annotations

import gc
import os
import socket
import sys
import time
import weakref
from typing import Any

import numpy as np
import pytest

from dataparallel.backends.base import Backend, DoneHandle, ReduceOp
from dataparallel.backends.single import SingleBackend
from dataparallel.errors import BackendUnavailableError


def triangle(size: int) -> int:
    return size * (size + 1) // 2


@pytest.mark.parametrize("dtype", [np.float64, np.float32, np.float16, np.int32, np.uint8])
def test_allreduce_ops_in_place(world: Backend, rank: int, size: int, dtype: Any) -> None:
    expected = {
        ReduceOp.SUM: triangle(size),
        ReduceOp.PROD: float(np.prod(np.arange(1, size + 1))),
        ReduceOp.MIN: 1,
        ReduceOp.MAX: size,
    }
    for op, want in expected.items():
        buf = np.full(5, rank + 1, dtype)
        assert world.allreduce(buf, op) is None
        np.testing.assert_array_equal(buf, np.full(5, want, dtype))


def test_iallreduce_request(world: Backend, rank: int, size: int) -> None:
    buf = np.full(1000, float(rank + 1))
    request = world.iallreduce(buf, ReduceOp.SUM)
    request.wait()
    assert request.test()
    np.testing.assert_array_equal(buf, np.full(1000, float(triangle(size))))


def test_reduce_to_each_root(world: Backend, rank: int, size: int) -> None:
    for root in range(size):
        buf = np.full(3, rank + 1, np.int64)
        world.reduce(buf, ReduceOp.SUM, root)
        want = triangle(size) if rank == root else rank + 1
        np.testing.assert_array_equal(buf, np.full(3, want))


def test_broadcast_and_ibroadcast_from_each_root(world: Backend, rank: int, size: int) -> None:
    for root in range(size):
        buf = np.full(4, rank, np.uint8)
        world.broadcast(buf, root)
        np.testing.assert_array_equal(buf, np.full(4, root, np.uint8))
        buf = np.full(4, float(rank))
        world.ibroadcast(buf, root).wait()
        np.testing.assert_array_equal(buf, np.full(4, float(root)))


def test_allgatherv_uneven_counts(world: Backend, rank: int, size: int) -> None:
    counts = [r + 1 for r in range(size)]
    send = np.full(rank + 1, rank, np.int32)
    recv = np.empty(sum(counts), np.int32)
    world.allgatherv(send, recv, counts)
    np.testing.assert_array_equal(recv, np.concatenate([np.full(r + 1, r) for r in range(size)]))
    # A rank may send nothing.
    counts = [r for r in range(size)]
    recv = np.empty(sum(counts), np.float64)
    world.allgatherv(np.full(rank, float(rank)), recv, counts)
    np.testing.assert_array_equal(recv, np.concatenate([np.full(r, float(r)) for r in range(size)]))


def test_several_nonblocking_allgathers_and_reduce_scatters_in_flight(
    world: Backend, rank: int, size: int
) -> None:
    """Started one after another, waited in reverse: each lands in its own buffers."""
    sends = [np.full(3, float(10 * k + rank), np.float32) for k in range(4)]
    gathered = [np.zeros(3 * size, np.float32) for _ in sends]
    counts = [2] * size
    scattered = [np.zeros(2, np.float32) for _ in sends]
    rows = [np.arange(2 * size, dtype=np.float32) + k for k in range(4)]
    handles = [world.iallgather(s, g) for s, g in zip(sends, gathered, strict=True)]
    handles += [
        world.ireduce_scatter(r, s, counts, ReduceOp.SUM)
        for r, s in zip(rows, scattered, strict=True)
    ]
    for handle in reversed(handles):
        handle.wait()
    for k in range(4):
        want = np.repeat(np.arange(size, dtype=np.float32) + 10 * k, 3)
        np.testing.assert_array_equal(gathered[k], want)
        np.testing.assert_array_equal(scattered[k], size * (rows[k][2 * rank : 2 * rank + 2]))


def test_objects(world: Backend, rank: int, size: int) -> None:
    for root in range(size):
        assert world.broadcast_object({"from": rank}, root) == {"from": root}
    assert world.allgather_object(f"r{rank}") == [f"r{r}" for r in range(size)]
    assert world.barrier() is None


def test_shape_and_repr(world: Backend, rank: int, size: int) -> None:
    assert (world.rank, world.size) == (rank, size)
    assert 0 <= world.local_rank < world.local_size <= size
    assert world.accepts_device("cpu")
    assert repr(world) == f"<{type(world).__name__} rank={rank} size={size}>"
    assert {"float32", "float64", "int64"} <= world.native_dtypes
    assert "bfloat16" not in world.native_dtypes or world.name != "mpi"


# --- the world of one, directly -------------------------------------------------------------


def test_single_backend_is_the_identity() -> None:
    single = SingleBackend.create()
    assert (single.rank, single.size, single.local_rank, single.local_size) == (0, 1, 0, 1)
    assert single.name == "single" and single.accepts_device("cuda:0")
    buf = np.arange(3.0)
    for op in ReduceOp:
        single.allreduce(buf, op)
        single.reduce(buf, op, 0)
        assert single.iallreduce(buf, op).test()
    single.broadcast(buf, 0)
    request = single.ibroadcast(buf, 0)
    assert isinstance(request, DoneHandle) and request.test()
    request.wait()
    np.testing.assert_array_equal(buf, np.arange(3.0))
    recv = np.zeros(3)
    single.allgatherv(buf, recv, [3])
    np.testing.assert_array_equal(recv, buf)
    assert single.broadcast_object("o", 0) == "o" and single.allgather_object(1) == [1]
    single.barrier()
    single.close()


def test_single_backend_refuses_peers_and_exits_on_abort() -> None:
    assert isinstance(SingleBackend.create(rank=0, world_size=1), SingleBackend)
    with pytest.raises(ValueError, match=r"world of one, but rank=None, world_size=3"):
        SingleBackend.create(world_size=3)
    with pytest.raises(SystemExit) as info:
        SingleBackend().abort(3)
    assert info.value.code == 3


# --- MPI ---------------------------------------------------------------------------------------


def test_missing_mpi4py_says_what_to_install(monkeypatch: pytest.MonkeyPatch) -> None:
    from dataparallel.backends.mpi import import_mpi

    monkeypatch.setitem(sys.modules, "mpi4py", None)
    monkeypatch.delitem(sys.modules, "mpi4py.MPI", raising=False)
    with pytest.raises(BackendUnavailableError, match=r"pip install 'dataparallel\[mpi\]'"):
        import_mpi()


def test_mpi_refuses_rendezvous_methods() -> None:
    from dataparallel.backends.mpi import MPIBackend

    with pytest.raises(ValueError, match=r"init_method='tcp://h:1' does not apply to MPI"):
        MPIBackend.create(init_method="tcp://h:1")


def test_mpi_refuses_a_rank_or_size_it_did_not_make(world: Backend, size: int) -> None:
    if world.name != "mpi":
        pytest.skip("needs the MPI backend (run under mpiexec)")
    from dataparallel.backends.mpi import MPIBackend

    with pytest.raises(ValueError, match=rf"world_size={size + 1} was given, but the MPI launcher"):
        MPIBackend.create(world_size=size + 1)
    with pytest.raises(ValueError, match=rf"rank={size} was given, but the MPI launcher made it"):
        MPIBackend.create(rank=size)


def test_mpi_on_a_given_communicator(world: Backend, rank: int, size: int) -> None:
    if world.name != "mpi":
        pytest.skip("needs the MPI backend (run under mpiexec)")
    from mpi4py import MPI

    from dataparallel.backends.mpi import MPIBackend

    # A private duplicate: the library's traffic never meets the user's.
    backend = MPIBackend(MPI.COMM_WORLD)
    try:
        assert MPI.Comm.Compare(backend.comm, MPI.COMM_WORLD) == MPI.CONGRUENT
        buf = np.full(2, float(rank))
        backend.allreduce(buf, ReduceOp.MAX)
        np.testing.assert_array_equal(buf, np.full(2, float(size - 1)))
    finally:
        backend.close()


def _machine() -> tuple[str, list[int]]:
    """This process's kernel (boot id, else host name) and the CPUs it may run on."""
    try:
        with open("/proc/sys/kernel/random/boot_id", encoding="ascii") as file:
            name = file.read().strip()
    except OSError:
        name = socket.gethostname()
    cpus = (
        os.sched_getaffinity(0) if hasattr(os, "sched_getaffinity") else range(os.cpu_count() or 1)
    )
    return name, sorted(cpus)


def test_mpi_waits_sleep_where_a_machine_has_more_ranks_than_cores(
    world: Backend, rank: int, size: int, monkeypatch: pytest.MonkeyPatch
) -> None:
    # MPICH's wait polls a core: where ranks outnumber their machine's cores it is the core a
    # slower rank computes on, so there the world makes MPICH sleep between polls.
    if world.name != "mpi":
        pytest.skip("needs the MPI backend (run under mpiexec)")
    from mpi4py import MPI

    from dataparallel.backends.mpi import MPIBackend
    from dataparallel.backends.mpi.backend import SLEEP_VARIABLE
    from dataparallel.backends.mpi.library import control

    if control(MPI, SLEEP_VARIABLE) is None:
        pytest.skip(f"this MPI library has no {SLEEP_VARIABLE} (not MPICH)")
    mine, cpus = _machine()
    machines = world.allgather_object((mine, cpus))
    here = [set(c) for name, c in machines if name == mine]
    crowded = len(here) > len(set().union(*here))
    assert getattr(world, "sleeps", None) is crowded
    held = control(MPI, SLEEP_VARIABLE)
    assert held == 1 or not crowded
    for given, sleeps in (("1", True), ("0", False)):
        monkeypatch.setenv("DATAPARALLEL_MPI_SLEEP", given)
        backend = MPIBackend.create()
        try:
            assert backend.sleeps is sleeps
            assert control(MPI, SLEEP_VARIABLE) == (1 if sleeps else held)
            buf = np.full(3, float(rank))
            backend.allreduce(buf, ReduceOp.MAX)
            np.testing.assert_array_equal(buf, np.full(3, float(size - 1)))
        finally:
            backend.close()
        assert control(MPI, SLEEP_VARIABLE) == held, "not put back when the engine closed"


def test_a_sleeping_mpi_wait_leaves_the_core_to_a_rank_that_computes(
    world: Backend, rank: int, size: int
) -> None:
    # Rank 0 computes for 0.4 s of CPU before it joins; the others wait for it meanwhile. A wait
    # that only yields uses about a core all along; a sleeping one, a small part of one.
    if world.name != "mpi" or size == 1:
        pytest.skip("needs the MPI backend and several ranks (run under mpiexec)")
    from mpi4py import MPI

    from dataparallel.backends.mpi import MPIBackend

    backend = MPIBackend(MPI.COMM_WORLD)
    try:
        backend.sleep()
        if not backend.sleeps:
            pytest.skip("this MPI library's waits cannot be made to sleep (not MPICH)")
        backend.barrier()
        if rank == 0:
            start = time.process_time()
            while time.process_time() - start < 0.4:
                sum(range(1000))
        wall, cpu = time.perf_counter(), time.thread_time()
        buf = np.ones(1 << 16, np.float32)
        backend.allreduce(buf, ReduceOp.SUM)
        wall, cpu = time.perf_counter() - wall, time.thread_time() - cpu
        np.testing.assert_array_equal(buf, np.full(1 << 16, float(size), np.float32))
        if rank != 0:
            assert wall > 0.3, "rank 0 joined before the others waited for it"
            assert cpu < 0.5 * wall, f"the wait used {cpu:.3f} s of CPU in {wall:.3f} s"
    finally:
        backend.close()


class _Owned(np.ndarray):
    """An array that a weak reference can follow (NumPy's own arrays take none)."""


def test_mpi_keeps_the_buffer_of_a_call_dropped_in_flight(
    world: Backend, rank: int, size: int
) -> None:
    # A caller may let go of a call in flight (an error raised between its start and its wait,
    # an optimizer dropped mid-step): mpi4py then frees the request, MPI runs the call on, and
    # would write its result into memory Python has freed, corrupting the heap (a crash later,
    # anywhere). Rank 0 drops its reduction before the other ranks have started theirs.
    if world.name != "mpi" or size == 1:
        pytest.skip("needs the MPI backend and several ranks (run under mpiexec)")
    engine = world.duplicate()  # its calls meet no other test's
    try:
        buf = np.full(1000, float(rank + 1)).view(_Owned)
        kept = weakref.ref(buf)
        if rank == 0:
            handle = engine.iallreduce(buf, ReduceOp.SUM)
            del handle, buf
            gc.collect()
            assert kept() is not None, "freed while MPI may still write into it"
            world.barrier()  # only now do the other ranks start theirs
        else:
            world.barrier()
            engine.iallreduce(buf, ReduceOp.SUM).wait()
            np.testing.assert_array_equal(buf, np.full(1000, float(triangle(size))))
            del buf
        # Each call lets go of the dropped calls MPI has completed: rank 0's, once it has.
        for _ in range(20):
            released = np.array([kept() is None], np.int64)
            engine.allreduce(released, ReduceOp.MIN)
            if released[0]:
                break
        assert kept() is None, "the dropped call's buffer is never let go of"
    finally:
        engine.close()

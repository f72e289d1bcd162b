"""The communication thread (`arrays/comm_thread.py`), and gradient buckets reduced on it.

Run at any world size (`pytest`, `mpiexec -n 3 ... pytest`).
"""

from __future__ import annotations

import threading
from typing import Any

import pytest
import torch
from _torch_common import global_batch, loss_of, make_model, share, step_pair

import dataparallel as dp
from dataparallel.arrays import fusion as fusion_module
from dataparallel.arrays.comm_thread import THREAD_PAUSE, CommThread
from dataparallel.arrays.fusion import settle
from dataparallel.backends.base import Backend
from dataparallel.errors import CollectiveTimeoutError


def test_jobs_run_in_order_on_one_thread_and_errors_reach_the_caller() -> None:
    comm = CommThread("test-comm")
    seen: list[tuple[int, str]] = []
    gate = threading.Event()

    def job(k: int) -> None:
        gate.wait()  # held until the caller has looked: no clock decides what it sees
        seen.append((k, threading.current_thread().name))
        if k == 1:
            raise ValueError("job 1 failed")

    jobs = [comm.submit(lambda k=k: job(k)) for k in range(4)]
    try:
        assert not any(j.done for j in jobs)  # the caller returned at once
    finally:
        gate.set()
    jobs[0].wait()
    with pytest.raises(ValueError, match="job 1 failed"):
        jobs[1].wait()
    jobs[3].wait()  # the jobs after a failure still run
    assert seen == [(k, "test-comm") for k in range(4)]
    late = comm.submit(lambda: seen.append((4, "late")))
    comm.close()  # runs what was submitted, then stops
    assert late.done and seen[-1] == (4, "late")
    comm.close()
    with pytest.raises(RuntimeError, match="closed"):
        comm.submit(lambda: None)


def overlapping_step(world: Backend) -> tuple[dp.DistributedOptimizer, torch.nn.Module]:
    model = make_model(hidden=16)
    opt = dp.DistributedOptimizer(torch.optim.SGD(model.parameters(), lr=0.1), bucket_bytes=256)
    opt.gradient_sync.overlap = True  # DATAPARALLEL_OVERLAP=1: buckets go to the thread
    return opt, model


def test_gradients_reduced_on_the_thread_match_one_process(world: Backend) -> None:
    opt, model = overlapping_step(world)
    reference = make_model(hidden=16)
    reference_opt = torch.optim.SGD(reference.parameters(), lr=0.1)
    for step in range(3):
        step_pair(model, opt, reference, reference_opt, *global_batch(step))
    for got, want in zip(model.parameters(), reference.parameters(), strict=True):
        torch.testing.assert_close(got, want)
    # The thread's engine is a private duplicate: the world's own engine saw none of it.
    assert opt.gradient_sync.bucket_backend is not world or world.size == 1


def test_an_engine_error_on_the_thread_is_raised_by_step_and_the_next_step_works(
    world: Backend, monkeypatch: pytest.MonkeyPatch
) -> None:
    if world.size == 1:
        pytest.skip("a world of one makes no call on the thread")
    opt, model = overlapping_step(world)
    engine = opt.gradient_sync.bucket_backend
    assert engine is not world
    start = engine.iallreduce
    failing = [True]

    def iallreduce(buf: Any, op: Any) -> Any:
        if failing[0]:  # every rank fails its first bucket alike: no message is left unmatched
            raise CollectiveTimeoutError("the engine gave up on this bucket")
        return start(buf, op)

    monkeypatch.setattr(engine, "iallreduce", iallreduce)
    x, y = global_batch(0)
    loss_of(model, share(x), share(y)).backward()  # buckets handed over; backward returns
    with pytest.raises(CollectiveTimeoutError, match="gave up on this bucket"):
        opt.step()
    failing[0] = False
    reference = make_model(hidden=16)
    reference.load_state_dict(model.state_dict())
    step_pair(model, opt, reference, torch.optim.SGD(reference.parameters(), lr=0.1), x, y)
    for got, want in zip(model.parameters(), reference.parameters(), strict=True):
        torch.testing.assert_close(got, want)


@pytest.mark.parametrize("nodes", ["one node", "several nodes"])
def test_on_the_thread_mpi_calls_across_nodes_are_tested_with_pauses(
    world: Backend, monkeypatch: pytest.MonkeyPatch, nodes: str
) -> None:
    # MPICH's wait spins a core of system calls, the core backward computes on (issue 24); over
    # shared memory (one node) the waiting is copying, and the thread waits in MPI as before.
    opt, model = overlapping_step(world)
    engine = opt.gradient_sync.bucket_backend
    if nodes == "several nodes":  # as if every rank were alone on its node
        monkeypatch.setattr(engine, "local_size", 1)
    settled: list[float] = []
    limits: set[float | None] = set()

    def recording(request: Any, pause: float, limit: float | None) -> None:
        settled.append(pause)
        limits.add(limit)
        settle(request, pause, limit)

    monkeypatch.setattr(fusion_module, "settle", recording)
    reference = make_model(hidden=16)
    reference_opt = torch.optim.SGD(reference.parameters(), lr=0.1)
    for step in range(2):
        step_pair(model, opt, reference, reference_opt, *global_batch(step))
    for got, want in zip(model.parameters(), reference.parameters(), strict=True):
        torch.testing.assert_close(got, want)
    # Gloo's wait does not spin: its calls are waited for in Gloo on any number of nodes.
    wire = world.size > 1 and world.name == "mpi" and nodes == "several nodes"
    if wire:
        assert settled == [THREAD_PAUSE] * len(settled)
        assert len(settled) >= opt.gradient_sync.calls > 0
        assert limits == {getattr(engine, "timeout", None)}  # then the engine's own wait raises
    else:
        assert settled == []


class _Late:
    """A call in flight that completes at its `after`-th test (never, for None)."""

    def __init__(self, after: int | None) -> None:
        self.after, self.tests = after, 0

    def test(self) -> bool:
        self.tests += 1
        return self.after is not None and self.tests >= self.after

    def wait(self) -> None:  # pragma: no cover - settle never waits
        raise AssertionError("settle waited in the engine")


def test_a_call_is_tested_until_it_completes_or_the_engines_timeout_passes() -> None:
    late = _Late(3)
    settle(late, 1e-6, None)
    assert late.tests == 3
    # With a timeout, a call that never completes is handed back to the engine's own wait
    # (which raises CollectiveTimeoutError) instead of being tested forever.
    never = _Late(None)
    settle(never, 1e-6, 0.0)
    assert never.tests >= 1

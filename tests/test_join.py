"""Uneven inputs (`dp.join`, `dp.torch.join`), at any world size, MPI and Gloo.

A rank that has joined answers the others' reductions with zeros until every rank has joined, so
nobody hangs and averages divide by the whole world (Horovod's rule). Every test below runs the
same code on every rank; ranks differ only in how much data they hold (0, 1 and many batches).
Results are compared with references every rank computes locally, and gathered before asserting
where ranks differ, so a failure on one rank cannot leave the others waiting.
"""

from __future__ import annotations

import numpy as np
import pytest

import dataparallel as dp
from dataparallel import protocol
from dataparallel.errors import CollectiveMismatchError, RankJoinedError

torch = pytest.importorskip("torch")
try:
    import jax.numpy as jnp
except ImportError:  # the JAX case is skipped
    jnp = None


# How many batches each rank holds: 0, 1 and many, rotated so that a world of two sees every pair.
# Ranks that join at once or after one step; and (4, 7, 9): after steps made without a handshake
# (every rank promised them), so that the rank that joins keeps its promise as joining.
PATTERNS = [(0, 1, 5), (5, 0, 1), (1, 5, 0), (4, 7, 9)]


def batches_of(size: int, pattern: tuple[int, ...]) -> list[int]:
    return [pattern[r % 3] + (r // 3) for r in range(size)]


def values(rank: int, step: int) -> np.ndarray:
    return np.array([rank + 1.0, step + 1.0, (rank + 1.0) * (step + 2.0)])


def test_a_world_of_one_joins_at_once(world: dp.Backend) -> None:
    if world.size == 1:
        assert dp.join() == 0


@pytest.mark.parametrize("first", [0, -1], ids=["rank-0-first", "last-rank-first"])
def test_allreduce_averages_over_the_world_with_zeros_from_joined_ranks(
    rank: int, size: int, first: int
) -> None:
    first = first % size
    if rank == first:
        last = dp.join()
    else:
        for step in range(3):
            mean = dp.allreduce(values(rank, step), op="avg")
            live = [r for r in range(size) if r != first]
            expected = sum(values(r, step) for r in live) / size
            np.testing.assert_allclose(mean, expected)
            tree = dp.allreduce({"w": torch.full((300, 40), rank + 1.0), "n": np.int64(rank)})
            assert tree["w"][0, 0].item() == sum(r + 1.0 for r in live)
            assert tree["n"] == sum(live)
            big = dp.allreduce(np.full(500, rank + 1.0))  # in place, past the handshake
            np.testing.assert_array_equal(big, np.full(500, sum(r + 1.0 for r in live)))
            metrics = dp.allreduce({"a": rank + 1.0, "b": 1.0})  # floats in the handshake
            assert metrics == {"a": sum(r + 1.0 for r in live), "b": float(len(live))}
            arrays = dp.allreduce([np.full(40, rank + 1.0), np.ones((3, 4))])  # a planned tree
            np.testing.assert_array_equal(arrays[0], np.full(40, sum(r + 1.0 for r in live)))
            np.testing.assert_array_equal(arrays[1], np.full((3, 4), len(live)))
            if jnp is not None:  # JAX leaves past the plan limit: one call ("whole"), replayed
                grads = [jnp.full((600, 600), rank + 1.0, jnp.float32), jnp.ones(16, jnp.float32)]
                out = dp.allreduce(grads)
                live_sum = sum(r + 1.0 for r in live)
                np.testing.assert_array_equal(out[0], np.full((600, 600), live_sum))
                np.testing.assert_array_equal(out[1], np.full(16, float(len(live))))
        last = dp.join()
    assert dp.allgather_object(last) == [last] * size
    assert last == (max(r for r in range(size) if r != first) if size > 1 else 0)


@pytest.mark.parametrize("pattern", PATTERNS)
def test_uneven_batches_train_as_horovod_does(
    rank: int, size: int, pattern: tuple[int, ...]
) -> None:
    """DistributedOptimizer: step k averages the gradients of the ranks that still have a batch
    (a joined rank counts as zeros); each rank's model stops where its data ends."""
    counts = batches_of(size, pattern)
    torch.manual_seed(0)
    model = torch.nn.Linear(3, 2)
    reference = torch.nn.Linear(3, 2)
    reference.load_state_dict(model.state_dict())
    opt = dp.DistributedOptimizer(torch.optim.SGD(model.parameters(), lr=0.1))
    ref_opt = torch.optim.SGD(reference.parameters(), lr=0.1)

    def batch(r: int, step: int) -> torch.Tensor:
        return torch.tensor(values(r, step), dtype=torch.float32).reshape(1, 3)

    for step in range(counts[rank]):
        opt.zero_grad()
        model(batch(rank, step)).pow(2).sum().backward()
        opt.step()
    last = dp.join()
    for step in range(counts[rank]):  # the reference: every rank's gradient, zeros once done
        grads = []
        for r in range(size):
            reference.zero_grad()
            if step < counts[r]:
                reference(batch(r, step)).pow(2).sum().backward()
                grads.append([p.grad.clone() for p in reference.parameters()])
        for p, *per_rank in zip(reference.parameters(), *grads, strict=True):
            p.grad = sum(per_rank) / size
        ref_opt.step()
    for p, q in zip(model.parameters(), reference.parameters(), strict=True):
        torch.testing.assert_close(p, q)
    assert last == max(r for r in range(size) if counts[r] == max(counts))


@pytest.mark.parametrize("pattern", PATTERNS)
def test_data_parallel_model_in_a_join_block(
    rank: int, size: int, pattern: tuple[int, ...]
) -> None:
    counts = batches_of(size, pattern)
    torch.manual_seed(1)
    model = dp.torch.DataParallelModel(torch.nn.Linear(3, 1, bias=False))
    opt = torch.optim.SGD(model.parameters(), lr=0.0)  # the gradients are what is checked
    grads = []
    with dp.torch.join(model) as joined:
        for step in range(counts[rank]):
            opt.zero_grad()
            x = torch.tensor(values(rank, step), dtype=torch.float32).reshape(1, 3)
            model(x).sum().backward()
            grads.append(model.module.weight.grad.clone())
            opt.step()
    for step, grad in enumerate(grads):
        live = [r for r in range(size) if step < counts[r]]
        expected = sum(values(r, step) for r in live) / size
        np.testing.assert_allclose(grad.numpy().reshape(-1), expected, rtol=1e-6)
    assert dp.allgather_object(joined.last) == [joined.last] * size


def test_reductions_that_joined_ranks_answer(rank: int, size: int) -> None:
    """reducescatter, iallreduce, reduce, min (zeros count, as in Horovod), reducers, barrier."""
    if rank == 0:
        dp.join()
        return
    live = size - 1
    rows = dp.reducescatter(np.ones((2 * size, 3)))
    np.testing.assert_array_equal(rows, np.full((2, 3), live))
    request = dp.iallreduce(torch.ones(5000))
    assert request.wait()[0].item() == live
    lowest = dp.allreduce(np.array([rank + 1.0, -1.0]), op="min")
    np.testing.assert_array_equal(lowest, [0.0, -1.0])
    reducer = dp.CoalescingReducer(scale=0.5, bucket_bytes=64)
    arrays = [np.full(n, 2.0) for n in (3, 30, 1)]
    for a in arrays:
        reducer.add(a)
    reducer.finalize()
    for a in arrays:
        np.testing.assert_array_equal(a, np.full(a.size, live))
    dp.barrier()
    total = dp.reduce(np.array([1.0]), root=size - 1)
    assert total[0] == (live if rank == size - 1 else 1.0)
    dp.join()


def test_other_collectives_are_refused_and_the_world_stays_usable(rank: int, size: int) -> None:
    if size == 1:
        return
    if rank == size - 1:
        dp.join()
    else:
        for call in (
            lambda: dp.allgather(np.ones(2)),
            lambda: dp.broadcast(np.ones(2), root=0),
            lambda: dp.broadcast_object("x"),
            lambda: dp.alltoall(np.ones(size - 0)),
        ):
            with pytest.raises(RankJoinedError, match="some ranks have joined"):
                call()
        assert dp.allreduce(np.ones(1))[0] == size - 1
        dp.join()
    assert dp.allgather_object(rank) == list(range(size))


def test_a_mismatch_among_the_ranks_still_working_is_reported(rank: int, size: int) -> None:
    if size < 3:
        return
    if rank == 0:
        dp.join()
    else:
        with pytest.raises(CollectiveMismatchError, match=r"ranks? 2"):
            dp.allreduce(np.ones(rank))
        dp.join()


def test_large_worlds_handshake_join_alike(
    rank: int, size: int, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Worlds over 64 ranks handshake with an allreduce of bounds instead of records."""
    from dataparallel import world

    # Plans are made under the protocol's limit, a constant of a process: a fresh cache here.
    monkeypatch.setattr(protocol, "GATHER_LIMIT", 1)
    monkeypatch.setattr(world.current(), "plans", world.Plans())
    test_allreduce_averages_over_the_world_with_zeros_from_joined_ranks(rank, size, -1)
    test_reductions_that_joined_ranks_answer(rank, size)
    test_a_mismatch_among_the_ranks_still_working_is_reported(rank, size)

"""`dataparallel.horovod.torch`, Horovod's API over dataparallel, at any world size.

Horovod's own suite runs against it through `tools/horovod_suite` (`make test-horovod`); these
are the project's checks of what the drop-in adds over dataparallel's API: Horovod's op and scale
rules, world ranks as roots of process sets, queued handles, names, and the optimizer's face.
"""

from __future__ import annotations

import warnings

import numpy as np
import pytest

import dataparallel as dp

torch = pytest.importorskip("torch")
hvd = pytest.importorskip("dataparallel.horovod.torch")


@pytest.fixture(autouse=True)
def _init(world: dp.Backend) -> None:
    hvd.init()  # dp.initialize() ran already: this is what a Horovod script calls


def test_ranks_and_what_is_built(rank: int, size: int) -> None:
    assert (hvd.rank(), hvd.size()) == (rank, size)
    assert hvd.local_rank() == dp.local_rank() and hvd.local_size() == dp.local_size()
    assert 0 <= hvd.cross_rank() < hvd.cross_size()
    assert hvd.is_initialized() and hvd.mpi_built() and hvd.gloo_built()
    assert hvd.mpi_enabled() == (dp.get_backend().name == "mpi")
    assert hvd.nccl_built() == 0 or hvd.nccl_built() > 2000
    assert not hvd.ccl_built() and not hvd.ddl_built() and not hvd.rocm_built()


def test_reduce_ops_and_horovod_integer_average(rank: int, size: int) -> None:
    x = torch.tensor([rank + 1.0, -2.0 * rank])
    torch.testing.assert_close(
        hvd.allreduce(x, op=hvd.Sum),
        torch.tensor([1.0, -2.0]) * 0 + sum(torch.tensor([r + 1.0, -2.0 * r]) for r in range(size)),
    )
    assert hvd.allreduce(x, op=hvd.Max)[0].item() == size
    assert hvd.allreduce(x, op=hvd.Min)[1].item() == -2.0 * (size - 1)
    assert hvd.allreduce(torch.tensor([2]), op=hvd.Product).item() == 2**size
    ints = torch.tensor([7 * rank + 1, -7 * rank - 1], dtype=torch.int32)
    mean = hvd.allreduce(ints)  # Average: the sum, scaled in float64, truncated (Horovod's)
    total = sum(7 * r + 1 for r in range(size))
    assert mean.dtype == torch.int32 and mean.tolist() == [int(total / size), -int(total / size)]
    assert x.tolist() == [rank + 1.0, -2.0 * rank]  # not in place
    with pytest.raises(NotImplementedError, match="Adasum"):
        hvd.allreduce(x, op=hvd.Adasum)
    with pytest.warns(DeprecationWarning, match="average"):
        assert hvd.allreduce(torch.ones(1), average=False).item() == size


def test_prescale_postscale_and_in_place(size: int) -> None:
    half = torch.full((3,), 1.5, dtype=torch.float16)
    out = hvd.allreduce(half, op=hvd.Sum, prescale_factor=0.5, postscale_factor=3.0)
    assert out.dtype == torch.float16 and out.tolist() == [2.25 * size] * 3
    ints = torch.full((2,), 5, dtype=torch.int64)
    assert hvd.allreduce_(ints, op=hvd.Sum, postscale_factor=0.3) is ints
    assert ints.tolist() == [int(5 * size * 0.3)] * 2
    group = [torch.ones(2), torch.full((3, 2), 2.0)]
    summed = hvd.grouped_allreduce(group, op=hvd.Sum)
    assert [t.sum().item() for t in summed] == [2.0 * size, 12.0 * size]


def test_queued_handles_complete_in_submission_order_wherever_ranks_wait(rank: int) -> None:
    a = hvd.allreduce_async(torch.ones(4), name="a", op=hvd.Sum)
    b = hvd.allgather_async(torch.full((rank + 1, 2), float(rank)), name="b")
    c = hvd.broadcast_async(torch.full((2,), float(rank)), root_rank=0, name="c")
    with pytest.raises(ValueError, match="already in flight"):
        hvd.allreduce_async(torch.ones(4), name="a")
    if rank % 2:  # odd ranks wait for the last first, even ones in order
        results = [hvd.synchronize(c), hvd.synchronize(b), hvd.synchronize(a)][::-1]
    else:
        assert hvd.poll(a) is False  # queued until now: poll starts it
        results = [hvd.synchronize(h) for h in (a, b, c)]
    assert results[0].tolist() == [float(dp.size())] * 4
    assert results[1].shape == (sum(r + 1 for r in range(dp.size())), 2)
    assert results[2].tolist() == [0.0, 0.0]
    assert hvd.poll(a) is True and hvd.synchronize(a) is None  # done and released
    hvd.allreduce_async(torch.ones(1), name="a")  # the name is free again
    hvd.barrier()


def test_process_sets_take_world_ranks_as_roots(rank: int, size: int) -> None:
    halves = [list(range(0, size, 2)), list(range(1, size, 2))]
    if size == 1:
        return  # its one set would be the world's, which exists already
    sets = [hvd.add_process_set(ranks) for ranks in halves]
    mine = sets[rank % 2]
    assert mine.included() and mine.rank() == mine.ranks.index(rank)
    assert mine.size() == len(mine.ranks)
    with pytest.raises(ValueError, match="duplicate"):
        hvd.add_process_set(list(sets[0].ranks))
    root = mine.ranks[-1]
    got = hvd.broadcast(torch.tensor([float(rank)]), root_rank=root, process_set=mine)
    assert got.item() == root
    assert hvd.broadcast_object(rank, root_rank=root, process_set=mine) == root
    assert hvd.allreduce(torch.ones(1), op=hvd.Sum, process_set=mine).item() == len(mine.ranks)
    for other in sets:
        if other is not mine:
            with pytest.raises(ValueError, match="not in it"):
                hvd.allreduce(torch.ones(1), process_set=other)
    assert all(hvd.remove_process_set(ps) for ps in sets)
    assert not hvd.remove_process_set(sets[0]) and sets[0].process_set_id is None


def test_reducescatter_and_alltoall(rank: int, size: int) -> None:
    x = torch.arange(2.0 * size).reshape(size, 2)
    part = hvd.reducescatter(x, op=hvd.Sum)
    assert part.tolist() == [[2.0 * rank * size, (2.0 * rank + 1) * size]]
    splits = torch.tensor([1] * size, dtype=torch.int32)
    got, received = hvd.alltoall(torch.full((size, 1), float(rank)), splits)
    assert got.reshape(-1).tolist() == [float(r) for r in range(size)]
    assert received.dtype == torch.int32 and received.tolist() == [1] * size
    with pytest.raises(ValueError, match="int32"):
        hvd.alltoall(torch.ones(size), torch.ones(size))


def test_distributed_optimizer_face(rank: int, size: int) -> None:
    model = torch.nn.Linear(2, 1)
    hvd.broadcast_parameters(model.state_dict(), root_rank=0)
    with pytest.raises(ValueError, match="unique"):
        hvd.DistributedOptimizer(
            torch.optim.SGD(model.parameters(), lr=0.1),
            named_parameters=[("w", model.weight), ("w", model.bias)],
        )
    with pytest.raises(ValueError, match="not named"):
        hvd.DistributedOptimizer(
            torch.optim.SGD(model.parameters(), lr=0.1), named_parameters=[("w", model.weight)]
        )
    opt = hvd.DistributedOptimizer(
        torch.optim.SGD(model.parameters(), lr=0.1), named_parameters=model.named_parameters()
    )
    assert isinstance(opt, torch.optim.SGD) and sorted(opt._parameter_names.values()) == [
        "bias",
        "weight",
    ]
    model(torch.full((1, 2), float(rank))).sum().backward()
    opt.synchronize()
    torch.testing.assert_close(model.weight.grad, torch.full((1, 2), (size - 1) / 2))
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        with opt.skip_synchronize():
            opt.step()
    assert caught == []
    opt.zero_grad()
    model(torch.ones(1, 2)).sum().backward()
    opt.synchronize()
    with pytest.warns(UserWarning, match="skip_synchronize"):
        opt.step()


def test_broadcast_optimizer_state_creates_state_first(rank: int) -> None:
    torch.manual_seed(rank)
    model = torch.nn.Linear(3, 2)
    opt = hvd.DistributedOptimizer(torch.optim.Adam(model.parameters(), lr=0.01 * (rank + 1)))
    hvd.broadcast_parameters(model.state_dict(), root_rank=0)
    hvd.broadcast_optimizer_state(opt, root_rank=0)
    assert opt.param_groups[0]["lr"] == 0.01 and len(opt.state) == 2
    states = hvd.allgather_object(float(opt.state[model.weight]["exp_avg_sq"].sum()))
    assert states == [states[0]] * len(states)


def test_join_through_the_drop_in(rank: int, size: int) -> None:
    if rank == 0 and size > 1:
        last = hvd.join()
    else:
        out = hvd.allreduce(torch.ones(3))  # Average over the world, rank 0 counting as zeros
        np.testing.assert_allclose(out.numpy(), (size - (size > 1)) / size)
        last = hvd.join()
    assert hvd.allgather_object(last) == [size - 1] * size


def test_gradients_are_horovods(rank: int, size: int) -> None:
    """Each synchronous operation differentiates as `horovod/torch/mpi_ops.py` defines."""
    x = torch.full((2, 3), float(rank + 1), requires_grad=True)
    hvd.allreduce(x, op=hvd.Average, postscale_factor=2.0).sum().backward()
    torch.testing.assert_close(x.grad, torch.full((2, 3), 2.0))  # averaged ones, scaled
    x.grad = None
    gathered = hvd.allgather(x)
    gathered.backward(torch.arange(float(gathered.numel())).reshape(gathered.shape))
    rows = torch.arange(float(gathered.numel())).reshape(gathered.shape)[2 * rank : 2 * rank + 2]
    torch.testing.assert_close(x.grad, rows)  # the same on every rank, so the average is itself
    x.grad = None
    hvd.broadcast(x, root_rank=size - 1).sum().backward()
    torch.testing.assert_close(x.grad, torch.full((2, 3), float(rank == size - 1)))
    x.grad = None
    hvd.reducescatter(torch.cat([x] * size), op=hvd.Sum).sum().backward()
    torch.testing.assert_close(x.grad, torch.full((2, 3), float(size * size)))
    # alltoall, equal splits of unequal inputs: rank r sends r + 1 rows to each rank.
    y = torch.ones((rank + 1) * size, 2, requires_grad=True)
    out = hvd.alltoall(y)
    assert out.shape[0] == sum(r + 1 for r in range(size))
    (out * 3).sum().backward()
    torch.testing.assert_close(y.grad, torch.full(y.shape, 3.0))
    x.grad, z = None, torch.ones(4, requires_grad=True)
    parts = hvd.grouped_allreduce([x, z], op=hvd.Sum)
    (parts[0].sum() + 2 * parts[1].sum()).backward()
    torch.testing.assert_close(x.grad, torch.full((2, 3), float(size)))
    torch.testing.assert_close(z.grad, torch.full((4,), 2.0 * size))


def test_compression_and_sparse_as_dense(rank: int, size: int) -> None:
    half, ctx = hvd.Compression.fp16.compress(torch.ones(3, dtype=torch.float64))
    assert half.dtype == torch.float16
    assert hvd.Compression.fp16.decompress(half, ctx).dtype == torch.float64
    out = hvd.allreduce(torch.full((4,), 0.5 + rank), compression=hvd.Compression.fp16)
    torch.testing.assert_close(out, torch.full((4,), 0.5 + (size - 1) / 2))
    embedding = torch.nn.Embedding(6, 2, sparse=True)
    hvd.broadcast_parameters(embedding.state_dict(), root_rank=0)
    opt = hvd.DistributedOptimizer(
        torch.optim.SparseAdam(list(embedding.parameters()), lr=0.1),
        compression=hvd.Compression.fp16,
        sparse_as_dense=True,
    )
    embedding(torch.tensor([rank % 6, 5])).sum().backward()
    opt.step()  # SparseAdam takes the reduced gradient: sparse again, as Horovod makes it
    grad = embedding.weight.grad
    assert grad is not None and grad.layout == torch.sparse_coo
    expected = torch.zeros(6, 2)
    for r in range(size):
        expected[r % 6] += 1 / size
    expected[5] += 1.0
    torch.testing.assert_close(grad.to_dense(), expected)


def test_sparse_allreduce_gathers_rows_without_a_warning(rank: int, size: int) -> None:
    """Horovod's sparse allreduce: every rank's rows, averaged; no sparse-invariants warning."""
    rows = torch.tensor([[rank % 4, 3]])
    mine = torch.sparse_coo_tensor(rows, torch.tensor([1.0, 2.0]), (4,), check_invariants=True)
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # torch warns when invariant checks are implicitly off
        got = hvd.sparse_allreduce_async(mine, name="sparse.rows", op=hvd.Average)()
    assert got.layout == torch.sparse_coo and got._indices().shape == (1, 2 * size)
    expected = torch.zeros(4)
    for r in range(size):
        expected[r % 4] += 1 / size
        expected[3] += 2 / size
    torch.testing.assert_close(got.coalesce().to_dense(), expected)

"""Process groups (`dp.new_group`): collectives among some ranks, at any world size.

Every test makes its groups on every rank (making one is collective), then only the members call
collectives with it; ranks outside check that they are refused.
"""

from __future__ import annotations

import itertools
from typing import Any

import numpy as np
import pytest

import dataparallel as dp
from dataparallel.errors import CollectiveMismatchError

torch = pytest.importorskip("torch")


def every_group(size: int) -> list[tuple[int, ...]]:
    """Every non-empty set of ranks of a world of `size`, smallest first."""
    ranks = range(size)
    return [c for k in range(1, size + 1) for c in itertools.combinations(ranks, k)]


def test_every_shape_of_group_reduces_among_its_members(rank: int, size: int) -> None:
    for members in every_group(size):
        group = dp.new_group(list(members))
        assert group.ranks == members and group.member == (rank in members)
        if group.member:
            assert dp.rank(group) == members.index(rank) and dp.size(group) == len(members)
            total = dp.allreduce(np.array([rank + 1.0, 1.0]), group=group)
            np.testing.assert_array_equal(total, [sum(r + 1.0 for r in members), len(members)])
            mean = dp.allreduce({"x": torch.tensor([float(rank)])}, op="avg", group=group)
            assert mean["x"].item() == pytest.approx(sum(members) / len(members))
        group.free()
    dp.barrier()


def test_roots_are_group_ranks(rank: int, size: int) -> None:
    members = list(range(size - 1, -1, -2))  # the last rank, then every other one going down
    group = dp.new_group(members)
    if group.member:
        last = dp.size(group) - 1  # the group's last rank: world rank max(members)
        got = dp.broadcast(np.array([float(rank)]), root=last, group=group)
        assert got[0] == sorted(members)[last]
        assert dp.broadcast_object(f"from {rank}", root=0, group=group) == f"from {min(members)}"
        assert dp.allgather_object(rank, group=group) == sorted(members)
        rows = dp.allgather(np.full((dp.rank(group) + 1, 2), rank), group=group)
        expected = np.concatenate([np.full((i + 1, 2), r) for i, r in enumerate(sorted(members))])
        np.testing.assert_array_equal(rows, expected)
        reduced = dp.reduce(np.array([1.0]), root=0, group=group)
        assert reduced[0] == (len(members) if dp.rank(group) == 0 else 1.0)
        dp.barrier(group=group)
    group.free()


def test_ranks_outside_a_group_are_refused(rank: int, size: int) -> None:
    group = dp.new_group([0])
    if rank == 0:
        assert dp.allreduce(np.ones(1), group=group)[0] == 1.0
    else:
        with pytest.raises(ValueError, match=rf"rank {rank} is not in it"):
            dp.allreduce(np.ones(1), group=group)
        with pytest.raises(ValueError, match="is not in it"):
            dp.rank(group)
    group.free()
    with pytest.raises(ValueError, match="it was freed" if rank == 0 else "is not in it"):
        dp.allreduce(np.ones(1), group=group)
    with pytest.raises(ValueError, match="group= or backend=, not both"):
        dp.allreduce(np.ones(1), group=group, backend=dp.get_backend())


def test_mismatches_within_a_group_raise_on_every_member(rank: int, size: int) -> None:
    if size < 2:
        pytest.skip("a mismatch needs two ranks")
    group = dp.new_group([0, 1])
    if group.member:
        with pytest.raises(CollectiveMismatchError, match=r"ranks? 1"):
            dp.allreduce(np.ones(2 + dp.rank(group)), group=group)
        assert dp.allreduce(np.ones(1), group=group)[0] == 2.0  # the group stays usable
    group.free()
    dp.barrier()


def test_new_group_checks_its_ranks(rank: int, size: int) -> None:
    with pytest.raises(ValueError, match="at least one rank"):
        dp.new_group([])
    with pytest.raises(ValueError, match="name a rank twice"):
        dp.new_group([0, 0])
    with pytest.raises(ValueError, match=f"not all ranks of this world of {size}"):
        dp.new_group([size])
    with pytest.raises(TypeError, match="not an int"):
        dp.new_group([0.0])
    with pytest.raises(TypeError, match="takes a list of ranks"):
        dp.new_group(0)
    if size > 1:
        with pytest.raises(CollectiveMismatchError, match="different ranks"):
            dp.new_group([0] if rank == 0 else [0, 1])
    dp.barrier()


def _model() -> Any:
    torch.manual_seed(0)
    return torch.nn.Sequential(torch.nn.Linear(3, 4), torch.nn.Tanh(), torch.nn.Linear(4, 1))


def test_training_within_a_group(rank: int, size: int) -> None:
    """Two halves of the world train apart: each averages only its own members' gradients."""
    halves = [list(range(0, size, 2)), list(range(1, size, 2))]
    groups = [dp.new_group(h) if h else None for h in halves]
    mine = next(g for g in groups if g is not None and g.member)
    model = _model()
    opt = dp.DistributedOptimizer(torch.optim.SGD(model.parameters(), lr=0.1), group=mine)
    wrapped = dp.torch.DataParallelModel(_model(), group=mine)
    x = torch.full((2, 3), float(rank))
    model(x).sum().backward()
    wrapped(x).sum().backward()
    expected = torch.zeros_like(model[0].weight)
    for r in mine.ranks:  # the group's average, computed here from every member's input
        probe = _model()
        probe(torch.full((2, 3), float(r))).sum().backward()
        expected += probe[0].weight.grad / len(mine.ranks)
    opt.synchronize()
    torch.testing.assert_close(model[0].weight.grad, expected)
    torch.testing.assert_close(wrapped.module[0].weight.grad, expected)
    opt.step()
    synced = dp.synchronize({"w": np.array([float(rank)])}, root=0, group=mine)
    assert synced["w"][0] == min(mine.ranks)
    share = dp.DistributedDataContainer(np.arange(10), group=mine)
    every = dp.allgather_object(list(share), group=mine)
    assert sorted(i for part in every for i in part) == list(range(10))
    loader = dp.DistributedDataLoader(np.arange(10), 3, group=mine)
    assert len({n for n in dp.allgather_object(len(loader), group=mine)}) == 1
    with dp.CoalescingReducer(group=mine) as reducer:
        ones = np.ones(3)
        reducer.add(ones)
    assert ones[0] == len(mine.ranks)
    for g in groups:
        if g is not None:
            g.free()
    dp.barrier()

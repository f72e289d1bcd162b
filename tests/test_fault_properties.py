"""Property: when one rank's call differs from the others' in one way, every rank raises.

Hypothesis draws a call (collective, tree of arrays and numbers, small and large leaves, op, root)
and one way in which one rank's call differs: the shape, dtype or tree of a leaf, the op, the
root, a skipped call, an extra call, or an input rejected on that rank only (a caught exception).
Every rank must raise (`CollectiveMismatchError`, or the rank's own error for a rejected input),
and the world must stay usable: the next calls give the right values. Under several ranks every
rank draws the same examples (`derandomize=True`, see `conftest.py`), and the whole job runs under
its launcher's timeout, so a hang would fail the job rather than pass unnoticed.
"""

from __future__ import annotations

import dataclasses
from typing import Any

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

import dataparallel as dp
import dataparallel.world as world_module

DTYPES = ["float32", "float64", "int32", "int64"]
FAULTS = ["shape", "dtype", "tree", "op", "root", "skip", "extra", "exception"]
# What checks-off still tells apart: whatever changes the messages (not shapes of equal size).
FAULTS_CHECKS_OFF = ["size", "dtype", "op", "root", "skip", "extra", "exception"]
COLLECTIVES = ["allreduce", "iallreduce", "reduce", "broadcast", "ibroadcast", "allgather"]


@dataclasses.dataclass(frozen=True)
class Call:
    collective: str
    leaves: tuple[tuple[str, int, str], ...]  # (key, size, dtype)
    op: str = "sum"
    root: int = 0

    def tree(self, rank: int) -> dict[str, np.ndarray]:
        return {key: np.full(n, rank + 1, dtype) for key, n, dtype in self.leaves}

    def run(self, rank: int) -> Any:
        x = self.tree(rank)
        if self.collective == "allreduce":
            return dp.allreduce(x, op=self.op)
        if self.collective == "iallreduce":
            return dp.iallreduce(x, op=self.op).wait()
        if self.collective == "reduce":
            return dp.reduce(x, op=self.op, root=self.root)
        if self.collective == "broadcast":
            return dp.broadcast(x, root=self.root)
        if self.collective == "ibroadcast":
            return dp.ibroadcast(x, root=self.root).wait()
        return dp.allgather(x)


leaves = st.lists(
    st.tuples(
        st.sampled_from("abcdef"),
        st.sampled_from([0, 1, 3, 5, 700, 40_000]),  # inline and through the engine
        st.sampled_from(DTYPES),
    ),
    min_size=1,
    max_size=4,
    unique_by=lambda leaf: leaf[0],
).map(lambda xs: tuple(sorted(xs)))

calls = st.builds(
    Call,
    collective=st.sampled_from(COLLECTIVES),
    leaves=leaves,
    op=st.sampled_from(["sum", "max", "min", "prod"]),
    root=st.integers(0, 2),
)


def changed(call: Call, fault: str, size: int) -> Call:
    """Return `call` changed in the way `fault` says (the misbehaving rank's call)."""
    (key, n, dtype), rest = call.leaves[0], call.leaves[1:]
    if fault in ("shape", "size"):
        return dataclasses.replace(call, leaves=((key, n + 2, dtype), *rest))
    if fault == "dtype":
        other = DTYPES[(DTYPES.index(dtype) + 1) % len(DTYPES)]
        return dataclasses.replace(call, leaves=((key, n, other), *rest))
    if fault == "tree":
        return dataclasses.replace(call, leaves=((key.upper(), n, dtype), *rest))
    if fault == "op":
        ops = ["sum", "max", "min", "prod"]
        return dataclasses.replace(call, op=ops[(ops.index(call.op) + 1) % len(ops)])
    assert fault == "root"
    return dataclasses.replace(call, root=(call.root + 1) % size)


def normalized(call: Call, size: int) -> Call:
    """Make `call` valid in this world, and make its op and root count where they should."""
    collective = call.collective
    root = call.root % size
    if fault_free_op(collective) and call.op != "sum":
        collective = "allreduce"
    return dataclasses.replace(call, collective=collective, root=root)


def fault_free_op(collective: str) -> bool:
    return collective in ("broadcast", "ibroadcast", "allgather")


def misbehave(call: Call, fault: str, rank: int, faulty: int, size: int) -> None:
    """Run one step of the job: the calls of rank `rank`, where `faulty` misbehaves."""
    second = "allgather" if call.collective != "allgather" else "allreduce"
    other = dataclasses.replace(call, collective=second)
    if rank != faulty:
        call.run(rank)
        other.run(rank)  # a step makes two calls; the second meets a skipping rank's first
        return
    if fault == "skip":
        other.run(rank)
    elif fault == "extra":
        other.run(rank)
        call.run(rank)
    elif fault == "exception":
        dp.allreduce({"bad": "not an array"})
    else:
        changed(call, fault, size).run(rank)
        other.run(rank)


def check_fault(call: Call, fault: str, faulty: int) -> None:
    rank, size = dp.rank(), dp.size()
    call = normalized(call, size)
    if fault == "op" and fault_free_op(call.collective):
        fault = "root" if call.collective != "allgather" else "dtype"
    if fault == "root" and call.collective in ("allreduce", "iallreduce", "allgather"):
        call = dataclasses.replace(call, collective="reduce")
    if fault in ("shape", "size") and call.collective == "allgather":
        fault = "dtype"  # allgather allows another first axis: a shape fault is no fault there
    try:
        misbehave(call, fault, rank, faulty % size, size)
        raised = "nothing"
    except (dp.CollectiveMismatchError, TypeError) as error:
        raised = type(error).__name__
    every = dp.allgather_object(raised)
    assert "nothing" not in every, (call, fault, every)
    # The world is usable, and in step: a fresh call pairs with the same call everywhere.
    assert dp.allreduce(np.full(3, rank + 1.0)).tolist() == [size * (size + 1) / 2] * 3
    assert dp.allreduce(np.ones(5000))[0] == size


pytestmark = pytest.mark.skipif(dp.size() == 1, reason="a misbehaving rank needs two ranks")


@pytest.mark.heavy
@settings(max_examples=150)
@given(call=calls, fault=st.sampled_from(FAULTS), faulty=st.integers(0, 2))
def test_one_rank_that_differs_makes_every_rank_raise(call: Call, fault: str, faulty: int) -> None:
    check_fault(call, fault, faulty)


@pytest.mark.heavy
@settings(max_examples=80)
@given(call=calls, fault=st.sampled_from(FAULTS_CHECKS_OFF), faulty=st.integers(0, 2))
def test_with_checks_off_a_rank_that_differs_in_its_messages_makes_every_rank_raise(
    call: Call, fault: str, faulty: int
) -> None:
    active = world_module.current()
    before = active.settings
    active.settings = dataclasses.replace(before, check=False)
    try:
        check_fault(call, fault, faulty)
    finally:
        active.settings = before

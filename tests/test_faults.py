"""A rank that misbehaves never gets a silently wrong result, nor leaves the others hanging.

Issue 10's cases, at any world size (`pytest`, `mpiexec -n 3 ... pytest`, `dataparallel run -n 2
--backend gloo -m pytest`): NaN under min/max gives the same result on every rank; a call
rejected on one rank fails on every rank and the next call pairs correctly; a rank that skips a
training step or abandons one midway makes every rank raise; with the checks off a dtype or size
mismatch still raises instead of hanging; an allreduce into a tensor saved for backward makes
backward raise. After each fault, the world is checked to be usable. Results and outcomes of
other ranks are compared through `dp.allgather_object`, so one rank's failure cannot hang them.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Iterator
from typing import Any

import numpy as np
import pytest
import torch
from torch import nn

import dataparallel as dp
import dataparallel.world as world_module
from dataparallel.errors import CollectiveMismatchError


@pytest.fixture
def faulty(size: int) -> int:
    """The rank that misbehaves: the last one (skips the test in a world of one)."""
    if size == 1:
        pytest.skip("a misbehaving rank needs two ranks or more")
    return size - 1


@pytest.fixture
def checks_off(monkeypatch: pytest.MonkeyPatch) -> Iterator[None]:
    active = world_module.current()
    monkeypatch.setattr(active, "settings", dataclasses.replace(active.settings, check=False))
    yield


def outcome(call: Callable[[], Any]) -> str:
    """Run `call`; return the name of what it raised, or "ok"."""
    try:
        call()
    except Exception as error:
        return type(error).__name__
    return "ok"


def assert_usable(size: int) -> None:
    """The world works: a plain allreduce (through the engine and inline) gives the right sum."""
    assert dp.allreduce(np.ones(1000))[0] == size
    assert dp.allreduce(1.0) == size


def same_everywhere(value: Any) -> list[Any]:
    every = dp.allgather_object(value)
    assert all(v == every[0] for v in every), every
    return every


# -- 1. NaN under min and max --------------------------------------------------------------------


def with_nans(rank: int, n: int, dtype: torch.dtype) -> torch.Tensor:
    x = torch.arange(n, dtype=torch.float64) + rank
    x[rank % n] = float("nan")  # each rank its own NaN; the last item has none
    x[-1] = 7.0 - rank
    return x.to(dtype)


@pytest.mark.matrix
@pytest.mark.parametrize("op", ["max", "min"])
@pytest.mark.parametrize("n", [2, 3000], ids=["inline", "engine"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.float64, torch.float16, torch.bfloat16])
@pytest.mark.parametrize("call", ["allreduce", "iallreduce", "reduce"])
def test_nan_wins_under_min_and_max_on_every_rank(
    rank: int, size: int, op: str, n: int, dtype: torch.dtype, call: str
) -> None:
    mine = with_nans(rank, n, dtype)
    if call == "allreduce":
        out = dp.allreduce(mine.clone(), op=op)
    elif call == "iallreduce":
        out = dp.iallreduce(mine.clone(), op=op).wait()
    else:
        out = dp.reduce(mine.clone(), op=op, root=size - 1)
        if rank != size - 1:
            torch.testing.assert_close(out, mine, equal_nan=True)
            out = None
    combine = np.maximum if op == "max" else np.minimum
    every = [with_nans(r, n, torch.float32).numpy() for r in range(size)]
    expected = combine.reduce(every, axis=0)
    if out is not None:
        got = out.float().numpy()
        np.testing.assert_array_equal(np.isnan(got), np.isnan(expected))
        np.testing.assert_allclose(got, expected, rtol=1e-2)
    if call != "reduce":  # (only the root has a result to compare)
        same_everywhere(out.float().numpy().tobytes())


def test_nan_checks_cost_nothing_when_no_rank_has_one(
    rank: int, size: int, faulty: int, monkeypatch: pytest.MonkeyPatch
) -> None:
    backend = world_module.current().backend
    calls: list[str] = []
    for name in ("allgather", "allreduce"):
        real = getattr(backend, name)

        def counting(*args: Any, real: Callable[..., None] = real, name: str = name) -> None:
            calls.append(name)
            real(*args)

        monkeypatch.setattr(backend, name, counting)
    x = np.ones(1000)
    dp.allreduce(x, op="max")
    assert calls == ["allgather", "allreduce"]
    calls.clear()
    x[3] = np.nan if rank == faulty else 0.0
    out = dp.allreduce(x, op="max")
    assert calls == ["allgather", "allreduce", "allreduce"]  # the mask, only now
    assert np.isnan(out[3]) and np.isnan(out).sum() == 1


# -- 2. a call rejected on one rank fails on every rank -----------------------------------------


BAD_CALLS: dict[str, tuple[Callable[[bool], Any], str]] = {
    "a string leaf": (lambda bad: dp.allreduce({"a": "x" if bad else 1.0}), "TypeError"),
    "an unknown op": (lambda bad: dp.allreduce(1.0, op="mean" if bad else "sum"), "ValueError"),
    "avg on ints": (
        lambda bad: dp.allreduce(np.ones(3, np.int64), op="avg" if bad else "sum"),
        "TypeError",
    ),
    "a root out of range": (
        lambda bad: dp.broadcast(np.ones(2), root=99 if bad else 0),
        "ValueError",
    ),
    "a bad scale": (lambda bad: dp.allreduce(1.0, scale="2" if bad else 2.0), "TypeError"),
    "a bad reduce root": (
        lambda bad: dp.reduce(np.ones(500), root=-1 if bad else 0),
        "ValueError",
    ),
    "an allgather of an object": (
        lambda bad: dp.allgather([object()] if bad else [np.ones(1)]),
        "TypeError",
    ),
    "a synchronize option": (
        lambda bad: dp.synchronize({"a": 1.0}, objects="all" if bad else "keep"),
        "ValueError",
    ),
    "a broadcast_object root": (
        lambda bad: dp.broadcast_object(1, root=99 if bad else 0),
        "ValueError",
    ),
}


@pytest.mark.parametrize("case", sorted(BAD_CALLS))
def test_a_call_rejected_on_one_rank_fails_on_every_rank(
    rank: int, size: int, faulty: int, case: str
) -> None:
    call, error = BAD_CALLS[case]
    got = outcome(lambda: call(rank == faulty))
    assert got == (error if rank == faulty else "CollectiveMismatchError")
    assert dp.allreduce(10.0 + rank) == sum(10.0 + r for r in range(size))  # in step
    assert_usable(size)


def test_the_mismatch_names_the_rank_that_failed_and_why(rank: int, faulty: int) -> None:
    with pytest.raises((TypeError, CollectiveMismatchError)) as info:
        dp.allreduce([np.ones(2), "no" if rank == faulty else 1.0])
    message = str(info.value)
    if rank == faulty:
        assert info.type is TypeError and message.startswith("x[1]: expected an array")
        assert "raised CollectiveMismatchError on the other ranks" in "\n".join(
            getattr(info.value, "__notes__", [])
        )
    else:
        assert message.startswith("allreduce failed on some ranks before the ranks communicated")
        assert f"rank {faulty}: TypeError: x[1]: expected an array" in message


@pytest.mark.parametrize("check", [True, False], ids=["checks-on", "checks-off"])
def test_steps_after_a_caught_error_pair_with_the_same_steps(
    rank: int, size: int, faulty: int, check: bool, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The issue's loop: rank `faulty` passes a bad value at step 2, catches it and goes on."""
    active = world_module.current()
    monkeypatch.setattr(active, "settings", dataclasses.replace(active.settings, check=check))
    results: dict[int, Any] = {}
    for step in range(5):
        value: Any = 10.0 * step + rank
        if step == 2 and rank == faulty:
            value = "bad"
        try:
            results[step] = dp.allreduce(value)
        except (TypeError, CollectiveMismatchError):
            results[step] = "raised"
    expected = {s: sum(10.0 * s + r for r in range(size)) for s in range(5)}
    expected[2] = "raised"
    assert results == expected


# -- 3. a rank that skips or abandons a training step --------------------------------------------


def small_model() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(6, 8), nn.Tanh(), nn.Linear(8, 3))


def train_step(model: nn.Module, opt: torch.optim.Optimizer | None, step: int) -> None:
    g = torch.Generator().manual_seed(step + 100 * dp.rank())
    if opt is not None:
        opt.zero_grad()
    model(torch.randn(4, 6, generator=g)).pow(2).mean().backward()
    if opt is not None:
        opt.step()


@pytest.mark.parametrize("face", ["optimizer", "model"])
@pytest.mark.parametrize("check", [True, False], ids=["checks-on", "checks-off"])
def test_a_rank_that_skips_a_step_makes_every_rank_raise(
    rank: int, size: int, faulty: int, face: str, check: bool, monkeypatch: pytest.MonkeyPatch
) -> None:
    active = world_module.current()
    monkeypatch.setattr(active, "settings", dataclasses.replace(active.settings, check=check))
    model = small_model()
    opt: torch.optim.Optimizer | None
    if face == "optimizer":
        opt = dp.DistributedOptimizer(torch.optim.SGD(model.parameters(), lr=0.1))
    else:
        model = dp.torch.DataParallelModel(model)
        opt = None

    def loop() -> None:
        for step in range(4):
            if rank == faulty and step == 1:
                continue  # skips the whole step: its next reduction meets the others' current
            train_step(model, opt, step)
        dp.allreduce(np.ones(3))  # the others' fourth reduction meets this

    got = outcome(loop)
    assert got == "CollectiveMismatchError", got
    assert_usable(size)
    train_step(model, opt, 10)  # and training goes on, in step again
    same_everywhere([p.grad.tolist() for p in model.parameters()])


class FailsOn(torch.autograd.Function):
    """Identity forward; backward raises on the chosen rank (a user's layer that fails)."""

    @staticmethod
    def forward(ctx: Any, x: torch.Tensor, fail: bool) -> torch.Tensor:
        ctx.fail = fail
        return x.clone()

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[torch.Tensor, None]:
        if ctx.fail:
            raise ValueError("this rank's backward fails on purpose")
        return grad, None


def test_a_rank_whose_backward_fails_midway_makes_the_others_skip_the_step(
    rank: int, size: int, faulty: int
) -> None:
    torch.manual_seed(0)
    first, last = nn.Linear(6, 8), nn.Linear(8, 3)
    params = [*first.parameters(), *last.parameters()]
    # Small buckets: `last`'s gradients go out before backward reaches the failing layer.
    opt = dp.DistributedOptimizer(torch.optim.SGD(params, lr=0.1), bucket_bytes=64)
    before = [p.detach().clone() for p in params]

    def step(fail: bool) -> str:
        opt.zero_grad()
        hidden = FailsOn.apply(first(torch.ones(2, 6)), fail)
        try:
            last(hidden).sum().backward()
        except ValueError:
            return "backward failed"
        return outcome(opt.step)

    got = step(rank == faulty)
    assert got == ("backward failed" if rank == faulty else "RankFailedError")
    for p, b in zip(params, before, strict=True):  # nobody applied the incomplete average
        torch.testing.assert_close(p.detach(), b)
    assert step(False) == "ok"  # the faulty rank's zero_grad completed the abandoned step
    same_everywhere([p.detach().tolist() for p in params])
    assert_usable(size)


# -- 6. checks off: the guard that stays -------------------------------------------------------


@pytest.mark.usefixtures("checks_off")
@pytest.mark.parametrize("n", [2, 3000], ids=["inline", "engine"])
@pytest.mark.parametrize("collective", ["allreduce", "broadcast", "iallreduce", "allgather"])
def test_with_checks_off_a_dtype_or_size_mismatch_still_raises(
    rank: int, size: int, faulty: int, n: int, collective: str
) -> None:
    call = {
        "allreduce": dp.allreduce,
        "broadcast": dp.broadcast,
        "iallreduce": lambda x: dp.iallreduce(x).wait(),
        "allgather": lambda x: dp.allgather(x.reshape(1, -1)),
    }[collective]
    x = np.ones(n, np.float32 if rank == faulty else np.float64)
    assert outcome(lambda: call(x)) == "CollectiveMismatchError"
    y = np.ones(n + (rank == faulty))
    assert outcome(lambda: call(y)) == "CollectiveMismatchError"
    assert_usable(size)


# -- 7. writes that autograd sees ---------------------------------------------------------------


@pytest.mark.parametrize("call", ["allreduce", "broadcast", "iallreduce", "reduce"])
def test_a_collective_into_a_tensor_saved_for_backward_makes_backward_raise(
    call: str, rank: int
) -> None:
    w = torch.tensor([0.5, 1.5], requires_grad=True)
    y = w.exp()  # exp saves its output for backward
    if call == "allreduce":
        dp.allreduce(y, op="avg")
    elif call == "broadcast":
        dp.broadcast(y.detach())  # a detached tensor shares the counter
    elif call == "reduce":
        dp.reduce(y, root=0)
    else:
        dp.iallreduce(y.detach()).wait()
    written = call in ("allreduce", "iallreduce") or (rank == 0) == (call == "reduce")
    if written:
        with pytest.raises(RuntimeError, match="modified by an inplace operation"):
            y.sum().backward()
    else:  # a broadcast's root and a reduce's other ranks keep their values: nothing to see
        y.sum().backward()
        w.grad = None
    # A tensor nobody saved is reduced as before, and its graph still works.
    z = w * 2
    dp.allreduce(z, op="avg")
    z.sum().backward()
    torch.testing.assert_close(w.grad, torch.full((2,), 2.0))


# -- a call keyed as it is meets the same call flattened (collectives/_plans.py) ---------------


@pytest.mark.parametrize("check", [True, False], ids=["checks-on", "checks-off"])
def test_a_numpy_array_and_a_tensor_make_the_same_call(
    rank: int, size: int, faulty: int, check: bool, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A NumPy array (keyed as it is) on most ranks, a torch tensor (flattened) on one."""
    active = world_module.current()
    monkeypatch.setattr(active, "settings", dataclasses.replace(active.settings, check=check))
    mine = np.array([1.0, rank], np.float32)
    x = torch.from_numpy(mine.copy()) if rank == faulty else mine.copy()
    out = dp.allreduce(x, op="avg")
    expected = np.array([1.0, sum(range(size)) / size], np.float32)
    np.testing.assert_array_equal(np.asarray(out), expected)
    value = np.float64(rank) if rank == faulty else float(rank)  # a NumPy scalar: general path
    assert dp.allreduce(value, op="max") == size - 1
    # And a mismatch between them is found, whichever path each rank took.
    y = torch.ones(3) if rank == faulty else np.ones(2, np.float32)
    assert outcome(lambda: dp.allreduce(y)) == "CollectiveMismatchError"
    assert_usable(size)


@pytest.mark.parametrize("op", ["sum", "avg", "prod"])
def test_a_packed_array_and_a_tensor_make_the_same_call(
    rank: int, size: int, faulty: int, op: str
) -> None:
    """A larger float array: in place on most ranks, a torch tensor (flattened) on one."""
    mine = np.full(1000, 1.0 + rank, np.float64)
    x = torch.from_numpy(mine.copy()) if rank == faulty else mine.copy()
    out = dp.allreduce(x, op=op, scale=2)
    values = [1.0 + r for r in range(size)]
    want = {"sum": sum(values), "avg": sum(values) / size, "prod": float(np.prod(values))}[op]
    np.testing.assert_array_equal(np.asarray(out), np.full(1000, 2 * want))
    if rank != faulty:
        assert out is x  # reduced in place, as the general path does
    y = torch.ones(30, dtype=torch.float64) if rank == faulty else np.ones(31)
    assert outcome(lambda: dp.allreduce(y)) == "CollectiveMismatchError"
    assert_usable(size)


@pytest.mark.parametrize("check", [True, False], ids=["checks-on", "checks-off"])
@pytest.mark.parametrize("kind", [list, dict])
def test_a_packed_tree_and_a_tree_with_a_tensor_make_the_same_call(
    rank: int, size: int, faulty: int, kind: type, check: bool, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A tree of NumPy arrays (one packed bucket) on most ranks, one torch leaf on one."""
    active = world_module.current()
    monkeypatch.setattr(active, "settings", dataclasses.replace(active.settings, check=check))

    def tree_of(arrays: list[Any]) -> Any:
        return arrays if kind is list else {f"layer{i}": a for i, a in enumerate(arrays)}

    arrays = [np.full(n, rank + 1.0, np.float32) for n in (20, 1, 33)]
    if rank == faulty:
        arrays[1] = torch.from_numpy(arrays[1])
    out = dp.allreduce(tree_of(arrays), op="avg", scale=2)
    mean = 2 * sum(r + 1.0 for r in range(size)) / size
    for got, n in zip(out if kind is list else out.values(), (20, 1, 33), strict=True):
        np.testing.assert_allclose(np.asarray(got), np.full(n, mean, np.float32), rtol=1e-6)
    # A mismatch is found whichever path each rank took, and whatever differs.
    y = [np.ones(20, np.float32), np.ones(3 + (rank == faulty), np.float32)]
    assert outcome(lambda: dp.allreduce(tree_of(y))) == "CollectiveMismatchError"
    z = [np.ones(20, np.float32), np.ones(3, np.float64 if rank == faulty else np.float32)]
    assert outcome(lambda: dp.allreduce(tree_of(z))) == "CollectiveMismatchError"
    assert_usable(size)


@pytest.mark.parametrize("scale", [None, 3, 0.1])
def test_a_float_averages_as_a_numpy_scalar_bit_for_bit(rank: int, size: int, scale: Any) -> None:
    """A Python float (keyed as it is) and a NumPy scalar (flattened): the same bits, every value.
    An average divides by the size where the general path divides (it once multiplied by
    1 / size: 705 of 2000 values differed in their last bit at 3 ranks, so that 50 values all
    agreeing by chance would be a one in a billion draw)."""
    values = [(rank + 1) * 0.1 + i * 0.37 for i in range(50)]
    fast = [dp.allreduce(v, op="avg", scale=scale) for v in values]
    general = [float(dp.allreduce(np.float64(v), op="avg", scale=scale)) for v in values]
    assert [a.hex() for a in fast] == [b.hex() for b in general]


@pytest.mark.parametrize("op", ["avg", "min"])
def test_metrics_as_they_are_and_flattened_agree_bit_for_bit(
    rank: int, size: int, faulty: int, op: str
) -> None:
    """A dict of Python floats (one plan) on most ranks, NumPy scalars (general path) on one."""
    mine = {"loss": (rank + 1) / 3, "acc": 0.1 * rank, "n": float("nan") if rank == faulty else 7.0}
    x = {k: np.float64(v) for k, v in mine.items()} if rank == faulty else mine
    out = dp.allreduce(x, op=op, scale=3)
    bits = [np.float64(out[k]).tobytes() for k in sorted(out)]
    assert dp.allgather_object(bits) == [bits] * size  # every rank, either path: the same bits
    assert np.isnan(out["n"])  # NaN wins under min, and sums to NaN
    y = {"loss": 1.0, "acc": 2.0} if rank == faulty else {"loss": 1.0, "accuracy": 2.0}
    assert outcome(lambda: dp.allreduce(y)) == "CollectiveMismatchError"
    assert_usable(size)


# -- large worlds: the handshake is an allreduce ------------------------------------------------


def test_large_worlds_check_with_an_allreduce(
    rank: int, size: int, faulty: int, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Over `GATHER_LIMIT` ranks the handshake carries no payload: made so here on every rank."""
    from dataparallel import protocol, world

    # Plans are made under the protocol's limit, a constant of a process: a fresh cache here.
    monkeypatch.setattr(protocol, "GATHER_LIMIT", 1)
    monkeypatch.setattr(world.current(), "plans", world.Plans())
    assert dp.allreduce(1.0) == size and dp.allreduce(np.ones(2))[0] == size
    assert outcome(lambda: dp.allreduce(np.ones(2 + (rank == faulty)))) == (
        "CollectiveMismatchError"
    )
    got = outcome(lambda: dp.allreduce("bad" if rank == faulty else 1.0))
    assert got == ("TypeError" if rank == faulty else "CollectiveMismatchError")
    x = np.zeros(3)
    x[1] = np.nan if rank == faulty else 1.0
    assert np.isnan(dp.allreduce(x, op="min")).tolist() == [False, True, False]
    assert_usable(size)


# -- reducers --------------------------------------------------------------------------------


@pytest.mark.parametrize("kind", ["inline", "coalescing", "coalescing-small-buckets"])
def test_reducers_that_differ_raise_on_every_rank(
    rank: int, size: int, faulty: int, kind: str
) -> None:
    def make() -> dp.Reducer:
        if kind == "inline":
            return dp.InlineReducer()
        return dp.CoalescingReducer(bucket_bytes=64 if "small" in kind else None)

    arrays = [np.ones(5), np.ones(40 + (rank == faulty))]

    def reduce_all() -> None:
        with make() as reducer:
            for a in arrays:
                reducer.add(a)

    assert outcome(reduce_all) == "CollectiveMismatchError"
    assert_usable(size)
    arrays = [np.ones(5), torch.ones(40, dtype=torch.float64)]  # families may differ: same call
    if rank == faulty:
        arrays[1] = np.ones(40)
    reduce_all()
    assert float(arrays[0][0]) == size and float(arrays[1][0]) == size


def test_a_call_that_failed_leaves_nothing_for_the_next(
    rank: int, size: int, monkeypatch: pytest.MonkeyPatch
) -> None:
    """An engine error in `Fusion.wait()` (every rank alike, so no message is left unmatched):
    the next wait returns and writes back only its own leaves, not the failed call's."""
    from dataparallel.arrays.actions import Reduction
    from dataparallel.arrays.families import family_of
    from dataparallel.arrays.fusion import Fusion
    from dataparallel.backends.base import ReduceOp
    from dataparallel.errors import CollectiveTimeoutError

    engine = world_module.current().backend
    fusion = Fusion(engine, Reduction(ReduceOp.SUM), bucket_bytes=64)
    start, failing = engine.iallreduce, [True]

    def iallreduce(buf: Any, op: Any) -> Any:
        if failing[0]:
            raise CollectiveTimeoutError("the engine gave up")
        return start(buf, op)

    monkeypatch.setattr(engine, "iallreduce", iallreduce)
    old = np.ones((4, 4))[:, ::2]  # not contiguous: a staged copy, written back by `wait`
    fusion.add_leaf(family_of(old), old, "float64", "cpu")
    with pytest.raises(CollectiveTimeoutError, match="gave up"):
        fusion.wait()
    failing[0] = False
    old[...] = 7.0
    new = np.full(3, rank + 1.0)
    fusion.add_leaf(family_of(new), new, "float64", "cpu")
    results = fusion.wait()
    assert len(results) == 1 and results[0] is new
    np.testing.assert_array_equal(new, np.full(3, size * (size + 1) / 2))
    np.testing.assert_array_equal(old, np.full((4, 2), 7.0))  # not overwritten by the failed call

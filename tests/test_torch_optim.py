"""`dp.DistributedOptimizer` for PyTorch, at any world size (`pytest`, `mpiexec -n 3 ... pytest`).

Every rank trains on its share of a global batch and is compared with a single-process reference
that every rank computes locally on the whole batch, from the same seed. Values from the other
ranks are gathered with `dp.allgather_object` before asserting, so a failure on one rank cannot
leave the others waiting.
"""

from __future__ import annotations

import copy
import json
import os
import threading
from collections.abc import Iterator
from typing import Any

import numpy as np
import pytest
import torch
import torch.distributed as dist
from _jobs import free_port
from _torch_common import (
    OPTIMIZERS,
    Branchy,
    Reversed,
    assert_same_on_every_rank,
    global_batch,
    loss_of,
    make_model,
    share,
    step_pair,
)
from torch import nn

import dataparallel as dp
from dataparallel import protocol
from dataparallel.backends.base import Backend
from dataparallel.errors import CollectiveMismatchError
from dataparallel.torch._buckets import assign, overlaps


def grads(model: nn.Module) -> list[torch.Tensor]:
    return [p.grad for p in model.parameters() if p.grad is not None]


# -- equivalence --------------------------------------------------------------------------------


@pytest.mark.parametrize("name", sorted(OPTIMIZERS))
@pytest.mark.parametrize("bucket_bytes", [64, None], ids=["small-buckets", "default-buckets"])
def test_shares_of_a_global_batch_match_one_process_on_the_whole(
    name: str, bucket_bytes: int | None, world: Backend
) -> None:
    model = make_model()
    reference = copy.deepcopy(model)
    opt = dp.DistributedOptimizer(OPTIMIZERS[name](model.parameters()), bucket_bytes=bucket_bytes)
    ref_opt = OPTIMIZERS[name](reference.parameters())
    initial = [p.detach().clone() for p in model.parameters()]
    for step in range(4):
        x, y = global_batch(step)
        step_pair(model, opt, reference, ref_opt, x, y)
        for got, want in zip(grads(model), grads(reference), strict=True):
            torch.testing.assert_close(got, want)
    for got, want, before in zip(model.parameters(), reference.parameters(), initial, strict=True):
        torch.testing.assert_close(got, want)
        assert not torch.equal(got, before)
    assert_same_on_every_rank(list(model.parameters()))
    sync = opt.gradient_sync
    assert sync.steps == 4
    if bucket_bytes == 64:
        assert len(sync.buckets) >= 4


@pytest.fixture(scope="module")
def torch_distributed(world: Backend) -> Iterator[None]:
    """A Gloo process group in the test processes (the default one when dp runs on Gloo)."""
    if dist.is_initialized():
        yield
        return
    port = dp.broadcast_object(free_port() if world.rank == 0 else None)
    dist.init_process_group(
        "gloo", init_method=f"tcp://127.0.0.1:{port}", rank=world.rank, world_size=world.size
    )
    yield
    dist.destroy_process_group()


@pytest.mark.parametrize("name", sorted(OPTIMIZERS))
def test_parity_with_distributed_data_parallel(name: str, torch_distributed: None) -> None:
    ours = make_model(seed=1)
    theirs = nn.parallel.DistributedDataParallel(copy.deepcopy(ours))
    opt = dp.DistributedOptimizer(OPTIMIZERS[name](ours.parameters()), bucket_bytes=256)
    ddp_opt = OPTIMIZERS[name](theirs.parameters())
    for step in range(4):
        x, y = global_batch(step)
        x, y = share(x), share(y)
        opt.zero_grad()
        loss_of(ours, x, y).backward()
        opt.step()
        ddp_opt.zero_grad()
        loss_of(theirs, x, y).backward()
        ddp_opt.step()
    for got, want in zip(ours.parameters(), theirs.module.parameters(), strict=True):
        torch.testing.assert_close(got, want)


# -- overlap and buckets ------------------------------------------------------------------------


@pytest.mark.parametrize("overlap", [True, False], ids=["overlap", "after-backward"])
def test_buckets_go_out_while_backward_still_runs_or_all_at_its_end(
    overlap: bool, world: Backend, monkeypatch: pytest.MonkeyPatch
) -> None:
    model = make_model(hidden=16)
    opt = dp.DistributedOptimizer(torch.optim.SGD(model.parameters(), lr=0.1), bucket_bytes=256)
    sync = opt.gradient_sync
    sync.overlap = overlap  # DATAPARALLEL_OVERLAP, or chosen per machine
    events: list[str] = []
    calls: list[str] = []  # the engine's: on the communication thread when overlapping
    start, send = sync.bucket_backend.iallreduce, sync._router.send

    def recording(buf: Any, op: Any) -> Any:
        calls.append(threading.current_thread().name)
        return start(buf, op)

    def sending(*args: Any) -> None:
        events.append("bucket")
        send(*args)

    monkeypatch.setattr(sync.bucket_backend, "iallreduce", recording)
    monkeypatch.setattr(sync._router, "send", sending)
    # A hook on the first layer's weight runs when backward has reached the first layer, which
    # comes last in backward.
    model[0].weight.register_hook(lambda g: events.append("backward reached the first layer"))
    x, y = global_batch(0)
    loss_of(model, share(x), share(y)).backward()
    assert "backward reached the first layer" in events
    first_layer = events.index("backward reached the first layer")
    if overlap:
        assert events[:first_layer].count("bucket") >= 2, events
    else:
        assert events[:first_layer].count("bucket") == 0, events
    assert events.count("bucket") == len(sync.buckets)
    assert sync.in_flight  # every bucket started before backward returned
    opt.step()
    assert not sync.in_flight
    # One call per bucket, and one for the used-parameter flags unless they fit in the last;
    # made on the communication thread when overlapping (a world of one has none).
    assert len(calls) in (len(sync.buckets), len(sync.buckets) + 1)
    threaded = overlap and world.size > 1
    assert set(calls) == {"dataparallel-comm" if threaded else "MainThread"}
    reference = make_model(hidden=16)  # the same average either way
    reference_opt = torch.optim.SGD(reference.parameters(), lr=0.1)
    loss_of(reference, x, y).backward()
    reference_opt.step()
    for got, want in zip(model.parameters(), reference.parameters(), strict=True):
        torch.testing.assert_close(got, want)


def test_overlap_when_a_core_is_spare_unless_told() -> None:
    cores = len(os.sched_getaffinity(0))
    assert overlaps(cores - 1, None) is (cores > 1)
    assert overlaps(cores, None) is False
    assert overlaps(cores, True) is True and overlaps(1, False) is False


def test_small_parameters_share_buckets_across_large_ones() -> None:
    """A weight, its bias, a norm's two vectors, in turn: the large ones go alone, at once; the
    small ones fill one bucket (placed when full, or at the end), not one each."""
    sizes = [4, 100, 4, 4, 100, 4, 30, 4]  # float32: 16 and 400 bytes; 120 for the 30
    params = [(f"p{i}", torch.zeros(n)) for i, n in enumerate(sizes)]
    buckets = assign(params, list(range(len(sizes))), bucket_bytes=64)
    assert [b.members for b in buckets] == [[1], [4], [6], [0, 2, 3, 5], [7]]
    assert all(b.key == ("cpu", "float32") for b in buckets)


def test_buckets_are_the_same_on_every_rank_and_follow_backward_order(world: Backend) -> None:
    model = Reversed()
    # One bucket (every parameter below the bucket size): its members show the order.
    opt = dp.DistributedOptimizer(torch.optim.SGD(model.parameters(), lr=0.1), bucket_bytes=4096)
    sync = opt.gradient_sync
    names = {id(p): n for n, p in model.named_parameters()}

    def layout() -> list[list[str]]:
        return [[names[id(p)] for p in bucket] for bucket in sync.buckets]

    assert layout()[0][0] == "stem.bias"  # reverse registration order, as DDP starts
    x, y = global_batch(0)
    loss_of(model, share(x), share(y)).backward()
    opt.step()
    assert layout()[0][0] == "head.bias"  # rebuilt from the order gradients arrived on rank 0
    every = dp.allgather_object(layout())
    assert all(theirs == every[0] for theirs in every)


# -- unused parameters, synchronize, accumulation -----------------------------------------------


def local_then_averaged(model: nn.Module, x: torch.Tensor) -> dict[str, np.ndarray | None]:
    """Each parameter's gradient averaged over ranks, zeros standing for ranks without one."""
    probe = copy.deepcopy(model)
    probe.zero_grad(set_to_none=True)
    probe(x).sum().backward()
    mine = {
        n: (None if p.grad is None else p.grad.numpy().copy()) for n, p in probe.named_parameters()
    }
    every = dp.allgather_object(mine)
    out: dict[str, np.ndarray | None] = {}
    for name, _ in model.named_parameters():
        got = [g[name] for g in every if g[name] is not None]
        out[name] = None if not got else sum(got) / dp.size()
    return out


def test_parameters_unused_on_some_ranks_get_the_average_with_zeros(world: Backend) -> None:
    model = Branchy()
    opt = dp.DistributedOptimizer(torch.optim.SGD(model.parameters(), lr=0.1), bucket_bytes=32)
    x = torch.randn(3, 4, generator=torch.Generator().manual_seed(world.rank))
    want = local_then_averaged(model, x)
    model(x).sum().backward()
    opt.synchronize()
    for name, p in model.named_parameters():
        if want[name] is None:
            assert p.grad is None, f"{name}: no rank used it, so its gradient must stay None"
        else:
            assert p.grad is not None
            np.testing.assert_allclose(p.grad.numpy(), want[name], rtol=1e-6, atol=1e-7)
    assert model.unused.weight.grad is None
    before = model.unused.weight.detach().clone()
    opt.step()
    assert torch.equal(model.unused.weight, before)
    assert_same_on_every_rank(list(model.parameters()))


def test_ranks_sending_a_bucket_as_one_pack_or_leaf_by_leaf_agree(world: Backend) -> None:
    """A host bucket's gradients go as one pack (`Fusion.add_pack`: one call packs them, and
    where the engine moves calls on by itself they all become views of the bucket's memory at
    once) where each is as the layout planned it, else leaf by leaf: here, at each step, one
    rank's first gradient is a view of a buffer of its own, so that rank sends the bucket leaf
    by leaf (writing into that buffer) while the others send it as a pack. The calls line up,
    and every rank has the average of one process on the whole batch."""
    bare = make_model()
    reference = copy.deepcopy(bare)
    model = dp.torch.DataParallelModel(bare)  # the default size: one bucket of everything
    assert len(model.gradient_sync.buckets) == 1
    params = list(model.parameters())
    opt = torch.optim.SGD(params, lr=0.1)
    ref_opt = torch.optim.SGD(reference.parameters(), lr=0.1)
    for step in range(3):
        x, y = global_batch(step)
        opt.zero_grad()
        ref_opt.zero_grad()
        own = step % world.size == world.rank  # this rank's first gradient is not alone
        flat = torch.zeros(params[0].numel() + 1)
        if own:
            params[0].grad = flat[1:].view_as(params[0])
        loss_of(model, share(x), share(y)).backward()
        loss_of(reference, x, y).backward()
        for got, want in zip(params, reference.parameters(), strict=True):
            torch.testing.assert_close(got.grad, want.grad)
        if own:
            torch.testing.assert_close(flat[1:], params[0].grad.reshape(-1))
            assert params[0].grad.untyped_storage().data_ptr() == flat.data_ptr()
        else:
            places = sorted((p.grad.data_ptr(), p.grad.nbytes) for p in params)
            ends = [start + nbytes for start, nbytes in places[:-1]]
            together = ends == [start for start, _ in places[1:]]
            assert together == world.progresses, "views of the bucket, one after the other"
        opt.step()
        ref_opt.step()
    for got, want in zip(params, reference.parameters(), strict=True):
        torch.testing.assert_close(got, want)
    assert_same_on_every_rank(params)


def test_synchronize_then_step_reduces_once(world: Backend) -> None:
    model = make_model()
    opt = dp.DistributedOptimizer(torch.optim.SGD(model.parameters(), lr=0.1), bucket_bytes=128)
    sync = opt.gradient_sync
    x, y = global_batch(0)
    loss_of(model, share(x), share(y)).backward()
    opt.synchronize()
    calls = sync.calls
    assert calls >= 2 and sync.steps == 1
    torch.nn.utils.clip_grad_norm_(model.parameters(), 0.5)
    clipped = [g.clone() for g in grads(model)]
    opt.synchronize()  # a second call does nothing
    opt.step()
    assert (sync.calls, sync.steps) == (calls, 1)
    assert all(torch.equal(a, b) for a, b in zip(grads(model), clipped, strict=True))
    assert_same_on_every_rank(list(model.parameters()))


def test_backward_passes_per_step_reduces_once_per_n_passes(world: Backend) -> None:
    model = make_model()
    reference = copy.deepcopy(model)
    opt = dp.DistributedOptimizer(
        torch.optim.SGD(model.parameters(), lr=0.1), backward_passes_per_step=2, bucket_bytes=128
    )
    assert opt.backward_passes_per_step == 2
    sync = opt.gradient_sync
    for step in range(2):
        opt.zero_grad()
        reference.zero_grad()
        calls = sync.calls
        for k in range(2):
            x, y = global_batch(10 * step + k)
            loss_of(model, share(x), share(y)).backward()
            loss_of(reference, share(x), share(y)).backward()  # local sum of the two passes
            if k == 0:
                assert sync.calls == calls, "the first pass must only accumulate"
                assert not sync.in_flight
        assert sync.in_flight or world.size == 1  # the second pass started the reduction
        want = dp.allreduce([g.clone() for g in grads(reference)], op="avg")
        opt.synchronize()
        assert sync.calls > calls
        for got, expected in zip(grads(model), want, strict=True):
            torch.testing.assert_close(got, expected)
        opt.step()
        reference.load_state_dict(model.state_dict())
    assert sync.steps == 2


def test_more_backward_passes_than_declared_raise(world: Backend) -> None:
    model = make_model()
    opt = dp.DistributedOptimizer(torch.optim.SGD(model.parameters(), lr=0.1))
    x, y = global_batch(0)
    loss_of(model, share(x), share(y)).backward()
    with pytest.raises(RuntimeError, match=r"more than backward_passes_per_step=1 backward"):
        loss_of(model, share(x), share(y)).backward()
    opt.zero_grad()  # completes the reduction in flight on every rank, then zeros
    assert all(p.grad is None for p in model.parameters())
    loss_of(model, share(x), share(y)).backward()
    opt.step()
    assert_same_on_every_rank(list(model.parameters()))


# -- behaves as the wrapped optimizer -----------------------------------------------------------


def test_isinstance_param_groups_and_zero_grad(world: Backend) -> None:
    model = make_model()
    inner = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.5)
    opt = dp.DistributedOptimizer(inner)
    assert isinstance(opt, torch.optim.SGD) and isinstance(opt, torch.optim.Optimizer)
    assert opt.param_groups is inner.param_groups and opt.state is inner.state
    opt.param_groups[0]["lr"] = 0.25
    assert inner.param_groups[0]["lr"] == 0.25
    assert "DistributedOptimizer(SGD (" in repr(opt)
    x, y = global_batch(0)
    loss_of(model, share(x), share(y)).backward()
    opt.zero_grad(set_to_none=False)
    assert all(torch.count_nonzero(p.grad) == 0 for p in model.parameters())
    opt.zero_grad()
    assert all(p.grad is None for p in model.parameters())


def test_state_dict_round_trip(world: Backend) -> None:
    model = make_model()
    opt = dp.DistributedOptimizer(torch.optim.Adam(model.parameters(), lr=0.01))
    for step in range(2):
        x, y = global_batch(step)
        opt.zero_grad()
        loss_of(model, share(x), share(y)).backward()
        opt.step()
    saved = copy.deepcopy(opt.state_dict())
    assert saved["state"][0]["step"].item() == 2
    again = dp.DistributedOptimizer(torch.optim.Adam(model.parameters(), lr=0.5))
    again.load_state_dict(saved)
    assert again.param_groups[0]["lr"] == 0.01
    for p in model.parameters():
        torch.testing.assert_close(again.state[p]["exp_avg"], opt.state[p]["exp_avg"])
    # The newest wrapper reduces the parameters; the first one no longer does.
    assert again.gradient_sync.parameters == list(model.parameters())
    assert opt.gradient_sync.parameters == []
    x, y = global_batch(2)
    again.zero_grad()
    loss_of(model, share(x), share(y)).backward()
    again.step()
    assert again.state[next(iter(model.parameters()))]["step"].item() == 3
    assert_same_on_every_rank(list(model.parameters()))


def test_learning_rate_scheduler_on_the_wrapper(world: Backend) -> None:
    model = make_model()
    opt = dp.DistributedOptimizer(torch.optim.SGD(model.parameters(), lr=0.4))
    scheduler = torch.optim.lr_scheduler.StepLR(opt, step_size=1, gamma=0.5)
    for step in range(3):
        x, y = global_batch(step)
        opt.zero_grad()
        loss_of(model, share(x), share(y)).backward()
        opt.step()
        scheduler.step()  # warnings are errors: it must see that opt.step() ran
    assert opt.param_groups[0]["lr"] == pytest.approx(0.05)
    assert opt.gradient_sync.steps == 3


def test_a_scheduler_created_before_wrapping_is_refused(world: Backend) -> None:
    inner = torch.optim.SGD(make_model().parameters(), lr=0.1)
    torch.optim.lr_scheduler.StepLR(inner, step_size=1)
    with pytest.raises(ValueError, match=r"Create the DistributedOptimizer first"):
        dp.DistributedOptimizer(inner)


def test_closure_optimizers_reduce_every_evaluation(world: Backend) -> None:
    model = make_model()
    reference = copy.deepcopy(model)
    opt = dp.DistributedOptimizer(torch.optim.LBFGS(model.parameters(), lr=0.5, max_iter=3))
    ref_opt = torch.optim.LBFGS(reference.parameters(), lr=0.5, max_iter=3)
    x, y = global_batch(0)

    def closure() -> torch.Tensor:
        opt.zero_grad()
        loss = loss_of(model, share(x), share(y))
        loss.backward()
        return dp.allreduce(loss.detach(), op="avg")  # LBFGS compares losses: use the global one

    def ref_closure() -> torch.Tensor:
        ref_opt.zero_grad()
        loss = loss_of(reference, x, y)
        loss.backward()
        return loss

    for _ in range(2):
        opt.step(closure)
        ref_opt.step(ref_closure)
    for got, want in zip(model.parameters(), reference.parameters(), strict=True):
        torch.testing.assert_close(got, want, rtol=1e-4, atol=1e-5)
    assert_same_on_every_rank(list(model.parameters()))


class Reclassing:
    """What Lightning's `LightningOptimizer` makes of the optimizer `configure_optimizers`
    returns: an object of its own, re-classed as a subclass of that optimizer's class (so that
    `isinstance` holds), which steps the optimizer and forwards what it lacks to it."""

    def __init__(self, optimizer: torch.optim.Optimizer) -> None:
        self._optimizer = optimizer
        self.__class__ = type(
            "Lightning" + type(optimizer).__name__, (type(self), type(optimizer)), {}
        )

    def step(self, closure: Any = None) -> Any:
        return self._optimizer.step(closure)

    def __getattr__(self, item: str) -> Any:
        return getattr(self._optimizer, item)


@pytest.mark.parametrize("which", ["dp", "horovod"])
def test_a_framework_can_reclass_the_optimizer(which: str, world: Backend) -> None:
    """Lightning's re-classing once failed (`object layout differs`): the wrapper's class added
    a slot. Real Horovod's optimizer survives it, so must both of ours."""
    import dataparallel.horovod.torch as hvd

    model = make_model()
    reference = copy.deepcopy(model)
    sgd = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    if which == "dp":
        opt = dp.DistributedOptimizer(sgd)
    else:
        opt = hvd.DistributedOptimizer(sgd, named_parameters=model.named_parameters())
    seen = Reclassing(opt)
    assert isinstance(seen, torch.optim.SGD) and isinstance(seen, type(opt))
    ref_opt = torch.optim.SGD(reference.parameters(), lr=0.1, momentum=0.9)
    for step in range(3):  # zero_grad is the wrapper's own, run on Lightning's object
        step_pair(model, seen, reference, ref_opt, *global_batch(step))
    for got, want in zip(model.parameters(), reference.parameters(), strict=True):
        torch.testing.assert_close(got, want)
    assert_same_on_every_rank(list(model.parameters()))
    assert seen.gradient_sync is opt.gradient_sync and opt.gradient_sync.steps == 3


def test_bad_arguments(world: Backend) -> None:
    model = make_model()
    with pytest.raises(ValueError, match=r"op='max' cannot combine gradients"):
        dp.DistributedOptimizer(torch.optim.SGD(model.parameters(), lr=0.1), op="max")
    with pytest.raises(ValueError, match=r"backward_passes_per_step=0 must be an int"):
        dp.DistributedOptimizer(
            torch.optim.SGD(model.parameters(), lr=0.1), backward_passes_per_step=0
        )
    opt = dp.DistributedOptimizer(torch.optim.SGD(model.parameters(), lr=0.1))
    with pytest.raises(TypeError, match=r"already a DistributedOptimizer"):
        dp.DistributedOptimizer(opt)
    plain = torch.optim.SGD(model.parameters(), lr=0.1)
    dp.DistributedOptimizer(plain)
    with pytest.raises(TypeError, match=r"SGD was wrapped in a DistributedOptimizer already"):
        dp.DistributedOptimizer(plain)  # a second wrapper would reduce the gradients twice
    with pytest.raises(TypeError, match=r"save\s+optimizer.state_dict\(\) instead"):
        copy.deepcopy(opt)


def test_op_sum_adds_the_gradients(world: Backend) -> None:
    model = nn.Linear(2, 1, bias=False)
    opt = dp.DistributedOptimizer(torch.optim.SGD(model.parameters(), lr=0.1), op="sum")
    (model(torch.full((1, 2), float(world.rank + 1))).sum()).backward()
    opt.synchronize()
    total = world.size * (world.size + 1) / 2
    torch.testing.assert_close(model.weight.grad, torch.full((1, 2), total))


@pytest.mark.skipif(dp.size() == 1, reason="a mismatch needs two ranks")
def test_different_models_raise_a_mismatch_on_every_rank(world: Backend) -> None:
    model = make_model(hidden=4 + (world.rank == world.size - 1))
    opt = dp.DistributedOptimizer(torch.optim.SGD(model.parameters(), lr=0.1))
    x, y = global_batch(0)
    with pytest.raises(CollectiveMismatchError, match=r"DistributedOptimizer gradient reduction"):
        loss_of(model, share(x), share(y)).backward()
    del opt
    assert dp.allreduce(1) == world.size  # the world is still usable


@pytest.mark.parametrize("mismatch", [False, True], ids=["same", "different"])
def test_the_handshake_begins_at_the_first_gradient_where_the_engine_moves_calls_on(
    mismatch: bool, world: Backend, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Gloo: the step's handshake is an `iallgather` begun by the first gradient's hook, so it
    overlaps backward; it is finished before the first bucket, and a mismatch still raises on
    every rank. MPI (moves calls on only inside its calls) and a world of one: not begun early."""
    if mismatch and world.size == 1:
        pytest.skip("a mismatch needs two ranks")
    model = make_model(hidden=4 + (mismatch and world.rank == world.size - 1))
    opt = dp.DistributedOptimizer(torch.optim.SGD(model.parameters(), lr=0.1))
    sync = opt.gradient_sync
    begun: list[int] = []  # the buckets sent so far, at each iallgather on the world's engine
    start = world.iallgather

    def iallgather(send: Any, recv: Any) -> Any:
        begun.append(sync.calls)
        return start(send, recv)

    monkeypatch.setattr(world, "iallgather", iallgather)
    early = world.progresses and world.size > 1
    x, y, before = *global_batch(0), []
    for _ in range(2):
        opt.zero_grad()
        before.append(sync.calls)
        if mismatch:
            with pytest.raises(CollectiveMismatchError, match=r"gradient reduction"):
                loss_of(model, share(x), share(y)).backward()
            break
        loss_of(model, share(x), share(y)).backward()
        opt.step()
        assert begun == (before if early else [])  # begun before the step's first bucket
    del opt
    assert dp.allreduce(1) == world.size  # the world is still usable


@pytest.mark.skipif(dp.size() == 1, reason="a world of one makes no handshake")
def test_steps_every_rank_promised_make_no_handshake_and_match_one_process(
    world: Backend,
) -> None:
    """Once every rank has promised, in a step's flags, that its next call is the next step
    (nothing else called between steps), the steps go without a handshake, as Horovod's
    response cache skips its negotiation, and still average what one process would."""
    model, reference = make_model(), make_model()
    opt = dp.DistributedOptimizer(torch.optim.SGD(model.parameters(), lr=0.1))
    ref_opt = torch.optim.SGD(reference.parameters(), lr=0.1)
    counts = []
    for step in range(8):
        counts.append(protocol.handshakes(world))
        step_pair(model, opt, reference, ref_opt, *global_batch(step))
        for got, want in zip(grads(model), grads(reference), strict=True):
            torch.testing.assert_close(got, want)
    made = np.diff(counts).tolist()  # the handshakes of steps 0-6
    assert made[1] == 1 and made[2:] == [0] * 5, made  # step 1 promised step 2, and so on
    for got, want in zip(model.parameters(), reference.parameters(), strict=True):
        torch.testing.assert_close(got, want)
    assert_same_on_every_rank(list(model.parameters()))


@pytest.mark.skipif(dp.size() == 1, reason="a world of one makes no handshake")
def test_a_loss_averaged_between_backward_and_step_keeps_the_steps_right(world: Backend) -> None:
    """Every rank averages its loss between backward and `step()`, after it promised the next
    step in its last bucket: that call ends the step first and keeps the promise on zeros on
    every rank (once: with a call between steps, no rank promises again), and every step still
    averages what one process would."""
    model, reference = make_model(), make_model()
    opt = dp.DistributedOptimizer(torch.optim.SGD(model.parameters(), lr=0.1))
    ref_opt = torch.optim.SGD(reference.parameters(), lr=0.1)
    for step in range(6):
        x, y = global_batch(step)
        opt.zero_grad()
        loss = loss_of(model, share(x), share(y))
        loss.backward()
        mean = dp.allreduce(loss.detach(), op="avg")
        opt.step()
        ref_opt.zero_grad()
        want = loss_of(reference, x, y)
        want.backward()
        ref_opt.step()
        torch.testing.assert_close(mean, dp.allreduce(loss.detach(), op="avg"))
        for got, expected in zip(model.parameters(), reference.parameters(), strict=True):
            torch.testing.assert_close(got, expected)
    assert protocol.owed(world) is None  # no promise made with calls between the steps


def promised_pair(
    world: Backend, frozen_bias: bool = False
) -> tuple[nn.Module, dp.DistributedOptimizer, nn.Module, torch.optim.SGD]:
    """A model and its one-process reference after four steps: step 4 is promised."""
    model, reference = make_model(), make_model()
    for m in (model, reference) if frozen_bias else ():
        m[0].bias.requires_grad_(False)
    opt = dp.DistributedOptimizer(torch.optim.SGD(model.parameters(), lr=0.1))
    ref_opt = torch.optim.SGD(reference.parameters(), lr=0.1)
    for step in range(4):
        step_pair(model, opt, reference, ref_opt, *global_batch(step))
    assert protocol.owed(world) is not None
    return model, opt, reference, ref_opt


@pytest.mark.skipif(dp.size() == 1, reason="a world of one makes no handshake")
def test_a_parameter_made_trainable_inside_a_promised_step_is_averaged(world: Backend) -> None:
    """Every rank makes a frozen parameter trainable between `zero_grad()` and backward of a step
    they all promised: its gradient goes in a call after the step's buckets, which begins with a
    handshake of its own (the step made none), and every gradient is what one process's is."""
    model, opt, reference, ref_opt = promised_pair(world, frozen_bias=True)
    x, y = global_batch(4)
    opt.zero_grad()
    ref_opt.zero_grad()
    for m in (model, reference):
        m[0].bias.requires_grad_(True)
    loss_of(model, share(x), share(y)).backward()
    opt.synchronize()
    loss_of(reference, x, y).backward()
    for got, want in zip(grads(model), grads(reference), strict=True):
        torch.testing.assert_close(got, want)
    torch.testing.assert_close(model[0].bias.grad, reference[0].bias.grad)
    opt.step()
    ref_opt.step()
    step_pair(model, opt, reference, ref_opt, *global_batch(5))
    for got, want in zip(model.parameters(), reference.parameters(), strict=True):
        torch.testing.assert_close(got, want)


@pytest.mark.skipif(dp.size() == 1, reason="a mismatch needs two ranks")
@pytest.mark.parametrize(
    "other",
    [
        "an allreduce",
        "an allreduce before step()",
        "a frozen parameter",
        "an unfrozen parameter",
        "every rank",
    ],
)
def test_a_rank_that_breaks_a_promised_step_raises_a_mismatch_on_every_rank(
    other: str, world: Backend
) -> None:
    """After steps made without a handshake, the last rank calls something else (an allreduce)
    or changes its layout (a frozen parameter, or one frozen everywhere made trainable there)
    instead of the promised step: it makes that step on zeros, and every rank raises
    `CollectiveMismatchError` naming what differs, as the handshake would have. When every rank
    calls the same other thing, nothing is raised."""
    model, opt, reference, ref_opt = promised_pair(world, other == "an unfrozen parameter")
    deviant = other == "every rank" or world.rank == world.size - 1
    x, y = global_batch(4)
    if other == "every rank":
        assert dp.allreduce(torch.ones(3)).tolist() == [world.size] * 3  # step 4 made on zeros
        step_pair(model, opt, reference, ref_opt, x, y)
        for got, want in zip(grads(model), grads(reference), strict=True):
            torch.testing.assert_close(got, want)
        assert_same_on_every_rank(list(model.parameters()))
        return
    if deviant and other == "a frozen parameter":
        model[0].bias.requires_grad_(False)  # taken into account by the step zero_grad begins
    if deviant and other == "an unfrozen parameter":
        model[0].bias.requires_grad_(True)
    if other == "an allreduce before step()":  # step 4 promises step 5 in its last bucket
        opt.zero_grad()
        loss_of(model, share(x), share(y)).backward()
        if deviant:  # ends step 4, makes step 5 on zeros, then its own call
            with pytest.raises(CollectiveMismatchError) as raised:
                dp.allreduce(torch.ones(3))
            opt.step()
        else:
            opt.step()
            x, y = global_batch(5)
            opt.zero_grad()
            with pytest.raises(CollectiveMismatchError) as raised:
                loss_of(model, share(x), share(y)).backward()
                opt.step()
    else:
        opt.zero_grad()
        with pytest.raises(CollectiveMismatchError) as raised:
            if deviant and other == "an allreduce":
                dp.allreduce(torch.ones(3))
            else:
                loss_of(model, share(x), share(y)).backward()
                opt.step()
    text = str(raised.value)
    assert "gradient reduction" in text
    assert ("allreduce" in text) == other.startswith("an allreduce"), text
    del opt
    assert dp.allreduce(1) == world.size  # the world is still usable


# -- synchronize(optimizer) ---------------------------------------------------------------------


def test_synchronize_gives_every_rank_roots_state_and_hyper_parameters(world: Backend) -> None:
    model = dp.synchronize(make_model(seed=world.rank))
    opt = torch.optim.Adam(model.parameters(), lr=0.01 * (world.rank + 1), betas=(0.8, 0.9))
    if world.rank == 0:  # only root has stepped: the others have no state at all
        loss_of(model, *global_batch(0)).backward()
        opt.step()
    else:
        opt.param_groups[0]["betas"] = (0.5, 0.5)
    assert dp.synchronize(opt) is opt
    assert opt.param_groups[0]["lr"] == 0.01 and opt.param_groups[0]["betas"] == (0.8, 0.9)
    keys = sorted(opt.state[next(iter(model.parameters()))])
    assert keys == ["exp_avg", "exp_avg_sq", "step"]
    state = [opt.state[p][k] for p in model.parameters() for k in keys]
    assert_same_on_every_rank(state)
    assert opt.state[next(iter(model.parameters()))]["step"].item() == 1
    # Then every rank steps identically.
    x, y = global_batch(1)
    dopt = dp.DistributedOptimizer(opt)
    dp.synchronize(model)
    dopt.zero_grad()
    loss_of(model, share(x), share(y)).backward()
    dopt.step()
    assert_same_on_every_rank(list(model.parameters()))


def test_synchronize_removes_state_root_does_not_have(world: Backend) -> None:
    model = dp.synchronize(make_model())
    opt = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    if world.rank != 0:
        loss_of(model, *global_batch(0)).backward()
        opt.step()
    dp.synchronize({"optimizer": opt})
    assert len(opt.state) == 0


def test_parameters_added_or_unfrozen_later_are_reduced(world: Backend) -> None:
    model = make_model()
    for p in model[4].parameters():
        p.requires_grad_(False)
    opt = dp.DistributedOptimizer(torch.optim.SGD(model[0].parameters(), lr=0.1), bucket_bytes=64)
    opt.add_param_group({"params": list(model[2].parameters())})
    opt.add_param_group({"params": list(model[4].parameters())})
    x = torch.randn(3, 5, generator=torch.Generator().manual_seed(world.rank))

    def check() -> None:
        want = local_then_averaged(model, x)
        opt.zero_grad()
        model(x).sum().backward()
        opt.synchronize()
        for name, p in model.named_parameters():
            if want[name] is None:
                assert p.grad is None, name
            else:
                np.testing.assert_allclose(p.grad.numpy(), want[name], rtol=1e-6, atol=1e-7)
        opt.step()

    check()
    assert model[4].weight.grad is None and len(opt.gradient_sync.parameters) == 4
    for p in model[4].parameters():  # unfrozen between step() and backward: reduced at once
        p.requires_grad_(True)
    check()
    assert len(opt.gradient_sync.parameters) == 6
    check()
    assert_same_on_every_rank(list(model.parameters()))


def test_the_timeline_records_each_steps_gradient_buckets(world: Backend, tmp_path: Any) -> None:
    model = make_model()
    opt = dp.DistributedOptimizer(torch.optim.SGD(model.parameters(), lr=0.1), bucket_bytes=256)
    with dp.timeline(tmp_path / "trace.json") as timeline:
        for step in range(2):
            x, y = global_batch(step)
            opt.zero_grad()
            loss_of(model, share(x), share(y)).backward()
            opt.step()
    events = json.loads(timeline.path.read_text())
    names = [e["name"] for e in events]
    assert names.count("DistributedOptimizer gradients") == 2
    assert names.count("communicate") >= 2 * 2 * len(opt.gradient_sync.buckets)  # begin and end

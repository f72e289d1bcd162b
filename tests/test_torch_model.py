"""`dp.torch.DataParallelModel` and `dp.synchronize` of modules, at any world size.

Every rank trains on its share of a global batch and is compared with a single-process reference
that every rank computes locally on the whole batch. Values from the other ranks are gathered
with `dp.allgather_object` before asserting, so a failure on one rank cannot leave the others
waiting.
"""

from __future__ import annotations

import copy
from collections import OrderedDict
from pathlib import Path

import numpy as np
import pytest
import torch
from _jobs import run_job
from _torch_common import (
    OPTIMIZERS,
    Branchy,
    assert_same_on_every_rank,
    global_batch,
    loss_of,
    make_model,
    share,
)
from torch import nn

import dataparallel as dp
from dataparallel.backends.base import Backend
from dataparallel.torch import _gradsync

EXAMPLES = Path(__file__).resolve().parent.parent / "examples"


@pytest.mark.parametrize("name", sorted(OPTIMIZERS))
def test_shares_of_a_global_batch_match_one_process_on_the_whole(name: str, world: Backend) -> None:
    bare = make_model()
    reference = copy.deepcopy(bare)
    model = dp.torch.DataParallelModel(bare, bucket_bytes=96)
    opt = OPTIMIZERS[name](model.parameters())
    ref_opt = OPTIMIZERS[name](reference.parameters())
    for step in range(4):
        x, y = global_batch(step)
        opt.zero_grad()
        loss_of(model, share(x), share(y)).backward()
        # The reduction is complete when backward returns: a plain optimizer reads .grad.
        ref_opt.zero_grad()
        loss_of(reference, x, y).backward()
        for got, want in zip(model.parameters(), reference.parameters(), strict=True):
            torch.testing.assert_close(got.grad, want.grad)
        opt.step()
        ref_opt.step()
    for got, want in zip(model.parameters(), reference.parameters(), strict=True):
        torch.testing.assert_close(got, want)
    assert_same_on_every_rank(list(model.parameters()))
    assert model.gradient_sync.steps == 4
    assert len(model.gradient_sync.buckets) >= 3


@pytest.mark.parametrize("set_to_none", [True, False])
def test_a_packed_buckets_gradients_are_its_memory_not_copies(
    set_to_none: bool, world: Backend
) -> None:
    """The reduced gradients of a bucket of several parameters are their places in the bucket's
    memory (DDP's `gradient_as_bucket_view`), not copies written back, on engines that move
    calls on by themselves (on MPI they are copied back: adopting was slower there). Each
    `.grad` stays the same tensor object (a reference taken before backward sees the result);
    kept between steps, backward accumulates into the bucket's memory, and the next steps are
    still right."""
    bare = make_model()
    reference = copy.deepcopy(bare)
    model = dp.torch.DataParallelModel(bare)  # the default size: one bucket of everything
    assert len(model.gradient_sync.buckets) == 1
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    ref_opt = torch.optim.SGD(reference.parameters(), lr=0.1)
    for step in range(3):
        x, y = global_batch(step)
        opt.zero_grad(set_to_none=set_to_none)
        ref_opt.zero_grad(set_to_none=set_to_none)
        held = [p.grad for p in model.parameters()]
        loss_of(model, share(x), share(y)).backward()
        loss_of(reference, x, y).backward()
        pairs = zip(model.parameters(), reference.parameters(), strict=True)
        for i, (got, want) in enumerate(pairs):
            torch.testing.assert_close(got.grad, want.grad)
            if held[i] is not None:
                assert got.grad is held[i], "the same tensor object, now on the bucket's memory"
        places = sorted((p.grad.data_ptr(), p.grad.nbytes) for p in model.parameters())
        ends = [start + nbytes for start, nbytes in places[:-1]]
        together = ends == [start for start, _ in places[1:]]
        assert together == world.progresses, "one after the other in the bucket, or copied"
        opt.step()
        ref_opt.step()
    for got, want in zip(model.parameters(), reference.parameters(), strict=True):
        torch.testing.assert_close(got, want)


def test_without_torchs_storage_use_count_gradients_are_copied_back(
    world: Backend, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Whether a gradient alone sees its memory is told by torch's private
    `torch._C._storage_Use_Count`, checked once: where it is absent or counts otherwise, no
    gradient becomes a view of its bucket (each keeps its own memory, written into), and the
    results are the same."""
    monkeypatch.delattr(torch._C, "_storage_Use_Count")
    assert _gradsync._use_count() is None
    monkeypatch.setattr(torch._C, "_storage_Use_Count", lambda cdata: 1, raising=False)
    assert _gradsync._use_count() is None
    monkeypatch.setattr(_gradsync, "_USE_COUNT", None)
    bare = make_model()
    reference = copy.deepcopy(bare)
    model = dp.torch.DataParallelModel(bare)
    for p in model.parameters():
        p.grad = torch.zeros_like(p)
    held = [(p.grad, p.grad.data_ptr()) for p in model.parameters()]
    x, y = global_batch(0)
    loss_of(model, share(x), share(y)).backward()
    loss_of(reference, x, y).backward()
    pairs = zip(model.parameters(), reference.parameters(), held, strict=True)
    for got, want, (grad, place) in pairs:
        torch.testing.assert_close(got.grad, want.grad)
        assert got.grad is grad and got.grad.data_ptr() == place, "written into, not moved"


def test_gradients_that_are_views_of_your_own_buffer_are_written_into_it(world: Backend) -> None:
    """A gradient whose memory something else sees (here: views of one flat buffer, as flat
    optimizers make them) keeps its memory: the reduced values are written into it."""
    bare = make_model()
    reference = copy.deepcopy(bare)
    model = dp.torch.DataParallelModel(bare)
    params = list(model.parameters())
    flat = torch.zeros(sum(p.numel() for p in params))
    offset = 0
    for p in params:
        p.grad = flat[offset : offset + p.numel()].view_as(p)
        offset += p.numel()
    x, y = global_batch(0)
    loss_of(model, share(x), share(y)).backward()
    loss_of(reference, x, y).backward()
    want = torch.cat([p.grad.reshape(-1) for p in reference.parameters()])
    torch.testing.assert_close(flat, want)
    for p in params:
        assert p.grad.untyped_storage().data_ptr() == flat.untyped_storage().data_ptr()


def test_wrapping_broadcasts_parameters_and_buffers_from_rank_0(world: Backend) -> None:
    torch.manual_seed(world.rank)
    bare = nn.Sequential(nn.Linear(3, 4), nn.BatchNorm1d(4))
    bare[1].running_mean.fill_(float(world.rank))
    bare[1].num_batches_tracked.fill_(world.rank + 5)
    model = dp.torch.DataParallelModel(bare)
    torch.manual_seed(0)
    want = nn.Linear(3, 4)
    torch.testing.assert_close(model.module[0].weight, want.weight)
    assert torch.count_nonzero(model.module[1].running_mean) == 0
    assert model.module[1].num_batches_tracked.item() == 5
    assert_same_on_every_rank([*model.parameters(), *model.buffers()])


def test_no_sync_accumulates_locally_then_reduces_the_sum(world: Backend) -> None:
    bare = make_model()
    reference = copy.deepcopy(bare)
    model = dp.torch.DataParallelModel(bare, bucket_bytes=128)
    sync = model.gradient_sync
    calls, steps = sync.calls, sync.steps
    batches = [tuple(share(t) for t in global_batch(10 + k)) for k in range(3)]
    with model.no_sync():
        for x, y in batches[:2]:
            loss_of(model, x, y).backward()
    assert (sync.calls, sync.steps) == (calls, steps), "no_sync must not communicate"
    local = [p.grad.clone() for p in model.parameters()]
    for x, y in batches[:2]:
        loss_of(reference, x, y).backward()
    for got, want in zip(local, reference.parameters(), strict=True):
        torch.testing.assert_close(got, want.grad)  # local sums, not reduced
    loss_of(model, *batches[2]).backward()
    loss_of(reference, *batches[2]).backward()
    assert sync.steps == steps + 1
    want = dp.allreduce([p.grad.clone() for p in reference.parameters()], op="avg")
    for p, expected in zip(model.parameters(), want, strict=True):
        torch.testing.assert_close(p.grad, expected)


def test_the_forward_decides_whether_backward_reduces(world: Backend) -> None:
    model = dp.torch.DataParallelModel(make_model())
    x, y = (share(t) for t in global_batch(0))
    with model.no_sync():
        loss = loss_of(model, x, y)
    steps = model.gradient_sync.steps
    loss.backward()  # outside the block, but its forward ran inside: local only (as DDP)
    assert model.gradient_sync.steps == steps


def test_parameters_unused_on_some_ranks(world: Backend) -> None:
    bare = Branchy()
    probe = copy.deepcopy(bare)
    model = dp.torch.DataParallelModel(bare, bucket_bytes=32)
    x = torch.randn(3, 4, generator=torch.Generator().manual_seed(world.rank))
    probe(x).sum().backward()
    mine = {
        n: None if p.grad is None else p.grad.numpy().copy() for n, p in probe.named_parameters()
    }
    every = dp.allgather_object(mine)
    for _ in range(2):  # twice: the buckets are rebuilt after the first step
        model.zero_grad()
        model(x).sum().backward()
        for name, p in model.module.named_parameters():
            got = [g[name] for g in every if g[name] is not None]
            if not got:
                assert p.grad is None, f"{name}: no rank used it, so its gradient must stay None"
            else:
                np.testing.assert_allclose(p.grad.numpy(), sum(got) / world.size, rtol=1e-6)
    assert model.module.b.weight.grad is not None


def test_a_layout_changed_between_steps_is_reduced_as_it_now_is(world: Backend) -> None:
    # What a step sends is planned once per layout; parameters frozen, converted or unfrozen
    # between steps must still be reduced as they are, in the step that follows and after.
    bare = make_model()
    reference = copy.deepcopy(bare)
    model = dp.torch.DataParallelModel(bare, bucket_bytes=96)
    changes = {
        2: lambda m: m[2].weight.requires_grad_(False),
        4: lambda m: m.double(),
        6: lambda m: m[2].weight.requires_grad_(True),
    }
    for step in range(8):
        if step in changes:
            changes[step](bare)
            changes[step](reference)
        x, y = global_batch(step)
        dtype = bare[0].weight.dtype
        model.zero_grad()
        loss_of(model, share(x).to(dtype), share(y).to(dtype)).backward()
        reference.zero_grad()
        loss_of(reference, x.to(dtype), y.to(dtype)).backward()
        for got, want in zip(model.parameters(), reference.parameters(), strict=True):
            assert (got.grad is None) == (want.grad is None), step
            if want.grad is not None:
                assert got.grad.dtype == want.grad.dtype, step
                torch.testing.assert_close(got.grad, want.grad)
    assert model.gradient_sync.steps == 8
    assert_same_on_every_rank(list(model.parameters()))


def test_attributes_pass_through_to_the_wrapped_module(world: Backend) -> None:
    bare = nn.Linear(3, 2)
    bare.note = "kept"  # type: ignore[assignment]
    model = dp.torch.DataParallelModel(bare)
    assert model.module is bare
    assert model.weight is bare.weight and model.in_features == 3 and model.note == "kept"
    with pytest.raises(AttributeError, match=r"no attribute 'nothing'"):
        _ = model.nothing
    model.eval()
    assert not bare.training


def test_state_dict_has_no_module_prefix_and_loads_both_forms(world: Backend) -> None:
    model = dp.torch.DataParallelModel(make_model())
    state = model.state_dict()
    assert list(state) == list(model.module.state_dict())
    bare = make_model(seed=3)
    bare.load_state_dict(state)  # a checkpoint of the wrapper loads into the bare model
    for a, b in zip(bare.parameters(), model.parameters(), strict=True):
        assert torch.equal(a, b)
    other = dp.torch.DataParallelModel(make_model(seed=4))
    other.load_state_dict(bare.state_dict())
    assert torch.equal(other.module[0].weight, bare[0].weight)
    ddp_style = OrderedDict(("module." + k, v * 2) for k, v in bare.state_dict().items())
    other.load_state_dict(ddp_style)
    assert torch.equal(other.module[0].weight, bare[0].weight * 2)
    with pytest.raises(RuntimeError, match=r"Unexpected key\(s\) in state_dict: \"extra\""):
        other.load_state_dict({**bare.state_dict(), "extra": torch.zeros(1)})


def test_state_dict_of_a_wrapper_inside_a_parent_module(world: Backend) -> None:
    parent = nn.ModuleDict({"net": dp.torch.DataParallelModel(make_model())})
    state = parent.state_dict()
    assert "net.0.weight" in state and not any(".module." in k for k in state)
    fresh = nn.ModuleDict({"net": dp.torch.DataParallelModel(make_model(seed=5))})
    fresh.load_state_dict(state)
    assert torch.equal(fresh["net"].module[0].weight, parent["net"].module[0].weight)


def test_a_plain_tensor_module_is_refused(world: Backend) -> None:
    with pytest.raises(TypeError, match=r"wraps a torch.nn.Module, got torch.Tensor"):
        dp.torch.DataParallelModel(torch.zeros(2))  # type: ignore[arg-type]


def test_synchronize_a_module_makes_parameters_and_buffers_roots(world: Backend) -> None:
    torch.manual_seed(world.rank + 1)
    model = nn.Sequential(nn.Linear(3, 4), nn.BatchNorm1d(4))
    model[1].running_var.fill_(world.rank + 2.0)
    root = world.size - 1
    assert dp.synchronize(model, root=root) is model
    assert torch.all(model[1].running_var == root + 2.0)
    torch.manual_seed(root + 1)
    torch.testing.assert_close(model[0].weight, nn.Linear(3, 4).weight)
    assert_same_on_every_rank([*model.parameters(), *model.buffers()])


def test_a_backward_pass_that_reaches_no_parameter_is_not_a_step(world: Backend) -> None:
    model = dp.torch.DataParallelModel(make_model())
    steps = model.gradient_sync.steps
    x = torch.randn(2, 5, requires_grad=True)
    (x * 2).sum().backward()
    assert model.gradient_sync.steps == steps


@pytest.mark.spawns
def test_the_digits_example_trains_to_95_percent_on_two_ranks(tmp_path: Path) -> None:
    checkpoint = tmp_path / "digits.pt"
    done = run_job(
        [EXAMPLES / "torch_digits.py", "--mode", "model", "--checkpoint", checkpoint],
        launcher="mpiexec",
        ranks=2,
        timeout=300,
    )
    assert done.returncode == 0, done.stdout + done.stderr
    lines = [line for line in done.stdout.splitlines() if line.startswith("final test accuracy")]
    assert len(lines) == 1, done.stdout  # printed by rank 0 only
    assert float(lines[0].split()[3].rstrip("%")) >= 95.0
    state = torch.load(checkpoint, weights_only=True)
    bare = nn.Sequential(
        nn.Linear(64, 128), nn.ReLU(), nn.Linear(128, 64), nn.ReLU(), nn.Linear(64, 10)
    )
    bare.load_state_dict(state["model"])  # no `module.` prefix


@pytest.mark.spawns
@pytest.mark.parametrize(("mode", "backend", "ranks"), [("zero1", "mpi", 3), ("zero2", "gloo", 2)])
def test_the_digits_example_trains_with_zero(
    mode: str, backend: str, ranks: int, tmp_path: Path
) -> None:
    """`--mode zero1`/`zero2`: sharded Adam state (uneven shards at 3 ranks); the checkpoint
    loads into a plain Adam."""
    checkpoint = tmp_path / "digits.pt"
    done = run_job(
        [EXAMPLES / "torch_digits.py", "--mode", mode, "--checkpoint", checkpoint],
        ranks=ranks,
        backend=backend,
        job_timeout=240,
        timeout=300,
    )
    assert done.returncode == 0, done.stdout + done.stderr
    lines = [line for line in done.stdout.splitlines() if "final test accuracy" in line]
    assert len(lines) == 1, done.stdout  # printed by rank 0 only
    assert float(lines[0].split("accuracy ")[1].split("%")[0]) >= 95.0
    state = torch.load(checkpoint, weights_only=True)
    bare = nn.Sequential(
        nn.Linear(64, 128), nn.ReLU(), nn.Linear(128, 64), nn.ReLU(), nn.Linear(64, 10)
    )
    bare.load_state_dict(state["model"])
    adam = torch.optim.Adam(bare.parameters())
    adam.load_state_dict(state["optimizer"])  # consolidated: torch's plain format
    steps = {float(s["step"]) for s in adam.state_dict()["state"].values()}
    assert len(adam.state_dict()["state"]) == 6 and len(steps) == 1 and steps.pop() > 100
    for p in bare.parameters():
        assert adam.state[p]["exp_avg_sq"].shape == p.shape


def test_dp_torch_without_pytorch_says_what_to_install() -> None:
    code = (
        "import sys\n"
        "sys.modules['torch'] = None  # as if PyTorch were not installed\n"
        "import dataparallel as dp\n"
        "try:\n"
        "    dp.torch\n"
        "except ImportError as e:\n"
        "    print(type(e).__name__, e)\n"
    )
    done = run_job(["-c", code], launcher="python")
    assert done.returncode == 0, done.stderr
    assert "pip install 'dataparallel[torch]'" in done.stdout, done.stdout

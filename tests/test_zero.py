"""`dp.torch.ZeroRedundancyOptimizer` (ZeRO stages 1 and 2), at any world size.

Every rank trains on its share of a global batch and is compared with a single-process reference
that every rank computes locally on the whole batch, from the same seed (or with the unsharded
`dp.DistributedOptimizer` where one process would differ). Values from the other ranks are
gathered with `dp.allgather_object` before asserting, so a failure on one rank cannot leave the
others waiting.
"""

from __future__ import annotations

import copy
from typing import Any

import pytest
import torch
from _torch_common import (
    OPTIMIZERS,
    Branchy,
    assert_same_on_every_rank,
    global_batch,
    loss_of,
    make_model,
    share,
)
from test_torch_optim import torch_distributed  # noqa: F401 - the fixture, for DDP
from torch import nn

import dataparallel as dp
from dataparallel.backends.base import Backend
from dataparallel.errors import CollectiveMismatchError
from dataparallel.torch import ZeroRedundancyOptimizer
from dataparallel.torch._zero.gather import SliceGather
from dataparallel.torch._zero.layout import lay_out_group

CLASSES: dict[str, tuple[type[torch.optim.Optimizer], dict[str, Any]]] = {
    "sgd-momentum": (torch.optim.SGD, {"lr": 0.1, "momentum": 0.9}),
    "adam": (torch.optim.Adam, {"lr": 0.01}),
}


def zero(
    model: nn.Module, name: str = "adam", stage: int = 1, **kw: Any
) -> ZeroRedundancyOptimizer:
    cls, options = CLASSES[name]
    return ZeroRedundancyOptimizer(model.parameters(), cls, stage=stage, **{**options, **kw})


def reference_of(model: nn.Module, name: str = "adam") -> tuple[nn.Module, torch.optim.Optimizer]:
    reference = copy.deepcopy(model)
    return reference, OPTIMIZERS[name](reference.parameters())


def wrapped(model: nn.Module, stage: int) -> nn.Module:
    """Stage 1 reads gradients a model wrapper reduced; stage 2 reduces them itself."""
    return dp.torch.DataParallelModel(model) if stage == 1 else model


def train(model: nn.Module, opt: torch.optim.Optimizer, steps: range, *, on_share: bool) -> None:
    for step in steps:
        x, y = global_batch(step)
        if on_share:
            x, y = share(x), share(y)
        opt.zero_grad()
        loss_of(model, x, y).backward()
        opt.step()


def assert_params_close(a: nn.Module, b: nn.Module, dtype: torch.dtype) -> None:
    tol = {"atol": 1e-5, "rtol": 1e-5} if dtype == torch.float32 else {}
    for got, want in zip(a.parameters(), b.parameters(), strict=True):
        torch.testing.assert_close(got, want, **tol)


# -- parity ---------------------------------------------------------------------------------


@pytest.mark.matrix
@pytest.mark.parametrize("name", sorted(CLASSES))
@pytest.mark.parametrize("stage", [1, 2])
@pytest.mark.parametrize("dtype", [torch.float32, torch.float64], ids=["f32", "f64"])
@pytest.mark.parametrize("bucket_bytes", [64, None], ids=["small-buckets", "default-buckets"])
@pytest.mark.parametrize("staged", [False, True], ids=["host", "staged"])
def test_shares_of_a_global_batch_match_one_process_on_the_whole(
    name: str,
    stage: int,
    dtype: torch.dtype,
    bucket_bytes: int | None,
    staged: bool,
    world: Backend,
) -> None:
    """`staged`: the device path (host buffers for every engine call, copies each way), forced
    for host parameters: what a CUDA model takes (tests/test_cuda_training.py)."""
    model = make_model().to(dtype)
    reference, ref_opt = reference_of(model, name)
    opt = zero(model, name, stage, bucket_bytes=bucket_bytes, _staged=staged)
    assert (opt._shards is not None and opt._shards._staging is not None) == (staged and stage == 2)
    net = wrapped(model, stage)
    for step in range(5):
        x, y = global_batch(step)
        opt.zero_grad()
        loss_of(net, share(x).to(dtype), share(y).to(dtype)).backward()
        opt.step()
        ref_opt.zero_grad()
        loss_of(reference, x.to(dtype), y.to(dtype)).backward()
        ref_opt.step()
    assert_params_close(model, reference, dtype)
    assert_same_on_every_rank(list(model.parameters()))
    if bucket_bytes == 64:
        assert len(opt._buckets) >= 4


@pytest.mark.parametrize("broadcasts", [False, True], ids=["allgather", "broadcasts"])
@pytest.mark.parametrize("merge_bytes", [0, 200, 1 << 20], ids=["alone", "some", "all"])
@pytest.mark.parametrize("staged", [False, True], ids=["host", "staged"])
def test_updated_segments_come_back_whatever_the_buckets_merged(
    merge_bytes: int, broadcasts: bool, staged: bool, world: Backend
) -> None:
    """Each rank writes its rank into its segments; after the gather every bucket holds every
    rank's segment in order, whether buckets went alone (in place) or merged into one call,
    as one allgather or as one broadcast per rank, or (`staged`) through host buffers apart
    from the slabs, as for parameters on a device."""
    params = [torch.zeros(n, dtype=d) for n, d in ((7, torch.float32), (30, torch.float64))]
    params += [torch.zeros(n) for n in (5, 40, 3)]
    slabs, buckets, _ = lay_out_group(0, list(enumerate(params)), dp.rank(), dp.size(), 32, 0)
    for bucket in buckets:
        lo, hi = bucket.mine
        slabs[bucket.slab].data[lo:hi] = dp.rank() + 1
    gather = SliceGather(slabs, buckets, world, merge_bytes, broadcasts, staged)
    calls = [len(call.buckets) for call in gather.calls]
    if staged:  # every call lands in its own host buffer, never in the slabs
        slab_spans = [(f.data.data_ptr(), f.data.data_ptr() + f.data.nbytes) for f in slabs]
        for call in gather.calls:
            assert call.merged
            at = call.rows.data_ptr()
            assert not any(lo <= at < hi for lo, hi in slab_spans)
    assert all((call.send is None) == broadcasts for call in gather.calls)  # sent from the rows
    assert sum(calls) == len(buckets) >= 4
    assert max(calls) == 1 if merge_bytes == 0 else max(calls) > 1
    if merge_bytes == 200:
        assert min(calls) < max(calls)  # some alone (in place), some merged
    for _ in range(2):  # the buffers are reused
        gather.run()
        for bucket in buckets:
            got = slabs[bucket.slab].data[bucket.start : bucket.stop]
            part = bucket.counts[0]
            want = torch.arange(dp.size(), dtype=got.dtype).repeat_interleave(part) + 1
            torch.testing.assert_close(got, want)


def test_mixed_dtypes_and_param_groups(world: Backend) -> None:
    def build() -> nn.Module:
        torch.manual_seed(3)
        return nn.Sequential(nn.Linear(5, 6).double(), nn.Linear(6, 3))

    model, reference = build(), build()

    class Net(nn.Module):
        def __init__(self, inner: nn.Module) -> None:
            super().__init__()
            self.inner = inner

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            return self.inner[1](torch.tanh(self.inner[0](x.double())).float())

    groups = lambda m: [  # noqa: E731
        {"params": m[0].parameters(), "lr": 0.02},
        {"params": m[1].parameters()},
    ]
    opt = ZeroRedundancyOptimizer(
        groups(model), torch.optim.Adam, stage=2, lr=0.01, bucket_bytes=48
    )
    ref_opt = torch.optim.Adam(groups(reference), lr=0.01)
    assert len(opt._slabs) == 2
    train(Net(model), opt, range(4), on_share=True)
    train(Net(reference), ref_opt, range(4), on_share=False)
    for got, want in zip(model.parameters(), reference.parameters(), strict=True):
        torch.testing.assert_close(got, want, atol=1e-5, rtol=1e-5)
    assert [g["lr"] for g in opt.param_groups] == [0.02, 0.01]


@pytest.mark.parametrize("stage", [1, 2])
@pytest.mark.parametrize("staged", [False, True], ids=["host", "staged"])
def test_parameters_without_gradients_match_the_unsharded_optimizer(
    stage: int, staged: bool, world: Backend
) -> None:
    model, unsharded = Branchy(), Branchy()
    opt = zero(model, "adam", stage, bucket_bytes=32, _staged=staged)
    plain = dp.DistributedOptimizer(torch.optim.Adam(unsharded.parameters(), lr=0.01))
    before = [p.detach().clone() for p in model.unused.parameters()]
    for net, o in ((wrapped(model, stage), opt), (unsharded, plain)):
        for step in range(3):
            x = torch.randn(4, 4, generator=torch.Generator().manual_seed(step + 10 * dp.rank()))
            o.zero_grad()
            net(x).pow(2).mean().backward()
            o.step()
    for got, want in zip(model.parameters(), unsharded.parameters(), strict=True):
        torch.testing.assert_close(got, want, atol=1e-6, rtol=1e-6)
    for got, was in zip(model.unused.parameters(), before, strict=True):
        assert torch.equal(got, was)  # never stepped: no gradient on any rank
    unused = {id(p) for p in model.unused.parameters()}
    for piece in opt.pieces:
        if id(opt._params[piece.param]) in unused:
            assert piece.tensor not in opt.optim.state
    assert_same_on_every_rank(list(model.parameters()))


@pytest.mark.usefixtures("torch_distributed")
def test_stage_1_under_distributed_data_parallel() -> None:
    model = make_model()
    reference, ref_opt = reference_of(model)
    opt = zero(model, "adam", 1, bucket_bytes=128)
    ddp = nn.parallel.DistributedDataParallel(model)  # DDP averages; the optimizer shards
    train(ddp, opt, range(4), on_share=True)
    train(reference, ref_opt, range(4), on_share=False)
    assert_params_close(model, reference, torch.float32)
    assert_same_on_every_rank(list(model.parameters()))


@pytest.mark.parametrize("stage", [1, 2])
def test_parameters_with_fewer_items_than_ranks(stage: int, world: Backend) -> None:
    """Buckets are padded to the world's size: padding may fill whole segments."""
    torch.manual_seed(0)
    params = [
        nn.Parameter(torch.randn(1)),
        nn.Parameter(torch.randn(4)),
        nn.Parameter(torch.randn(2, 3)),
    ]
    reference = [nn.Parameter(p.detach().clone()) for p in params]
    opt = ZeroRedundancyOptimizer(params, torch.optim.Adam, stage=stage, bucket_bytes=4, lr=0.1)
    ref_opt = torch.optim.Adam(reference, lr=0.1)
    mean = sum(range(dp.size())) / dp.size()
    for _ in range(3):
        opt.zero_grad()
        sum((p * (k + 1 + dp.rank())).sum() for k, p in enumerate(params)).backward()
        if stage == 1:
            dp.allreduce_gradients([p.grad for p in params])
        opt.step()
        ref_opt.zero_grad()
        sum((p * (k + 1 + mean)).sum() for k, p in enumerate(reference)).backward()
        ref_opt.step()
    for got, want in zip(params, reference, strict=True):
        torch.testing.assert_close(got, want)


# -- memory ---------------------------------------------------------------------------------


@pytest.mark.parametrize("stage", [1, 2])
def test_state_per_rank_is_a_slice_of_the_unsharded_state(stage: int, world: Backend) -> None:
    model = make_model(hidden=32)
    reference, ref_opt = reference_of(model)
    bucket_bytes = 256
    opt = zero(model, "adam", stage, bucket_bytes=bucket_bytes)
    train(wrapped(model, stage), opt, range(1), on_share=True)
    train(reference, ref_opt, range(1), on_share=False)

    def sliced(state: dict[Any, dict[str, Any]]) -> int:
        return sum(s[k].nbytes for s in state.values() for k in ("exp_avg", "exp_avg_sq"))

    unsharded, mine = sliced(ref_opt.state), sliced(opt.optim.state)
    every = dp.allgather_object(mine)
    assert sum(every) == unsharded  # every item's state on exactly one rank
    buckets = len(opt._buckets)
    assert max(every) <= unsharded / dp.size() + 2 * 4 * buckets  # one item per bucket more
    assert max(every) <= unsharded / dp.size() + 2 * bucket_bytes


def test_stage_2_keeps_only_its_slice_of_the_gradients(world: Backend) -> None:
    model = make_model(hidden=32)
    bucket_bytes = 256
    opt = zero(model, "adam", 2, bucket_bytes=bucket_bytes)
    x, y = global_batch(0)
    loss_of(model, share(x), share(y)).backward()
    assert all(p.grad is None for p in model.parameters())  # freed as their buckets went out
    shards = opt._shards
    assert shards is not None
    total = sum(p.numel() for p in model.parameters())
    every = dp.allgather_object(sum(s.numel() for s in shards.shards))
    buckets = len(opt._buckets)
    assert total <= sum(every) < total + dp.size() * buckets  # each bucket padded to size items
    assert max(every) <= total / dp.size() + buckets
    # The shard plus at most two send buffers of one bucket (a send and a receive in flight).
    assert opt.gradient_bytes <= 4 * (total / dp.size() + len(opt._buckets)) + 3 * bucket_bytes
    opt.step()


# -- accumulation, clipping, schedulers, groups ------------------------------------------------


@pytest.mark.parametrize("stage", [1, 2])
@pytest.mark.parametrize("staged", [False, True], ids=["host", "staged"])
@pytest.mark.parametrize("bucket_bytes", [64, None], ids=["small-buckets", "one-bucket"])
def test_gradient_accumulation_matches_one_process(
    stage: int, staged: bool, bucket_bytes: int | None, world: Backend
) -> None:
    """Staged, the passes after the first add what lands to the shard on the "device". With one
    bucket, the second pass's reduce-scatter of it starts while the first's is in flight."""
    model = make_model()
    reference, ref_opt = reference_of(model)
    opt = zero(model, "adam", stage, bucket_bytes=bucket_bytes, _staged=staged)
    net = wrapped(model, stage)
    for step in range(3):
        x, y = global_batch(step)
        xs, ys = share(x), share(y)
        half = len(xs) // 2
        opt.zero_grad()
        for part in (slice(0, half), slice(half, None)):
            (loss_of(net, xs[part], ys[part]) * len(xs[part]) / len(xs)).backward()
        opt.step()
        ref_opt.zero_grad()
        loss_of(reference, x, y).backward()
        ref_opt.step()
    assert_params_close(model, reference, torch.float32)


@pytest.mark.parametrize("stage", [1, 2])
def test_clip_grad_norm_uses_the_norm_over_every_shard(stage: int, world: Backend) -> None:
    model = make_model()
    reference, ref_opt = reference_of(model)
    opt = zero(model, "adam", stage, bucket_bytes=64)
    net = wrapped(model, stage)
    for step in range(3):
        x, y = global_batch(step)
        opt.zero_grad()
        loss_of(net, share(x), share(y)).backward()
        norm = opt.clip_grad_norm_(0.05)
        opt.step()
        ref_opt.zero_grad()
        loss_of(reference, x, y).backward()
        want = torch.nn.utils.clip_grad_norm_(reference.parameters(), 0.05)
        ref_opt.step()
        torch.testing.assert_close(norm, want, atol=1e-6, rtol=1e-5)
        assert float(want) > 0.05  # the clipping did something
    assert_params_close(model, reference, torch.float32)
    x, y = global_batch(3)
    opt.zero_grad()
    loss_of(net, share(x), share(y)).backward()
    ref_opt.zero_grad()
    loss_of(reference, x, y).backward()
    inf = opt.clip_grad_norm_(1.0, norm_type=float("inf"))
    want = torch.nn.utils.clip_grad_norm_(reference.parameters(), 1.0, norm_type=float("inf"))
    torch.testing.assert_close(inf, want, atol=1e-6, rtol=1e-5)


def test_learning_rate_schedulers_and_added_param_groups(world: Backend) -> None:
    model = make_model()
    reference, _ = reference_of(model)
    first = list(model.parameters())[:4]
    opt = ZeroRedundancyOptimizer(first, torch.optim.SGD, lr=0.1, momentum=0.9, bucket_bytes=64)
    ref_opt = torch.optim.SGD(list(reference.parameters())[:4], lr=0.1, momentum=0.9)
    schedule = torch.optim.lr_scheduler.StepLR(opt, step_size=1, gamma=0.5)
    ref_schedule = torch.optim.lr_scheduler.StepLR(ref_opt, step_size=1, gamma=0.5)
    net = wrapped(model, 1)
    for step in range(4):
        if step == 2:
            opt.add_param_group({"params": list(model.parameters())[4:], "lr": 0.05})
            ref_opt.add_param_group({"params": list(reference.parameters())[4:], "lr": 0.05})
        x, y = global_batch(step)
        opt.zero_grad()
        loss_of(net, share(x), share(y)).backward()
        opt.step()
        schedule.step()
        ref_opt.zero_grad()
        loss_of(reference, x, y).backward()
        ref_opt.step()
        ref_schedule.step()
    assert opt.param_groups[0]["lr"] == ref_opt.param_groups[0]["lr"] == 0.1 / 16
    assert_params_close(model, reference, torch.float32)


def test_pieces_are_whole_parameters_in_a_world_of_one(world: Backend) -> None:
    model = make_model()
    opt = zero(model, "adam", 1, bucket_bytes=64)  # parameters span buckets: pieces rejoin
    params = list(model.parameters())
    if dp.size() == 1:
        assert len(opt.pieces) == len(params)
    every = dp.allgather_object(sum(piece.tensor.numel() for piece in opt.pieces))
    assert sum(every) == sum(p.numel() for p in params)
    for piece in opt.pieces:  # views of the parameters themselves
        p = params[piece.param]
        assert piece.tensor.data_ptr() == p.data_ptr() + piece.start * p.element_size()


# -- checkpoints ----------------------------------------------------------------------------


@pytest.mark.parametrize("stage", [1, 2])
@pytest.mark.parametrize("staged", [False, True], ids=["host", "staged"])
def test_consolidated_state_is_a_plain_optimizers_and_loads_back(
    stage: int, staged: bool, world: Backend
) -> None:
    model = make_model()
    reference, ref_opt = reference_of(model)
    opt = zero(model, "adam", stage, bucket_bytes=64, _staged=staged)
    net = wrapped(model, stage)
    train(net, opt, range(3), on_share=True)
    train(reference, ref_opt, range(3), on_share=False)
    opt.consolidate_state_dict(to=dp.size() - 1)
    if dp.rank() == dp.size() - 1:
        state = opt.state_dict()
        want = ref_opt.state_dict()
        assert state["param_groups"] == want["param_groups"]
        assert state["state"].keys() == want["state"].keys()
        for k, entry in want["state"].items():
            assert entry.keys() == state["state"][k].keys()
            for key, value in entry.items():
                torch.testing.assert_close(state["state"][k][key], value, atol=1e-6, rtol=1e-5)
        plain = torch.optim.Adam(copy.deepcopy(reference).parameters(), lr=0.01)
        plain.load_state_dict(state)  # a plain Adam takes it
    else:
        with pytest.raises(RuntimeError, match="consolidate_state_dict"):
            opt.state_dict()
        state = None
    state = dp.broadcast_object(state, root=dp.size() - 1)
    fresh_model = copy.deepcopy(model)
    fresh = zero(fresh_model, "adam", stage, bucket_bytes=48, _staged=staged)  # other slices
    fresh.load_state_dict(state)
    train(wrapped(fresh_model, stage), fresh, range(3, 6), on_share=True)
    train(reference, ref_opt, range(3, 6), on_share=False)
    assert_params_close(fresh_model, reference, torch.float32)


def test_a_plain_optimizers_state_dict_loads_into_the_sharded_one(world: Backend) -> None:
    model = make_model()
    reference, ref_opt = reference_of(model)
    train(reference, ref_opt, range(2), on_share=False)
    model.load_state_dict(reference.state_dict())
    opt = zero(model, "adam", 2, bucket_bytes=64)
    opt.load_state_dict(ref_opt.state_dict())
    train(model, opt, range(2, 5), on_share=True)
    train(reference, ref_opt, range(2, 5), on_share=False)
    assert_params_close(model, reference, torch.float32)


# -- bad input ------------------------------------------------------------------------------


def test_optimizer_class_must_be_an_optimizer_class(world: Backend) -> None:
    model = make_model()
    with pytest.raises(TypeError, match=r"not an optimizer: give SGD, lr=\.\.\. instead"):
        ZeroRedundancyOptimizer(model.parameters(), torch.optim.SGD(model.parameters(), lr=0.1))
    with pytest.raises(TypeError, match=r"subclass of torch\.optim\.Optimizer"):
        ZeroRedundancyOptimizer(model.parameters(), dict)  # type: ignore[arg-type]
    with pytest.raises(ValueError, match="stage=3 must be 1 or 2"):
        ZeroRedundancyOptimizer(model.parameters(), torch.optim.SGD, stage=3, lr=0.1)  # type: ignore[arg-type]


@pytest.mark.parametrize("stage", [1, 2])
def test_parameters_on_two_devices_are_refused_and_named(stage: int, world: Backend) -> None:
    """One optimizer shards one device's parameters ("meta" stands in for a GPU here)."""
    params = [nn.Parameter(torch.zeros(3)), nn.Parameter(torch.zeros(3, device="meta"))]
    with pytest.raises(
        ValueError,
        match=r"param_groups\[0\]\['params'\]\[1\] is on meta, the parameters before it on cpu",
    ):
        ZeroRedundancyOptimizer(params, torch.optim.Adam, stage=stage, lr=0.1)


def test_parameters_that_differ_between_ranks_are_named(world: Backend) -> None:
    if dp.size() == 1:
        pytest.skip("needs two ranks")
    model = make_model(hidden=8 + (dp.rank() == 1))
    with pytest.raises(CollectiveMismatchError, match=r"param_groups\[0\]\['params'\]\[0\]"):
        ZeroRedundancyOptimizer(model.parameters(), torch.optim.Adam, lr=0.1)


@pytest.mark.parametrize("passes", [1, 2])
def test_stage_2_a_rank_running_another_backward_pass_raises_on_every_rank(
    passes: int, world: Backend
) -> None:
    """The last rank runs one backward pass more than the others before step(): it raises at
    that pass, the others at step(), all CollectiveMismatchError naming the ranks; after
    zero_grad() on every rank the next steps agree."""
    if dp.size() == 1:
        pytest.skip("needs two ranks")
    model = make_model()
    opt = zero(model, "adam", 2, bucket_bytes=64)
    x, y = global_batch(0)
    xs, ys = share(x), share(y)
    for _ in range(passes):
        loss_of(model, xs, ys).backward()
    last = dp.size() - 1
    others = "rank 0" if last == 1 else f"ranks {', '.join(map(str, range(last)))}"
    expected = rf"rank {last} began another pass where {others} called step\(\)"
    with pytest.raises(CollectiveMismatchError, match=expected):
        if dp.rank() == last:
            loss_of(model, xs, ys).backward()
        else:
            opt.step()
    opt.zero_grad()
    train(model, opt, range(1, 3), on_share=True)
    assert_same_on_every_rank(list(model.parameters()))


def test_a_state_dict_from_another_model_is_refused(world: Backend) -> None:
    model = make_model()
    opt = zero(model)
    other = make_model(hidden=9)
    other_opt = torch.optim.Adam(other.parameters(), lr=0.01)
    train(other, other_opt, range(1), on_share=False)
    with pytest.raises(
        ValueError, match=r"'exp_avg' of param_groups\[0\]\['params'\]\[0\] has shape \[9, 5\]"
    ):
        opt.load_state_dict(other_opt.state_dict())
    fewer = torch.optim.Adam(list(other.parameters())[:2], lr=0.01)
    with pytest.raises(ValueError, match="param group 0 has 2 parameter"):
        opt.load_state_dict(fewer.state_dict())
    with pytest.raises(ValueError, match="no 'state' and 'param_groups'"):
        opt.load_state_dict({"weights": 1})
    with pytest.raises(ValueError, match="give a rank"):
        opt.consolidate_state_dict(to=dp.size())


def test_stage_2_refuses_parameters_a_wrapper_reduces(world: Backend) -> None:
    model = dp.torch.DataParallelModel(make_model())
    with pytest.raises(
        ValueError,
        match=r"param_groups\[0\]\['params'\]\[0\] is already reduced by a DataParallelModel",
    ):
        zero(model, "adam", 2)
    bare = make_model()
    opt = zero(bare, "adam", 2)
    late = dp.torch.DataParallelModel(bare)  # takes the reduction over: refused at backward
    x, y = global_batch(0)
    loss_of(late, share(x), share(y)).backward()
    with pytest.raises(RuntimeError, match="reduced twice"):
        opt.step()


@pytest.mark.parametrize("name", ["compression", "backward_passes_per_step", "op"])
def test_a_gradient_reduction_option_is_refused_by_name(name: str, world: Backend) -> None:
    value = {"compression": dp.Compression.fp16, "backward_passes_per_step": 2, "op": "sum"}[name]
    with pytest.raises(TypeError, match=f"takes no {name}=") as raised:
        zero(make_model(), "adam", 1, **{name: value})
    if name == "compression":
        assert "DataParallelModel(model, compression=...)" in str(raised.value)


@pytest.mark.parametrize("stage", [1, 2])
def test_parameters_of_no_item_are_in_the_consolidated_state(stage: int, world: Backend) -> None:
    torch.manual_seed(0)
    with pytest.warns(UserWarning, match="zero-element"):
        model = nn.Sequential(nn.Linear(4, 3), nn.Linear(3, 0), nn.Linear(0, 2))
    reference, ref_opt = reference_of(model)
    opt = zero(model, "adam", stage)
    net = wrapped(model, stage)
    x = torch.randn(6, 4, generator=torch.Generator().manual_seed(1))
    for _ in range(2):
        opt.zero_grad()
        net(share(x)).mean().backward()  # equal shares: the mean of means is the mean
        opt.step()
        ref_opt.zero_grad()
        reference(x).mean().backward()
        ref_opt.step()
    opt.consolidate_state_dict(to=0)
    if dp.rank() != 0:
        return
    got, want = opt.state_dict()["state"], ref_opt.state_dict()["state"]
    assert sorted(got) == sorted(want)  # the empty weights and bias (2, 3, 4) too
    for k, state in want.items():
        assert sorted(got[k]) == sorted(state)
        for key, value in state.items():
            torch.testing.assert_close(got[k][key], value, atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("stage", [1, 2])
def test_a_model_converted_after_the_optimizer_is_named(stage: int, world: Backend) -> None:
    model = nn.Linear(4, 2).double()
    opt = zero(model, "adam", stage)
    model.float()  # new data: no longer the slab the optimizer steps
    opt.zero_grad()
    wrapped(model, stage)(torch.randn(3, 4)).sum().backward()
    with pytest.raises(RuntimeError, match=r"converted \(model.float\(\).*Convert the model first"):
        opt.step()
    # The pass's reduce-scatters (stage 2) landed before the error: dropped in flight, MPI would
    # write their results into memory freed with the optimizer.
    assert opt._shards is None or not opt._shards.in_flight

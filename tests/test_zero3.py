"""`dp.torch.fully_shard` (ZeRO stage 3), at any world size.

Every rank trains its share of a global batch on the sharded model and is compared, step by
step, with an unsharded copy that every rank trains locally on the whole batch from the same
seed (equal shares: the average of the ranks' means is the global mean). A rank's shard of a
parameter is compared with the rows of the reference that `parameter_shards()` says it holds.
Values from the other ranks are gathered before asserting, so a failure on one rank cannot leave
the others waiting.
"""

from __future__ import annotations

import copy
from collections.abc import Callable
from typing import Any

import pytest
import torch
from _torch_common import global_batch, share
from torch import nn

import dataparallel as dp
from dataparallel.torch import FullyShardedModule, fully_shard

HIDDEN = 7  # rows that 2 and 3 ranks do not divide: padded chunks
TOL = {"atol": 2e-6, "rtol": 2e-5}


class Block(nn.Module):
    def __init__(self, width: int, dtype: torch.dtype = torch.float32) -> None:
        super().__init__()
        self.linear = nn.Linear(width, width, dtype=dtype)
        self.scale = nn.Parameter(torch.ones((), dtype=dtype))  # a parameter of no dimension

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return torch.tanh(self.linear(x.to(self.linear.weight.dtype))).float() * self.scale


class Net(nn.Module):
    """A stem, three blocks and a head of two outputs (fewer rows than 3 ranks)."""

    def __init__(self, *, tied: bool = False, wide: bool = False, mixed: bool = False) -> None:
        super().__init__()
        torch.manual_seed(0)
        width = 64 if wide else HIDDEN
        self.stem = nn.Linear(5, width)
        dtypes = [torch.float64 if mixed and i == 1 else torch.float32 for i in range(3)]
        self.blocks = nn.ModuleList(Block(width, dtype) for dtype in dtypes)
        self.proj = nn.Linear(width, width)
        if tied:
            self.back = nn.Linear(width, width)
            self.back.weight = self.proj.weight  # tied: the root holds both places
        self.head = nn.Linear(width, 3)
        self.unused = nn.Parameter(torch.ones(2))
        # Mixed: a float64 parameter in the root's group too (two dtypes in one group).
        self.gain = nn.Parameter(torch.ones(width, dtype=torch.float64)) if mixed else None
        self.tied = tied

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = torch.tanh(self.stem(x))
        for block in self.blocks:
            h = block(h)
        h = torch.tanh(self.proj(h))
        if self.gain is not None:
            h = h * self.gain.float()
        if self.tied:
            h = torch.tanh(self.back(h))
        return self.head(h)


def shard(model: Net, **kw: Any) -> Net:
    for block in model.blocks:
        fully_shard(block, **kw)
    return fully_shard(model, **kw)


def loss_of(model: nn.Module, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
    return ((model(x) - y) ** 2).mean()


OPTIMIZERS: dict[str, Callable[[Any], torch.optim.Optimizer]] = {
    "sgd": lambda ps: torch.optim.SGD(ps, lr=0.1, momentum=0.9),
    "adam": lambda ps: torch.optim.Adam(ps, lr=0.01),
}


def assert_matches(model: FullyShardedModule, reference: nn.Module, *, grads: bool = False) -> None:
    """Every rank's shards equal the reference's rows (checked on every rank, then agreed)."""
    wanted = dict(reference.named_parameters())
    failures = []
    for name, s in model.parameter_shards().items():
        whole = wanted[name].grad if grads else wanted[name].detach()
        got = s.param.grad if grads else s.param.detach()
        if grads and (whole is None or got is None):
            if (whole is None) != (got is None) and s.param.numel():
                failures.append(f"{name}: grad None on one side")
            continue
        assert whole is not None and got is not None
        rows = whole.reshape(s.shape)[s.offsets[0] : s.offsets[0] + len(got)] if s.shape else whole
        if s.param.numel() == 0:
            continue
        try:
            torch.testing.assert_close(got.double(), rows.reshape(got.shape).double(), **TOL)
        except AssertionError as error:
            failures.append(f"{name}: {error}")
    every = dp.allgather_object(failures)
    assert not any(every), every


def step_both(
    model: nn.Module,
    opt: torch.optim.Optimizer,
    reference: nn.Module,
    ref_opt: torch.optim.Optimizer,
    step: int,
) -> tuple[float, float]:
    x, y = global_batch(step)
    opt.zero_grad()
    loss = loss_of(model, share(x), share(y))
    loss.backward()
    opt.step()
    ref_opt.zero_grad()
    ref_loss = loss_of(reference, x, y)
    ref_loss.backward()
    ref_opt.step()
    return float(dp.allreduce(loss.detach(), op="avg")), float(ref_loss.detach())


@pytest.mark.heavy
@pytest.mark.parametrize("optimizer", ["sgd", "adam"])
@pytest.mark.parametrize("variant", ["plain", "tied", "mixed", "staged", "keep"])
def test_training_equals_unsharded(optimizer: str, variant: str) -> None:
    model = Net(tied=variant == "tied", mixed=variant == "mixed")
    reference = copy.deepcopy(model)
    shard(model, _staged=variant == "staged", reshard_after_forward=variant != "keep")
    opt, ref_opt = (
        OPTIMIZERS[optimizer](model.parameters()),
        OPTIMIZERS[optimizer](reference.parameters()),
    )
    for step in range(4):
        loss, ref_loss = step_both(model, opt, reference, ref_opt, step)
        assert loss == pytest.approx(ref_loss, rel=1e-5, abs=1e-6)
        assert_matches(model, reference)
    # A parameter no rank used keeps no gradient, as in one process.
    assert model.parameter_shards()["unused"].param.grad is None


def test_optimizer_steps_shards_only() -> None:
    model = Net(wide=True)
    whole = sum(p.numel() for p in model.parameters())
    shard(model)
    held = sum(p.numel() for p in model.parameters())
    rows_padding = sum(int(p.shape[0]) if p.dim() else 1 for p in Net(wide=True).parameters())
    assert held <= whole / dp.size() + rows_padding
    opt = torch.optim.Adam(model.parameters(), lr=0.01)
    x, y = global_batch(0)
    loss_of(model, share(x), share(y)).backward()
    opt.step()
    for p in model.parameters():
        assert p.grad is None or p.grad.shape == p.shape
        for state in opt.state[p].values():
            assert not isinstance(state, torch.Tensor) or state.dim() == 0 or state.shape == p.shape


def test_memory_per_rank() -> None:
    """Between steps a rank holds its shards only (about 1/N); in forward, at most the root's
    parameters and two blocks' (the one running and the one prefetched) are gathered."""
    model = Net(wide=True)
    total = sum(p.numel() * p.element_size() for p in model.parameters())
    blocks = [sum(p.numel() * p.element_size() for p in b.parameters()) for b in model.blocks]
    shard(model)
    root_bytes = total - sum(blocks)
    opt = torch.optim.Adam(model.parameters(), lr=0.01)
    peaks: list[int] = []

    def measure(*_: object) -> None:
        peaks.append(model.parameter_bytes()[1])

    for block in model.blocks:
        block.register_forward_hook(measure)
    sizes = []
    for step in range(3):
        x, y = global_batch(step)
        opt.zero_grad()
        loss_of(model, share(x), share(y)).backward()
        opt.step()
        sharded, gathered = model.parameter_bytes()
        sizes.append(sharded)
        assert gathered == 0
        held = {
            p.untyped_storage().data_ptr(): p.untyped_storage().nbytes() for p in model.parameters()
        }
        assert sum(held.values()) == sharded  # no storage beyond the shards
    padding = sum((int(p.shape[0]) if p.dim() else 1) * 8 for p in model.parameters())
    assert sizes[-1] <= total / dp.size() + padding
    assert max(peaks) <= root_bytes + 2 * max(blocks) + padding, (peaks, root_bytes, blocks)
    assert max(peaks) > 0


@pytest.mark.parametrize("how", ["no_sync", "every-pass"])
def test_accumulation(how: str) -> None:
    model = Net()
    reference = copy.deepcopy(model)
    shard(model)
    opt, ref_opt = (
        OPTIMIZERS["adam"](model.parameters()),
        OPTIMIZERS["adam"](reference.parameters()),
    )
    for step in range(3):
        x, y = global_batch(step)
        xs, ys = share(x), share(y)
        half = len(xs) // 2
        opt.zero_grad()
        with model.no_sync() if how == "no_sync" else _nothing():
            (loss_of(model, xs[:half], ys[:half]) / 2).backward()
        if how == "no_sync":
            assert all(p.grad is None for p in model.parameters())
        (loss_of(model, xs[half:], ys[half:]) / 2).backward()
        opt.step()
        ref_opt.zero_grad()
        loss_of(reference, x, y).backward()
        ref_opt.step()
        assert_matches(model, reference)


class _nothing:
    def __enter__(self) -> None:
        return None

    def __exit__(self, *_: object) -> None:
        return None


def test_frozen_parameters() -> None:
    model = Net()
    model.blocks[1].linear.weight.requires_grad_(False)
    model.stem.bias.requires_grad_(False)
    reference = copy.deepcopy(model)
    shard(model)
    frozen = model.parameter_shards()["blocks.1.linear.weight"].param
    before = frozen.detach().clone()
    trainable = [p for p in model.parameters() if p.requires_grad]
    opt = torch.optim.SGD(trainable, lr=0.1, momentum=0.9)
    ref_opt = torch.optim.SGD(
        [p for p in reference.parameters() if p.requires_grad], lr=0.1, momentum=0.9
    )
    for step in range(3):
        step_both(model, opt, reference, ref_opt, step)
        assert_matches(model, reference)
    assert frozen.grad is None and not frozen.requires_grad
    torch.testing.assert_close(frozen.detach(), before, rtol=0, atol=0)


def test_clip_grad_norm_across_shards() -> None:
    model = Net()
    reference = copy.deepcopy(model)
    shard(model)
    for norm_type in (2.0, 1.0, float("inf")):
        x, y = global_batch(7)
        model.zero_grad()
        reference.zero_grad()
        (loss_of(model, share(x), share(y)) * 50).backward()
        (loss_of(reference, x, y) * 50).backward()
        got = model.clip_grad_norm_(0.5, norm_type)
        want = torch.nn.utils.clip_grad_norm_(reference.parameters(), 0.5, norm_type)
        torch.testing.assert_close(got.double(), want.double(), rtol=1e-5, atol=1e-6)
        assert float(want) > 0.5  # it clipped
        assert_matches(model, reference, grads=True)


def test_parameter_shards_rebuild_the_parameters() -> None:
    """Every rank's shards, put at their offsets, are the whole parameters exactly."""
    model = Net()
    reference = copy.deepcopy(model)
    shard(model)
    mine = {
        n: (s.offsets, tuple(s.shape), s.param.detach().clone())
        for n, s in model.parameter_shards().items()
    }
    assert set(mine) == {n for n, _ in reference.named_parameters()}
    every = dp.allgather_object(mine)
    for name, whole in reference.named_parameters():
        built = torch.full_like(whole, float("nan"))
        for shards in every:
            offsets, shape, part = shards[name]
            assert shape == tuple(whole.shape)
            if part.numel() == 0:
                continue
            if not shape:
                built = part.clone()
            else:
                built[offsets[0] : offsets[0] + len(part)] = part
        torch.testing.assert_close(built, whole.detach(), rtol=0, atol=0)


def test_forward_without_grad_frees_everything() -> None:
    model = Net()
    reference = copy.deepcopy(model)
    shard(model)
    x, _ = global_batch(0)
    with torch.no_grad():
        out = model(x)
    torch.testing.assert_close(out, reference(x).detach(), **TOL)
    assert model.parameter_bytes()[1] == 0
    model.unshard()  # the root's own parameters, whole, until reshard()
    torch.testing.assert_close(
        model.head.weight.detach(), reference.head.weight.detach(), rtol=0, atol=0
    )
    model.reshard()
    assert model.parameter_bytes()[1] == 0


def test_errors() -> None:
    model = Net()
    shard(model)
    with pytest.raises(ValueError, match="sharded already"):
        fully_shard(model)
    with pytest.raises(ValueError, match=r"dp\.torch\.join"):
        dp.torch.join(model)
    with pytest.raises(ValueError, match="DataParallelModel cannot wrap"):
        dp.torch.DataParallelModel(model)
    # A parameter tied across two sharded siblings.
    a, b = nn.Linear(3, 3), nn.Linear(3, 3)
    b.weight = a.weight
    fully_shard(a)
    with pytest.raises(ValueError, match="tied to one"):
        fully_shard(b)
    converted = shard(Net())
    converted.double()  # after fully_shard: the shards are no longer what is sent
    with pytest.raises(RuntimeError, match="Move or convert the model before"):
        converted(torch.zeros(2, 5, dtype=torch.float64))
    with pytest.raises(TypeError, match=r"torch\.nn\.Module"):
        fully_shard(object())  # type: ignore[type-var]
    # The elastic state carries a model sharded over the world with the optimizers over its
    # shards (tests/test_elastic.py), not such an optimizer without its model, nor a model
    # sharded over a group, which goes with its world.
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    with pytest.raises(ValueError, match=r"optimizer 'optimizer' steps parameters sharded"):
        dp.elastic.TorchState(optimizer=opt)
    with pytest.raises(ValueError, match=r"optimizer 'opt' steps parameters sharded"):
        dp.elastic.TorchState(model=Net(), opt=opt)
    dp.elastic.TorchState(inner=nn.Sequential(model), opt=opt)  # inside another module: found
    grouped = shard(Net(), group=dp.new_group(range(dp.size())))
    with pytest.raises(ValueError, match=r"shards over a group \(fully_shard\(group=...\)\)"):
        dp.elastic.TorchState(model=grouped)


def test_next_block_is_prefetched() -> None:
    """From the second forward on, each block's forward runs with the next block's gather
    already started; in backward, with the previous block's."""
    model = shard(Net())
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    seen: list[tuple[str, int, str]] = []

    def watch(i: int, when: str) -> Callable[..., None]:
        def hook(*_: object) -> None:
            other = i + 1 if when == "forward" else i - 1
            if 0 <= other < len(model.blocks):
                seen.append((when, i, model.blocks[other]._dp_group.phase.value))

        return hook

    for i, block in enumerate(model.blocks):
        block.register_forward_hook(watch(i, "forward"))
        block.register_full_backward_hook(watch(i, "backward"))
    for step in range(2):
        seen.clear()
        x, y = global_batch(step)
        opt.zero_grad()
        loss_of(model, share(x), share(y)).backward()
        opt.step()
    forward = [phase for when, _, phase in seen if when == "forward"]
    backward = [phase for when, _, phase in seen if when == "backward"]
    assert forward and all(p != "sharded" for p in forward), seen
    assert backward and all(p != "sharded" for p in backward), seen

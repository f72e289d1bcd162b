"""A model too big for one process: built on the meta device, sharded there, then given memory
for this rank's rows only (`FullyShardedModule.to_empty`), as FSDP2 users do.

Runs in whatever world pytest runs in (1, 2, 3 ranks; MPI, Gloo). What it shows: the model built
on the meta device holds no memory; after `to_empty` every rank holds its rows only; the bytes
of parameters (and gradients) each rank holds, read at every module's forward and backward of a
training step, stay within its shards plus one block's whole parameters and gradients, below the
whole model's at 2 and 3 ranks; and a checkpoint of a model built whole (`dp.checkpoint`) loads
into the meta-built one, each rank reading only its rows, which then computes what the whole
model computes.
"""

from __future__ import annotations

import importlib.util
import shutil
import tempfile
from collections.abc import Iterator
from pathlib import Path

import pytest

if importlib.util.find_spec("torch") is None:
    pytest.skip("needs torch", allow_module_level=True)

import torch
from torch import nn

import dataparallel as dp
from dataparallel.backends.base import Backend

WIDTH, BLOCKS = 24, 8  # 24 rows: every rank of 1, 2 or 3 holds some of every weight


def build() -> nn.Sequential:
    return nn.Sequential(
        *[nn.Sequential(nn.Linear(WIDTH, WIDTH), nn.Tanh()) for _ in range(BLOCKS)]
    )


def sharded_on_meta() -> nn.Sequential:
    with torch.device("meta"):
        model = build()
    for block in model:
        dp.torch.fully_shard(block)
    return dp.torch.fully_shard(model)


@pytest.fixture
def folder(world: Backend) -> Iterator[Path]:
    made = tempfile.mkdtemp(prefix="dp-zero3-meta-") if dp.rank() == 0 else None
    path = Path(dp.broadcast_object(made))
    yield path / "ckpt"
    dp.barrier()
    if dp.rank() == 0:
        shutil.rmtree(path, ignore_errors=True)


def test_no_rank_ever_holds_the_whole_parameters(world: Backend) -> None:
    model = sharded_on_meta()
    assert all(p.is_meta for p in model.parameters())
    whole = sum(p.numel() for p in build().parameters()) * 4  # bytes of the whole model
    model.to_empty(device="cpu")
    torch.manual_seed(1000 + dp.rank())  # each rank initializes its own rows
    for module in model.modules():
        if isinstance(module, nn.Linear):
            module.reset_parameters()
    held = model.parameter_bytes()  # type: ignore[operator]
    assert held[1] == 0  # nothing gathered between steps
    shards = model.parameter_shards()  # type: ignore[operator]
    for name, info in shards.items():
        rows = -(-info.shape[0] // dp.size())
        assert info.param.shape[0] <= rows, name  # this rank's rows, no more
        assert not info.param.is_meta
    one_block = (WIDTH * WIDTH + WIDTH) * 4
    readings: list[int] = []

    def read(*_: object) -> None:
        sharded, gathered = model.parameter_bytes()  # type: ignore[operator]
        readings.append(sharded + gathered)

    hooks = []
    for block in model:
        hooks.append(block.register_forward_pre_hook(read))
        hooks.append(block.register_forward_hook(read))
        hooks.append(block.register_full_backward_pre_hook(read))
        hooks.append(block.register_full_backward_hook(read))
    opt = torch.optim.Adam(model.parameters(), lr=0.01)
    for step in range(2):
        g = torch.Generator().manual_seed(step * 10 + dp.rank())
        x = torch.randn(4, WIDTH, generator=g, requires_grad=True)
        model(x).pow(2).sum().backward()
        read()
        opt.step()
        opt.zero_grad()
    for hook in hooks:
        hook.remove()
    most = max(readings)
    # this rank's shards (padded rows), and at most one block's whole parameters and gradients
    padded = BLOCKS * (-(-WIDTH // dp.size()) * (WIDTH + 1)) * 4
    assert most <= padded + 2 * one_block, (most, padded, one_block)
    if dp.size() > 1:
        assert most < whole, (most, whole)


def test_a_checkpoint_of_the_whole_model_loads_into_the_meta_built_one(folder: Path) -> None:
    torch.manual_seed(0)
    plain = build()
    dp.checkpoint.save({"model": plain}, folder)
    model = sharded_on_meta()
    model.to_empty(device="cpu")
    dp.checkpoint.load({"model": model}, folder)
    whole = dict(plain.named_parameters())
    for name, info in model.parameter_shards().items():  # type: ignore[operator]
        lo = info.offsets[0]
        rows = whole[name].detach()[lo : lo + info.param.shape[0]]
        assert torch.equal(info.param.detach(), rows), name
    x = torch.randn(3, WIDTH, generator=torch.Generator().manual_seed(5))
    with torch.no_grad():
        assert torch.equal(model(x), plain(x))


def test_a_forward_before_to_empty_says_what_to_do(world: Backend) -> None:
    model = sharded_on_meta()
    with pytest.raises(RuntimeError, match=r"on the meta device.*model\.to_empty"):
        model(torch.ones(1, WIDTH))

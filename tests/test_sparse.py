"""Sparse gradients (`nn.Embedding(sparse=True)`) in `DistributedOptimizer`, `DataParallelModel`.

Every rank trains on its share of a global batch of token ids; the reference is one process on
the whole batch, with a dense embedding (same values: a sparse gradient is a dense one with most
rows left out) or with the same sparse embedding and optimizer.
"""

from __future__ import annotations

import copy

import pytest
import torch
from _torch_common import assert_same_on_every_rank, share, step_pair
from torch import nn

import dataparallel as dp
from dataparallel.backends.base import Backend

BATCH, VOCAB, WIDTH = 12, 30, 4


class Tagger(nn.Module):
    def __init__(self, sparse: bool) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.embed = nn.Embedding(VOCAB, WIDTH, sparse=sparse)
        self.head = nn.Linear(WIDTH, 1)

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        return self.head(self.embed(ids)).squeeze(-1).sum(-1)


def batch(step: int) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(100 + step)
    return torch.randint(0, VOCAB, (BATCH, 3), generator=g), torch.randn(BATCH, generator=g)


def loss_of(model: nn.Module, ids: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
    return ((model(ids) - y) ** 2).mean()


def bucketed(opt: torch.optim.Optimizer) -> set[int]:
    """The ids of the parameters that travel in the optimizer's buckets."""
    return {id(p) for bucket in opt.gradient_sync.buckets for p in bucket}  # type: ignore[attr-defined]


def train_both(
    model: nn.Module,
    opt: torch.optim.Optimizer,
    reference: nn.Module,
    ref_opt: torch.optim.Optimizer,
    steps: int,
) -> None:
    for step in range(steps):
        ids, y = batch(step)
        step_pair(model, opt, reference, ref_opt, ids, y, loss_of)
        grad, want = model.embed.weight.grad, reference.embed.weight.grad
        assert grad is not None and want is not None
        torch.testing.assert_close(grad.to_dense(), want.to_dense())
        for got, ref in zip(model.parameters(), reference.parameters(), strict=True):
            torch.testing.assert_close(got, ref)


def test_sparse_gradients_train_as_dense_ones_on_one_process(world: Backend) -> None:
    model, reference = Tagger(sparse=True), Tagger(sparse=False)
    opt = dp.DistributedOptimizer(torch.optim.SGD(model.parameters(), lr=0.05))
    train_both(model, opt, reference, torch.optim.SGD(reference.parameters(), lr=0.05), 4)
    grad = model.embed.weight.grad
    assert grad is not None and grad.is_sparse and grad.is_coalesced()
    # After the first step the embedding left the dense buckets: it is gathered instead.
    assert id(model.embed.weight) not in bucketed(opt)
    assert_same_on_every_rank([*model.parameters()])


def test_sparse_adam_sees_sparse_gradients_equal_to_one_processes(world: Backend) -> None:
    model, reference = Tagger(sparse=True), Tagger(sparse=True)

    def optimizers(m: Tagger) -> list[torch.optim.Optimizer]:
        return [
            torch.optim.SparseAdam([m.embed.weight], lr=0.05),
            torch.optim.Adam(m.head.parameters(), lr=0.05),
        ]

    sparse_opt, dense_opt = optimizers(model)
    ref_sparse, ref_dense = optimizers(reference)
    # One DistributedOptimizer per inner optimizer: each reduces its own parameters.
    sparse_opt = dp.DistributedOptimizer(sparse_opt)
    dense_opt = dp.DistributedOptimizer(dense_opt)
    for step in range(4):
        ids, y = batch(step)
        for opt in (sparse_opt, dense_opt, ref_sparse, ref_dense):
            opt.zero_grad()
        loss_of(model, share(ids), share(y)).backward()
        loss_of(reference, ids, y).backward()
        for opt in (sparse_opt, dense_opt, ref_sparse, ref_dense):
            opt.step()
        for got, want in zip(model.parameters(), reference.parameters(), strict=True):
            torch.testing.assert_close(got, want)
    assert_same_on_every_rank([*model.parameters()])


def test_sparse_as_dense_reduces_in_the_buckets_and_comes_back_sparse(world: Backend) -> None:
    model, reference = Tagger(sparse=True), Tagger(sparse=False)
    opt = dp.DistributedOptimizer(
        torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9), sparse_as_dense=True
    )
    ref_opt = torch.optim.SGD(reference.parameters(), lr=0.05, momentum=0.9)
    train_both(model, opt, reference, ref_opt, 3)
    grad = model.embed.weight.grad
    assert grad is not None and grad.layout == torch.sparse_coo  # as Horovod's
    assert id(model.embed.weight) in bucketed(opt)


@pytest.mark.parametrize("op", ["avg", "sum"])
def test_an_embedding_unused_on_some_ranks_averages_with_their_zeros(
    op: str, rank: int, size: int
) -> None:
    """Rank 0 looks up rows; the others use only the head: their embedding has no gradient."""
    model = Tagger(sparse=True)
    opt = dp.DistributedOptimizer(torch.optim.SGD(model.parameters(), lr=0.1), op=op)
    dense = Tagger(sparse=False)
    dense_opt = dp.DistributedOptimizer(torch.optim.SGD(dense.parameters(), lr=0.1), op=op)
    for step in range(3):
        ids, _ = batch(step)
        for m, o in ((model, opt), (dense, dense_opt)):
            o.zero_grad()
            if rank == 0:
                m(ids).sum().backward()
            else:
                m.head(torch.ones(2, WIDTH)).sum().backward()
            o.step()
        for got, want in zip(model.parameters(), dense.parameters(), strict=True):
            torch.testing.assert_close(got, want)
        grad = model.embed.weight.grad
        assert grad is not None and grad.is_sparse


def test_a_sparse_parameter_no_rank_used_keeps_no_gradient(world: Backend) -> None:
    model = Tagger(sparse=True)
    opt = dp.DistributedOptimizer(torch.optim.SGD(model.parameters(), lr=0.1))
    for step in range(2):  # the first step is dense, the second gathered
        opt.zero_grad()
        ids, _ = batch(step)
        model(ids).sum().backward()
        opt.step()
    opt.zero_grad()
    model.head(torch.ones(2, WIDTH)).sum().backward()
    opt.step()
    assert model.embed.weight.grad is None and model.head.weight.grad is not None


def test_data_parallel_model_averages_sparse_gradients(world: Backend) -> None:
    bare, reference = Tagger(sparse=True), Tagger(sparse=False)
    model = dp.torch.DataParallelModel(bare)
    opt = torch.optim.SGD(model.parameters(), lr=0.05)
    ref_opt = torch.optim.SGD(reference.parameters(), lr=0.05)
    for step in range(3):
        ids, y = batch(step)
        opt.zero_grad()
        loss_of(model, share(ids), share(y)).backward()
        grad = bare.embed.weight.grad
        assert grad is not None and grad.is_sparse  # reduced when backward returns
        opt.step()
        ref_opt.zero_grad()
        loss_of(reference, ids, y).backward()
        ref_opt.step()
        for got, want in zip(bare.parameters(), reference.parameters(), strict=True):
            torch.testing.assert_close(got, want)


def test_accumulated_sparse_gradients_are_reduced_once(world: Backend) -> None:
    model, reference = Tagger(sparse=True), Tagger(sparse=False)
    opt = dp.DistributedOptimizer(
        torch.optim.SGD(model.parameters(), lr=0.05), backward_passes_per_step=2
    )
    ref_opt = torch.optim.SGD(reference.parameters(), lr=0.05)
    for step in range(3):
        opt.zero_grad()
        ref_opt.zero_grad()
        for half in range(2):
            ids, y = batch(10 * step + half)
            (loss_of(model, share(ids), share(y)) / 2).backward()
            (loss_of(reference, ids, y) / 2).backward()
        opt.step()
        ref_opt.step()
        for got, want in zip(model.parameters(), reference.parameters(), strict=True):
            torch.testing.assert_close(got, want)


def test_gathered_gradients_of_a_copy_made_model_are_independent(world: Backend) -> None:
    """Two models, two optimizers: each gathers only its own embedding."""
    first = Tagger(sparse=True)
    second = copy.deepcopy(first)
    opts = [
        dp.DistributedOptimizer(torch.optim.SGD(m.parameters(), lr=0.1)) for m in (first, second)
    ]
    for step in range(2):
        ids, y = batch(step)
        for m, o in zip((first, second), opts, strict=True):
            o.zero_grad()
            loss_of(m, share(ids), share(y)).backward()
            o.step()
    for a, b in zip(first.parameters(), second.parameters(), strict=True):
        torch.testing.assert_close(a, b)

"""Compression while a rank has joined: its zeros travel in the live ranks' wire dtype.

A rank that has joined (`dp.join`) replays the others' calls on zeros; with `compression=` those
calls send 16-bit buffers, so the replay must too, or MPI hangs (or asserts inside MPICH) and Gloo
aborts in C++ on the size mismatch. Every wire dtype, the reductions, and the realistic form:
`DistributedOptimizer(compression=...)` and `DataParallelModel(compression=...)` inside
`dp.torch.join` with uneven batches. Values are small integers, exact in 16 bits.
"""

from __future__ import annotations

import numpy as np
import pytest

import dataparallel as dp
from dataparallel.config import DEFAULT_BUCKET_BYTES

torch = pytest.importorskip("torch")

WIRES = {"fp16": dp.Compression.fp16, "bf16": dp.Compression.bf16}
# float32 items: one bucket, at the bucket size, past it (each leaf in place alone).
SIZES = [1000, DEFAULT_BUCKET_BYTES // 4, 3 * DEFAULT_BUCKET_BYTES // 4]
PATTERNS = [(0, 1, 3), (3, 0, 1), (1, 3, 0)]  # batches per rank, rotated over the ranks


@pytest.mark.parametrize("wire", WIRES)
@pytest.mark.parametrize("first", [0, -1], ids=["rank-0-joins", "last-rank-joins"])
def test_reductions_with_compression_meet_a_joined_rank(
    rank: int, size: int, wire: str, first: int
) -> None:
    if size == 1:
        pytest.skip("needs a rank that joins and one that works")
    compression = WIRES[wire]
    first %= size
    if rank == first:
        dp.join()
        return
    live = [r for r in range(size) if r != first]
    total = float(sum(r + 1 for r in live))
    for n in SIZES:
        x = np.full(n, rank + 1.0, np.float32)
        out = dp.allreduce(x, "avg", compression=compression)
        np.testing.assert_allclose(out, np.full(n, total / size, np.float32), rtol=1e-6)
        tree = {
            "w": torch.full((n,), rank + 1.0),
            "v": np.full(7, rank + 1.0, np.float64),
            "i": np.full(3, rank + 1, np.int64),  # not floating: travels as it is
        }
        got = dp.iallreduce(tree, compression=compression).wait()
        assert got["w"][0].item() == total and got["v"][0] == total and got["i"][0] == total
        grads = dp.allreduce_gradients(
            [np.full(n, rank + 1.0, np.float32)], op="sum", compression=compression
        )
        assert grads[0][-1] == total
    dp.join()


def _batch(r: int, step: int) -> torch.Tensor:
    return torch.tensor([[r + 1.0, step + 1.0, 0.5 * (r + step)]])


def _reference(size: int, counts: list[int], steps: int) -> torch.nn.Module:
    """What every rank's model holds after `steps` steps: the average over the world of the
    gradients of the ranks that still had a batch (zeros for the others), in full precision."""
    torch.manual_seed(0)
    reference = torch.nn.Linear(3, 2)
    opt = torch.optim.SGD(reference.parameters(), lr=0.05)
    for step in range(steps):
        grads = []
        for r in range(size):
            reference.zero_grad()
            if step < counts[r]:
                reference(_batch(r, step)).pow(2).sum().backward()
                grads.append([p.grad.clone() for p in reference.parameters()])
        for p, *per_rank in zip(reference.parameters(), *grads, strict=True):
            p.grad = sum(per_rank) / size
        opt.step()
    return reference


@pytest.mark.parametrize("wire", WIRES)
@pytest.mark.parametrize("pattern", PATTERNS)
@pytest.mark.parametrize("face", ["optimizer", "model"])
def test_uneven_batches_with_compression_in_a_join_block(
    rank: int, size: int, wire: str, pattern: tuple[int, ...], face: str
) -> None:
    counts = [pattern[r % 3] + r // 3 for r in range(size)]
    torch.manual_seed(0)
    model: torch.nn.Module = torch.nn.Linear(3, 2)
    inner = torch.optim.SGD(model.parameters(), lr=0.05)
    if face == "optimizer":
        opt = dp.DistributedOptimizer(inner, compression=WIRES[wire])
        joinable: object = opt
    else:
        model = dp.torch.DataParallelModel(model, compression=WIRES[wire])
        opt, joinable = inner, model
    with dp.torch.join(joinable) as joined:
        for step in range(counts[rank]):
            opt.zero_grad()
            model(_batch(rank, step)).pow(2).sum().backward()
            opt.step()
    reference = _reference(size, counts, counts[rank])
    tolerance = 1e-2 if wire == "bf16" else 2e-3  # 16-bit gradients
    for p, q in zip(model.parameters(), reference.parameters(), strict=True):
        torch.testing.assert_close(p.detach(), q.detach(), rtol=tolerance, atol=tolerance)
    assert joined.last == max(r for r in range(size) if counts[r] == max(counts))

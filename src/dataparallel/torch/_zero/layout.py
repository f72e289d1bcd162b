"""How `ZeroRedundancyOptimizer` lays parameters out: slabs, buckets, segments, pieces.

Per (param group, dtype) the parameters are cut into buckets as `GradientSync` cuts them
(`_buckets.assign`: reverse registration order, the order backward usually produces their
gradients; a parameter of `bucket_bytes` or more is a bucket of its own) and live in one slab (a
contiguous buffer), bucket after bucket; each parameter's `.data` becomes a view of it. Every
bucket ends with fewer than `size` items of padding, so that it splits into `size` equal
contiguous segments, one per rank: a parameter may span ranks. Equal segments make the
allgathers plain ones (MPI's `Allgatherv` is far slower: benchmarks/NOTES.md). Rank r owns
segment r of every bucket, so one reduce-scatter per bucket leaves each rank its gradients and
one allgather per bucket returns every rank's update.

What a rank's inner optimizer steps are `Piece`s: its segments cut at parameter boundaries,
each a 1-D view of the slab. A piece belongs to one parameter, so an optimizer skips it exactly
when it would skip the parameter (no gradient on any rank); in a world of one the pieces are the
whole parameters. The slabs live on the parameters' device (a CUDA device too); what crosses to
the host for the engines is `gather`'s and `gradients`' business.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

from dataparallel.torch._buckets import assign

__all__ = ["Bucket", "Piece", "Slab", "host_buffer", "lay_out_group"]


def host_buffer(items: int, dtype: torch.dtype, staged: bool) -> torch.Tensor:
    """A host buffer for the engines, made once and kept. `staged` (device data passes through
    it): pinned where torch has CUDA, so that the copies to and from the device are plain DMA."""
    return torch.empty(items, dtype=dtype, pin_memory=staged and torch.cuda.is_available())


@dataclass
class Piece:
    """The part `[start, stop)` of parameter `param` that this rank steps."""

    param: int  # the parameter's index among all of the optimizer's parameters
    slab: int  # the index of its slab
    start: int
    stop: int
    tensor: torch.Tensor  # a 1-D view of the slab: what the inner optimizer steps
    shard_at: int  # where its gradient lies in the slab's gradient shard (stage 2)


@dataclass
class Bucket:
    """Items `[start, stop)` of slab `slab`: one reduce-scatter, one allgather."""

    slab: int
    start: int
    stop: int
    filled: int  # the end of its parameters' items (padding up to `stop`)
    counts: list[int]  # items per rank (all equal)
    shard_at: int  # where this rank's segment starts in the slab's gradient shard
    mine: tuple[int, int]  # this rank's segment, in the slab's coordinates
    params: list[int]  # its parameters (indices among the optimizer's parameters)


@dataclass
class Slab:
    """One param group's parameters of one dtype, bucket after bucket."""

    group: int
    dtype: torch.dtype
    data: torch.Tensor
    offsets: dict[int, int]  # parameter index -> its first item in `data`
    shard_items: int = 0  # this rank's items over all of its buckets
    buckets: list[int] = field(default_factory=list)  # indices into the optimizer's buckets


def lay_out_group(
    group: int,
    params: list[tuple[int, torch.Tensor]],
    rank: int,
    size: int,
    bucket_bytes: int,
    first_slab: int,
    device: torch.device | str = "cpu",
) -> tuple[list[Slab], list[Bucket], list[Piece]]:
    """Lay out one param group: move its parameters into slabs; return them, their
    buckets and this rank's pieces. `params` are (index among all parameters, parameter), all on
    `device`, where the slabs are made."""
    by_dtype: dict[torch.dtype, list[tuple[int, torch.Tensor]]] = {}
    for k, p in reversed(params):
        by_dtype.setdefault(p.dtype, []).append((k, p))
    slabs: list[Slab] = []
    buckets: list[Bucket] = []
    pieces: list[Piece] = []
    for dtype, members in by_dtype.items():
        f = first_slab + len(slabs)
        named = [(str(k), p) for k, p in members]
        ranges, offsets, at = [], {}, 0
        for cut in assign(named, list(range(len(members))), bucket_bytes):
            start = at
            for j in cut.members:
                offsets[members[j][0]] = at
                at += members[j][1].numel()
            filled, at = at, start + -(-(at - start) // size) * size
            if at > start:
                ranges.append((start, filled, at, [members[j][0] for j in cut.members]))
        data = torch.zeros(at, dtype=dtype, device=device)
        with torch.no_grad():
            for k, p in members:
                view = data[offsets[k] : offsets[k] + p.numel()]
                view.copy_(p.reshape(-1))
                p.data = view.view(p.shape)
        slab = Slab(group, dtype, data, offsets)
        numel = {k: p.numel() for k, p in members}
        for start, filled, stop, ks in ranges:
            part = (stop - start) // size
            mine = (start + rank * part, start + (rank + 1) * part)
            bucket = Bucket(f, start, stop, filled, [part] * size, slab.shard_items, mine, ks)
            slab.buckets.append(len(buckets))
            buckets.append(bucket)
            for k in ks:
                a = offsets[k]
                lo, hi = max(a, mine[0]), min(a + numel[k], mine[1])
                if lo < hi:
                    shard_at = slab.shard_items + lo - mine[0]
                    pieces.append(Piece(k, f, lo - a, hi - a, data[lo:hi], shard_at))
            slab.shard_items += part
        if rank == 0:  # a parameter of no item has no segment: rank 0 steps it (its state)
            for k, p in members:
                if p.numel() == 0:
                    a = offsets[k]
                    pieces.append(Piece(k, f, 0, 0, data[a:a], slab.shard_items))
        slabs.append(slab)
    return slabs, buckets, pieces

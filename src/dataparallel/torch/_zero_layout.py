"""How `ZeroRedundancyOptimizer` lays parameters out: flat buffers, buckets, segments, pieces.

Per (param group, dtype) the parameters live in one flat buffer (`Flat`), in reverse
registration order (the order backward usually produces their gradients); each parameter's
`.data` becomes a view of it. The flat buffer is cut into buckets of `bucket_bytes`, and every
bucket into `size` contiguous segments, one per rank, balanced to within one item
(`segment_counts`): a parameter may span buckets and ranks. Rank r owns segment r of every
bucket, so one reduce-scatter per bucket leaves each rank its gradients and one allgather per
bucket returns every rank's update. A rank's share of a flat buffer is at most one item per
bucket more than `1 / size` of it.

What a rank's inner optimizer steps are `Piece`s: a segment cut at parameter boundaries (and
rejoined where consecutive segments of one parameter touch, as they do in a world of one), each
a 1-D view of the flat buffer. A piece belongs to one parameter, so an optimizer skips it
exactly when it would skip the parameter (no gradient on any rank).
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

__all__ = ["Bucket", "Flat", "Piece", "plan_group", "segment_counts"]


def segment_counts(items: int, size: int) -> list[int]:
    """Split `items` into `size` contiguous counts, the first `items % size` one larger."""
    base, extra = divmod(items, size)
    return [base + (r < extra) for r in range(size)]


@dataclass
class Piece:
    """The part `[start, stop)` of parameter `param` (its flat index) that this rank steps."""

    param: int  # the parameter's index among all of the optimizer's parameters
    flat: int  # the index of its flat buffer
    start: int
    stop: int
    tensor: torch.Tensor  # a 1-D view of the flat buffer: what the inner optimizer steps
    shard_at: int  # where its gradient lies in the flat's gradient shard (stage 2)


@dataclass
class Bucket:
    """Items `[start, stop)` of flat buffer `flat`: one reduce-scatter, one allgather."""

    flat: int
    start: int
    stop: int
    counts: list[int]  # items per rank
    shard_at: int  # where this rank's segment starts in the flat's gradient shard
    mine: tuple[int, int]  # this rank's segment, in the flat buffer's coordinates
    params: list[int]  # the parameters it overlaps (indices among the optimizer's parameters)


@dataclass
class Flat:
    """One param group's parameters of one dtype, laid end to end."""

    group: int
    dtype: torch.dtype
    data: torch.Tensor
    offsets: dict[int, int]  # parameter index -> its first item in `data`
    shard_items: int = 0  # this rank's items over all of its buckets
    buckets: list[int] = field(default_factory=list)  # indices into the optimizer's buckets


def plan_group(
    group: int,
    params: list[tuple[int, torch.Tensor]],
    rank: int,
    size: int,
    bucket_bytes: int,
    first_flat: int,
) -> tuple[list[Flat], list[Bucket], list[Piece]]:
    """Lay out one param group: move its parameters into flat buffers; return them, their
    buckets and this rank's pieces. `params` are (index among all parameters, parameter)."""
    by_dtype: dict[torch.dtype, list[tuple[int, torch.Tensor]]] = {}
    for k, p in reversed(params):
        by_dtype.setdefault(p.dtype, []).append((k, p))
    flats: list[Flat] = []
    buckets: list[Bucket] = []
    pieces: list[Piece] = []
    for dtype, members in by_dtype.items():
        f = first_flat + len(flats)
        total = sum(p.numel() for _, p in members)
        data = torch.empty(total, dtype=dtype)
        offsets, at = {}, 0
        with torch.no_grad():
            for k, p in members:
                n = p.numel()
                data[at : at + n].copy_(p.reshape(-1))
                p.data = data[at : at + n].view(p.shape)
                offsets[k] = at
                at += n
        flat = Flat(group, dtype, data, offsets)
        step = max(1, bucket_bytes // data.element_size())
        ends = [(k, offsets[k], offsets[k] + p.numel()) for k, p in members]
        for start in range(0, total, step):
            stop = min(total, start + step)
            counts = segment_counts(stop - start, size)
            seg = start + sum(counts[:rank])
            overlapping = [k for k, a, b in ends if a < stop and b > start]
            mine = (seg, seg + counts[rank])
            bucket = Bucket(f, start, stop, counts, flat.shard_items, mine, overlapping)
            flat.buckets.append(len(buckets))
            buckets.append(bucket)
            for k, a, b in ends:
                lo, hi = max(a, bucket.mine[0]), min(b, bucket.mine[1])
                if lo >= hi:
                    continue
                shard_at = flat.shard_items + lo - bucket.mine[0]
                last = pieces[-1] if pieces else None
                if (
                    last is not None
                    and last.param == k
                    and a + last.stop == lo
                    and (last.shard_at + last.stop - last.start == shard_at)
                ):  # touches the piece before: one piece (a world of one)
                    last.stop = hi - a
                    last.tensor = data[a + last.start : hi]
                    continue
                pieces.append(Piece(k, f, lo - a, hi - a, data[lo:hi], shard_at))
            flat.shard_items += counts[rank]
        flats.append(flat)
    return flats, buckets, pieces

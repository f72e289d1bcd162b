"""`Shards`: this rank's pieces of one tensor that no rank holds whole, each with its place.

Whatever shards a tensor (ZeRO's flat slices of a parameter's optimizer state, a fully sharded
parameter, a JAX array's local pieces) hands a checkpoint the same thing: the tensor's global
shape and dtype, and this rank's pieces as boxes (offsets and a tensor of the box's sizes). That
is torch DCP's chunk model (`ChunkStorageMetadata`), so a checkpoint made of `Shards` is a DCP
checkpoint, and loading cuts the saved boxes by their offsets into whatever boxes the loading
ranks hold: the world sizes of the two jobs never meet.

A flat slice of a tensor (items `[start, stop)` of its row-major order, as ZeRO keeps them) is
not one box in general: `flat_boxes` cuts it into at most `2 * ndim - 1` boxes (a partial row,
whole rows, a partial row, one dimension down at each end), each a contiguous run of the slice.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass

import torch

__all__ = ["Shards", "flat_boxes"]

Box = tuple[tuple[int, ...], tuple[int, ...]]  # (offsets, sizes)


def flat_boxes(shape: Sequence[int], start: int, stop: int) -> list[tuple[Box, int]]:
    """Cut items `[start, stop)` of a row-major tensor of `shape` into boxes, in order: each
    (offsets, sizes) with its first item's place in the run (counted from `start`)."""
    shape = tuple(int(n) for n in shape)
    out: list[tuple[Box, int]] = []

    def cut(dims: tuple[int, ...], lo: int, hi: int, prefix: tuple[int, ...], at: int) -> None:
        if lo >= hi:
            return
        if not dims:
            out.append(((prefix, ()), at))
            return
        inner = math.prod(dims[1:])
        first, last = lo // inner, (hi - 1) // inner
        rest = len(dims) - 1
        if first == last:
            cut(dims[1:], lo - first * inner, hi - first * inner, (*prefix, first), at)
            return
        if lo % inner:
            cut(dims[1:], lo % inner, inner, (*prefix, first), at)
            at += inner - lo % inner
            first += 1
        whole_last = last if hi % inner == 0 else last - 1
        if whole_last >= first:
            rows = whole_last - first + 1
            out.append((((*prefix, first, *[0] * rest), (rows, *dims[1:])), at))
            at += rows * inner
        if hi % inner:
            cut(dims[1:], 0, hi % inner, (*prefix, last), at)

    cut(shape, start, stop, (), 0)
    # a box found one dimension down lacks the sizes of the dimensions above it (1 each)
    fixed = []
    for (offsets, sizes), at in out:
        fixed.append(((offsets, (1,) * (len(offsets) - len(sizes)) + sizes), at))
    return fixed


@dataclass(frozen=True)
class Shards:
    """This rank's pieces of a tensor of `shape`: `pieces` are (offsets, tensor) boxes.

    Every rank's boxes together must cover the tensor exactly once (a save checks it); a rank
    may hold none. Give it in a checkpoint's state where the tensor would stand; loading fills
    the boxes in place (make them views of the memory to fill).

    >>> import torch
    >>> from dataparallel.checkpoint import Shards
    >>> state = torch.zeros(5)                      # items 3..7 of a 4 x 3 parameter's state
    >>> s = Shards.from_flat((4, 3), 3, state)
    >>> for offsets, piece in s.pieces:  # row 1 whole, then the first 2 items of row 2
    ...     print(offsets, tuple(piece.shape))
    (1, 0) (1, 3)
    (2, 0) (1, 2)
    """

    shape: tuple[int, ...]
    dtype: torch.dtype
    pieces: tuple[tuple[tuple[int, ...], torch.Tensor], ...]

    @classmethod
    def from_flat(cls, shape: Sequence[int], start: int, flat: torch.Tensor) -> Shards:
        """The pieces of a flat slice: `flat` holds items `[start, start + len(flat))` of the
        tensor of `shape`, in row-major order (ZeRO's slices). The boxes are views of `flat`."""
        if flat.dim() != 1:
            raise ValueError(f"Shards.from_flat: a flat slice is 1-D, got shape {list(flat.shape)}")
        pieces = []
        for (offsets, sizes), at in flat_boxes(shape, start, start + flat.numel()):
            pieces.append((offsets, flat[at : at + math.prod(sizes)].view(sizes)))
        return cls(tuple(int(n) for n in shape), flat.dtype, tuple(pieces))

    def piece(self, offsets: Sequence[int]) -> torch.Tensor:
        """The piece whose box begins at `offsets`."""
        key = tuple(int(n) for n in offsets)
        for at, tensor in self.pieces:
            if at == key:
                return tensor
        raise KeyError(f"no piece at offsets {list(key)} on this rank")

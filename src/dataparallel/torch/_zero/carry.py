"""Carrying a fully sharded model and its optimizers' state over an elastic re-form.

A rank holds only its rows of each parameter (and of each optimizer's state for it), so a lost
worker's rows would go with it. A *commit* therefore keeps, on each rank, a copy of its own rows
and of the next rank's (a ring exchange: each rank's rows are then on two ranks, and any loss
but of two neighbours at once leaves a holder of every row). After a re-form each group is cut
again for the new world (`ShardGroup.relayout`, the same parameters), then filled one group at
a time: every survivor gives the rows it holds, every rank puts the whole of the group's
parameters (and of the state tensors of a parameter's rows) together and keeps its new rows.
So a re-form holds one group's whole parameters and state at a time, as a forward holds one
group's parameters. An optimizer state value is a parameter's rows when it is a tensor of the
shard's shape (Adam's `exp_avg`, SGD's `momentum_buffer`), as `dp.checkpoint` decides; any
other value (`step`) is the same on every rank and is taken from one.

Records are plain picklable dicts: `{"rank", "size", "own", "next"}`, `own` and `next` each a
list over the parameters (every group's, in model order) of `{"param": rows, "state": {optimizer
name: {key: value}}}`; `next` is the next rank's (None when nothing was exchanged).
"""

from __future__ import annotations

import pickle
from collections.abc import Mapping, Sequence
from typing import Any, Literal, Protocol, TypedDict

import numpy as np
import torch

from dataparallel.backends.base import Backend
from dataparallel.collectives.objects import allgather_object
from dataparallel.collectives.pointtopoint import sendrecv

__all__ = ["carry_over", "record", "restore"]

Optimizers = Mapping[str, torch.optim.Optimizer]


class _Shard(Protocol):
    """What a commit reads of one parameter of a `ShardGroup`."""

    @property
    def sharded(self) -> torch.Tensor: ...  # this rank's rows
    @property
    def shape(self) -> torch.Size: ...  # the whole parameter's
    @property
    def first(self) -> int: ...  # the first row this rank holds
    @property
    def mine(self) -> int: ...  # the rows it holds


class _Group(Protocol):
    """What a commit reads of a `ShardGroup` (without the import: it imports this module)."""

    @property
    def params(self) -> Sequence[_Shard]: ...
    @property
    def backend(self) -> Backend: ...
    def relayout(self, backend: Backend) -> None: ...


Groups = Sequence[_Group]  # in model order
Held = Literal["own", "next"]  # which entries of a commit hold a rank's rows


class Entry(TypedDict):
    """One parameter's rows, and each optimizer's state of them (by the optimizer's name)."""

    param: torch.Tensor
    state: dict[str, dict[str, Any]]  # optimizer name -> key -> tensor of rows, or value


class Rows(TypedDict):
    """A rank's commit (`record`): its own entries, and the next rank's (None if not sent)."""

    rank: int
    size: int
    own: list[Entry]
    next: list[Entry] | None


def _is_rows(value: object, shard: torch.Tensor) -> bool:
    """Whether an optimizer state value holds the shard's rows (`dp.checkpoint`'s rule)."""
    return isinstance(value, torch.Tensor) and value.dim() > 0 and value.shape == shard.shape


def _copy(value: object) -> object:
    return value.detach().clone() if isinstance(value, torch.Tensor) else value


def _entries(groups: Groups, optimizers: Optimizers) -> list[Entry]:
    """A copy of this rank's rows of every parameter and of its optimizers' state."""
    out = []
    for group in groups:
        for info in group.params:
            shard = info.sharded
            state = {
                name: {k: _copy(v) for k, v in opt.state[shard].items()}
                for name, opt in optimizers.items()
                if shard in opt.state
            }
            out.append(Entry(param=shard.detach().clone(), state=state))
    return out


def _bytes(value: object) -> np.ndarray:
    return np.frombuffer(pickle.dumps(value, protocol=pickle.HIGHEST_PROTOCOL), np.uint8).copy()


def _loads(data: np.ndarray) -> list[Entry]:
    return pickle.loads(data.tobytes())


def record(
    groups: Groups,
    optimizers: Optimizers,
    backend: Backend,
    *,
    exchange: bool,
    of: Rows | None = None,
) -> Rows:
    """This rank's commit of `groups` (laid out over `backend`): its own rows (`of`'s, a
    commit made earlier in this layout, instead of today's) and, with `exchange` (collective:
    a ring of `sendrecv`s), the next rank's."""
    own = _entries(groups, optimizers) if of is None else of["own"]
    rank, size = backend.rank, backend.size
    following = None
    if exchange and size > 1:
        data = _bytes(own)
        ahead, behind = (rank + 1) % size, (rank - 1) % size
        count = np.array([data.size], np.int64)
        got = sendrecv(count, np.zeros(1, np.int64), ahead, behind, backend=backend)
        into = np.empty(int(got[0]), np.uint8)
        following = _loads(sendrecv(data, into, ahead, behind, backend=backend))
    return Rows(rank=rank, size=size, own=own, next=following)


def restore(groups: Groups, optimizers: Optimizers, saved: Rows) -> bool:
    """Put this rank's committed rows back (the layout unchanged since: not collective).
    Returns False, changing nothing, when the groups were laid out again since."""
    params = [info for group in groups for info in group.params]
    backend = groups[0].backend if groups else None
    if backend is None or (saved["rank"], saved["size"]) != (backend.rank, backend.size):
        return False
    with torch.no_grad():
        for info, entry in zip(params, saved["own"], strict=True):
            info.sharded.copy_(entry["param"])
            for name, opt in optimizers.items():
                opt.state.pop(info.sharded, None)
                if name in entry["state"]:
                    opt.state[info.sharded] = {k: _copy(v) for k, v in entry["state"][name].items()}
    return True


def holders(marks: list[tuple[int, int, bool] | None]) -> dict[int, tuple[int, Held]]:
    """For each old rank, the new rank holding its rows and whether as its `own` or `next`,
    from what each new rank committed as (old rank, old size, whether it holds the next
    rank's copy), None for a newcomer.

    Raises:
        RuntimeError: some old rank's rows are held by no survivor.
    """
    sizes = sorted({m[1] for m in marks if m is not None})
    if len(sizes) != 1:
        raise RuntimeError(
            "the elastic state of a fully sharded model: the surviving workers committed in "
            f"worlds of sizes {sizes}, where one commit of one world was expected."
        )
    size = sizes[0]
    where = {m[0]: new for new, m in enumerate(marks) if m is not None}
    out: dict[int, tuple[int, Held]] = {}
    for old in range(size):
        before = where.get((old - 1) % size)
        if old in where:
            out[old] = (where[old], "own")
        elif before is not None and (mark := marks[before]) is not None and mark[2]:
            out[old] = (before, "next")
        else:
            raise RuntimeError(
                f"the rows of a fully sharded model that rank {old} of {size} held are on no "
                "surviving worker: each state.commit() (and the elastic run's first sync) keeps "
                "a copy of a rank's rows on the rank before it, so two neighbouring ranks lost "
                "at once cannot be carried over. Restart from a dp.checkpoint after such a loss."
            )
    return out


def carry_over(
    groups: Groups,
    optimizers: Optimizers,
    saved: Rows | None,
    backend: Backend,
) -> None:
    """Lay `groups` out over `backend` (the re-formed world) and fill each rank's new rows of
    the parameters and of the optimizers' state from the survivors' commits (collective).

    `saved` is this rank's commit, or None on a newcomer (which holds nothing to give; its
    groups are laid out over `backend` already, and are laid out again all the same).
    """
    mark = None if saved is None else (saved["rank"], saved["size"], saved["next"] is not None)
    marks = allgather_object(mark, backend=backend)
    held = holders(marks)
    old_size = len(held)
    for group in groups:
        group.relayout(backend)
    at = 0
    for group in groups:
        count = len(group.params)
        mine: dict[int, list[Entry]] = {}
        if saved is not None:
            for old, (new, how) in held.items():
                if new == backend.rank:
                    rows = saved[how]
                    assert rows is not None  # (`holders` names "next" only where it was sent)
                    mine[old] = rows[at : at + count]
        every: dict[int, list[Entry]] = {}
        for part in allgather_object(mine, backend=backend):
            every.update(part)
        for k, info in enumerate(group.params):
            _fill(info, [every[old][k] for old in range(old_size)], optimizers, backend.rank)
        at += count


def _fill(info: _Shard, by_rank: list[Entry], optimizers: Optimizers, rank: int) -> None:
    """Give this rank's shard of `info` (laid out already) its rows, and its optimizers' state,
    from every old rank's committed entry for it."""
    shard = info.sharded
    scalar = not info.shape
    with torch.no_grad():
        if scalar:  # held whole by rank 0, in either world
            if shard.numel():
                shard.copy_(by_rank[0]["param"])
        elif shard.numel():
            whole = torch.cat([e["param"] for e in by_rank])
            shard.copy_(whole[info.first : info.first + info.mine])
    # The values of one rank in the old world stand for its like in the new one: rank 0 (the
    # holder of a scalar parameter) for rank 0, another for the others.
    source = 0 if rank == 0 or len(by_rank) == 1 else 1
    for name, opt in optimizers.items():
        opt.state.pop(shard, None)
        if scalar and rank != 0 and len(by_rank) == 1:
            continue  # no old rank stood where this one stands: its state starts afresh
        entry = by_rank[source]["state"].get(name)
        if entry is None:
            continue
        state: dict[str, object] = {}
        for key, value in entry.items():
            if not scalar and _is_rows(value, by_rank[source]["param"]):
                whole = torch.cat([e["state"][name][key] for e in by_rank])
                state[key] = whole[info.first : info.first + info.mine].clone()
            else:
                state[key] = _copy(value)
        opt.state[shard] = state

"""Process groups: some of the world's ranks, for collectives among them alone (`dp.new_group`)."""

from __future__ import annotations

import numbers
from collections.abc import Callable, Iterable
from dataclasses import dataclass
from typing import SupportsIndex

from dataparallel.backends.base import Backend, released
from dataparallel.errors import CollectiveMismatchError
from dataparallel.world import current

__all__ = ["Group", "backend_of", "new_group"]


@dataclass(eq=False)
class Group:
    """Some of the world's ranks, for collectives among them alone (`dp.new_group`).

    A group's rank of a process is its position in `ranks` (sorted). On a rank outside the group
    the object exists too (every rank made it), but collectives with it raise `ValueError`.

    Attributes:
        ranks: the world ranks in the group, sorted.
    """

    ranks: tuple[int, ...]
    _engine: Backend | None
    _world_rank: int

    @property
    def member(self) -> bool:
        """Whether this process is in the group."""
        return self._world_rank in self.ranks

    @property
    def backend(self) -> Backend:
        """The engine of the group's collectives; raises `ValueError` outside the group."""
        if self._engine is None:
            why = "it was freed" if self.member else f"rank {self._world_rank} is not in it"
            raise ValueError(
                f"This process cannot use the group of ranks {list(self.ranks)}: {why}. Only the "
                "group's ranks call collectives with group=; others skip those calls (test "
                "`group.member`)."
            )
        return self._engine

    def free(self) -> None:
        """Release the group's engine (communicators, Gloo groups); it can no longer be used."""
        self.release()()

    def release(self, *, cut: bool = False) -> Callable[[], None]:
        """`free`, but the engine only released (`Backend.release`; cut first if `cut`): return
        what finishes it."""
        engine, self._engine = self._engine, None
        return released(engine, cut=cut) if engine is not None else _freed


def _freed() -> None:
    """Nothing left to free (`Group.release` of a group freed already, or of a non-member)."""

    def __repr__(self) -> str:
        return f"Group(ranks={list(self.ranks)}, member={self.member})"


def backend_of(backend: Backend | None, group: Group | None) -> Backend | None:
    """Return the engine that a call's `backend=` or `group=` names (None: the world's).

    Raises:
        ValueError: both were given, or this process is not in `group`.
    """
    if group is None:
        return backend
    if backend is not None:
        raise ValueError("Give group= or backend=, not both: a group has its own engine.")
    return group.backend


def new_group(ranks: Iterable[SupportsIndex]) -> Group:
    """Return a group of the world ranks `ranks`, for collectives among them alone.

    Collective: every rank of the world calls it, with the same ranks (checked), including the
    ranks that are not in it. Pass the group as `group=` to the collectives, the reducers,
    `DistributedOptimizer`, `DataParallelModel`, `synchronize` and the data containers;
    `dp.rank(group)` and `dp.size(group)` give this process's place in it. `group.free()`
    releases it (Horovod's `remove_process_set`).

    >>> import dataparallel as dp
    >>> _ = dp.initialize("single")
    >>> group = dp.new_group([0])
    >>> dp.rank(group), dp.size(group), group.member
    (0, 1, True)
    """
    world = current()
    size = world.backend.size
    if isinstance(ranks, (str, bytes)) or not hasattr(ranks, "__iter__"):
        raise TypeError(f"new_group takes a list of ranks, got {type(ranks).__name__}.")
    ranks = list(ranks)
    for r in ranks:
        if isinstance(r, bool) or not isinstance(r, numbers.Integral):
            raise TypeError(f"new_group: rank {r!r} is a {type(r).__name__}, not an int.")
    members = tuple(sorted(int(r) for r in ranks))
    if not members:
        raise ValueError("new_group: a group needs at least one rank, got none.")
    if len(set(members)) != len(members):
        raise ValueError(f"new_group: ranks {ranks} name a rank twice.")
    if members[0] < 0 or members[-1] >= size:
        raise ValueError(f"new_group: ranks {ranks} are not all ranks of this world of {size}.")
    if size > 1:
        every = world.backend.allgather_object(members)
        if any(other != members for other in every):
            named = "; ".join(f"rank {r}: {list(g)}" for r, g in enumerate(every))
            raise CollectiveMismatchError(
                f"Ranks called new_group with different ranks ({named}). Every rank must call it "
                "with the same list."
            )
    group = Group(members, world.backend.split(members), world.backend.rank)
    world.groups.append(group)  # freed by dp.finalize() if not before
    return group

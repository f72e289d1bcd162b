"""Horovod's process sets over dataparallel's groups: `ProcessSet`, `add_process_set`, ...

A process set is a `dp.Group` (`dp.new_group`) with Horovod's face: ranks are world ranks, roots
of broadcasts are world ranks too (translated to the group's here), `rank()`/`size()` are the
process's place in the set, and `remove_process_set` frees the group.
"""

from __future__ import annotations

import itertools
from collections.abc import Sequence

from dataparallel import caches, groups, world
from dataparallel.collectives import objects
from dataparallel.horovod.torch._basics import require_init

__all__ = [
    "ProcessSet",
    "add_process_set",
    "global_process_set",
    "group_of",
    "remove_process_set",
    "reset_process_sets",
    "root_in",
]


class ProcessSet:
    """Some of the world's processes, for collectives among them alone (Horovod's `ProcessSet`).

    Build one from a list of world ranks and pass it to `hvd.init(process_sets=[...])` or
    `hvd.add_process_set`; `process_set_id` is set once it is registered. Creating a process set
    from an MPI communicator is not supported: give the ranks.
    """

    process_set_id: int | None = None
    ranks: list[int] | None = None
    mpi_comm: object = None  # Horovod's communicator: never one here

    def __init__(self, ranks_or_comm: Sequence[int]) -> None:
        if isinstance(ranks_or_comm, (str, bytes)) or not hasattr(ranks_or_comm, "__iter__"):
            raise ValueError(
                "ProcessSet takes a list of world ranks here (a process set made from an MPI "
                "communicator is not supported by dataparallel: pass comm's world ranks)."
            )
        ranks = sorted(ranks_or_comm)
        if any(not isinstance(r, int) for r in ranks):
            raise ValueError("ProcessSet should be initialized with a list of process ranks.")
        self.ranks = ranks
        self._group: groups.Group | None = None

    def _invalidate(self) -> None:
        self.process_set_id = None
        self._group = None

    def size(self) -> int | None:
        """Return the number of processes in the set, or None when it is not registered."""
        if self.process_set_id is None:
            return None
        return len(self.ranks or ()) if self.process_set_id else world.size()

    def rank(self) -> int | None:
        """Return this process's rank in the set (None when not registered or not included).

        Collectives take world ranks as roots, as in Horovod; this is the position in the set.
        """
        if self.process_set_id is None or not self.included():
            return None
        return (self.ranks or []).index(world.rank()) if self.process_set_id else world.rank()

    def included(self) -> bool | None:
        """Return whether this process is in the set (None when the set has no ranks yet).

        The global set holds every rank of the world, however the world was made: after
        `dp.initialize()` without `hvd.init()` too (its `ranks` are filled in by `hvd.init()`).
        """
        if self.process_set_id == 0:
            return True
        if self.ranks is None:
            return None
        return world.rank() in self.ranks

    def __str__(self) -> str:
        return (
            f"ProcessSet(process_set_id={self.process_set_id}, ranks={self.ranks}, mpi_comm=None)"
        )

    __repr__ = __str__


global_process_set = ProcessSet([])
global_process_set.process_set_id = 0

_registered: dict[int, ProcessSet] = {}
_ids = itertools.count(1)


@caches.register
def reset_process_sets() -> None:
    """Forget every process set but the global one (`init()` and `shutdown()` call this)."""
    for ps in _registered.values():
        if ps._group is not None:
            ps._group.free()
        ps._invalidate()
    _registered.clear()
    global_process_set.process_set_id = 0
    global_process_set.ranks = list(range(world.size())) if world.initialized() else []


def add_process_set(process_set: ProcessSet | Sequence[int]) -> ProcessSet:
    """Register a process set and return it (collective: every process calls it alike).

    Raises:
        ValueError: a process set of the same ranks exists already.
    """
    require_init()
    if not isinstance(process_set, ProcessSet):
        process_set = ProcessSet(process_set)
    ranks = list(process_set.ranks or [])
    # A checked collective first (`new_group` exchanges the ranks unchecked): a process that is
    # not making this call with the others fails it with them instead of mixing messages.
    every = objects.allgather_object(("add_process_set", ranks))
    if any(other != every[0] for other in every):
        raise ValueError(f"Processes added different process sets: {[r for _, r in every]}.")
    existing = [global_process_set.ranks, *(ps.ranks for ps in _registered.values())]
    if ranks in existing:
        raise ValueError(f"Attempted to add a duplicate process set: {process_set}")
    process_set._group = groups.new_group(ranks)
    process_set.process_set_id = next(_ids)
    _registered[process_set.process_set_id] = process_set
    return process_set


def remove_process_set(process_set: ProcessSet) -> bool:
    """Unregister a process set and free its group; return whether it was registered."""
    set_id = process_set.process_set_id
    if set_id is None or set_id == 0 or _registered.get(set_id) is not process_set:
        return False
    del _registered[set_id]
    if process_set._group is not None:
        process_set._group.free()
    process_set._invalidate()
    return True


def group_of(process_set: ProcessSet) -> groups.Group | None:
    """Return the set's group for `group=` (None: the global set, the world).

    Raises:
        ValueError: the set is not registered.
    """
    if process_set.process_set_id == 0:
        return None
    group = process_set._group
    if process_set.process_set_id is None or group is None:
        raise ValueError(f"{process_set} is not registered: call hvd.add_process_set first.")
    return group


def root_in(process_set: ProcessSet, root_rank: int) -> int:
    """Translate the world rank `root_rank` to its rank in the set."""
    if process_set.process_set_id == 0:
        return root_rank
    ranks = process_set.ranks or []
    if root_rank not in ranks:
        raise ValueError(
            f"root_rank={root_rank} is not in {process_set}: give the world rank of one of its "
            "processes."
        )
    return ranks.index(root_rank)

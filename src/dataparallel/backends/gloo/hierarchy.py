"""Hierarchical allreduce over Gloo: inside each host, across hosts, inside each host again.

Gloo's allreduce is a ring over every rank: with ranks numbered by host, each of the ring's edges
between hosts carries 2(n-1)/n of the message (1.5 of it at 2 hosts of 2 ranks), and more when the
hosts alternate. Reduced in three steps instead, one message crosses between hosts, whatever the
numbering: the ranks of a host reduce-scatter the buffer among themselves, each local rank
allreduces its slice with the ranks of the same local rank on the other hosts, and the slices are
gathered inside each host again (Horovod's `HOROVOD_HIERARCHICAL_ALLREDUCE`; MPICH's own
`MPI_Allreduce` composes the same way, so the MPI backend needs none of this: docs/network.md).

`Hierarchy.build` decides (collective, once per world): `DATAPARALLEL_HIERARCHICAL=1/0` forces it
on or off; unset, it is on only where the world spans hosts of several ranks each *and* the hosts
interleave in rank order (as a round-robin placement gives): the ring then crosses between hosts
at nearly every edge, twice the bytes of ranks numbered host by host. Numbered host by host, as
every launcher of this package, mpiexec and Slurm's block placement give, the ring already
crosses only at the hosts' boundaries, and the three steps, each a rendezvous of its own, cost
more than the third of the bytes they save except on a slow link, where they merely tie
(docs/network.md has the figures by size and link). Every host must hold the same number of
ranks; otherwise the flat ring stays. Buffers under `MIN_BYTES` stay flat too.
"""

from __future__ import annotations

from collections.abc import Callable
from types import ModuleType
from typing import TYPE_CHECKING, Any, Protocol

if TYPE_CHECKING:
    import torch
    from torch.distributed import ProcessGroup

    from dataparallel.config import Settings

# How a hierarchy makes each of its groups: torch's ranks -> the group and its connections.
MakeGroup = Callable[[list[int]], tuple[Any, set[str]]]

__all__ = ["MIN_BYTES", "Hierarchy", "Steps", "interleaved"]

# Below this a buffer takes the flat ring: the three steps' latency outweighs what they save,
# even where the hosts interleave across a slow link.
MIN_BYTES = 1 << 20


def interleaved(hosts: list[str]) -> bool:
    """Whether some host's ranks are not consecutive in rank order (`hosts[r]`: rank r's host),
    so that the ring crosses between hosts more often than there are hosts."""
    changes = sum(a != b for a, b in zip(hosts, hosts[1:] + hosts[:1], strict=True))
    return changes > len(set(hosts))


class _Work(Protocol):
    """A started torch collective (`torch.distributed.Work`)."""

    def is_completed(self) -> bool: ...

    def wait(self) -> object: ...


class Steps:
    """The three steps of one hierarchical allreduce, as one torch work object: each step starts
    when the one before completed (`is_completed` advances without blocking; `wait` blocks).

    One after the other, not pipelined over pieces of the buffer: pieces whose step across
    hosts ran while the next piece's step inside the host did came back wrong (benchmarks/
    NOTES.md, "Hierarchy across two emulated hosts"), though each step alone is right."""

    def __init__(self, steps: list[Callable[[], _Work]], finish: Callable[[], None] | None) -> None:
        self._steps, self._finish = steps, finish
        self._work: _Work | None = self._steps.pop(0)()

    def is_completed(self) -> bool:
        while self._work is not None and self._work.is_completed():
            self._advance()
        return self._work is None

    def wait(self) -> bool:
        while self._work is not None:
            self._advance()
        return True

    def _advance(self) -> None:
        assert self._work is not None  # (called while a step is in flight)
        self._work.wait()  # raises the step's own error, if it failed
        if self._steps:
            self._work = self._steps.pop(0)()
            return
        self._work = None
        if self._finish is not None:
            self._finish()
            self._finish = None


class Hierarchy:
    """This rank's two Gloo groups: the ranks of its host (`local`), and the ranks of the same
    local rank on every host (`across`)."""

    def __init__(self, dist: ModuleType, make: MakeGroup, hosts: list[str], rank: int) -> None:
        """Make the groups of a world whose rank `r` lives on host `hosts[r]` by `make(ranks)`
        (the engine's way: `GlooBackend._new_group`; collective over torch's default group,
        which this world must be: every rank makes every group, in the same order). Every
        host holds the same number of ranks."""
        self._dist, self._make, self.hosts, self.rank = dist, make, hosts, rank
        labels = list(dict.fromkeys(hosts))  # in order of first rank
        members = [[r for r, h in enumerate(hosts) if h == label] for label in labels]
        self.local_size = len(members[0])
        made: set[str] = set()

        def group(ranks: list[int]) -> ProcessGroup:
            formed, sockets = make(ranks)
            made.update(sockets)
            return formed

        local_groups = [group(m) for m in members]
        across_groups = [group([m[i] for m in members]) for i in range(self.local_size)]
        self.sockets = frozenset(made)  # the groups' connections (`GlooBackend.sever`)
        host = labels.index(hosts[rank])
        self.local_rank = members[host].index(rank)
        self.local, self.across = local_groups[host], across_groups[self.local_rank]

    @classmethod
    def build(
        cls, dist: ModuleType, make: MakeGroup, hosts: list[str], rank: int, settings: Settings
    ) -> Hierarchy | None:
        """Return the hierarchy of a world whose rank `r` lives on host `hosts[r]` (any label
        the ranks agree on), or None where the flat ring stays (collective, as the groups)."""
        forced = settings.hierarchical
        counts = [hosts.count(h) for h in dict.fromkeys(hosts)]
        spans = len(counts) > 1 and max(counts) > 1
        if forced is False or (forced is None and not (spans and interleaved(hosts))):
            return None
        if len(set(counts)) != 1:
            if forced:
                raise ValueError(
                    "DATAPARALLEL_HIERARCHICAL=1 needs the same number of ranks on every host; "
                    f"the hosts hold {sorted(counts)}: unset it for the flat ring."
                )
            return None
        return cls(dist, make, hosts, rank)

    def duplicate(self) -> Hierarchy:
        """The same hierarchy on groups of its own (collective): for an engine of the same
        processes used from another thread, whose calls must not meet these groups' calls."""
        return Hierarchy(self._dist, self._make, self.hosts, self.rank)

    def start(self, tensor: torch.Tensor, op: object) -> Steps:
        """Start the three steps on the contiguous 1-D `tensor`, reduced in place."""
        import torch

        n, parts = tensor.numel(), self.local_size
        slice_len = -(-n // parts)
        whole = tensor
        finish: Callable[[], None] | None = None
        if slice_len * parts != n:  # padded: the pad's values are reduced and never read
            whole = torch.zeros(slice_len * parts, dtype=tensor.dtype)
            whole[:n].copy_(tensor)

            def finish() -> None:
                tensor.copy_(whole[:n])

        mine = torch.empty(slice_len, dtype=tensor.dtype)
        dist, local, across = self._dist, self.local, self.across
        scatter = getattr(dist, "reduce_scatter_single", None) or dist.reduce_scatter_tensor
        gather = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor
        steps: list[Callable[[], _Work]] = [
            lambda: scatter(mine, whole, op=op, group=local, async_op=True),
            lambda: dist.all_reduce(mine, op=op, group=across, async_op=True),
            lambda: gather(whole, mine, group=local, async_op=True),
        ]
        return Steps(steps, finish)

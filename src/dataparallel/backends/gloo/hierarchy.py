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
crosses only at the hosts' boundaries, and on a fast link the three steps, each a meeting of
ranks of its own, cost more than the third of the bytes they save; across a slow link they pay,
but nothing here knows the link's speed: `DATAPARALLEL_HIERARCHICAL=1` turns them on there
(docs/network.md has the figures by size and link). Every host must hold the same number of
ranks; otherwise the flat ring stays. Buffers under `MIN_BYTES` stay flat too. A world on one
host is a hierarchy too, unless told otherwise, where its ranks share memory: its steps inside
the host, through that memory, are the whole allreduce (`Hierarchy._on_one_host`).

Inside a host the steps go through shared memory where the host's ranks share it (`shared.py`:
each rank's buffer written once into a file its peers map, a word per step through a bell
beside them: `bells.py`), else by point-to-point sends over the host's group; either way each
slice is folded in the same order, so the results are the same bits.
"""

from __future__ import annotations

import contextlib
import queue
import threading
from collections import deque
from collections.abc import Callable
from types import ModuleType
from typing import TYPE_CHECKING, Any, Protocol

from dataparallel.backends.gloo import bells
from dataparallel.backends.gloo.bells import SAID_REDUCED, SAID_WRITTEN, Bells
from dataparallel.backends.gloo.shared import SHARED_DIR, SLOTS, SharedSlots

if TYPE_CHECKING:
    import torch
    from torch.distributed import ProcessGroup

    from dataparallel.config import Settings

# How a hierarchy makes each of its groups: torch's ranks -> the group and its connections.
MakeGroup = Callable[[list[int]], tuple[Any, set[str]]]

__all__ = ["IN_FLIGHT", "MIN_BYTES", "Carried", "Hierarchy", "interleaved"]

# Below this a buffer takes the flat ring: the three steps' latency outweighs what they save,
# even where the hosts interleave across a slow link.
MIN_BYTES = 1 << 20
# Calls a step leaves in the lanes before landing the oldest (`GlooBackend.calls_in_flight`): a
# model's buckets on the communication thread (`torch._buckets.THREAD_BUCKETS`), so that the
# lanes hold a whole step's and the memory held stays a few buckets'.
IN_FLIGHT = 8


def interleaved(hosts: list[str]) -> bool:
    """Whether some host's ranks are not consecutive in rank order (`hosts[r]`: rank r's host),
    so that the ring crosses between hosts more often than there are hosts."""
    changes = sum(a != b for a, b in zip(hosts, hosts[1:] + hosts[:1], strict=True))
    return changes > len(set(hosts))


class _Work(Protocol):
    """A started torch collective or point-to-point call (`torch.distributed.Work`)."""

    def wait(self) -> object: ...


class Carried:
    """One hierarchical allreduce in flight, as a torch work object for the engine's handle:
    `is_completed` says without blocking whether the lanes have written its result, `wait`
    blocks until they have and raises what a step of it raised."""

    __slots__ = ("ended", "error", "generations", "op", "ringed", "seq", "tensor", "work")

    def __init__(self, tensor: torch.Tensor, op: object, seq: int) -> None:
        self.tensor, self.op, self.seq = tensor, op, seq
        self.work: _Work | None = None  # the step across hosts, once started
        # Each local rank's file for this call (`SharedSlots`), where it goes through them
        self.generations: list[int] | None = None
        # Reduced whole by Gloo's ring on the host's group: one host where no file could be had
        self.ringed = False
        self.error: BaseException | None = None
        self.ended = threading.Event()  # set once the lanes are done with it, failed or not

    def is_completed(self) -> bool:
        return self.ended.is_set()

    def wait(self) -> bool:
        self.ended.wait()
        if self.error is not None:
            raise self.error
        return True

    def fail(self, error: BaseException) -> None:
        self.error = error
        self.ended.set()

    def done(self) -> None:
        self.ended.set()


class Hierarchy:
    """This rank's two Gloo groups: the ranks of its host (`local`), and the ranks of the same
    local rank on every host (`across`)."""

    def __init__(
        self,
        dist: ModuleType,
        make: MakeGroup,
        hosts: list[str],
        rank: int,
        timeout: float | None = None,
    ) -> None:
        """Make the groups of a world whose rank `r` lives on host `hosts[r]` by `make(ranks)`
        (the engine's way: `GlooBackend._new_group`; collective over torch's default group,
        which this world must be: every rank makes every group, in the same order). Every
        host holds the same number of ranks. `timeout`: seconds a step inside the host waits
        for a peer's word (None: torch's default for its groups)."""
        self._dist, self._make, self.hosts, self.rank = dist, make, hosts, rank
        default = getattr(dist, "default_pg_timeout", None)  # a timedelta
        if timeout is None and default is not None:
            timeout = default.total_seconds()
        self._timeout = timeout
        labels = list(dict.fromkeys(hosts))  # in order of first rank
        members = [[r for r, h in enumerate(hosts) if h == label] for label in labels]
        self.local_size = len(members[0])
        made: set[str] = set()

        def group(ranks: list[int]) -> ProcessGroup:
            formed, sockets = make(ranks)
            made.update(sockets)
            return formed

        local_groups = [group(m) for m in members]
        across = range(self.local_size if len(members) > 1 else 0)  # none on one host
        across_groups = [group([m[i] for m in members]) for i in across]
        self.sockets = frozenset(made)  # the groups' connections (`GlooBackend.sever`)
        host = labels.index(hosts[rank])
        self.local_rank = members[host].index(rank)
        self.local = local_groups[host]
        self.across = across_groups[self.local_rank] if across_groups else None
        self._groups = [g for g in (self.local, self.across) if g is not None]  # `close`'s
        self._peers = members[host]  # the global ranks of this host, by local rank
        # Where the host's ranks share memory, the steps inside it go through it (`shared.py`),
        # their words through bells (`bells.py`): both, or neither
        self._shared = (
            SharedSlots.join(dist, self.local, self._peers[0], self.local_rank)
            if self.local_size > 1 and bells.available()
            else None
        )
        self._bells: Bells | None = None
        if self._shared is not None:
            self._bells = Bells.join(
                dist,
                self.local,
                str(SHARED_DIR / self._shared.prefix),
                self.local_rank,
                self.local_size,
                SLOTS,
            )
            if self._bells is None:
                self._shared.close()
                self._shared = None
        # The first lane's last calls, ended or not: their events only, not their buffers
        self._recent: deque[threading.Event] = deque(maxlen=SLOTS - 1)
        # The two lanes (`start`): started with the first call, ended by `close`.
        self._inside: queue.SimpleQueue[Carried | None] = queue.SimpleQueue()
        self._outside: queue.SimpleQueue[Carried | None] = queue.SimpleQueue()
        self._lanes: list[threading.Thread] = []
        self._seq = 0
        self._broken: BaseException | None = None

    @classmethod
    def build(
        cls, dist: ModuleType, make: MakeGroup, hosts: list[str], rank: int, settings: Settings
    ) -> Hierarchy | None:
        """Return the hierarchy of a world whose rank `r` lives on host `hosts[r]` (any label
        the ranks agree on), or None where the flat ring stays (collective, as the groups)."""
        forced = settings.hierarchical
        counts = [hosts.count(h) for h in dict.fromkeys(hosts)]
        if forced is not False and len(counts) == 1 and counts[0] > 1:
            return cls._on_one_host(dist, make, hosts, rank, settings)
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
        return cls(dist, make, hosts, rank, settings.timeout)

    @classmethod
    def _on_one_host(
        cls, dist: ModuleType, make: MakeGroup, hosts: list[str], rank: int, settings: Settings
    ) -> Hierarchy | None:
        """A world on one host: its steps inside the host are the whole allreduce, and through
        shared memory they copy each buffer once in and once out, where Gloo's ring sends it
        through the kernel's sockets (twice the copies, and a wake-up per segment). Kept where
        the ranks share memory or `DATAPARALLEL_HIERARCHICAL=1` asks for the steps anyway;
        otherwise the ring, which the steps by sends would only slow."""
        made = cls(dist, make, hosts, rank, settings.timeout)
        if made.shares_memory or settings.hierarchical:
            return made
        made.close()
        return None

    def duplicate(self) -> Hierarchy:
        """The same hierarchy on groups of its own (collective): for an engine of the same
        processes used from another thread, whose calls must not meet these groups' calls."""
        return Hierarchy(self._dist, self._make, self.hosts, self.rank, self._timeout)

    def start(self, tensor: torch.Tensor, op: object) -> Carried:
        """Start the three steps on the contiguous 1-D `tensor`, reduced in place.

        Two threads of this hierarchy's own (lanes) carry them, so that they move on while the
        caller computes and one call's step across hosts overlaps the next call's step inside
        the host: the first lane reduce-scatters inside the host and starts the step across,
        calls in the order they were started (so every member of the group across starts them
        in the same order); the second waits for the step across and gathers inside the host.
        Inside the host the steps are point-to-point sends tagged with the call's number, so the
        two lanes' messages never meet whatever the threads' timing. Gloo's own reduce-scatter
        is an allreduce of the whole buffer (twice the bytes, a copy), and its work object never
        reports completion: sends are the reduce-scatter the steps need."""
        carried = Carried(tensor, op, self._seq)
        self._seq += 1
        if not self._lanes:
            for name, loop in (("inside", self._scatter_loop), ("outside", self._gather_loop)):
                lane = threading.Thread(
                    target=loop, name=f"dataparallel-hierarchy-{name}", daemon=True
                )
                lane.start()
                self._lanes.append(lane)
        self._inside.put(carried)
        return carried

    @property
    def spans_hosts(self) -> bool:
        """Whether the world spans several hosts: a step across them follows the steps inside."""
        return self.across is not None

    @property
    def shares_memory(self) -> bool:
        """Whether the steps inside the host go through shared memory (`shared.py`)."""
        return self._shared is not None

    def close(self) -> None:
        """End the lanes once the calls queued before are done, and wait for them, then destroy
        this rank's groups, as the engine destroys its own, and remove the host's shared memory
        files. Safe to call twice; on a broken world, after the engine's `sever` (the lanes'
        calls then fail at once).

        A lane must have ended before the interpreter finalizes: one that only drops its last
        call then (its tensor, whose freeing lets the GIL go and takes it back) is ended by
        CPython inside torch's destructor, which aborts the process ("terminate called without
        an active exception"; `world._finalize_at_exit`)."""
        lanes, self._lanes = self._lanes, []
        if lanes:
            self._inside.put(None)
            for lane in lanes:
                lane.join()
        if self._groups:
            for group in self._groups:
                with contextlib.suppress(ValueError, RuntimeError):  # gone with torch's default
                    self._dist.destroy_process_group(group)
            self._groups = []
        if self._bells is not None:
            self._bells.close()
        if self._shared is not None:
            self._shared.close()

    def _bounds(self, n: int) -> list[int]:
        """Where each local rank's slice of an `n`-element buffer begins, and the end."""
        return [n * i // self.local_size for i in range(self.local_size + 1)]

    def _tag(self, carried: Carried, step: int) -> int:
        """The tag of a call's sends inside the host: its number and the step (0 or 1)."""
        return (carried.seq % (1 << 29)) * 2 + step

    # Each part is looked up at each call, so that one replaced on the class (a benchmark's
    # timing, benchmarks/hierarchy.py --phases) takes effect in lanes already running.
    def _scatter_loop(self) -> None:
        self._carry(self._inside, lambda carried: self.scatter(carried), self._outside.put)
        self._outside.put(None)  # the second lane ends after the calls passed on

    def _gather_loop(self) -> None:
        self._carry(self._outside, lambda carried: self.gather(carried), Carried.done)

    def _carry(
        self,
        calls: queue.SimpleQueue[Carried | None],
        part: Callable[[Carried], None],
        then: Callable[[Carried], object],
    ) -> None:
        """A lane: each call from `calls` through this lane's `part`, then `then`, until None.
        Once a part failed, every later call fails with that error: the calls no longer line up
        across ranks."""
        while (carried := calls.get()) is not None:
            try:
                if self._broken is not None:
                    raise self._broken
                part(carried)
            except BaseException as error:
                if self._broken is None and self._shared is not None:
                    self._shared.remove_all()  # with what a peer that died left, if one did
                self._broken = self._broken or error
                carried.fail(error)
                continue
            then(carried)

    def scatter(self, carried: Carried) -> None:
        """The first lane's part of a call: this rank's slice reduced inside the host (through
        shared memory where the host's ranks share it, else by sends: `_scatter_by_sends`),
        then the step across hosts started on it. A call for which a rank of the host could
        have no file (/dev/shm full) takes the sends, or on a lone host Gloo's ring over the
        host's group, which the sends would only slow.

        Through shared memory: this rank writes the parts of the buffer its peers reduce into
        its file for the call's slot and says so to each peer (a word through its bell, which
        also tells them the file's generation); once every peer has said so, it folds each
        peer's copy of its slice into its own, in local rank order, as the sends do. A slot's
        file is written again `SLOTS` calls later, and only once this rank's second lane has
        ended the call `SLOTS - 1` back: every peer waits so before its word for a call, so
        their words for the call before say that they ended the call that last used the slot,
        and none still reads what is written over."""
        shared, me = self._shared, self.local_rank
        if shared is not None:
            if len(self._recent) == self._recent.maxlen:
                self._recent[0].wait()
            self._recent.append(carried.ended)
            tensor = carried.tensor
            slot = carried.seq % SLOTS
            nbytes = tensor.numel() * tensor.element_size()
            generation = shared.offer(slot, nbytes)
            bounds = self._bounds(tensor.numel())
            if generation >= 0:
                mine = _typed(shared.own(slot), tensor)
                for j in range(self.local_size):
                    if j != me:
                        mine[bounds[j] : bounds[j + 1]].copy_(tensor[bounds[j] : bounds[j + 1]])
            generations = self._meet(carried, SAID_WRITTEN, generation)
            if min(generations) >= 0:
                carried.generations = generations
                own = tensor[bounds[me] : bounds[me + 1]]
                combine = _combiner(self._dist, carried.op)
                for j, g in enumerate(generations):
                    if j != me:
                        theirs = _typed(shared.peer(j, slot, g), tensor)
                        combine(own, theirs[bounds[me] : bounds[me + 1]])
                self._start_across(carried, own)
                return
            if not self.spans_hosts:  # the host is the world: its ring beats the sends
                carried.work = self._dist.all_reduce(
                    tensor, op=carried.op, group=self.local, async_op=True
                )
                carried.ringed = True
                return
        self._scatter_by_sends(carried)

    def _scatter_by_sends(self, carried: Carried) -> None:
        """The first lane's part by sends: each peer's slice sent to it, theirs of this rank's
        received and combined in local rank order, the step across started."""
        import torch

        tensor, dist, me = carried.tensor, self._dist, self.local_rank
        bounds = self._bounds(tensor.numel())
        mine = tensor[bounds[me] : bounds[me + 1]]
        tag = self._tag(carried, _SCATTER)
        sends, received = [], []
        for j, peer in enumerate(self._peers):
            if j == me:
                continue
            part = tensor[bounds[j] : bounds[j + 1]]
            sends.append(dist.isend(part, dst=peer, group=self.local, tag=tag))
            theirs = torch.empty_like(mine)
            received.append((dist.irecv(theirs, src=peer, group=self.local, tag=tag), theirs))
        combine = _combiner(dist, carried.op)
        for work, theirs in received:
            work.wait()
            combine(mine, theirs)
        for work in sends:  # the gather writes over what they send
            work.wait()
        self._start_across(carried, mine)

    def _start_across(self, carried: Carried, mine: torch.Tensor) -> None:
        if self.across is not None:
            carried.work = self._dist.all_reduce(
                mine, op=carried.op, group=self.across, async_op=True
            )

    def gather(self, carried: Carried) -> None:
        """The second lane's part: wait for the step across, then share the slices inside the
        host: through shared memory where the first lane went through it (this rank's slice
        written into its own file, where no peer reads any more, a word to each peer, and each
        peer's slice copied from its file), else by sends, each received into its place."""
        if carried.work is not None:
            carried.work.wait()
            carried.work = None
        if carried.ringed:
            return
        tensor, dist, me = carried.tensor, self._dist, self.local_rank
        bounds = self._bounds(tensor.numel())
        mine = tensor[bounds[me] : bounds[me + 1]]
        shared, generations = self._shared, carried.generations
        if shared is not None and generations is not None:
            slot = carried.seq % SLOTS
            _typed(shared.own(slot), tensor)[bounds[me] : bounds[me + 1]].copy_(mine)
            self._meet(carried, SAID_REDUCED, 0)
            for j, g in enumerate(generations):
                if j != me:
                    theirs = _typed(shared.peer(j, slot, g), tensor)
                    tensor[bounds[j] : bounds[j + 1]].copy_(theirs[bounds[j] : bounds[j + 1]])
            shared.settle(slot)  # every peer has mapped this rank's file: its name can go
            return
        tag = self._tag(carried, _GATHER)
        works = []
        for j, peer in enumerate(self._peers):
            if j == me:
                continue
            works.append(dist.isend(mine, dst=peer, group=self.local, tag=tag))
            place = tensor[bounds[j] : bounds[j + 1]]
            works.append(dist.irecv(place, src=peer, group=self.local, tag=tag))
        for work in works:
            work.wait()

    def _meet(self, carried: Carried, word: int, said: int) -> list[int]:
        """Say `word` of this call to every peer of the host through the bells, with `said`,
        and return what each local rank said with it (this rank's own in its place), once all
        have: a step's "done", whose failures end the wait as a Gloo call's would."""
        assert self._bells is not None  # the steps through shared memory have bells
        self._bells.say(word, carried.seq, said)
        words = [said] * self.local_size
        for j, theirs in self._bells.hear(word, carried.seq, self._timeout).items():
            words[j] = theirs
        return words

    def sever(self) -> None:
        """End the waits on the host's words, here and at the peers (`GlooBackend.sever`: the
        groups' connections are shut down beside)."""
        if self._bells is not None:
            self._bells.sever()


# A call's messages inside the host by sends, each its own tag (`Hierarchy._tag`): the slices
# sent, the reduced slices sent back.
_SCATTER, _GATHER = 0, 1


def _typed(raw: torch.Tensor, like: torch.Tensor) -> torch.Tensor:
    """The first bytes of a shared file, as a 1-D tensor of `like`'s dtype and length."""
    return raw[: like.numel() * like.element_size()].view(like.dtype)


def _combiner(dist: ModuleType, op: object) -> Callable[[torch.Tensor, torch.Tensor], object]:
    """How the step inside the host folds a peer's slice into this rank's, for torch's `op`."""
    import torch

    if op == dist.ReduceOp.SUM:
        return torch.Tensor.add_
    if op == dist.ReduceOp.PRODUCT:
        return torch.Tensor.mul_
    if op == dist.ReduceOp.MIN:
        return lambda mine, theirs: torch.minimum(mine, theirs, out=mine)
    if op == dist.ReduceOp.MAX:
        return lambda mine, theirs: torch.maximum(mine, theirs, out=mine)
    raise ValueError(f"the hierarchy reduces no {op!r}")

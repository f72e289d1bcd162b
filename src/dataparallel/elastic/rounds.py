"""Rounds: how the workers of an elastic run meet, in the store that `dataparallel run` holds.

The launcher (`launch/spawn.py`) owns a TCP store that outlives every worker. Each time the
membership changes (a worker died, discovery reported new slots) it opens a new *round*: it writes
the round's members, in rank order, under `round/G`, then `latest = G`. Rounds are numbered
0, 1, 2, ... without gaps. A worker joins a round by:

1. waiting for a round newer than the one it had (`round/G` appears);
2. reading the newest, `latest`, and finding its rank there (its position in the members);
3. arriving (`round/G/arrived` counts up); the last to arrive marks the round `ready` as
   formed, unless the launcher marked it superseded first (a member died before it formed, and
   a newer round opened): then back to 2 with the newer round;
4. making torch's default Gloo group of the round, under the key prefix `round/G/group/`,
   so groups of different rounds never see each other's keys.

A worker left out of the newest round because discovery reported fewer slots finds the key
`removed/ID` (the launcher writes it first) and leaves the run with status 0 (`WorkerRemoved`).

`dp.initialize()` then makes the library's world over that group (`backends/registry.choose`).
A member lost meanwhile fails that too; `rejoin` (which `dataparallel run`'s runner gives
`dp.initialize` through `world.on_lost_member`) then leaves the round and joins the next, so a
world forms in the end whenever the launcher forms one, the first one included.

A worker that can join no round (none opened within the timeout, or the launcher left it out)
raises `NoWorldError`, which `elastic.run` does not catch: waiting again would wait for ever.
"""

from __future__ import annotations

import contextlib
import datetime
import functools
import json
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING

from dataparallel.backends.gloo.group import Connects, gloo_group
from dataparallel.backends.rendezvous import interface_toward
from dataparallel.config import Settings, connect_limit
from dataparallel.elastic import liveness
from dataparallel.elastic.forming import round_key, unreached, watching
from dataparallel.errors import DataParallelError, LinkLostError, RankFailedError, library_error

if TYPE_CHECKING:
    from torch.distributed import Store

__all__ = [
    "LATEST",
    "NoWorldError",
    "Round",
    "WorkerRemoved",
    "arrived_key",
    "connect",
    "current",
    "formed",
    "join",
    "leave",
    "newest",
    "publish",
    "ready_key",
    "rejoin",
    "removed_key",
    "report_split",
    "supersede",
]

LATEST = "latest"
# The value of a round's `ready` key: every member arrived, or the launcher opened a newer one
# first (a member died before the round formed). Whichever is written first stays.
FORMED, SUPERSEDED = "formed", "superseded"


def arrived_key(generation: int) -> str:
    return f"round/{generation}/arrived"


def ready_key(generation: int) -> str:
    return f"round/{generation}/ready"


def removed_key(worker: str) -> str:
    """The key the launcher sets before it leaves `worker` out of the next round (its slot was
    removed: the discovery script reports fewer slots)."""
    return f"removed/{worker}"


class NoWorldError(DataParallelError, RuntimeError):
    """This worker can join no world: the launcher opened no round for it within
    `DATAPARALLEL_ELASTIC_TIMEOUT` seconds, or left it out of the newest one.

    Not a `RankFailedError`, so `elastic.run` lets it through: the worker ends, with status 1.
    """


class WorkerRemoved(SystemExit):
    """This worker's slot was removed (discovery reports fewer slots): it leaves the run.

    Raised by `join` (so by `elastic.run` at the commit where the others re-form); a
    `SystemExit` with status 0, so the process ends cleanly unless the script catches it.
    Horovod's workers on a removed host stop the same way.
    """

    def __init__(self, worker: str, generation: int) -> None:
        super().__init__(0)
        self.worker, self.generation = worker, generation

    def __str__(self) -> str:
        return (
            f"worker {self.worker} was removed from the run (the host discovery script reports "
            f"fewer slots; round {self.generation} goes on without it): leaving with status 0."
        )


@dataclass(frozen=True)
class Round:
    """One world of an elastic run: its number, its members in rank order, and this worker."""

    generation: int
    members: tuple[str, ...]
    me: str

    @property
    def rank(self) -> int:
        return self.members.index(self.me)

    @property
    def size(self) -> int:
        return len(self.members)


_client: Store | None = (
    None  # the worker's connection to the launcher's store, for the process's life
)
_current: Round | None = None  # the round this worker joined last (its membership, not a world)
_watched: Store | None = None  # the store of the round's group (Python: torch calls back into it)


def current() -> Round | None:
    """Return the round this worker joined last, or None outside an elastic run."""
    return _current


def connect(settings: Settings) -> Store:
    """Return this worker's client of the launcher's store (made once per process)."""
    global _client
    if _client is None:
        from dataparallel.backends.gloo.group import import_torch_distributed

        dist = import_torch_distributed()
        assert settings.elastic_store is not None
        host, port = settings.elastic_store
        _client = dist.TCPStore(
            host,
            port,
            is_master=False,
            timeout=datetime.timedelta(seconds=settings.elastic_timeout),
            wait_for_workers=False,
        )
    return _client


def newest(store: Store) -> int:
    """Return the newest round's number."""
    return int(store.get(LATEST))


def _exists(store: Store, key: str, wait: datetime.timedelta) -> bool:
    try:
        store.wait([key], wait)
    except RuntimeError:  # torch raises a plain RuntimeError (DistStoreError) on timeout
        return False
    return True


def join(after: int, settings: Settings | None = None) -> Round:
    """Join the first round newer than `after` that forms, and make torch's default group of it.

    Raises:
        NoWorldError: no round formed within `DATAPARALLEL_ELASTIC_TIMEOUT` seconds (the
            launcher ends such a run itself; this is the worker's own guard), or the launcher
            left this worker out of the newest round (it was lost to the launcher).
        WorkerRemoved: the launcher removed this worker's slot (status 0: it ends the process).
    """
    global _current
    settings = settings if settings is not None else Settings.from_env()
    if settings.elastic_store is None or settings.elastic_worker is None:
        raise RuntimeError(
            "dataparallel.elastic needs a worker of `dataparallel run --min-np M ...` (the "
            "launcher's store and this worker's id are not in the environment)."
        )
    store = connect(settings)
    deadline = time.monotonic() + settings.elastic_timeout
    if not _exists(store, round_key(after + 1), _left(deadline)):
        raise NoWorldError(
            f"no new world formed within {settings.elastic_timeout:g} s after round {after} "
            "(DATAPARALLEL_ELASTIC_TIMEOUT): the launcher did not re-form the run."
        )
    while True:
        generation = max(newest(store), after + 1)  # `latest` is written after the round
        members = tuple(json.loads(store.get(round_key(generation))))
        me = settings.elastic_worker
        if me not in members and store.check([removed_key(me)]):
            removed = WorkerRemoved(me, generation)
            print(f"dataparallel: {removed}", file=sys.stderr, flush=True)
            raise removed
        if me not in members:
            raise NoWorldError(
                f"worker {me} is not a member of round {generation} ({', '.join(members)}): "
                "the launcher left it out."
            )
        if store.add(arrived_key(generation), 1) == len(members):
            store.compare_set(ready_key(generation), "", FORMED)
        if not _exists(store, ready_key(generation), _left(deadline)):
            raise NoWorldError(
                f"round {generation} did not form within {settings.elastic_timeout:g} s: not "
                f"every member of {', '.join(members)} arrived."
            )
        if store.get(ready_key(generation)) == FORMED.encode():
            chosen = Round(generation, members, me)
            try:
                with liveness.changing_world():
                    _make_group(store, chosen, settings)
                    _current = chosen
            except RuntimeError as exc:  # a member died, or is out of reach (`_unconnected`)
                leave()
                if isinstance(exc, NoWorldError):  # every member answers: no round would help
                    raise
                if not _exists(store, round_key(generation + 1), _left(deadline)):
                    raise NoWorldError(
                        f"round {generation}'s Gloo group did not form: {exc}"
                    ) from exc
            else:
                liveness.watch(settings, generation, _world, store)
                return chosen
        after = generation  # a member died before it formed: the launcher opened a newer one


def _world() -> tuple[int, tuple[str, ...]]:
    return (-1, ()) if _current is None else (_current.generation, _current.members)


def rejoin(error: BaseException, leave_world: Callable[[], None] | None = None) -> None:
    """Leave the world (`leave_world`, where there is one) and the round whose world, or a
    group over it, could not form (`error`: a member was lost meanwhile), and join the next
    round. A lost member shows as a `RankFailedError` or as torch's own `RuntimeError` (a
    connection refused or closed); any other error (a mismatch, a bad argument, an interrupt)
    is raised as it is, and nothing is left.

    `dp.initialize` and `world.form` call this (`world.on_lost_member`) and then try again.

    Raises:
        NoWorldError, WorkerRemoved: as `join`.
    """
    joined = _current
    lost = isinstance(error, RankFailedError) or not isinstance(error, DataParallelError)
    if joined is None or not isinstance(error, RuntimeError) or not lost:
        raise error
    report_split(error)
    if leave_world is not None:
        leave_world()
    leave()
    join(joined.generation)


def report_split(error: BaseException) -> None:
    """Tell the launcher that this worker's world broke on a peer it lost by its link
    (`error` is, or carries, a `LinkLostError`): it may be a split, where the launcher still
    reaches both sides and sees no worker lost, and would never open the next round. The
    launcher decides which side goes on (`launch/spawn.py`). Nothing for any other error."""
    lost = library_error(error)
    if _current is None or _client is None or not isinstance(lost, LinkLostError):
        return
    _report_split(_client, _current, lost.address)


def _report_split(store: Store, joined: Round, address: str) -> None:
    """Report, in round `joined`, that this worker lost its link to the peer at `address`."""
    report = json.dumps({"round": joined.generation, "worker": joined.me, "address": address})
    with contextlib.suppress(RuntimeError):  # the store gone: the launcher is ending the run
        store.queue_push(liveness.SPLITS, report)


def _unconnected(
    store: Store, chosen: Round, settings: Settings, error: BaseException, name: str
) -> Exception:
    """Return the error for a Gloo group of round `chosen` that did not connect (`error`; `name`
    says which group: the round's own, the world's, its private duplicate, the hierarchy's,
    `dp.new_group`'s; `gloo.group.Connects`), after reporting each member host this worker
    cannot reach (`forming.unreached`, within the link timeout) as a split: the launcher may
    still reach both, see no worker lost, and open no next round. A `RankFailedError` where
    the launcher opened the next round (a member was lost: that settles it) or a member was
    reported: the worker leaves the round and joins the next, wherever the group was being
    made. Where every member's host answers and no round is coming, nothing would open one:
    a `NoWorldError` naming the group, at once (the worker ends)."""
    first = str(error).strip().splitlines()[0] if str(error).strip() else type(error).__name__
    # Which wait ran out is in Gloo's own line: a member's address is waited for in the store
    waited = (
        "a member's address waited for up to the store's timeout, "
        f"a connection up to {connect_limit(settings.link_timeout):g} s"
    )
    said, answers = "the launcher opened the next round", False
    with contextlib.suppress(OSError, RuntimeError):
        if _watched is not None and not store.check([round_key(chosen.generation + 1)]):
            cut = unreached(_watched, settings.link_timeout)
            for address in cut:
                _report_split(store, chosen, address)
            said = f"out of reach: {', '.join(cut)} (reported)" if cut else "every member answers"
            answers = not cut
    if answers:
        return NoWorldError(
            f"{name} (Gloo, round {chosen.generation}, members {', '.join(chosen.members)}) did "
            f"not connect its members ({first}; {waited}), though the host of every "
            "member answers and the launcher lost none: something between them refuses Gloo's "
            "connections (a firewall, GLOO_SOCKET_IFNAME naming an interface the others do not "
            "reach). No round would form otherwise; this worker leaves the run."
        )
    return RankFailedError(
        f"{name} (Gloo, round {chosen.generation}) did not connect its members ({first}; "
        f"{waited}); {said}."
    )


def publish(
    store: Store,
    generation: int,
    members: list[str],
    cut_off: list[str],
    notify: bool,
) -> None:
    """Open round `generation` of `members` (in rank order), as the launcher does: the round,
    then `latest`; then, where it leaves out workers because their link is gone (`cut_off`)
    and the others follow the rounds (`notify`: `liveness.follows`), the round and those
    workers on each member's notice queue: they have connections to cut. A round without
    (a worker died, or joined) needs nothing of the followers, and costs the store nothing
    more."""
    store.set(round_key(generation), json.dumps(members))
    store.set(LATEST, str(generation))
    if notify and cut_off:
        notice = json.dumps({"round": generation, "lost": cut_off})
        for member in members:
            store.queue_push(liveness.notice_key(member), notice)


def supersede(store: Store, generation: int) -> bool:
    """Mark round `generation` as never to form, unless it formed (the launcher, before it opens
    the next round: members still waiting for it then go on to the next). Return whether it
    formed."""
    if generation < 0:
        return False
    return bytes(store.compare_set(ready_key(generation), "", SUPERSEDED)) == FORMED.encode()


def formed(store: Store, generation: int) -> bool:
    """Return whether round `generation` formed (every member arrived)."""
    key = ready_key(generation)
    return bool(store.check([key])) and bytes(store.get(key)) == FORMED.encode()


def _left(deadline: float) -> datetime.timedelta:
    return datetime.timedelta(seconds=max(0.001, deadline - time.monotonic()))


def _make_group(store: Store, chosen: Round, settings: Settings) -> None:
    from dataparallel.backends.gloo.group import import_torch_distributed

    dist = import_torch_distributed()
    global _watched
    _watched = watching(store, chosen.generation, chosen.members)
    prefix = dist.PrefixStore(f"{round_key(chosen.generation)}/group/", _watched)
    # A worker always has its elastic timeout when the setting's is unset.
    seconds = settings.group_timeout
    timeout = datetime.timedelta(seconds=seconds) if seconds is not None else None
    # Every group made over the round's, as the round's own, connects within the round's limit
    # (`forming`), and its collectives get their timeout once it formed.
    unconnected = functools.partial(_unconnected, store, chosen, settings)
    connects = Connects(connect_limit(settings.link_timeout), unconnected)
    assert settings.elastic_store is not None
    liveness.publish_address(store, chosen.me, settings)
    # Bound where the launcher's store is reached: across hosts, hostnames may resolve to
    # nothing and Gloo would bind to loopback, out of the other hosts' reach.
    interface = None
    if settings.gloo_socket_ifname is None:
        interface = interface_toward(*settings.elastic_store)

    def make(connecting: datetime.timedelta | None) -> None:
        dist.init_process_group(
            "gloo", store=prefix, rank=chosen.rank, world_size=chosen.size, timeout=connecting
        )

    gloo_group(make, interface, timeout, "the round's own group", connects)


def leave() -> None:
    """Destroy torch's default group (and every group made over it), if there is one. Where
    none formed (its making failed), torch's count of the groups made is set back as that
    would: torch names the next round's group from it, and a member whose group formed
    and was destroyed names it from zero (a name apart, its keys would never meet)."""
    dist = sys.modules.get("torch.distributed")
    if dist is None or not dist.is_available():
        return
    if dist.is_initialized():
        dist.destroy_process_group()
    else:
        dist.distributed_c10d._world.group_count = 0

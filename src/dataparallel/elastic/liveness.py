"""A worker's watch over the hosts of an elastic run: peers behind a dead link are cut off, and
a worker cut off from the launcher leaves.

A worker that dies closes its connections, and its peers' Gloo calls fail at once. A host whose
link goes down closes nothing: its peers' calls wait on connections that will never deliver
(Gloo's timeout, `DATAPARALLEL_TIMEOUT`, is minutes), and the host's own workers wait on theirs.
Two watches bound that, both within `dataparallel run --link-timeout` seconds
(`DATAPARALLEL_LINK_TIMEOUT`):

- Each worker on another host than the launcher's store beats every `BEAT` seconds (a counter
  under `heartbeat_key`, `_beat`), and the launcher (`Heartbeats`) takes one whose counter
  stood still for the link timeout for out of reach; its ssh to the worker gives up too, later
  (ssh's `ServerAliveInterval` counts whole seconds). Each worker follows the rounds
  (`_follow`: a store client of its own, blocked on the worker's notice queue, `notice_key`):
  when the launcher opens a round without workers it lost so, by their link, it pushes the
  round and those workers onto the notice queue of each member, which reads them the moment
  the round opens (waiting costs the store nothing, and the notice holds what the follower
  needs). Where they are members of this worker's world, it shuts down this process's
  connections to their addresses (`address_key`, which each worker publishes as it
  makes a group; the store's own connection is kept): a Gloo call waiting on them fails at once
  with "Connection closed", as when a peer dies (`RankFailedError`), and `elastic.run` re-forms.
- A worker on another host than the launcher's store checks every second that the store still
  accepts a connection (`_probe`). When it has not for much longer than the link timeout
  (`config.silence_limit`, as a rank started over ssh waits for the launcher's beats), the
  worker is on the far side of the dead link: the launcher, whose heartbeats decide a loss
  within the link timeout, has dropped it, and its collectives wait on peers it cannot reach.
  It says so and leaves, with its process group where it leads one (a worker started over
  ssh), so that nothing of it lingers on the cut host. Leaving at the link timeout itself would
  end healthy workers wherever a busy machine keeps the store's replies late.

Both run only where a link can be lost (`follows`): a run whose store is on loopback has every
worker on the launcher's host (no other host could reach the store), and there the launcher
pushes no notices. Their threads ask the store from Python, each call but the follower's wait
bounded (`CALL_TIMEOUT`), and stop at exit (`atexit`: a stop event, an empty notice that wakes
the follower, then a join) before the interpreter finalizes: a thread still inside the store's
C++ then, woken by a round the launcher opens, would die by a forced unwind through code that
may not throw, and abort the worker (SIGABRT) after a run that went well.

Connections are cut by `backends.connections` (Linux); elsewhere none is, and the survivors wait
out Gloo's timeout.
"""

from __future__ import annotations

import atexit
import contextlib
import datetime
import ipaddress
import json
import os
import signal
import socket
import sys
import threading
import time
from collections.abc import Callable, Iterable, Iterator, Sequence
from typing import TYPE_CHECKING

from dataparallel.backends.connections import cut_connections
from dataparallel.backends.rendezvous import address_toward, interface_address, is_here
from dataparallel.config import LINK_TIMEOUT_VARIABLE, Settings, silence_limit

if TYPE_CHECKING:
    from torch.distributed import Store

__all__ = [
    "SPLITS",
    "Heartbeats",
    "address_key",
    "changing_world",
    "client",
    "follows",
    "heartbeat_key",
    "notice_key",
    "popped",
    "publish_address",
    "watch",
]

# How often a worker on another host checks that the launcher's store answers (seconds).
PROBE_INTERVAL = 1.0
# How often a worker on another host beats (seconds): short against the least link timeout (the
# launcher's judgement is late by up to one beat), long against the store's round trip.
BEAT = 0.1
# The longest a store call of the watch may take (seconds): long against a loaded machine's
# stalls (a call that fails ends the watch, and its beats), short enough for an exit to wait on.
CALL_TIMEOUT = 10.0
# How long the follower's wait for the next round lasts before it waits again (seconds): a
# round may not open for days, and a store's wait that times out logs a warning.
FOLLOW_WAIT = 86400.0
# The queue where workers report a peer they lost by its link (`rounds.report_split`), JSON
# `{"round": G, "worker": ID, "address": PEER'S ADDRESS}`: the launcher, blocked on it, decides
# at once which side of a split goes on (`launch/spawn.py`); an empty value ends its wait.
SPLITS = "splits"
# A worker's last heartbeat, as its watch stops: it is ending (its exit follows), not silent.
LEFT = b"left"

# Held while this worker leaves one world and makes the next: connections cut meanwhile could
# be the new world's to a live worker sharing a lost one's address.
_changing = threading.Lock()
_watching = False
_stop = threading.Event()  # set at exit: the watch's threads end
_threads: list[threading.Thread] = []


def address_key(worker: str) -> str:
    """The key where `worker` publishes the address its Gloo connections use."""
    return f"address/{worker}"


def heartbeat_key(worker: str) -> str:
    """The key whose counter `worker` adds to every `BEAT` seconds while it is in reach."""
    return f"heartbeat/{worker}"


def notice_key(worker: str) -> str:
    """The queue where the launcher pushes each round it opens with `worker` in it that leaves
    out workers lost by their link, where `follows` says the worker watches (`rounds.publish`):
    JSON `{"round": G, "lost": [ID, ...]}`. The worker's own empty value wakes its follower at
    exit."""
    return f"notice/{worker}"


def follows(store_host: str) -> bool:
    """Whether the workers of a run whose store they reach at `store_host` watch the rounds:
    only where a link can be lost (not on loopback)."""
    return not _is_loopback(store_host)


@contextlib.contextmanager
def changing_world() -> Iterator[None]:
    """Hold off cutting connections while this worker makes a new world's group."""
    with _changing:
        yield


def publish_address(store: Store, worker: str, settings: Settings) -> None:
    """Write the address this worker's Gloo group binds to (the user's interface, else the one
    toward the launcher's store) where the others find it if its link goes down."""
    assert settings.elastic_store is not None
    if settings.gloo_socket_ifname is not None:
        address = interface_address(settings.gloo_socket_ifname.split(",")[0])
    else:
        address = address_toward(*settings.elastic_store)
    if address is not None:
        store.set(address_key(worker), address)


def watch(
    settings: Settings,
    generation: int,
    world: Callable[[], tuple[int, Sequence[str]]],
    client: Store,
) -> None:
    """Start this process's watches (once, and only if the run may span hosts): follow the
    rounds after `generation`, cutting the connections to members of this worker's world
    (`world()`: its round and members) lost by their link; and, on another host than the
    store's, beat, and leave when the store stops answering. All stop when the interpreter
    exits, the follower woken through `client` (the worker's own client of the store)."""
    global _watching
    assert settings.elastic_store is not None
    me = settings.elastic_worker
    if _watching or me is None or not follows(settings.elastic_store[0]):
        return
    _watching = True
    at = settings.elastic_store
    _threads.append(
        threading.Thread(
            target=_follow,
            args=(at, generation, world, me),
            name="dataparallel-rounds",
            daemon=True,
        )
    )
    if _far(at[0]):
        _threads.append(
            threading.Thread(
                target=_beat,
                args=(at, heartbeat_key(me)),
                name="dataparallel-heartbeat",
                daemon=True,
            )
        )
        _threads.append(
            threading.Thread(
                target=_probe,
                args=(at, settings.link_timeout, me),
                name="dataparallel-store-probe",
                daemon=True,
            )
        )
    atexit.register(_stop_watching, client, me)
    for thread in _threads:
        thread.start()


def _stop_watching(client: Store, me: str) -> None:
    """Stop the watch's threads and wait for them: the follower is woken by an empty notice of
    this worker's own, every other call is bounded."""
    _stop.set()
    if _threads[0].is_alive():  # else the store is gone, and the follower's wait failed
        with contextlib.suppress(RuntimeError):
            client.set_timeout(datetime.timedelta(seconds=CALL_TIMEOUT))
            client.queue_push(notice_key(me), b"")
    for thread in _threads:
        thread.join(timeout=2 * CALL_TIMEOUT + PROBE_INTERVAL)


def client(store_at: tuple[str, int], seconds: float = CALL_TIMEOUT) -> Store:
    """A client of the store at `store_at` whose calls wait at most `seconds`."""
    from dataparallel.backends.gloo.group import import_torch_distributed

    dist = import_torch_distributed()
    timeout = datetime.timedelta(seconds=seconds)
    return dist.TCPStore(*store_at, is_master=False, timeout=timeout, wait_for_workers=False)


def popped(store: Store, queue: str) -> Iterator[bytes]:
    """Each value pushed onto the store's `queue`, as it comes, until an empty value (the
    waiter's end), through `store`, a client that only waits there (`client(..., FOLLOW_WAIT)`);
    raises RuntimeError where the store is gone. The launcher's split reports (`SPLITS`) and a
    worker's notices (`notice_key`)."""
    from dataparallel.backends.gloo.group import import_torch_distributed

    dist = import_torch_distributed()
    while True:
        try:
            value = bytes(store.queue_pop(queue))
        except dist.DistStoreError:  # nothing for a day: wait again
            continue
        if not value:
            return
        yield value


def _follow(
    store_at: tuple[str, int],
    generation: int,
    world: Callable[[], tuple[int, Sequence[str]]],
    me: str,
) -> None:
    """Wait for each round the launcher opens after `generation` naming workers lost by their
    link (its notice), and cut the connections to those of this worker's world. Through a
    client of its own: a store client's call holds its connection until answered, so the beats
    (`_beat`) through this one would wait for the next notice."""
    try:
        store = client(store_at, FOLLOW_WAIT)
        for notice in popped(store, notice_key(me)):  # until this worker's own, at exit
            if _stop.is_set():
                return
            said = json.loads(notice)
            if said["round"] > generation:  # else a round before this worker's first world
                _cut(store, store_at, said["round"], said["lost"], world)
    except RuntimeError:  # the store is gone or silent: `_probe` (or the launcher's end) settles it
        return


def _cut(
    store: Store,
    store_at: tuple[str, int],
    generation: int,
    lost: list[str],
    world: Callable[[], tuple[int, Sequence[str]]],
) -> None:
    """Cut the connections to the members of this worker's world that round `generation` leaves
    out as `lost` by their link."""
    if not _changing.acquire(blocking=False):
        return  # between worlds: the old one's connections are closing anyway
    try:
        joined, members = world()
        if joined >= generation:
            return  # this world is already without them: its connections stay
        keys = [address_key(m) for m in members if m in lost]
        addresses = {bytes(store.get(k)).decode() for k in keys if store.check([k])}
        cut_connections(addresses, keep=_resolved(store_at))
    finally:
        _changing.release()


def _beat(store_at: tuple[str, int], key: str) -> None:
    """Add to this worker's heartbeat counter every `BEAT` seconds until exit, then say it left."""
    try:
        store = client(store_at)
        while not _stop.wait(BEAT):
            store.add(key, 1)
        store.set(key, LEFT.decode())
    except RuntimeError:  # the store is gone or silent: `_probe` (or the launcher's end) settles it
        return


class Heartbeats:
    """The launcher's ear on its workers of other hosts: each one's heartbeat counter, and when
    (by the launcher's clock, so no two hosts' clocks are compared) it last saw it move.

    A worker counts from its first world on (its watch starts there), and stops counting when
    its watch stops (`LEFT`: it is ending, and its exit follows). One whose counter stood still
    for `limit` seconds is out of reach: its host, its link, or its process stalled.
    """

    def __init__(self, limit: float) -> None:
        self.limit = limit
        self._heard: dict[str, tuple[bytes, float]] = {}
        self._done: set[str] = set()  # said silent, or left

    def silent(self, store: Store, workers: Iterable[str]) -> dict[str, float]:
        """Return the `workers` silent for the limit, with how long (seconds); each once.

        The launcher looks at every worker of another host each tenth of a second: one round
        trip reads every counter (`multi_get`), whatever the number of workers. It waits for a
        key not there, so it reads only the workers seen beating; those not yet seen are
        checked before, all in one round trip, else one each (only while some do not beat)."""
        now = time.monotonic()
        watched = [worker for worker in workers if worker not in self._done]
        unheard = [worker for worker in watched if worker not in self._heard]
        if unheard and not store.check([heartbeat_key(worker) for worker in unheard]):
            some = len(unheard) > 1  # one alone was just checked
            beating = {w for w in unheard if some and store.check([heartbeat_key(w)])}
            watched = [w for w in watched if w in self._heard or w in beating]
        if not watched:
            return {}
        values = store.multi_get([heartbeat_key(worker) for worker in watched])
        quiet: dict[str, float] = {}
        for worker, read in zip(watched, values, strict=True):
            self.note(worker, bytes(read), now, quiet)
        return quiet

    def note(self, worker: str, value: bytes, now: float, quiet: dict[str, float]) -> None:
        """Take `worker`'s counter `value`, read at `now`: a new value is a beat; the same one
        for the limit puts the worker in `quiet` (with how long), once; `LEFT` ends the watch."""
        heard = self._heard.get(worker)
        if value == LEFT:
            self._done.add(worker)
        elif heard is None or value != heard[0]:
            self._heard[worker] = (value, now)
        elif now - heard[1] >= self.limit:
            quiet[worker] = now - heard[1]
            self._done.add(worker)


def _probe(store_at: tuple[str, int], link_timeout: float, worker: str | None) -> None:
    limit = silence_limit(link_timeout)
    answered = time.monotonic()
    while not _stop.is_set():
        try:
            with socket.create_connection(store_at, timeout=PROBE_INTERVAL):
                pass
        except OSError:
            silent = time.monotonic() - answered
            if silent >= limit:
                _leave(store_at, silent, worker)
            _stop.wait(0.1)
            continue
        answered = time.monotonic()
        _stop.wait(PROBE_INTERVAL)


def _leave(store_at: tuple[str, int], silent: float, worker: str | None) -> None:
    host, port = store_at
    print(
        f"dataparallel: worker {worker} has had no answer from the launcher's store at "
        f"{host}:{port} for {silent:.1f} s ({LINK_TIMEOUT_VARIABLE}, `dataparallel run "
        "--link-timeout`): this host's link is down, or the launcher is gone; leaving the run.",
        file=sys.stderr,
        flush=True,
    )
    with contextlib.suppress(OSError):
        if os.getpgid(0) == os.getpid():  # a worker started over ssh leads its own group
            os.killpg(0, signal.SIGKILL)
    os._exit(1)


def _is_loopback(host: str) -> bool:
    """Whether `host` is a loopback address: a store there is out of every other host's reach,
    so the run has one host, and no link to lose."""
    try:
        return ipaddress.ip_address(socket.gethostbyname(host)).is_loopback
    except (OSError, ValueError):
        return False


def _far(host: str) -> bool:
    """Whether the store's `host` is another machine, which a link joins to this one; one that
    resolves to no address here is far (the probe then finds it out of reach, and leaves)."""
    try:
        return not is_here(host)
    except OSError:
        return True


def _resolved(store_at: tuple[str, int]) -> tuple[str, int]:
    try:
        return socket.gethostbyname(store_at[0]), store_at[1]
    except OSError:
        return store_at

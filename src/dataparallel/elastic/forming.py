"""A round's Gloo group forming, watched: a member that dies meanwhile is noticed at once.

torch makes a Gloo group by rendezvous in a store: each member writes its address and waits for
the others'. A member that dies before writing its own leaves the others waiting in the store
until its timeout (`--elastic-timeout` + 30 s). `watching(store, round)` wraps the launcher's
store for that rendezvous: its waits poll the store (`SLICE` seconds apart at most) and read,
between two polls, whether the launcher opened a newer round that leaves out one of this
round's members (a worker lost or removed; one that only adds workers lets this group form).
If so the wait fails with `RankFailedError`, and `rounds.join` goes on to the newer round. A
wait that finds its keys there reads it too, at most every `SLICE` seconds (not on every key:
that would cost a round trip per key): a member that reaches the rendezvous after the newer
round opened and the others gave up would otherwise find their keys written and form the group
alone, then wait on them in Gloo's connections. The
wrapper must outlive the group (torch calls back into it): `rounds` keeps it.

Once the addresses are read, Gloo connects each pair of members, and that wait is Gloo's own:
nothing outside it can cut it short. `rounds` gives it a deadline (`config.connect_limit`)
shorter than the group's timeout, which torch takes for the connects and the collectives alike
(the collectives get theirs back once the group formed), for the round's group and for every
group made over it after (`gloo.group.Connects`), which meet in the same store. The
rendezvous' waits above take no part in it: they last the store's timeout, and a newer round
ends them. A group that did not connect may have met a member it cannot reach, though the
launcher reaches both (a split, that no one else reports): `unreached` tries each member host's
Gloo address, which the rendezvous read, within the link timeout.
"""

from __future__ import annotations

import datetime
import json
import socket
import struct
import sys
import time
from collections.abc import Mapping
from typing import TYPE_CHECKING, Any

from dataparallel.backends.connections import Peer, unreachable
from dataparallel.errors import RankFailedError

if TYPE_CHECKING:
    from torch.distributed import Store

__all__ = ["SLICE", "gloo_address", "round_key", "unreached", "watching"]

# The longest pause between two polls of a waiting member: long against the store's round trip,
# short against a person waiting.
SLICE = 0.05


def watching(store: Any, generation: int, members: tuple[str, ...]) -> Store:
    """Return `store` wrapped so that its waits fail once round `generation` cannot form."""
    from dataparallel.backends.gloo.group import import_torch_distributed

    dist = import_torch_distributed()

    class _Watched(dist.Store):  # type: ignore[name-defined]
        """Delegates to the launcher's store; its waits poll, watching for a newer round."""

        def __init__(self) -> None:
            super().__init__()
            self._limit: datetime.timedelta = store.timeout
            # The least a wait lasts: Gloo passes its connect deadline to each.
            self._least: datetime.timedelta = store.timeout
            # What was read under each key: Gloo's members' addresses among them (`unreached`).
            self.read: dict[str, bytes] = {}
            # Keys a wait found: Gloo waits for each peer's key, then gets it; the get need not
            # ask the store again whether the key is there (a third of the rendezvous' trips).
            self._present: set[str] = set()
            self._looked = -SLICE  # when a wait last read whether a newer round opened

        def set(self, key: str, value: str | bytes) -> None:
            store.set(key, value)

        def get(self, key: str) -> bytes:
            if key not in self._present:
                self.wait([key])
            value = self.read[key] = bytes(store.get(key))
            return value

        def add(self, key: str, amount: int) -> int:
            return int(store.add(key, amount))

        def compare_set(self, key: str, expected: str | bytes, desired: str | bytes) -> bytes:
            return bytes(store.compare_set(key, expected, desired))

        def check(self, keys: list[str]) -> bool:
            return bool(store.check(keys))

        def delete_key(self, key: str) -> bool:
            self._present.discard(key)
            return bool(store.delete_key(key))

        def num_keys(self) -> int:
            return int(store.num_keys())

        def set_timeout(self, timeout: datetime.timedelta) -> None:
            self._limit = timeout

        def wait(self, keys: list[str], timeout: datetime.timedelta | None = None) -> None:
            limit = max(timeout or self._limit, self._least)
            deadline = time.monotonic() + limit.total_seconds()
            pause = 0.001
            while True:  # polled: a store's timed-out wait logs a warning
                present = bool(store.check(keys))
                now = time.monotonic()
                if not present or now - self._looked >= SLICE:
                    lost = _left_out(store, generation, members)
                    if lost:
                        raise RankFailedError(
                            f"round {generation}'s Gloo group cannot form: the launcher opened "
                            f"round {generation + 1} without worker(s) {', '.join(lost)}."
                        )
                    self._looked = now
                if present:
                    break
                if now >= deadline:
                    raise RankFailedError(
                        f"round {generation}'s Gloo group did not form within "
                        f"{limit.total_seconds():g} s (waiting for "
                        f"{', '.join(keys)})."
                    )
                time.sleep(pause)
                pause = min(2 * pause, SLICE)
            self._present.update(keys)

    return _Watched()


def round_key(generation: int) -> str:
    """The key under which the launcher writes round `generation`'s members (JSON list)."""
    return f"round/{generation}"


def _left_out(store: Store, generation: int, members: tuple[str, ...]) -> list[str]:
    """The members of round `generation` that the next round leaves out (none: no next round)."""
    key = round_key(generation + 1)
    if not store.check([key]):
        return []
    newer = set(json.loads(store.get(key)))
    return [m for m in members if m not in newer]


def unreached(watched: Store, wait: float) -> list[str]:
    """Return the addresses of the hosts of a round's members, as its groups' rendezvous read
    them (`watching`), whose Gloo device answers no connect within `wait` seconds
    (`connections.unreachable`): a group that did not connect met them. Each host is tried
    once; what reads otherwise than `gloo_address` knows is not tried. The addresses are those
    each member publishes too (`liveness.address_key`: Gloo binds to that interface)."""
    read: Mapping[str, bytes] = getattr(watched, "read", {})
    at: dict[str, Peer] = {}
    for value in read.values():
        address = gloo_address(value)
        if address is not None:
            at.setdefault(address[0], address)
    return sorted(peer[0] for peer in unreachable(list(at.values()), wait))


def gloo_address(value: bytes) -> Peer | None:
    """The (IPv4 address, port) a member's Gloo device listens on, from what Gloo's rendezvous
    writes under the member's rank: its host's name, then the device's `sockaddr`, each after
    its length (a native `size_t`), then the pairs' numbers. None where it reads otherwise."""
    size = struct.calcsize("@N")
    try:
        (name,) = struct.unpack_from("@N", value, 0)
        (length,) = struct.unpack_from("@N", value, size + name)
    except struct.error:
        return None
    start = 2 * size + name
    address = value[start : start + length]
    if length < 8 or len(address) < length:
        return None
    if int.from_bytes(address[:2], sys.byteorder) != socket.AF_INET:
        return None
    return socket.inet_ntop(socket.AF_INET, address[4:8]), int.from_bytes(address[2:4], "big")

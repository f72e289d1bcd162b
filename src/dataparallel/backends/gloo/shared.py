"""Shared memory of one host's ranks, for the hierarchy's steps inside the host (`hierarchy.py`).

Inside a host the hierarchy's data need not go through TCP at all: each rank writes the parts
of a buffer its peers reduce into a file of its own under /dev/shm, mapped by every rank of the
host, and each reduces its slice straight from its peers' files. The words that say "written"
go through shared memory too (`bells.py`), which sees a peer that dies or hangs as a Gloo
message would.

Files: one per rank and slot (`SLOTS`; a call takes slot `seq % SLOTS`), made as the call needs
(a generation per size: a call needing more than its slot holds, or a quarter of it, makes the
next), named `dataparallel-<host's token>-<local rank>-<slot>-<generation>`. The space is taken
with `posix_fallocate`, so a full /dev/shm fails with ENOSPC when made, never with SIGBUS when
written; a rank that cannot make one says so and the call takes the sends, or on one host Gloo's
ring (`Hierarchy.scatter`), as every later call of that size or more on this rank does.
A name is removed (`settle`) once every peer has mapped it: the mapping lives on without it, and
a rank that dies later leaves nothing behind. What is left where a rank died between making a
file and its peers mapping it is removed by the others (`remove_all`, on a failed step and at
`close`): every name of the host's token.
"""

from __future__ import annotations

import contextlib
import mmap
import os
import secrets
import threading
from pathlib import Path
from types import ModuleType
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    import torch

__all__ = ["SHARED_DIR", "SLOTS", "SharedSlots"]

# Where the files live: Linux's shared-memory file system (what `shm_open` uses).
SHARED_DIR = Path("/dev/shm")
# Calls whose files are in use at once: the first lane runs at most SLOTS - 1 calls ahead of
# the second (`Hierarchy.scatter`), enough to keep the link busy with the steps across queued.
SLOTS = 4
# Sizes are taken in whole multiples of this, so that buckets of about one size share a file.
GRAIN = 1 << 16


class SharedSlots:
    """This rank's files and its maps of its peers' files, for the slots of one hierarchy."""

    def __init__(self, prefix: str, local_rank: int) -> None:
        self.prefix, self.local_rank = prefix, local_rank
        # This rank's own file for each slot: (generation, its bytes), and the name not yet removed
        self._own: dict[int, tuple[int, torch.Tensor]] = {}
        self._unsettled: dict[int, Path] = {}
        self._generation = 0
        # The smallest size no file could be had for (/dev/shm full): not tried again
        self._refused: int | None = None
        # Each peer's file for each slot, as mapped here: (local rank, slot) -> (generation, bytes)
        self._peers: dict[tuple[int, int], tuple[int, torch.Tensor]] = {}
        self._lock = threading.Lock()  # between making a file and `close`
        self._closed = False

    @classmethod
    def join(
        cls, dist: ModuleType, group: object, leader: int, local_rank: int
    ) -> SharedSlots | None:
        """The host's shared slots, or None where its ranks do not see one shared-memory file
        system (collective over the host's `group`, whose rank `leader` is local rank 0): the
        leader makes a file of a fresh token, every rank reads it back, and all agree."""
        import torch

        probe: Path | None = None
        token: str | None = None
        if local_rank == 0 and SHARED_DIR.is_dir() and hasattr(os, "posix_fallocate"):
            token = secrets.token_hex(8)
            probe = SHARED_DIR / f"dataparallel-{token}-probe"
            try:
                probe.write_text(token)
            except OSError:
                token = None
        box: list[Any] = [token]
        dist.broadcast_object_list(box, src=leader, group=group)
        token = box[0]
        sees = False
        if token is not None:
            with contextlib.suppress(OSError):
                sees = (SHARED_DIR / f"dataparallel-{token}-probe").read_text() == token
        agreed = torch.tensor([int(sees)], dtype=torch.int32)
        dist.all_reduce(agreed, op=dist.ReduceOp.MIN, group=group)
        if probe is not None:
            probe.unlink(missing_ok=True)
        return cls(f"dataparallel-{token}-", local_rank) if agreed.item() else None

    def offer(self, slot: int, nbytes: int) -> int:
        """Make sure this rank's file for `slot` holds `nbytes`, and return its generation (the
        peers find it by it), or -1 where no file could be had: the call then goes another way,
        and so does every later call of that size or more (no file asked for again)."""
        held = self._own.get(slot)
        if held is not None and nbytes <= held[1].numel() < 4 * max(nbytes, GRAIN):
            return held[0]
        size = -(-nbytes // GRAIN) * GRAIN
        if self._refused is not None and size >= self._refused:
            return -1
        with self._lock:
            if self._closed:
                return -1
            self._generation += 1
            path = self._path(self.local_rank, slot, self._generation)
            try:
                mapped = _map(path, create=size)
            except OSError:
                path.unlink(missing_ok=True)
                self._refused = size if self._refused is None else min(size, self._refused)
                return -1
            stale = self._unsettled.pop(slot, None)
            if stale is not None:  # a call that failed before its peers mapped it
                stale.unlink(missing_ok=True)
            self._unsettled[slot] = path
        self._own[slot] = (self._generation, mapped)
        return self._generation

    def own(self, slot: int) -> torch.Tensor:
        """This rank's file for `slot`, as bytes."""
        return self._own[slot][1]

    def peer(self, local_rank: int, slot: int, generation: int) -> torch.Tensor:
        """A peer's file for `slot` of `generation`, as bytes, mapped here the first time."""
        held = self._peers.get((local_rank, slot))
        if held is not None and held[0] == generation:
            return held[1]
        path = self._path(local_rank, slot, generation)
        try:
            mapped = _map(path)
        except OSError as exc:
            raise RuntimeError(
                f"the shared memory of local rank {local_rank} on this host ({path}) could "
                f"not be mapped: {exc}"
            ) from exc
        self._peers[local_rank, slot] = (generation, mapped)
        return mapped

    def settle(self, slot: int) -> None:
        """Remove the name of this rank's file for `slot` once every peer has mapped it."""
        with self._lock:
            path = self._unsettled.pop(slot, None)
        if path is not None:
            path.unlink(missing_ok=True)

    def remove_all(self) -> None:
        """Remove every name of this host's token: this rank's, and those a peer that died
        left (the maps stay valid where they are held)."""
        with contextlib.suppress(OSError):
            for path in SHARED_DIR.glob(f"{self.prefix}*"):
                path.unlink(missing_ok=True)

    def close(self) -> None:
        """Make no more files, and remove every name of the host's token (safe to call twice).
        The maps go with the last reference to them."""
        with self._lock:
            self._closed = True
        self.remove_all()
        self._unsettled.clear()

    def _path(self, local_rank: int, slot: int, generation: int) -> Path:
        return SHARED_DIR / f"{self.prefix}{local_rank}-{slot}-{generation}"


def _map(path: Path, create: int = 0) -> torch.Tensor:
    """The file at `path` mapped as a byte tensor: made first with `create` bytes taken (the
    name must be new), else opened as it is."""
    import torch

    flags = os.O_RDWR | (os.O_CREAT | os.O_EXCL if create else 0)
    fd = os.open(path, flags, 0o600)
    try:
        if create:
            os.posix_fallocate(fd, 0, create)
        size = os.fstat(fd).st_size
        mapped = mmap.mmap(fd, size)
    finally:
        os.close(fd)
    return torch.frombuffer(mapped, dtype=torch.uint8)

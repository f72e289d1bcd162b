"""The words of one host's ranks to each other, through shared memory (`Bells`).

The hierarchy's steps through shared memory (`shared.py`) need a word from every peer of the
host at each step: "my part is written" (with the generation of the file it is in), then "my
reduced slice is written". Sent over the host's Gloo group, each word is a message through
Gloo's TCP loop thread on both sides and a wake-up of the waiting lane: where the host's ranks
outnumber its cores, those wake-ups are what a step waits for. Here each rank has a small file
of its own (its bell) that its peers map: a step's word is a count stored in it (and, for the
first step, the generation beside it), and a peer that waits for it sleeps on the count with a
futex, which the saying rank wakes. One system call a side, no thread between.

What a message over Gloo gave for free is kept: a peer that dies is seen through a handle on
its process (`os.pidfd_open`, checked with its start time, so that a process of another pid
namespace that shares /dev/shm cannot pass for it), a rank that closes or severs its world says
so in its bell, and a wait ends after the world's timeout. A waiting rank looks at these every
`SLICE` seconds of sleep.

Counts are 32-bit (what a futex compares), compared modulo 2**32: a peer is never more than a
few calls ahead. The count is stored after the data it announces, and read before the data; on
x86-64 stores are seen by other cores in the order they were made and loads are not reordered
with loads, so that order is the memory's too. Elsewhere there are no bells (`available`), and
the hierarchy takes its steps by sends.
"""

from __future__ import annotations

import contextlib
import ctypes
import mmap
import os
import platform
import select
import time
from pathlib import Path
from types import ModuleType

from dataparallel.errors import CollectiveTimeoutError, RankFailedError

__all__ = ["SAID_REDUCED", "SAID_WRITTEN", "SLICE", "Bells", "available"]

# The two words of a call (`Hierarchy.scatter`, `Hierarchy.gather`).
SAID_WRITTEN, SAID_REDUCED = 0, 1
# Seconds a waiting rank sleeps at most before it looks at its peers' processes and bells again.
SLICE = 0.05

# A bell: this rank's process (pid, start time), whether it closed, a count per word, each on
# a cache line of its own, and the generation said with each call's first word, by slot.
_PID, _START, _CLOSED = 0, 8, 16
_COUNT = (64, 128)
_WORDS = 192
_SIZE = 4096

_FUTEX_WAIT, _FUTEX_WAKE = 0, 1  # shared between processes: not the _PRIVATE variants
_SYS_FUTEX = {"x86_64": 202, "AMD64": 202}.get(platform.machine())


class _Timespec(ctypes.Structure):
    _fields_ = [("tv_sec", ctypes.c_long), ("tv_nsec", ctypes.c_long)]


def available() -> bool:
    """Whether this machine has bells: Linux on x86-64 (the futex call and the memory order
    the counts rely on), with process handles (`os.pidfd_open`)."""
    return _SYS_FUTEX is not None and hasattr(os, "pidfd_open") and os.name == "posix"


class Bells:
    """This rank's bell and its peers', mapped, with handles on the peers' processes."""

    def __init__(self, own: mmap.mmap, peers: dict[int, tuple[mmap.mmap, int]], slots: int) -> None:
        self._own, self._slots = own, slots
        self._peers = peers  # local rank -> (its bell, a handle on its process)
        self._libc = ctypes.CDLL(None, use_errno=True)
        # A poll of the peers' processes per word: each word is waited for by one lane, and a
        # poll object is not for two threads at once
        self._polls = (select.poll(), select.poll())
        for poll in self._polls:
            for _, handle in peers.values():
                poll.register(handle, select.POLLIN)
        self._severed = False

    @classmethod
    def join(
        cls,
        dist: ModuleType,
        group: object,
        prefix: str,
        local_rank: int,
        local_size: int,
        slots: int,
    ) -> Bells | None:
        """The host's bells, or None where some rank could not make its own, map a peer's, or
        see a peer's process as the peer wrote it (collective over the host's `group`): each
        rank makes its bell, all agree, each maps its peers' and checks their processes, all
        agree again, and each removes its bell's name (the maps live on)."""
        import torch

        def agree(ok: bool) -> bool:
            flag = torch.tensor([int(ok)], dtype=torch.int32)
            dist.all_reduce(flag, op=dist.ReduceOp.MIN, group=group)
            return bool(flag.item())

        path = Path(f"{prefix}{local_rank}-bell")
        own: mmap.mmap | None = None
        with contextlib.suppress(OSError):
            own = _make(path)
        peers: dict[int, tuple[mmap.mmap, int]] = {}
        try:
            if not agree(own is not None):
                return None
            ok = True
            for j in range(local_size):
                if j == local_rank:
                    continue
                try:
                    bell = _open(Path(f"{prefix}{j}-bell"))
                    pid = int.from_bytes(bell[_PID : _PID + 8], "little")
                    start = int.from_bytes(bell[_START : _START + 8], "little")
                    handle = os.pidfd_open(pid)
                except OSError:
                    ok = False
                    break
                peers[j] = (bell, handle)
                if _start_time(pid) != start:  # another process of that number: not the peer
                    ok = False
                    break
            if not agree(ok):
                for _, handle in peers.values():
                    os.close(handle)
                return None
        finally:
            path.unlink(missing_ok=True)
        assert own is not None
        return cls(own, peers, slots)

    def say(self, word: int, seq: int, said: int = 0) -> None:
        """Say `word` (`SAID_WRITTEN` or `SAID_REDUCED`) of call `seq` to every peer: the
        generation `said` first, for the first word, then the count, then wake the waiting."""
        own = self._own
        if word == SAID_WRITTEN:
            at = _WORDS + 8 * (seq % self._slots)
            own[at : at + 8] = said.to_bytes(8, "little", signed=True)
        count = ctypes.c_uint32.from_buffer(own, _COUNT[word])
        count.value = (seq + 1) & 0xFFFFFFFF
        self._wake(ctypes.addressof(count))

    def hear(self, word: int, seq: int, timeout: float | None) -> dict[int, int]:
        """Wait until every peer has said `word` of call `seq`; return what each said with it
        (the generation, for the first word). Raises `RankFailedError` where a peer's process
        ended or it closed its world, `CollectiveTimeoutError` after `timeout` seconds."""
        target = (seq + 1) & 0xFFFFFFFF
        deadline = None if timeout is None else time.monotonic() + timeout
        said: dict[int, int] = {}
        for j, (bell, _) in self._peers.items():
            count = ctypes.c_uint32.from_buffer(bell, _COUNT[word])
            while True:
                seen = count.value
                if (seen - target) & 0xFFFFFFFF < 0x80000000:  # seen >= target, modulo 2**32
                    break
                self._look(j, word, seq, deadline)
                self._sleep(ctypes.addressof(count), seen)
            if word == SAID_WRITTEN:
                at = _WORDS + 8 * (seq % self._slots)
                said[j] = int.from_bytes(bell[at : at + 8], "little", signed=True)
        return said

    def sever(self) -> None:
        """Say in this rank's bell that it has left the world (its peers' waits end with an
        error), and end this rank's own waits."""
        self._severed = True
        self._own[_CLOSED] = 1
        for word in (SAID_WRITTEN, SAID_REDUCED):
            self._wake(ctypes.addressof(ctypes.c_uint32.from_buffer(self._own, _COUNT[word])))

    def close(self) -> None:
        """`sever`, then let go of the peers' processes (safe to call twice)."""
        if not self._severed:
            self.sever()
        for _, handle in self._peers.values():
            with contextlib.suppress(OSError):
                os.close(handle)
        self._peers = {}

    def _look(self, j: int, word: int, seq: int, deadline: float | None) -> None:
        """Raise what ends a wait for peer `j`: this rank severed, the peer's process ended or
        it left its world, the deadline passed."""
        step = "written" if word == SAID_WRITTEN else "reduced"
        where = f"the host's shared memory step of call {seq} (its part {step})"
        if self._severed:
            raise RankFailedError(f"{where}: this rank's world was severed while it waited")
        bell, handle = self._peers[j]
        if bell[_CLOSED] or any(fd == handle for fd, _ in self._polls[word].poll(0)):
            raise RankFailedError(
                f"{where}: local rank {j} of this host exited or left the world before saying "
                "it. Look for the first traceback of the job: it names the rank that failed."
            )
        if deadline is not None and time.monotonic() > deadline:
            raise CollectiveTimeoutError(
                f"{where}: local rank {j} of this host did not say it within the world's "
                "timeout. A rank may be stuck or calling other collectives; raise "
                "dp.initialize(timeout=...) / DATAPARALLEL_TIMEOUT if it is just slow."
            )

    def _sleep(self, address: int, seen: int) -> None:
        """Sleep on the count at `address` while it still reads `seen`, `SLICE` at most (the
        kernel compares first: a count stored meanwhile is never slept through)."""
        span = _Timespec(0, int(SLICE * 1e9))
        self._libc.syscall(
            ctypes.c_long(_SYS_FUTEX or 0),
            ctypes.c_void_p(address),
            ctypes.c_int(_FUTEX_WAIT),
            ctypes.c_uint(seen),
            ctypes.byref(span),
        )

    def _wake(self, address: int) -> None:
        """Wake every process that sleeps on the count at `address`."""
        self._libc.syscall(
            ctypes.c_long(_SYS_FUTEX or 0),
            ctypes.c_void_p(address),
            ctypes.c_int(_FUTEX_WAKE),
            ctypes.c_int(0x7FFFFFFF),
            None,
        )


def _make(path: Path) -> mmap.mmap:
    """This rank's bell, made new at `path`: its process written in."""
    fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_EXCL, 0o600)
    try:
        os.posix_fallocate(fd, 0, _SIZE)
        bell = mmap.mmap(fd, _SIZE)
    finally:
        os.close(fd)
    pid = os.getpid()
    bell[_PID : _PID + 8] = pid.to_bytes(8, "little")
    bell[_START : _START + 8] = _start_time(pid).to_bytes(8, "little")
    return bell


def _open(path: Path) -> mmap.mmap:
    fd = os.open(path, os.O_RDWR)
    try:
        return mmap.mmap(fd, _SIZE)
    finally:
        os.close(fd)


def _start_time(pid: int) -> int:
    """When process `pid` started, in clock ticks since boot (`/proc/PID/stat`), or -1."""
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
    except OSError:
        return -1
    return int(stat.rsplit(")", 1)[1].split()[19])

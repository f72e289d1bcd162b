"""Which rank of this machine died first: seen by the launcher itself, beside mpiexec's report.

When a rank is killed, Hydra kills the others too, and its report names one pid: not always the
first to die (under load it named rank 0 after rank 1 was killed, both having status 9). So the
launcher watches the ranks of its machine itself, two ways:

- each rank holds the writing end of a FIFO the launcher reads (`runnotes.hold_alive`). The
  kernel closes it when the rank's files close as it dies, the moment Hydra's pipes close too,
  and before the others, which Hydra kills only then, have torn their memory down and closed
  theirs. The FIFOs that hang up first, without an `end` note, are the ranks that died first;
- for a rank without one (it died before opening it), its pidfd: at its death, the ranks dead
  or *dying* (the kernel's PF_EXITING flag, set at the start of exit, so before Hydra can know)
  without an `end` note are noted, which always includes the first.

Several ranks noted are named as the candidates.
"""

from __future__ import annotations

import contextlib
import os
import select
import threading

from dataparallel.launch._rundir import RunDir

__all__ = ["FirstDeaths"]

_POLL_MS = 20  # how often the run folder is read for ranks that just started
_IDLE_MS = 500  # how often the watcher looks when every rank is watched


_PROC = os.path.isdir("/proc/self")
_PF_EXITING = 0x4  # the kernel's flag of a task that has begun to exit (include/linux/sched.h)


def _alive(pid: int) -> bool:
    """Whether `pid` runs: a zombie, or one that has begun to exit, is dead (Linux: /proc)."""
    if not _PROC:
        try:
            os.kill(pid, 0)
        except ProcessLookupError:
            return False
        except PermissionError:
            pass
        return True
    try:
        with open(f"/proc/{pid}/stat", "rb") as file:
            fields = file.read().rpartition(b")")[2].split()
    except OSError:
        return False
    if len(fields) < 7:
        return False
    return fields[0] not in (b"Z", b"X") and not int(fields[6]) & _PF_EXITING


class FirstDeaths:
    """A daemon thread watching the ranks of this machine until one dies unexplained."""

    def __init__(self, run_dir: RunDir, n: int) -> None:
        self.run_dir, self.n = run_dir, n
        self.first: list[int] = []  # the ranks that died first, when the watcher could tell
        self.seen: set[int] = set()  # every rank whose death the watcher has judged, blamed or not
        self._pipes: dict[int, int] = {}  # the reading end of each rank's FIFO -> its rank
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._watch, name="dataparallel-deaths", daemon=True)

    def __enter__(self) -> FirstDeaths:
        self._pipes = self.run_dir.alive_pipes(self.n)  # before the ranks start
        self._thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self._stop.set()
        self._thread.join(timeout=1.0)
        for fd in self._pipes:
            os.close(fd)

    def _watch(self) -> None:
        watched: dict[int, int] = {}  # rank -> pid
        poller = select.poll()
        for fd in self._pipes:
            poller.register(fd, select.POLLHUP)
        pidfds: list[int] = []
        try:
            while not self._stop.is_set():
                for rank, pid in self.run_dir.local_pids().items():
                    if rank not in watched:
                        watched[rank] = pid
                        with contextlib.suppress(OSError, AttributeError):
                            pidfds.append(os.pidfd_open(pid))
                            poller.register(pidfds[-1], select.POLLIN)
                # Every rank of the job seen here: only deaths can wake the watcher now.
                wait = _POLL_MS if len(watched) < self.n else _IDLE_MS
                closed = []
                for fd, events in poller.poll(wait):
                    if fd in self._pipes and not events & select.POLLHUP:
                        continue
                    poller.unregister(fd)  # a dead rank's fds stay ready: once is enough
                    if fd in self._pipes:
                        closed.append(self._pipes[fd])
                if self._note_unexplained(closed) or self._judge(watched):
                    return
        finally:
            for fd in pidfds:
                os.close(fd)

    def _judge(self, watched: dict[int, int]) -> bool:
        """Note the ranks dead or dying without an `end` note; True once some are."""
        return self._note_unexplained([r for r, pid in watched.items() if not _alive(pid)])

    def _note_unexplained(self, dead: list[int]) -> bool:
        """Note the ranks of `dead` that left no `end` note; True if any (the others finished,
        or failed in the runner's hands)."""
        if not dead:
            return False
        ended = self.run_dir.ends()
        self.first = sorted(rank for rank in dead if rank not in ended)
        self.seen.update(dead)  # after `first`: a reader that sees a rank here sees its verdict
        return bool(self.first)

"""Which rank of this machine died first: seen by the launcher itself, before mpiexec's cleanup.

When a rank is killed, Hydra kills the others too, and its report names one pid: not always the
first to die (under load it named rank 0 after rank 1 was killed, both having status 9). The
launcher therefore watches the ranks of its machine (their pids come from the run folder) with a
pidfd each, and notes the ranks that died without an `end` note while others still lived: those
died first. When every rank is found dead at once, the watcher cannot tell, and says nothing.
"""

from __future__ import annotations

import contextlib
import os
import select
import threading

from dataparallel.launch._rundir import RunDir

__all__ = ["FirstDeaths"]

_POLL_MS = 20  # how often the run folder is read for ranks that just started


_PROC = os.path.isdir("/proc/self")


def _alive(pid: int) -> bool:
    """Whether `pid` runs: a zombie is dead too where /proc tells (Linux)."""
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
            state = file.read().rpartition(b")")[2].split()[0]
    except (OSError, IndexError):
        return False
    return state not in (b"Z", b"X")


class FirstDeaths:
    """A daemon thread watching the ranks of this machine until one dies unexplained."""

    def __init__(self, run_dir: RunDir) -> None:
        self.run_dir = run_dir
        self.first: list[int] = []  # the ranks that died first, when the watcher could tell
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._watch, name="dataparallel-deaths", daemon=True)

    def __enter__(self) -> FirstDeaths:
        self._thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self._stop.set()
        self._thread.join(timeout=1.0)

    def _watch(self) -> None:
        watched: dict[int, int] = {}  # rank -> pid
        poller = select.poll()
        fds: list[int] = []
        try:
            while not self._stop.is_set():
                for rank, pid in self.run_dir.local_pids().items():
                    if rank not in watched:
                        watched[rank] = pid
                        with contextlib.suppress(OSError, AttributeError):
                            fds.append(os.pidfd_open(pid))
                            poller.register(fds[-1], select.POLLIN)
                poller.poll(_POLL_MS)
                if self._judge(watched):
                    return
        finally:
            for fd in fds:
                os.close(fd)

    def _judge(self, watched: dict[int, int]) -> bool:
        """Note the ranks dead without an `end` note if others live; True once decided."""
        dead = [rank for rank, pid in watched.items() if not _alive(pid)]
        if not dead:
            return False
        ended = self.run_dir.ends()
        unexplained = sorted(rank for rank in dead if rank not in ended)
        if not unexplained:
            return False  # ranks that finished, or failed in the runner's hands
        if len(dead) < len(watched):
            self.first = unexplained
        return True

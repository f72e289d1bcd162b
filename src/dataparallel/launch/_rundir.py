"""The run folder: the launcher's side of the notes its ranks leave there (`runnotes.py`).

A rank with no `end` note died outside the runner's hands: killed by a signal, or stopped by its
launcher when another rank ended. `dataparallel run` promises status 0 only when every rank
succeeded, so a job whose launcher reports 0 while a rank has no `done` note is a failure.
"""

from __future__ import annotations

import contextlib
import os
import shutil
import signal
import socket
import tempfile
from pathlib import Path

from dataparallel.runnotes import DONE, INITIALIZING, READY, parse_world

__all__ = ["RunDir", "signal_name"]


class RunDir:
    """The launcher's side: a fresh folder, read once the ranks have written their notes."""

    def __init__(self) -> None:
        self.path = tempfile.mkdtemp(prefix="dataparallel-run-")

    def _read(self, suffix: str) -> dict[int, str]:
        notes = {}
        for path in Path(self.path).glob(f"rank-*.{suffix}"):
            rank = path.name[len("rank-") : -len(suffix) - 1]
            with contextlib.suppress(OSError, ValueError):
                notes[int(rank)] = path.read_text(encoding="utf-8").strip()
        return notes

    def ends(self) -> dict[int, str]:
        """Return how each rank that noted its end ended, by rank."""
        return self._read("end")

    def alive_pipes(self, n: int) -> dict[int, int]:
        """Make the `rank-R.alive` FIFO of each of `n` ranks; return their reading ends, by fd.

        A reading end reports a hang-up once its rank has opened the FIFO and closed it (died).
        Where FIFOs cannot be made, fewer (or none) are returned.
        """
        pipes: dict[int, int] = {}
        for rank in range(n):
            path = os.path.join(self.path, f"rank-{rank}.alive")
            with contextlib.suppress(OSError, AttributeError):
                os.mkfifo(path)
                pipes[os.open(path, os.O_RDONLY | os.O_NONBLOCK)] = rank
        return pipes

    def local_pids(self) -> dict[int, int]:
        """Return the process id of each rank that runs on this machine, by rank."""
        host, pids = socket.gethostname(), {}
        for rank, text in self._read("pid").items():
            where, _, pid = text.rpartition(" ")
            if where == host and pid.isdigit():
                pids[rank] = int(pid)
        return pids

    def signal_ranks(self, n: int, signum: int) -> bool:
        """Send `signum` to every rank of `n` if all run here and are known; return whether sent."""
        pids = self.local_pids()
        if sorted(pids) != list(range(n)):
            return False
        ended = self.ends()
        for rank, pid in pids.items():
            if rank not in ended:  # a pid noted by a rank that ended may be another process now
                with contextlib.suppress(ProcessLookupError, PermissionError):
                    os.kill(pid, signum)
        return True

    def left_early(self) -> bool:
        """Return whether a rank left through `os._exit(0)` before its script finished."""
        return any(how == "os._exit 0" for how in self.ends().values())

    def unfinished_rank(self, rank: int) -> str | None:
        """Return why rank `rank`, which exited with status 0, did not finish, or None if it did."""
        how = self.ends().get(rank)
        if how == DONE:
            return None
        if how is not None and how.startswith("os._exit"):
            return _left(rank, how)
        return f"rank {rank} exited with status 0 before its script finished"

    def unfinished(self, n: int) -> str | None:
        """Return why the job of `n` ranks did not succeed on every rank, or None if it did.

        Meant for a job whose launcher reports success: each rank must have noted `done`.
        """
        ends = self.ends()
        missing = [r for r in range(n) if ends.get(r) != DONE]
        if not missing:
            return None
        left = [r for r in missing if ends.get(r, "").startswith("os._exit")]
        silent = [r for r in missing if r not in left]
        parts = [_left(r, ends[r]) for r in left]
        if silent:
            parts.append(
                f"{_ranks(silent)} ended without finishing "
                + (
                    "(stopped when another rank ended)"
                    if left
                    else "(left early, e.g. through os._exit, a crash, or stopped by the launcher)"
                )
            )
        return "; ".join(parts) + ". Status 0 means that every rank finished its script."

    def stranded(self) -> str | None:
        """Return why a rank waits for ever in `dp.initialize`, or None.

        A world needs every rank: a rank that entered its G-th `initialize` waits for ever once
        another rank has ended without having had that world (it never called `initialize` so
        many times).
        """
        ends = self.ends()
        if not ends:
            return None
        worlds: dict[int, tuple[str, int]] = {}
        for rank, text in self._read("world").items():
            with contextlib.suppress(ValueError):
                worlds[rank] = parse_world(text)
        for rank, (state, generation) in sorted(worlds.items()):
            if state != INITIALIZING or rank in ends:
                continue
            for other, how in sorted(ends.items()):
                if how != DONE:
                    continue  # a failure, or os._exit: the launchers end those jobs already
                other_state, had = worlds.get(other, (READY, 0))
                if other_state != READY:
                    had -= 1  # it ended while entering that world: it never had it
                if had < generation:
                    return (
                        f"rank {rank} waits in dp.initialize() for rank {other}, which finished "
                        "its script without calling it: a world needs every rank"
                    )
        return None

    def remove(self) -> None:
        """Delete the folder and its notes."""
        shutil.rmtree(self.path, ignore_errors=True)


def _left(rank: int, how: str) -> str:
    """Say that `rank` left through what its note `how` (`os._exit CODE`) names."""
    call, _, code = how.partition(" ")
    return f"rank {rank} left through {call}({code}) before its script finished"


def _ranks(ranks: list[int]) -> str:
    if len(ranks) == 1:
        return f"rank {ranks[0]}"
    return "ranks " + ", ".join(map(str, ranks[:-1])) + f" and {ranks[-1]}"


def signal_name(signum: int) -> str:
    """Return `SIGKILL` for 9, and so on (`signal N` for a number Python does not name)."""
    try:
        return signal.Signals(signum).name
    except ValueError:
        return f"signal {signum}"

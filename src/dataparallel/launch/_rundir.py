"""The run folder, where each rank of a `dataparallel run` job notes its process and how it ended.

The launcher makes a fresh folder and names it in `DATAPARALLEL_RUN_DIR`; the runner of each rank
writes two notes there, when the folder exists on its machine (ranks on other machines of an MPI
job write none):

- `rank-R.pid`: `HOST PID`, at start, so that the launcher can signal the ranks of its machine;
- `rank-R.end`: how the rank ended, when the runner saw it end: `done` (the script succeeded and
  the world was finalized), `failed CODE`, or `os._exit CODE` (the script left through `os._exit`
  before it finished).

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

__all__ = ["DONE", "RunDir", "note_end", "note_start", "signal_name"]

DONE = "done"


def _write(folder: str, name: str, text: str) -> None:
    """Write `text` to `folder/name` at once (a temporary file renamed), if `folder` exists."""
    if not os.path.isdir(folder):
        return
    path = os.path.join(folder, name)
    with contextlib.suppress(OSError):
        with open(path + ".tmp", "w", encoding="utf-8") as file:
            file.write(text)
        os.replace(path + ".tmp", path)


def note_start(folder: str, rank: int) -> None:
    """Note this process as rank `rank` (runner side)."""
    _write(folder, f"rank-{rank}.pid", f"{socket.gethostname()} {os.getpid()}\n")


def note_end(folder: str, rank: int, how: str) -> None:
    """Note how rank `rank` ended: `DONE`, `failed CODE` or `os._exit CODE` (runner side)."""
    _write(folder, f"rank-{rank}.end", how + "\n")


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

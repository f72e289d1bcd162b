"""The notes each rank of a `dataparallel run` job leaves in its run folder, for the launcher.

The launcher makes a fresh folder and names it in `DATAPARALLEL_RUN_DIR` (`Settings.run_dir`);
each rank writes small files there, when the folder exists on its machine (ranks on other
machines of an MPI job write none), and the launcher (`dataparallel.launch`) reads them:

- `rank-R.pid`: `HOST PID`, at start, so that the launcher can signal the ranks of its machine;
- `rank-R.world`: `initializing G` when the rank enters its G-th `dp.initialize`, `ready G` once
  that world is up (`failed G` if it raised). A world needs every rank: one waiting there for a
  rank that has ended would wait for ever, and the launcher ends such a job;
- `rank-R.end`: how the rank ended, when the runner saw it end: `done` (the script succeeded and
  the world was finalized), `failed CODE` (`failed CODE peer-gone` when the failure was
  `RankFailedError`: another rank failed or exited while this one waited on it), or `os._exit
  CODE` (the script left through `os._exit` before it finished).

And one file the launcher makes: `rank-R.alive`, a FIFO whose writing end the rank holds open
for its whole life (`hold_alive`). The kernel closes it when the process's files close as it
dies, before anything else of its death shows, which is how the launcher learns it first.
"""

from __future__ import annotations

import contextlib
import glob
import os
import socket

__all__ = [
    "DONE",
    "FAILED",
    "INITIALIZING",
    "PEER_GONE",
    "READY",
    "hold_alive",
    "note_end",
    "note_start",
    "note_world",
    "parse_world",
    "running_here",
]

DONE = "done"
INITIALIZING, READY, FAILED = "initializing", "ready", "failed"  # `dp.initialize`, by stage
PEER_GONE = "peer-gone"  # after `failed CODE`: the failure was another rank's going


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
    """Note this process as rank `rank`."""
    _write(folder, f"rank-{rank}.pid", f"{socket.gethostname()} {os.getpid()}\n")


def note_end(folder: str, rank: int, how: str) -> None:
    """Note how rank `rank` ended: `DONE`, `failed CODE` or `os._exit CODE`."""
    _write(folder, f"rank-{rank}.end", how + "\n")


def running_here(folder: str, but: int) -> list[int]:
    """Return the ranks of this machine, `but` excepted, whose process runs and has noted no end.

    A rank reads the others' notes too when Ctrl-C ends the job (`launch.runner`): under MPI the
    first rank to exit makes mpiexec kill the rest, and one still reporting its
    `KeyboardInterrupt` would lose it.
    """
    host, ranks = socket.gethostname(), []
    for path in glob.glob(os.path.join(glob.escape(folder), "rank-*.pid")):
        rank = os.path.basename(path)[len("rank-") : -len(".pid")]
        try:
            with open(path, encoding="utf-8") as file:
                where, _, pid = file.read().strip().rpartition(" ")
            if where != host or not rank.isdigit() or int(rank) == but:
                continue
            if os.path.exists(os.path.join(folder, f"rank-{rank}.end")):
                continue
            os.kill(int(pid), 0)
        except (OSError, ValueError):  # no such note or process (or not ours to signal)
            continue
        ranks.append(int(rank))
    return sorted(ranks)


def note_world(folder: str, rank: int, state: str) -> None:
    """Note that rank `rank` enters `dp.initialize` (`INITIALIZING`) or has its world (`READY`).

    The generation counts this process's worlds: entering after `ready G` is `initializing G+1`.
    """
    last_state, generation = INITIALIZING, 0
    path = os.path.join(folder, f"rank-{rank}.world")
    with contextlib.suppress(OSError, ValueError), open(path, encoding="utf-8") as file:
        last_state, generation = parse_world(file.read())
    if state == INITIALIZING and last_state == READY:
        generation += 1
    elif state == INITIALIZING:
        generation = max(generation, 1)
    _write(folder, f"rank-{rank}.world", f"{state} {generation}\n")


def parse_world(text: str) -> tuple[str, int]:
    """Return the state and generation of a `rank-R.world` note."""
    state, _, generation = text.strip().partition(" ")
    return state, int(generation)


def hold_alive(folder: str, rank: int) -> int | None:
    """Open this rank's end of its `rank-R.alive` FIFO, if the launcher made one, and return it.

    Keep it open until the process ends (never write to it). Processes forked from this one
    close their copy, so that the FIFO closes with this process, not with its last child.
    """
    try:
        fd = os.open(os.path.join(folder, f"rank-{rank}.alive"), os.O_WRONLY | os.O_NONBLOCK)
    except OSError:  # no such FIFO (a Gloo job, another machine), or no launcher reading it
        return None

    def close_in_child() -> None:
        with contextlib.suppress(OSError):
            os.close(fd)

    os.register_at_fork(after_in_child=close_in_child)
    return fd

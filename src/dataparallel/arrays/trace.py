"""A Chrome-trace timeline of every collective, viewable in Perfetto (ui.perfetto.dev).

Each rank writes its own file, streamed as events happen (so a crashed job still leaves a trace):
`path` itself in a world of one, else `path` with `.rank<r>` before its suffix, or `path` with its
`{rank}` placeholder filled in. Per collective it records the whole call, and per fused bucket the
phases of Horovod's timeline: `queue` (from the bucket's first array to its flush), `pack`,
`communicate` (from the start of the engine's call to its completion) and `unpack`.

`dataparallel.world.timeline` (public as `dp.timeline`) starts one; the world owns it.
"""

from __future__ import annotations

import atexit
import json
import os
import threading
import time
from pathlib import Path
from types import TracebackType
from typing import TextIO

__all__ = ["Timeline"]


class Timeline:
    """Records trace events for one rank into a Chrome-trace JSON file."""

    def __init__(self, path: str | os.PathLike[str], rank: int = 0, size: int = 1) -> None:
        self.path = _rank_path(Path(path), rank, size)
        self.rank = rank
        self._lock = threading.Lock()
        self._next_id = 0
        self._file: TextIO | None = open(self.path, "w")  # noqa: SIM115 - closed in close()
        self._file.write("[\n")
        self._emit({"name": "process_name", "ph": "M", "args": {"name": f"rank {rank}"}})
        atexit.register(self.close)  # a script that never calls dp.finalize() still gets valid JSON

    @staticmethod
    def now() -> float:
        """Return the current time in microseconds, the trace's unit."""
        return time.perf_counter_ns() / 1e3

    def complete(self, name: str, start_us: float, **args: object) -> None:
        """Record a phase `name` that began at `start_us` and ends now."""
        now = self.now()
        self._emit({"name": name, "ph": "X", "ts": start_us, "dur": now - start_us, "args": args})

    def begin(self, name: str, **args: object) -> int:
        """Record the start of an asynchronous span; return its id for `end`."""
        with self._lock:
            self._next_id += 1
            span = self._next_id
        self._emit(
            {"name": name, "ph": "b", "cat": "comm", "id": span, "ts": self.now(), "args": args}
        )
        return span

    def end(self, name: str, span: int) -> None:
        """Record the end of the asynchronous span `span`."""
        self._emit({"name": name, "ph": "e", "cat": "comm", "id": span, "ts": self.now()})

    def _emit(self, event: dict[str, object]) -> None:
        event.setdefault("pid", self.rank)
        event.setdefault("tid", threading.get_ident() % 100_000)
        line = json.dumps(event) + ",\n"
        with self._lock:
            if self._file is not None:
                self._file.write(line)

    def close(self) -> None:
        """Finish the file (a valid JSON array) and stop recording."""
        with self._lock:
            if self._file is None:
                return
            file, self._file = self._file, None
        file.write(
            json.dumps(
                {
                    "name": "trace_end",
                    "ph": "i",
                    "s": "p",
                    "ts": self.now(),
                    "pid": self.rank,
                    "tid": 0,
                }
            )
            + "\n]\n"
        )
        file.close()
        atexit.unregister(self.close)

    @property
    def closed(self) -> bool:
        """Whether the file is finished (nothing more is recorded)."""
        return self._file is None

    def __enter__(self) -> Timeline:
        return self

    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        self.close()


def _rank_path(path: Path, rank: int, size: int) -> Path:
    if "{rank}" in str(path):
        return Path(str(path).format(rank=rank))
    if size == 1:
        return path
    return path.with_name(f"{path.stem}.rank{rank}{path.suffix}")

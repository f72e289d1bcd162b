"""The ranks' output, streamed to the launcher's own with a `[rank N] ` prefix on every line."""

from __future__ import annotations

import os
import re
import select
import threading
from collections.abc import Callable
from typing import BinaryIO, TextIO

__all__ = ["Output", "pump"]

# Seconds a partial line (a prompt, a progress bar being redrawn) waits before it is shown anyway.
PARTIAL_LINE_SECONDS = 0.5

# A line ends at "\n", or at a "\r" not starting "\r\n" (progress bars redraw with "\r").
_LINE_END = re.compile(rb"\n|\r(?=[^\n])")


class Output:
    """One of the launcher's streams (stdout or stderr), shared by the pumps of every rank.

    It writes whole lines at once, and remembers whose line is unfinished: a partial line shown
    early is continued without a new prefix, or closed with a newline if another rank writes first.
    """

    def __init__(self, stream: TextIO) -> None:
        self._stream = stream
        self._buffer: BinaryIO | None = getattr(stream, "buffer", None)
        self._lock = threading.Lock()
        self._open: bytes | None = None  # prefix of the rank whose line is unfinished

    def write(self, prefix: bytes, data: bytes, complete: bool) -> None:
        """Write `data` from the rank of `prefix`; `complete` when it ends its line."""
        with self._lock:
            head = b""
            if self._open != prefix:
                head = (b"\n" if self._open is not None else b"") + prefix
            self._emit(head + data)
            self._open = None if complete else prefix

    def end(self, prefix: bytes, data: bytes) -> None:
        """Write what the rank of `prefix` left without a final newline, and close its line."""
        with self._lock:
            unfinished = self._open == prefix
        if data or unfinished:
            self.write(prefix, data + b"\n", complete=True)

    def _emit(self, data: bytes) -> None:
        if self._buffer is not None:
            self._buffer.write(data)
            self._buffer.flush()
        else:
            self._stream.write(data.decode(errors="replace"))
            self._stream.flush()


def pump(
    source: BinaryIO,
    output: Output,
    prefix: bytes,
    tap: Callable[[bytes], None] | None = None,
) -> None:
    """Copy `source` to `output` until end of file, line by line, each line prefixed.

    A partial line that stays partial for `PARTIAL_LINE_SECONDS` (an `input()` prompt, a progress
    bar) is shown anyway. `tap`, if given, sees every complete line too (the MPI launcher reads
    mpiexec's report of a rank's death there).
    """
    fd = source.fileno()
    pending = b""
    while True:
        ready, _, _ = select.select([fd], [], [], PARTIAL_LINE_SECONDS)
        if not ready:
            if pending:
                output.write(prefix, pending, complete=False)
                pending = b""
            continue
        chunk = os.read(fd, 65536)
        if not chunk:
            break
        pending += chunk
        start = 0
        for match in _LINE_END.finditer(pending):
            line = pending[start : match.end()]
            output.write(prefix, line, complete=True)
            if tap is not None:
                tap(line)
            start = match.end()
        pending = pending[start:]
    output.end(prefix, pending)
    source.close()

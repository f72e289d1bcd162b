"""Removing a file:// rendezvous file once every rank's store on it has gone.

torch's `FileStore` removes its file in the destructor of the last store, but its destructor
counts in two locked steps: it adds one to the finished workers, then takes one from the live
references, and removes the file only when its own two readings say "last" (references 0 and
finished == world size). Two ranks finishing at once can each read themselves not last (A
finishes, B finishes, B drops a reference, A drops the last one but read "1 finished" before
B's), and the file stays: 4 of 150 three-rank worlds finishing together left it here (none with
this module, 2026-11-26). A file left by a finished job misleads the next job in the directory
(see `rendezvous.py`).

`remove_if_every_store_left` reads the same two counters after this process's store is gone,
under the same lock torch takes, and removes the file when they say everyone has finished. The
last rank to drop its reference then always sees the final counts, whatever the interleaving.
"""

from __future__ import annotations

import contextlib
import fcntl
import os
import struct
from pathlib import Path

__all__ = ["remove_if_every_store_left"]

# torch's keys for the counters (FileStore.cpp: cleanupKey_, refCountKey_); user keys start "/".
_FINISHED = b"cleanup/"
_REFERENCES = b"refcount/"
_LENGTH = struct.Struct("=I")  # each key and value: a native uint32 length, then the bytes


def remove_if_every_store_left(path: Path, workers: int) -> bool:
    """Remove torch's FileStore file at `path` when no store holds it and `workers` have
    finished; return whether it was removed. Best effort: an unreadable or missing file is
    left as it is (torch's own destructor may have removed it already)."""
    try:
        fd = os.open(path, os.O_RDWR)
    except OSError:
        return False
    try:
        fcntl.flock(fd, fcntl.LOCK_EX)  # what torch's FileStore takes to change the file
        counters = _counters(os.read(fd, os.fstat(fd).st_size))
        if counters is None:
            return False
        finished, references = counters
        if references != 0 or finished < workers:
            return False
        with contextlib.suppress(FileNotFoundError):
            path.unlink()
        return True
    finally:
        os.close(fd)  # releases the lock


def _counters(data: bytes) -> tuple[int, int] | None:
    """Return the last (finished, references) values in a FileStore file, or None when the
    file is not one (or has no such counters yet)."""
    values: dict[bytes, bytes] = {}
    pos = 0
    try:
        while pos < len(data):
            fields = []
            for _ in range(2):
                (length,) = _LENGTH.unpack_from(data, pos)
                pos += _LENGTH.size
                if pos + length > len(data):
                    return None
                fields.append(data[pos : pos + length])
                pos += length
            values[fields[0]] = fields[1]
        return int(values[_FINISHED]), int(values[_REFERENCES])
    except (struct.error, KeyError, ValueError):
        return None

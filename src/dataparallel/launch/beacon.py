"""The launcher's own line to ranks that mpiexec starts on other hosts: a lost host ends the job.

Under `--backend mpi` across hosts mpiexec starts the ranks over ssh itself, and nothing notices
a host whose link goes down while ranks wait on it. Hydra (MPICH's mpiexec) does not act on its
ssh client's end, and its control connection to the host's proxy, like MPI's connections to the
host's ranks, is silent rather than closed: a collective waiting on a silent peer has nothing in
flight for TCP to time out, so the job waits for `--timeout` (tests/test_multihost.py). The
launcher therefore keeps a line of its own to each rank, as it does through ssh under Gloo:

- it listens on a port of its machine (`Beacon`); the ranks find it in `BEACON_VARIABLE`
  (mpiexec passes the environment on), connect, say their rank and host, and both sides write an
  empty line every `config.beat_interval` seconds;
- the launcher takes a rank whose line stood still for the link timeout (`--link-timeout`) for
  out of reach (its host, or its link), names it, and ends the job;
- a rank on another host than the launcher's that hears nothing for `config.silence_limit`, or
  whose line ends (the launcher gone), leaves with its process group (the host's proxy and
  ranks), so that nothing of the job stays on a cut host (the runner's `follow`).

A rank that cannot reach the port runs unwatched, as it did before.
"""

from __future__ import annotations

import contextlib
import select
import socket
import threading
import time
from dataclasses import dataclass, field

from dataparallel.backends.rendezvous import address_toward
from dataparallel.config import beat_interval

__all__ = ["Beacon", "Lost", "hello"]


def hello(rank: int) -> bytes:
    """A rank's first line on the beacon: its rank and its host's name."""
    return f"{rank} {socket.gethostname()}\n".encode()


@dataclass(frozen=True)
class Lost:
    """A rank whose line stood still for the link timeout: its rank, host and address."""

    rank: int
    host: str
    address: str
    silent: float

    def __str__(self) -> str:
        return (
            f"rank {self.rank} on {self.host} ({self.address}) has not been heard for "
            f"{self.silent:.1f} s (--link-timeout): the host or its link is gone"
        )


@dataclass
class _Line:
    address: str
    heard: float
    said: bytes = b""  # what the rank wrote before its hello's end
    rank: int | None = None
    host: str = "?"
    ended: bool = False  # its rank closed it: finished, or dead (mpiexec reports that)
    lost: bool = False


@dataclass
class Beacon:
    """The launcher's side: a thread that accepts the ranks' lines, beats on them, and notes
    the first rank silent for `link_timeout` seconds (`lost`)."""

    link_timeout: float
    toward: str  # a host of the job: the port is announced at this machine's address toward it
    address: str | None = None  # `host:port` for `BEACON_VARIABLE` (None: no route to announce)
    _lost: list[Lost] = field(default_factory=list)
    _stop: threading.Event = field(default_factory=threading.Event)

    def __enter__(self) -> Beacon:
        self._server = socket.create_server(("0.0.0.0", 0))
        port = self._server.getsockname()[1]
        here = address_toward(self.toward, port)
        self.address = None if here is None else f"{here}:{port}"
        self._thread = threading.Thread(target=self._serve, name="dataparallel-beacon", daemon=True)
        self._thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self._stop.set()
        self._thread.join(timeout=5.0)
        self._server.close()

    def lost(self) -> Lost | None:
        """The first rank found silent for the link timeout, if one was."""
        return self._lost[0] if self._lost else None

    def _serve(self) -> None:
        interval = beat_interval(self.link_timeout)
        lines: dict[socket.socket, _Line] = {}
        beat = time.monotonic()
        try:
            while not self._stop.is_set():
                wait = max(0.0, min(beat - time.monotonic(), 0.1))
                readable, _, _ = select.select([self._server, *lines], [], [], wait)
                now = time.monotonic()
                for sock in readable:
                    if sock is self._server:
                        with contextlib.suppress(OSError):
                            connection, peer = self._server.accept()
                            connection.setblocking(False)
                            lines[connection] = _Line(str(peer[0]), now)
                        continue
                    self._read(sock, lines[sock], now)
                if now >= beat:
                    for sock in lines:
                        with contextlib.suppress(OSError):  # a cut host's buffer may be full
                            sock.send(b"\n")
                    beat = now + interval
                for sock, line in list(lines.items()):
                    if line.ended:
                        sock.close()
                        del lines[sock]
                    elif line.rank is not None and not line.lost:
                        self._judge(line, now)
        finally:
            for sock in lines:
                sock.close()

    def _judge(self, line: _Line, now: float) -> None:
        """Note `line`'s rank as lost once its line stood still for the link timeout."""
        if now - line.heard >= self.link_timeout:
            line.lost = True
            assert line.rank is not None
            self._lost.append(Lost(line.rank, line.host, line.address, now - line.heard))

    @staticmethod
    def _read(sock: socket.socket, line: _Line, now: float) -> None:
        try:
            data = sock.recv(4096)
        except BlockingIOError:
            return
        except OSError:
            data = b""
        if not data:
            line.ended = True
            return
        line.heard = now
        if line.rank is None:
            line.said += data
            first, newline, _ = line.said.partition(b"\n")
            if newline:
                rank, _, host = first.decode(errors="replace").partition(" ")
                with contextlib.suppress(ValueError):
                    line.rank, line.host = int(rank), host or "?"

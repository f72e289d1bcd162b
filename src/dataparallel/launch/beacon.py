"""The launcher's own line to ranks that mpiexec starts on other hosts: a lost host ends the job.

Under `--backend mpi` across hosts mpiexec starts the ranks over ssh itself, and nothing notices
a host whose link goes down while ranks wait on it. Hydra (MPICH's mpiexec) does not act on its
ssh client's end, and its control connection to the host's proxy, like MPI's connections to the
host's ranks, is silent rather than closed: a collective waiting on a silent peer has nothing in
flight for TCP to time out, so the job waits for `--timeout` (tests/test_multihost.py). The
launcher therefore keeps a line of its own to each rank, as it does through ssh under Gloo:

- it listens on a port of its machine, at the address toward the other hosts (`Beacon`), not on
  every interface; the ranks find it in `BEACON_VARIABLE` (mpiexec passes the environment on),
  with a secret of the job's own, connect, say the secret, their rank and their host, and both
  sides write an empty line every `config.beat_interval` seconds. A connection that does not
  say the secret in its first line (or says nothing for the link timeout) is closed and never
  watched: nothing else that reaches the port can pose as a rank, be taken for a lost one, or
  keep a line open;
- the launcher takes a rank whose line stood still for the link timeout (`--link-timeout`) for
  out of reach (its host, or its link), names it, and ends the job;
- a rank on another host than the launcher's that hears nothing for `config.silence_limit`, or
  whose line ends (the launcher gone), leaves with its process group (the host's proxy and
  ranks), so that nothing of the job stays on a cut host (the runner's `follow`);
- a rank whose own connection to another host stopped answering for the link timeout while
  both lines beat on (a *split*: the hosts cannot reach each other, the launcher reaches both;
  `backends/connections.watch_every` watches MPI's connections in the rank) says so on its line,
  `lost ADDRESS` (`report`), and the launcher names both sides (`Cut`) and ends the job; a
  report of an address that is no host of the job (the program's own connection elsewhere)
  ends nothing.

A rank that cannot reach the port runs unwatched, as it did before.
"""

from __future__ import annotations

import contextlib
import hmac
import secrets
import select
import socket
import threading
import time
from collections.abc import Iterable
from dataclasses import dataclass, field

from dataparallel.backends.rendezvous import address_toward, is_here
from dataparallel.config import beat_interval

__all__ = ["Beacon", "Cut", "Lost", "hello", "parse_address", "report"]

# The longest first line a rank says (its secret, rank and host name): anything longer is not one.
_HELLO_BYTES = 1024
# What begins a rank's report of a connection lost (`report`).
_LOST = "lost"


def hello(secret: str, rank: int) -> bytes:
    """A rank's first line on the beacon: the job's secret, its rank and its host's name."""
    return f"{secret} {rank} {socket.gethostname()}\n".encode()


def report(peer: str) -> bytes:
    """A rank's line on the beacon saying that its connection to `peer` (an address) stopped
    answering for the link timeout."""
    return f"{_LOST} {peer}\n".encode()


def parse_address(value: str) -> tuple[str, str, int]:
    """Return the secret, host and port of `BEACON_VARIABLE`'s value, `SECRET@HOST:PORT`.

    Raises:
        ValueError: the value is not of that form.

    >>> parse_address("5eb2@10.0.0.1:41234")
    ('5eb2', '10.0.0.1', 41234)
    """
    secret, at, where = value.partition("@")
    host, colon, port = where.rpartition(":")
    if not (secret and at and host and colon and port.isdigit()):
        raise ValueError(f"{value!r} is not SECRET@HOST:PORT")
    return secret, host, int(port)


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


@dataclass(frozen=True)
class Cut:
    """A rank whose connection to another host stopped answering for the link timeout while
    the launcher heard both (a split): the rank, its host and address, the peer's address, and
    the ranks the launcher hears from there (`rank N on HOST` each)."""

    rank: int
    host: str
    address: str
    peer: str
    there: tuple[str, ...]
    link_timeout: float

    def __str__(self) -> str:
        there = f" ({', '.join(self.there)})" if self.there else ""
        return (
            f"rank {self.rank} on {self.host} ({self.address}) lost its link to {self.peer}"
            f"{there}: that host has not answered the rank for {self.link_timeout:g} s "
            "(--link-timeout), though the launcher still hears both. The link between the two "
            "hosts is down while each reaches the launcher (a split; under Gloo the rank's call "
            "raises dp.LinkLostError)"
        )


@dataclass
class _Line:
    address: str
    heard: float
    said: bytes = b""  # what the rank wrote since its last line's end
    rank: int | None = None  # None until it said the job's secret and its rank
    host: str = "?"
    ended: bool = False  # its rank closed it: finished, or dead (mpiexec reports that)
    lost: bool = False


@dataclass
class Beacon:
    """The launcher's side: a thread that accepts the ranks' lines, beats on them, and notes
    the first rank silent for `link_timeout` seconds (`lost`).

    It listens at this machine's address toward `toward` only, and watches only the lines that
    begin with its `secret` (made here, one per job); the others are closed (`refused`, their
    addresses). Without a route toward `toward` it does not listen, and `address` is None.
    """

    link_timeout: float
    toward: str  # a host of the job: the port is bound to this machine's address toward it
    address: str | None = None  # `SECRET@HOST:PORT` for `BEACON_VARIABLE` (None: not listening)
    refused: list[str] = field(default_factory=list)
    secret: str = field(default_factory=lambda: secrets.token_hex(16))
    _lost: list[Lost] = field(default_factory=list)
    _cut: list[Cut] = field(default_factory=list)
    _stop: threading.Event = field(default_factory=threading.Event)
    _server: socket.socket | None = None
    _thread: threading.Thread | None = None

    def __enter__(self) -> Beacon:
        here = address_toward(self.toward, 9)  # the port only picks a route
        if here is None:
            return self
        self._server = socket.create_server((here, 0))
        self.address = f"{self.secret}@{here}:{self._server.getsockname()[1]}"
        self._thread = threading.Thread(target=self._serve, name="dataparallel-beacon", daemon=True)
        self._thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self._stop.set()
        if self._thread is not None:
            self._thread.join(timeout=5.0)
        if self._server is not None:
            self._server.close()

    def lost(self) -> Lost | None:
        """The first rank found silent for the link timeout, if one was."""
        return self._lost[0] if self._lost else None

    def cut(self) -> Cut | None:
        """The first rank that reported a connection to another host lost, if one did."""
        return self._cut[0] if self._cut else None

    def _serve(self) -> None:
        assert self._server is not None
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
                    self._read(sock, lines[sock], now, lines.values())
                if now >= beat:
                    for sock, line in lines.items():
                        if line.rank is None:
                            continue  # not a rank of this job (yet)
                        with contextlib.suppress(OSError):  # a cut host's buffer may be full
                            sock.send(b"\n")
                    beat = now + interval
                for sock, line in list(lines.items()):
                    if (
                        line.rank is None
                        and not line.ended
                        and now - line.heard >= self.link_timeout
                    ):
                        self.refused.append(line.address)  # connected, and said nothing
                        line.ended = True
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

    def _read(self, sock: socket.socket, line: _Line, now: float, lines: Iterable[_Line]) -> None:
        try:
            data = sock.recv(4096)
        except BlockingIOError:
            return
        except OSError:
            data = b""
        if not data:
            line.ended = True
            return
        line.said += data
        if line.rank is None:
            first, newline, rest = line.said.partition(b"\n")
            if not newline and len(line.said) <= _HELLO_BYTES:
                return  # the hello's end is yet to come (its beginning does not count as heard)
            said = first.decode(errors="replace").split(" ", 2)
            if (
                not newline
                or len(said) < 2
                or not said[1].isdigit()
                or not hmac.compare_digest(said[0].encode(), self.secret.encode())
            ):
                self.refused.append(line.address)
                line.ended = True
                return
            line.rank, line.host = int(said[1]), (said[2] if len(said) > 2 else "") or "?"
            line.said = rest
        line.heard = now
        *said_lines, line.said = line.said.split(b"\n")
        if len(line.said) > _HELLO_BYTES:  # no line of a rank is that long
            line.said = b""
        for each in said_lines:  # beats (empty), and reports of a connection lost
            word, _, peer = each.decode(errors="replace").partition(" ")
            if word == _LOST and peer:
                self._note_cut(line, peer, lines)

    def _note_cut(self, line: _Line, peer: str, lines: Iterable[_Line]) -> None:
        """Note `line`'s rank's report of its link to `peer` lost, where `peer` is a host of
        the job: one of the ranks' lines comes from there, or it is this machine. A connection
        of the program's own to somewhere else (a download from a server that does not answer)
        is no rank's link, and ends nothing."""
        assert line.rank is not None
        there = tuple(
            f"rank {other.rank} on {other.host}"
            for other in lines
            if other.address == peer and other.rank is not None
        )
        try:
            ours = bool(there) or is_here(peer)
        except OSError:
            ours = False
        if ours:
            self._cut.append(
                Cut(line.rank, line.host, line.address, peer, there, self.link_timeout)
            )

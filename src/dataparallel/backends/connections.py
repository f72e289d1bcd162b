"""This process's TCP connections: found by their peer, kept alive, watched, cut.

Gloo's and MPI's connections between hosts are plain TCP, and TCP says nothing about a peer
that stopped answering while nothing is in flight: a rank waiting to receive from a host whose
link went down, or that can no longer reach it while the launcher still can (a *split*), waits
out Gloo's timeout (`DATAPARALLEL_TIMEOUT`, minutes), and under MPI for ever. Four tools bound
that:

- `keep_alive`: every connection Gloo makes to another address (`rendezvous.gloo_connecting`)
  gets TCP keep-alive, as `dataparallel run`'s ssh gets `ServerAliveInterval`: once it has been
  idle for a second the kernel asks the peer's kernel every second, and after `--link-timeout`
  (rounded up) unanswered asks fails the connection with "Connection timed out": Gloo's call
  waiting on it raises. The peer's kernel answers whatever its process does (computing,
  stalled, not reading), so only a peer out of reach is ever taken for gone; and the asks are
  sent only while nothing is in flight, so a full receive window (a peer busy elsewhere) is not
  one either.
- The watch (`Links`, a thread looking every eighth of the link timeout, `look_interval`, in
  processes that have such connections) judges each watched connection by `TCP_INFO`: one that
  waits on its peer (data in flight unacknowledged, or keep-alive asks unanswered) with no
  acknowledgement for the link timeout is *lost*, and handed to its callback, once (a look
  late at most: an eighth of the timeout). Gloo's (`keep_alive`) is shut down at once
  (`_fail`), with every other Gloo connection to the same host, its peer's address noted
  (`found_lost`): the Gloo call waiting on any of them wakes with "Connection closed by peer",
  which `translate_error` makes a `LinkLostError` for an address noted here. This covers data
  in flight, which keep-alive does not (TCP alone would retransmit for about 15 minutes,
  `tcp_retries2`); waiting instead for the kernel to fail it (a `TCP_USER_TIMEOUT`) would wait
  for its next retransmission, backed off to 0.2, 0.6, 1.4 s after the first send. (Given to
  every connection from the start, `TCP_USER_TIMEOUT` would also fail a healthy one whose peer
  does not read for that long: its window full, the peer's kernel answering.)
- `watch_every`: a rank that mpiexec started on another host than the launcher's has MPI's
  connections, made by MPI whenever it needs one and never reported: the watch adopts every
  new connection of the process to another address as it appears, gives it keep-alive asks
  (which the kernel acts on only after 127 unanswered, two minutes: MPI is told nothing, the
  watch decides), and hands a lost one to the rank's report to the launcher
  (`launch/runner.py`, `launch/beacon.py`).
- `unreachable`: which of some peers' addresses answer no connect within a time (a group
  that could not connect: `elastic/forming.py`).
- `cut_connections`: shut down the connections to given addresses, which wakes a thread blocked
  on one as if the peer had closed it (an elastic worker's watch, `elastic/liveness.py`);
  `shut_down`, the connections a Gloo group made (`GlooBackend.sever`: a world that lost a
  member cuts them all, so that no survivor waits in a call for a peer that waits in another
  call for it).

Connections are found in Linux's `/proc/self/net/tcp{,6}` and `/proc/self/fd`; elsewhere none
is, and nothing is done.
"""

from __future__ import annotations

import atexit
import contextlib
import errno
import ipaddress
import math
import os
import selectors
import socket
import struct
import threading
import time
from collections.abc import Callable, Collection, Iterator, Mapping
from dataclasses import dataclass

__all__ = [
    "WATCH_INTERVAL",
    "Links",
    "Peer",
    "connections",
    "cut_connections",
    "forget_lost",
    "found_lost",
    "keep_alive",
    "look_interval",
    "shut_down",
    "stalled",
    "tcp_sockets",
    "unreachable",
    "watch_every",
]

Peer = tuple[str, int]  # a connection's remote (IPv4 address, port)

# The longest interval between two looks at the watched connections (`look_interval`).
WATCH_INTERVAL = 0.25
# The looks within a link timeout, and the shortest interval between two (seconds).
LOOKS_PER_TIMEOUT = 8
LEAST_INTERVAL = 0.05
# The longest `Links.stop` waits for the thread (seconds); a look takes milliseconds.
_STOP_WAIT = 5.0
# struct tcp_info (linux/tcp.h): 8 single bytes, then 32-bit fields; the ones read here are
# tcpi_probes (the 4th byte: asks unanswered, keep-alive's or a zero window's), tcpi_unacked
# (the 5th field), tcpi_last_data_sent (the 10th: new data, milliseconds ago) and
# tcpi_last_ack_recv (the 13th, milliseconds).
_TCP_INFO = struct.Struct("=8B13I")
# The most unanswered keep-alive asks Linux takes (TCP_KEEPCNT): the kernel acts long after
# the watch has (`watch_every`).
_KEEPCNT_MOST = 127


def look_interval(link_timeout: float) -> float:
    """How often to look at connections whose peer is lost after `link_timeout` seconds: an
    eighth of it, so that the look that finds a loss comes an eighth late at most, between
    `LEAST_INTERVAL` (a look reads every watched connection: a busy process's thread) and
    `WATCH_INTERVAL`.

    >>> look_interval(5), look_interval(1), look_interval(0.5), look_interval(0.1)
    (0.25, 0.125, 0.0625, 0.05)
    """
    return min(WATCH_INTERVAL, max(LEAST_INTERVAL, link_timeout / LOOKS_PER_TIMEOUT))


def connections() -> dict[str, Peer]:
    """Return this process's TCP connections (not listening sockets): each one's socket inode
    and its peer's (IPv4 address, port)."""
    peers = dict(tcp_sockets())
    return {inode: peers[inode] for inode, _ in _socket_fds(set(peers))}


def keep_alive(made: Mapping[str, Peer], link_timeout: float) -> int:
    """Give the connections of `made` (socket inodes and their peers: those a Gloo group just
    made) whose peer is not loopback TCP keep-alive, asked after 1 s idle, every second, given
    up after `link_timeout` seconds (rounded up) of silence; and watch them (`Links`): one whose
    peer has not answered for the link timeout is shut down, its peer noted lost (`_fail`).
    Return how many."""
    if not hasattr(socket, "TCP_KEEPIDLE"):  # not Linux: TCP's own rules
        return 0
    far = {inode for inode, peer in made.items() if not _loopback(peer[0])}
    kept = {}
    for inode, fd in _socket_fds(far):
        with contextlib.suppress(OSError), socket.socket(fileno=os.dup(fd)) as connection:
            _ask(connection, max(1, math.ceil(link_timeout)))
            kept[inode] = made[inode]
    if kept:
        _links.watch(kept, link_timeout, _fail)
    return len(kept)


def watch_every(link_timeout: float, lost: Callable[[Peer], None], ignore: Collection[str]) -> None:
    """Watch every connection this process has or makes from now on to an address that is not
    loopback, but those of `ignore` (socket inodes): each gets keep-alive asks (which the
    kernel acts on only after two minutes), and one whose peer has not answered for
    `link_timeout` seconds is handed to `lost` with its peer, once. Nothing is done to the
    connection itself: `lost` says what follows. For a process whose connections something
    else makes, and never reports (MPI's)."""
    if hasattr(socket, "TCP_KEEPIDLE"):
        _links.adopt(link_timeout, lambda _, peer: lost(peer), ignore)


def _ask(connection: socket.socket, count: int) -> None:
    """Turn keep-alive on: asked after 1 s idle, every second, `count` unanswered asks."""
    connection.setsockopt(socket.SOL_SOCKET, socket.SO_KEEPALIVE, 1)
    connection.setsockopt(socket.IPPROTO_TCP, socket.TCP_KEEPIDLE, 1)
    connection.setsockopt(socket.IPPROTO_TCP, socket.TCP_KEEPINTVL, 1)
    connection.setsockopt(socket.IPPROTO_TCP, socket.TCP_KEEPCNT, count)


# The addresses of peers whose Gloo connection the watch found lost (`_fail`) since the last
# group formed (`forget_lost`): Gloo's error for such a connection says only that it closed.
_lost: set[str] = set()


def found_lost(address: str) -> bool:
    """Whether the watch found a connection of this process's groups to `address` lost (its
    peer silent for the link timeout) since the last group formed."""
    return address in _lost


def forget_lost() -> None:
    """Forget the peers found lost: a new group forms (`rendezvous.gloo_connecting`), and a
    connection of its that closes is a peer gone, unless the watch finds it lost again."""
    _lost.clear()


def _fail(connection: socket.socket, peer: Peer) -> None:
    """Note `peer`'s address as lost, and shut `connection` down, and every other watched
    connection of this process's groups to that address: a call waiting on any of them wakes
    at once, as if the peer had closed it. The peer's host has not answered this one for the
    link timeout, so it answers none: the one a call waits on may belong to another group
    than the one found first (an idle group's keep-alive asks go unanswered before the step's
    data does), and would otherwise be found only once its own wait had lasted that long.
    Each one's user timeout of a millisecond then has the kernel drop it at its next
    retransmission, instead of sending its data and its end for minutes to a peer that does
    not answer."""
    _lost.add(peer[0])  # before the shutdown: the waiting call's error may come at once
    _cut(connection)
    for _, fd in _socket_fds(_links.forget(peer[0], _fail)):
        with contextlib.suppress(OSError), socket.socket(fileno=os.dup(fd)) as other:
            _cut(other)


def _cut(connection: socket.socket) -> None:
    with contextlib.suppress(OSError):
        connection.setsockopt(socket.IPPROTO_TCP, socket.TCP_USER_TIMEOUT, 1)
        connection.shutdown(socket.SHUT_RDWR)


def stalled(
    since: float | None, now: float, waiting: int, ack_age: float, silent: float = 0.0
) -> float | None:
    """Return since when a connection has waited on its peer with no acknowledgement (None: it
    does not wait), given the previous answer `since`, the time `now`, what it waits on (its
    unacknowledged segments and unanswered asks), the seconds since its last acknowledgement,
    and how long the peer is known to have been silent already (`silent`; data in flight: the
    shorter of the seconds since its last acknowledgement and since the last data went out,
    which waits unacknowledged since, and of the time since the look before). The wait counts
    from that, at the first look that saw it waiting or after a newer acknowledgement; asks
    unanswered know nothing more (their peer answered the ask before, a second earlier at
    most), and count from that look.

    >>> stalled(None, 10.0, 3, 4.0), stalled(10.0, 12.0, 3, 6.0), stalled(10.0, 12.0, 3, 0.5)
    (10.0, 10.0, 12.0)
    >>> stalled(None, 10.0, 3, 4.0, silent=0.3), stalled(10.0, 12.0, 3, 0.5, silent=0.5)
    (9.7, 11.5)
    >>> stalled(10.0, 12.0, 0, 6.0) is None
    True
    """
    if waiting == 0:
        return None
    acknowledged = now - ack_age
    if since is None or acknowledged > since:
        return now - silent
    return since


@dataclass
class _Watched:
    peer: Peer
    link_timeout: float
    lost: Callable[[socket.socket, Peer], None]
    since: float | None = None  # since when it has waited on its peer (`stalled`)


@dataclass
class _Adopting:
    link_timeout: float
    lost: Callable[[socket.socket, Peer], None]
    seen: set[str]  # connections already adopted, or never to be (`ignore`)


class Links:
    """A watch over connections: a thread that, every `look_interval` of the least link timeout
    watched, reads each watched connection's `TCP_INFO` (`look`), hands one that waited on its
    peer with no acknowledgement for its link timeout to its callback and forgets it, and
    forgets those closed. The process has one (`keep_alive`, `watch_every`); a benchmark makes
    its own."""

    def __init__(self) -> None:
        self.interval = WATCH_INTERVAL  # between two looks (`look_interval`)
        self._watched: dict[str, _Watched] = {}
        self._adopting: _Adopting | None = None
        self._lock = threading.Lock()
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None
        self._registered = False  # its stop, with atexit

    def watch(
        self,
        peers: Mapping[str, Peer],
        link_timeout: float,
        lost: Callable[[socket.socket, Peer], None],
    ) -> None:
        """Watch the connections of `peers` (socket inodes and their peers), each handed to
        `lost` once its peer has not answered for `link_timeout` seconds; start the thread."""
        with self._lock:
            for inode, peer in peers.items():
                self._watched[inode] = _Watched(peer, link_timeout, lost)
            self.interval = min(self.interval, look_interval(link_timeout))
        self.start()

    def forget(self, address: str, lost: Callable[[socket.socket, Peer], None]) -> set[str]:
        """Stop watching the connections to `address` that would be handed to `lost`; return
        them (socket inodes)."""
        with self._lock:
            gone = {i for i, e in self._watched.items() if e.peer[0] == address and e.lost is lost}
            for inode in gone:
                del self._watched[inode]
        return gone

    def adopt(
        self,
        link_timeout: float,
        lost: Callable[[socket.socket, Peer], None],
        ignore: Collection[str],
    ) -> None:
        """Also watch, from each look on, every connection of this process to an address that
        is not loopback, but `ignore`'s, giving it keep-alive asks the kernel acts on only
        after two minutes."""
        with self._lock:
            self._adopting = _Adopting(link_timeout, lost, set(ignore))
            self.interval = min(self.interval, look_interval(link_timeout))
        self.start()

    def start(self) -> None:
        """Start the thread (where it is not running), which stops at exit or at `stop`."""
        with self._lock:
            if self._thread is not None:
                return
            if not self._registered:
                atexit.register(self.stop)
                self._registered = True
            self._stop.clear()
            self._thread = threading.Thread(
                target=self._run, name="dataparallel-links", daemon=True
            )
            self._thread.start()

    def stop(self) -> None:
        """Stop the thread and wait for it (a while: a callback may block, a report to a
        launcher out of reach); what is watched stays so (`start` again)."""
        self._stop.set()
        thread, self._thread = self._thread, None
        if thread is not None and thread is not threading.current_thread():
            thread.join(timeout=_STOP_WAIT)

    def _run(self) -> None:
        while not self._stop.wait(self.interval):
            self.look()

    def look(self) -> None:
        """Look at every watched connection once (the thread's turn)."""
        fds = dict(_socket_fds(None))
        with self._lock:
            for inode in set(self._watched) - set(fds):
                del self._watched[inode]  # closed
            if self._adopting is not None:
                self._adopt(self._adopting, fds)
            watched = list(self._watched.items())
        now = time.monotonic()
        for inode, entry in watched:
            with contextlib.suppress(OSError), socket.socket(fileno=os.dup(fds[inode])) as sock:
                fields = _TCP_INFO.unpack_from(
                    sock.getsockopt(socket.IPPROTO_TCP, socket.TCP_INFO, 104)
                )
                unacked, probes = fields[8 + 4], fields[3]
                ack_age, sent_age = fields[8 + 12] / 1000, fields[8 + 9] / 1000
                # At most a look's interval: a connection still connecting has sent no data and
                # heard no acknowledgement, and both ages read as the machine's uptime.
                silent = min(ack_age, sent_age, self.interval) if unacked else 0.0
                entry.since = stalled(entry.since, now, unacked + probes, ack_age, silent)
                if entry.since is not None and now - entry.since >= entry.link_timeout:
                    with self._lock:
                        self._watched.pop(inode, None)
                    entry.lost(sock, entry.peer)  # the peer is out of reach

    def _adopt(self, adopting: _Adopting, fds: Mapping[str, int]) -> None:
        """Watch this process's connections not seen before (under the lock)."""
        fresh = set(fds) - adopting.seen - set(self._watched)
        if not fresh:
            return
        table = dict(tcp_sockets())
        for inode in fresh:
            peer = table.get(inode)
            if peer is None:  # not a connection: never one, or not connected yet
                if not _may_connect(fds[inode]):
                    adopting.seen.add(inode)
                continue
            adopting.seen.add(inode)
            if _loopback(peer[0]):
                continue
            with contextlib.suppress(OSError), socket.socket(fileno=os.dup(fds[inode])) as sock:
                _ask(sock, _KEEPCNT_MOST)
                self._watched[inode] = _Watched(peer, adopting.link_timeout, adopting.lost)


def _may_connect(fd: int) -> bool:
    """Whether socket `fd` is a TCP socket that may yet connect (not listening)."""
    with contextlib.suppress(OSError), socket.socket(fileno=os.dup(fd)) as sock:
        tcp = sock.family in (socket.AF_INET, socket.AF_INET6) and sock.type == socket.SOCK_STREAM
        return tcp and not sock.getsockopt(socket.SOL_SOCKET, socket.SO_ACCEPTCONN)
    return False


_links = Links()  # this process's watch


# What a connect ends with when the peer's host answered (its kernel: nothing listens there, or
# the connection was reset): the host is in reach.
_ANSWERED = (0, errno.ECONNREFUSED, errno.ECONNRESET)


def unreachable(peers: Collection[Peer], wait: float) -> set[Peer]:
    """Return the `peers` (IPv4 address, port) whose host answers no connect within `wait`
    seconds. A connect accepted or refused is an answer, whatever listens there; one this
    machine cannot send (no route to the host: "Permission denied", "Invalid argument", "No
    route to host"), or that stays unanswered, is not. The connects go out together, and are
    closed as they end."""
    silent: set[Peer] = set()
    with selectors.DefaultSelector() as pending:
        for peer in peers:
            connection = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
            connection.setblocking(False)
            code = connection.connect_ex(peer)
            if code == errno.EINPROGRESS:
                pending.register(connection, selectors.EVENT_WRITE, peer)
                continue
            if code not in _ANSWERED:
                silent.add(peer)
            connection.close()
        deadline = time.monotonic() + wait
        while pending.get_map() and (left := deadline - time.monotonic()) > 0:
            for key, _ in pending.select(left):
                done = key.fileobj
                assert isinstance(done, socket.socket)
                pending.unregister(done)
                if done.getsockopt(socket.SOL_SOCKET, socket.SO_ERROR) not in _ANSWERED:
                    silent.add(key.data)
                done.close()
        for key in list(pending.get_map().values()):
            pending.unregister(key.fileobj)
            silent.add(key.data)  # unanswered
            assert isinstance(key.fileobj, socket.socket)
            key.fileobj.close()
    return silent


def cut_connections(addresses: set[str], keep: tuple[str, int] | None = None) -> int:
    """Shut down this process's TCP connections to any of `addresses` (IPv4), but `keep`'s
    (address, port); return how many. A thread blocked reading or writing one wakes with an
    end of stream or an error, as if the peer had closed it."""
    if not addresses:
        return 0
    return shut_down(
        {inode for inode, remote in tcp_sockets() if remote[0] in addresses and remote != keep}
    )


def shut_down(inodes: Collection[str]) -> int:
    """Shut down this process's connections of `inodes` (socket inodes; those still open);
    return how many. A thread blocked reading or writing one wakes with an end of stream or an
    error, and so does the peer's end, as if either process had closed it."""
    cut = 0
    for _, fd in _socket_fds(set(inodes)):
        with contextlib.suppress(OSError), socket.socket(fileno=os.dup(fd)) as connection:
            connection.shutdown(socket.SHUT_RDWR)
            cut += 1
    return cut


def _loopback(address: str) -> bool:
    return ipaddress.ip_address(address).is_loopback


def tcp_sockets() -> Iterator[tuple[str, tuple[str, int]]]:
    """Each TCP socket of this network namespace that is not listening: its inode and its
    remote (IPv4 address, port); IPv6 ones only where they carry an IPv4 address."""
    for table in ("/proc/self/net/tcp", "/proc/self/net/tcp6"):
        try:
            with open(table, encoding="ascii") as file:
                lines = file.read().splitlines()[1:]
        except OSError:
            continue
        for line in lines:
            fields = line.split()
            if len(fields) < 10 or fields[3] == "0A":  # 0A: listening
                continue
            hex_address, _, hex_port = fields[2].partition(":")
            raw = bytes.fromhex(hex_address)
            # Each 32-bit word is in the machine's order (little-endian where this runs).
            words = b"".join(raw[i : i + 4][::-1] for i in range(0, len(raw), 4))
            if len(words) == 4:
                address = str(ipaddress.IPv4Address(words))
            else:
                mapped = ipaddress.IPv6Address(words).ipv4_mapped
                if mapped is None:
                    continue
                address = str(mapped)
            yield fields[9], (address, int(hex_port, 16))


def _socket_fds(inodes: set[str] | None) -> Iterator[tuple[str, int]]:
    """This process's file descriptors that are the sockets of `inodes` (None: every socket),
    with their inode."""
    if inodes is not None and not inodes:
        return
    with contextlib.suppress(OSError):
        for entry in os.listdir("/proc/self/fd"):
            with contextlib.suppress(OSError):
                target = os.readlink(f"/proc/self/fd/{entry}")
                if target.startswith("socket:[") and (inodes is None or target[8:-1] in inodes):
                    yield target[8:-1], int(entry)

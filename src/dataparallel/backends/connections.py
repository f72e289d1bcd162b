"""This process's TCP connections: found by their peer, kept alive, cut.

Gloo's connections between hosts are plain TCP, and TCP says nothing about a peer that stopped
answering while nothing is in flight: a rank waiting to receive from a host whose link went
down, or that can no longer reach it while the launcher still can (a *split*), waits out Gloo's
timeout (`DATAPARALLEL_TIMEOUT`, minutes). Two tools bound that:

- `keep_alive`: every connection Gloo makes to another address (`rendezvous.gloo_connecting`)
  gets TCP keep-alive, as `dataparallel run`'s ssh gets `ServerAliveInterval`: once it has been
  idle for a second the kernel asks the peer's kernel every second, and after `--link-timeout`
  (rounded up) unanswered asks fails the connection with "Connection timed out": Gloo's call
  waiting on it raises. The peer's kernel answers whatever its process does (computing,
  stalled, not reading), so only a peer out of reach is ever taken for gone; and the asks are
  sent only while nothing is in flight, so a full receive window (a peer busy elsewhere) is not
  one either. A connection cut while data of its own is in flight in both directions is not
  covered: TCP's retransmissions decide there (`tcp_retries2`, about 15 minutes).
  (`TCP_USER_TIMEOUT` would cover it, but also fails a healthy connection whose peer does not
  read for that long: it is not used.)
- `keep_alive` also watches those connections (a thread, every `WATCH_INTERVAL` seconds) for
  the case keep-alive cannot see: data of this process in flight that the peer's kernel has not
  acknowledged for the link timeout (`TCP_INFO`: unacknowledged segments, and the time since the
  last acknowledgement), where TCP itself would retransmit for about 15 minutes
  (`tcp_retries2`). Such a connection is given a `TCP_USER_TIMEOUT` of a millisecond, so that
  the kernel fails it at its next retransmission, "Connection timed out", as keep-alive would.
  (Given to every connection from the start, `TCP_USER_TIMEOUT` would also fail a healthy one
  whose peer does not read for that long: its window full, the peer's kernel answering.)
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
import ipaddress
import math
import os
import socket
import struct
import threading
import time
from collections.abc import Collection, Iterator

__all__ = [
    "WATCH_INTERVAL",
    "connections",
    "cut_connections",
    "keep_alive",
    "shut_down",
    "stalled",
    "tcp_sockets",
]

# How often the connections kept alive are looked at for data the peer does not acknowledge.
WATCH_INTERVAL = 0.25
# struct tcp_info (linux/tcp.h): 8 single bytes, then 32-bit fields; the ones read here are
# tcpi_unacked (the 5th) and tcpi_last_ack_recv (the 13th, milliseconds).
_TCP_INFO = struct.Struct("=8B13I")

_watched: dict[str, float] = {}  # socket inode -> its link timeout (seconds)
_pending: dict[str, float] = {}  # socket inode -> since when data waits unacknowledged
_watch_lock = threading.Lock()
_watch_stop = threading.Event()
_watcher: threading.Thread | None = None


def connections() -> dict[str, tuple[str, int]]:
    """Return this process's TCP connections (not listening sockets): each one's socket inode
    and its peer's (IPv4 address, port)."""
    peers = dict(tcp_sockets())
    return {inode: peers[inode] for inode, _ in _socket_fds(set(peers))}


def keep_alive(since: Collection[str], link_timeout: float) -> int:
    """Give this process's TCP connections that are not in `since` (socket inodes: those it had
    before) and whose peer is not loopback TCP keep-alive: asked after 1 s idle, every second,
    given up after `link_timeout` seconds (rounded up) of silence. Return how many."""
    if not hasattr(socket, "TCP_KEEPIDLE"):  # not Linux: TCP's own rules
        return 0
    peers = {i: p for i, p in tcp_sockets() if i not in since and not _loopback(p[0])}
    count = 0
    for _, fd in _socket_fds(set(peers)):
        with contextlib.suppress(OSError), socket.socket(fileno=os.dup(fd)) as connection:
            connection.setsockopt(socket.SOL_SOCKET, socket.SO_KEEPALIVE, 1)
            connection.setsockopt(socket.IPPROTO_TCP, socket.TCP_KEEPIDLE, 1)
            connection.setsockopt(socket.IPPROTO_TCP, socket.TCP_KEEPINTVL, 1)
            connection.setsockopt(
                socket.IPPROTO_TCP, socket.TCP_KEEPCNT, max(1, math.ceil(link_timeout))
            )
            count += 1
    if count:
        _watch(peers, link_timeout)
    return count


def stalled(since: float | None, now: float, unacked: int, ack_age: float) -> float | None:
    """Return since when a connection's data has waited for an acknowledgement (None: it does
    not wait), given the previous answer `since`, the time `now`, its unacknowledged segments
    and the seconds since its last acknowledgement. The wait counts from the first look that
    saw data waiting, or from a newer acknowledgement, whichever is later.

    >>> stalled(None, 10.0, 3, 4.0), stalled(10.0, 12.0, 3, 6.0), stalled(10.0, 12.0, 3, 0.5)
    (10.0, 10.0, 12.0)
    >>> stalled(10.0, 12.0, 0, 6.0) is None
    True
    """
    if unacked == 0:
        return None
    acknowledged = now - ack_age
    if since is None or acknowledged > since:
        return now
    return since


def _watch(peers: Collection[str], link_timeout: float) -> None:
    global _watcher
    with _watch_lock:
        _watched.update(dict.fromkeys(peers, link_timeout))
        if _watcher is None:
            _watcher = threading.Thread(target=_look, name="dataparallel-links", daemon=True)
            _watcher.start()
            atexit.register(_watch_stop.set)


def _look() -> None:
    """Every `WATCH_INTERVAL` seconds, fail the watched connections whose data has waited for an
    acknowledgement for their link timeout; forget those closed."""
    while not _watch_stop.wait(WATCH_INTERVAL):
        with _watch_lock:
            watched = dict(_watched)
        found = dict(_socket_fds(set(watched)))
        now = time.monotonic()
        with _watch_lock:
            for inode in set(_watched) - set(found):
                _watched.pop(inode, None)
                _pending.pop(inode, None)
        for inode, fd in found.items():
            with contextlib.suppress(OSError), socket.socket(fileno=os.dup(fd)) as connection:
                info = connection.getsockopt(socket.IPPROTO_TCP, socket.TCP_INFO, 104)
                fields = _TCP_INFO.unpack_from(info)
                unacked, ack_age = fields[8 + 4], fields[8 + 12] / 1000
                since = stalled(_pending.get(inode), now, unacked, ack_age)
                if since is None:
                    _pending.pop(inode, None)
                    continue
                _pending[inode] = since
                if now - since >= watched[inode]:  # the peer is out of reach: fail it now
                    connection.setsockopt(socket.IPPROTO_TCP, socket.TCP_USER_TIMEOUT, 1)
                    with _watch_lock:
                        _watched.pop(inode, None)
                        _pending.pop(inode, None)


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


def _socket_fds(inodes: set[str]) -> Iterator[tuple[str, int]]:
    """This process's file descriptors that are the sockets of `inodes`, with their inode."""
    if not inodes:
        return
    with contextlib.suppress(OSError):
        for entry in os.listdir("/proc/self/fd"):
            with contextlib.suppress(OSError):
                target = os.readlink(f"/proc/self/fd/{entry}")
                if target.startswith("socket:[") and target[8:-1] in inodes:
                    yield target[8:-1], int(entry)

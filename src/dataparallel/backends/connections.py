"""This process's TCP connections, found in Linux's `/proc`, and shut down to end the calls that
wait on them.

Gloo has no abort: a call in flight ends when a connection it waits on closes, or at Gloo's
timeout (minutes). Shutting a connection down wakes a thread of this process blocked reading or
writing it with the stream's end or an error, and the peer's end sees the same, as if one of
the two processes had closed it. Two callers: an elastic worker cuts its connections to peers
lost by their link (`cut_connections`, by the peers' addresses: `elastic/liveness.py`), and a
world that lost a member shuts down the connections its Gloo groups made (`GlooBackend.sever`,
`sockets_made`), so that no survivor is left waiting in a call for a peer that waits in
another call for it.

Sockets are found in `/proc/self/net/tcp{,6}` and `/proc/self/fd`; elsewhere none is found and
none is cut.
"""

from __future__ import annotations

import contextlib
import ipaddress
import os
import socket
from collections.abc import Callable, Iterable, Iterator
from typing import TypeVar

__all__ = ["cut_connections", "own_sockets", "shut_down", "sockets_made", "tcp_sockets"]

T = TypeVar("T")


def cut_connections(addresses: set[str], keep: tuple[str, int] | None = None) -> int:
    """Shut down this process's TCP connections to any of `addresses` (IPv4), but `keep`'s
    (address, port); return how many. A thread blocked reading or writing one wakes with an
    end of stream or an error, as if the peer had closed it."""
    if not addresses:
        return 0
    return shut_down(
        inode for inode, remote in tcp_sockets() if remote[0] in addresses and remote != keep
    )


def sockets_made(make: Callable[[], T]) -> tuple[T, frozenset[str]]:
    """Return `make()` and the TCP connections of this process (inodes) that appeared while it
    ran: a Gloo group's connections to its peers, made when the group is (as torch makes them).
    Listening sockets are left out: Gloo's listener ends the process (`std::terminate`) when an
    accept on it fails."""
    before = own_sockets()
    made = make()
    connected = {inode for inode, _ in tcp_sockets()}
    return made, (own_sockets() - before) & connected


def shut_down(inodes: Iterable[str]) -> int:
    """Shut down this process's sockets of `inodes` (those still open); return how many."""
    cut = 0
    for fd in _socket_fds(set(inodes)):
        with contextlib.suppress(OSError), socket.socket(fileno=os.dup(fd)) as connection:
            connection.shutdown(socket.SHUT_RDWR)
            cut += 1
    return cut


def own_sockets() -> frozenset[str]:
    """The inodes of this process's open sockets."""
    return frozenset(inode for _, inode in _fd_sockets())


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


def _fd_sockets() -> Iterator[tuple[int, str]]:
    """This process's file descriptors that are sockets, with their inodes."""
    with contextlib.suppress(OSError):
        for entry in os.listdir("/proc/self/fd"):
            with contextlib.suppress(OSError):
                target = os.readlink(f"/proc/self/fd/{entry}")
                if target.startswith("socket:["):
                    yield int(entry), target[8:-1]


def _socket_fds(inodes: set[str]) -> Iterator[int]:
    """This process's file descriptors that are the sockets of `inodes`."""
    if inodes:
        yield from (fd for fd, inode in _fd_sockets() if inode in inodes)

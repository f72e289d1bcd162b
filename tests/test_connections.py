"""This process's TCP connections (`backends/connections.py`): keep-alive on the new ones to
other hosts, the watch that hands on a connection whose peer stopped answering, and Gloo's words
for a connection the kernel gave up on (`translate_error`).

What they are for, a link cut between two hosts while the launcher reaches both (a split), is
run across emulated hosts in tests/test_multihost.py; here, which connections get them.
"""

from __future__ import annotations

import os
import socket

import pytest
from _jobs import outer_world_size

from dataparallel.backends.connections import connections
from dataparallel.backends.rendezvous import address_toward
from dataparallel.errors import CollectiveTimeoutError, LinkLostError, RankFailedError

# Every rank of a multi-rank pass would check its own connections alike: nothing more to see.
pytestmark = pytest.mark.skipif(
    outer_world_size() > 1, reason="this process's own sockets: runs in the world of one"
)


def _kept_alive(sock: socket.socket) -> tuple[int, int, int, int]:
    return (
        sock.getsockopt(socket.SOL_SOCKET, socket.SO_KEEPALIVE),
        sock.getsockopt(socket.IPPROTO_TCP, socket.TCP_KEEPIDLE),
        sock.getsockopt(socket.IPPROTO_TCP, socket.TCP_KEEPINTVL),
        sock.getsockopt(socket.IPPROTO_TCP, socket.TCP_KEEPCNT),
    )


def _this_machines_address() -> str:
    if not hasattr(socket, "TCP_KEEPIDLE"):
        pytest.skip("TCP keep-alive's settings are Linux's")
    here = address_toward("192.0.2.1", 9)  # this machine's way out (TEST-NET-1: no one there)
    if here is None or here.startswith("127."):
        pytest.skip("this machine has no address but loopback")
    return here


def test_keep_alive_goes_to_the_connections_a_group_made_to_other_addresses_only(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """A connection made before a group forms (`rendezvous.gloo_connecting`), or to loopback,
    is left as it was; one made meanwhile to an address of a network interface gets
    keep-alive: 1 s idle, 1 s apart, the link timeout (rounded up) unanswered."""
    from dataparallel.backends.rendezvous import gloo_connecting

    here = _this_machines_address()
    monkeypatch.setenv("DATAPARALLEL_LINK_TIMEOUT", "2.5")
    with socket.create_server((here, 0)) as server, socket.create_server(("127.0.0.1", 0)) as lo:
        old = socket.create_connection(server.getsockname(), timeout=30)
        accepted = [server.accept()[0]]
        with gloo_connecting(None) as made:
            new = socket.create_connection(server.getsockname(), timeout=30)
            loop = socket.create_connection(lo.getsockname(), timeout=30)
            accepted += [server.accept()[0], lo.accept()[0]]
        try:
            assert len(made) == 4  # both ends of `new` and of `loop`
            assert _kept_alive(new) == (1, 1, 1, 3)
            assert _kept_alive(accepted[1])[0] == 1
            assert _kept_alive(old)[0] == 0 and _kept_alive(accepted[0])[0] == 0
            assert _kept_alive(loop)[0] == 0 and _kept_alive(accepted[2])[0] == 0
        finally:
            for sock in (old, new, loop, *accepted):
                sock.close()


def test_the_watch_adopts_new_connections_and_hands_on_one_whose_peer_never_answers() -> None:
    """What watches MPI's connections (`watch_every`; here a `Links` of the test's own): each
    connection made to another address gets keep-alive asks the kernel acts on only after two
    minutes, but not one to loopback nor one it was told to ignore; one whose peer never
    answers (a connect to a listener whose queue is full: the kernel drops its first segment,
    which waits unacknowledged) is handed to the callback with its peer after the link
    timeout, once, and the healthy ones never are."""
    import errno
    import os
    import time

    from dataparallel.backends.connections import Links

    here = _this_machines_address()
    links, lost = Links(), []
    with (
        socket.create_server((here, 0)) as server,
        socket.create_server(("127.0.0.1", 0)) as lo,
        socket.create_server((here, 0), backlog=0) as full,
    ):
        queued = socket.create_connection(full.getsockname(), timeout=30)  # fills its queue
        ignored = socket.create_connection(server.getsockname(), timeout=30)
        ignore = {str(os.fstat(ignored.fileno()).st_ino)}
        links.adopt(0.5, lambda _, peer: lost.append(peer), ignore)
        new = socket.create_connection(server.getsockname(), timeout=30)
        loop = socket.create_connection(lo.getsockname(), timeout=30)
        accepted = [server.accept()[0], server.accept()[0], lo.accept()[0]]
        silent = socket.socket()
        silent.setblocking(False)
        try:
            assert silent.connect_ex(full.getsockname()) == errno.EINPROGRESS
            guard = time.monotonic() + 60  # a hang guard: the silent peer is handed on soon
            while not lost:
                assert time.monotonic() < guard, "the silent connection was never handed on"
                time.sleep(0.05)
            links.look()  # one more look: nothing else is handed on, nor the same again
            assert lost == [full.getsockname()]
            assert _kept_alive(new) == (1, 1, 1, 127) and _kept_alive(accepted[1])[0] == 1
            assert _kept_alive(ignored)[0] == 0 and _kept_alive(loop)[0] == 0
        finally:
            links.stop()
            for sock in (queued, ignored, new, loop, silent, *accepted):
                sock.close()


@pytest.mark.parametrize(
    "said",
    [
        "[../third_party/gloo/gloo/transport/tcp/pair.cc:534] Read error [10.0.0.3]:41234: "
        "Connection timed out",
        "Write error 10.0.0.3:41234: No route to host",
    ],
)
def test_a_connection_the_kernel_gave_up_on_is_a_lost_link_naming_the_peer(said: str) -> None:
    pytest.importorskip("torch.distributed")
    from dataparallel.backends.gloo.backend import translate_error

    error = translate_error(RuntimeError(said), "allreduce", 2)
    assert isinstance(error, LinkLostError) and isinstance(error, RankFailedError)
    assert error.address == "10.0.0.3"
    assert str(error).startswith("Gloo allreduce on rank 2 lost its link to 10.0.0.3: that host ")
    assert "--link-timeout" in str(error) and "a split" in str(error)
    # Gloo's own timeout is still a timeout, and a closed connection a rank gone.
    timeout = translate_error(RuntimeError("Timed out waiting 60000ms for recv"), "x", 0)
    assert isinstance(timeout, CollectiveTimeoutError)
    closed = translate_error(RuntimeError("Connection closed by peer [10.0.0.3]:1"), "x", 0)
    assert type(closed) is RankFailedError


def test_a_connection_the_watch_found_lost_is_shut_down_and_its_close_is_a_lost_link() -> None:
    """The watch's callback for Gloo's connections (`_fail`) shuts the connection down at
    once, which wakes a reader blocked on it, and notes its peer: Gloo's "closed by peer" for
    that address is then a `LinkLostError`, for another address still a rank gone, and after
    a new group forms (`rendezvous.gloo_connecting`) a rank gone again."""
    import threading

    pytest.importorskip("torch.distributed")
    from dataparallel.backends.connections import _fail
    from dataparallel.backends.gloo.backend import translate_error
    from dataparallel.backends.rendezvous import gloo_connecting

    said = "[pair.cc:553] Connection closed by peer [10.0.0.7]:2470. This is typically caused"
    with socket.create_server(("127.0.0.1", 0)) as server:
        waiting = socket.create_connection(server.getsockname(), timeout=30)
        peer = server.accept()[0]
        with waiting, peer:
            got: list[bytes] = []
            reader = threading.Thread(target=lambda: got.append(waiting.recv(1)))
            reader.start()
            _fail(waiting, ("10.0.0.7", 2470))
            reader.join(timeout=30)  # a guard: the shutdown wakes it at once
            assert got == [b""] and peer.recv(1) == b""
    try:
        lost = translate_error(RuntimeError(said), "allreduce", 1)
        assert isinstance(lost, LinkLostError) and lost.address == "10.0.0.7"
        other = translate_error(RuntimeError(said.replace(".7]", ".8]")), "allreduce", 1)
        assert type(other) is RankFailedError
    finally:
        with gloo_connecting(None):
            pass
    assert type(translate_error(RuntimeError(said), "allreduce", 1)) is RankFailedError


def test_unreachable_takes_a_refused_connect_for_an_answer_and_a_silent_one_for_none() -> None:
    """`unreachable`: a listener, and a port where nothing listens (the kernel refuses), are
    in reach; a connect that no one answers (a listener whose queue is full drops it) is not,
    once the wait is over."""
    from dataparallel.backends.connections import unreachable

    here = _this_machines_address()
    with (
        socket.create_server((here, 0)) as server,
        socket.create_server((here, 0), backlog=0) as full,
    ):
        queued = socket.create_connection(full.getsockname(), timeout=30)  # fills its queue
        closed = socket.create_server((here, 0))
        nothing = closed.getsockname()
        closed.close()
        with queued:
            peers = [server.getsockname(), nothing, full.getsockname()]
            assert unreachable(peers, 0.5) == {full.getsockname()}


def test_a_members_gloo_address_is_read_from_what_its_rendezvous_wrote() -> None:
    """`forming.gloo_address` reads the address and port Gloo's device listens on from the
    value Gloo's rendezvous writes under a member's rank (here one written by torch's own Gloo,
    a world of one in a process of its own: this one's default group is the tests'), and None
    from anything else."""
    pytest.importorskip("torch.distributed")
    import subprocess
    import sys

    from dataparallel.elastic.forming import gloo_address

    done = subprocess.run(
        [sys.executable, "-c", _WRITES_ITS_ADDRESS],
        env={**os.environ, "GLOO_SOCKET_IFNAME": "lo"},
        capture_output=True,
        text=True,
        timeout=120,
        check=False,
    )
    assert done.returncode == 0, done.stderr
    value = bytes.fromhex(done.stdout.split()[-1])
    address = gloo_address(value)
    assert address is not None and address[0] == "127.0.0.1" and 0 < address[1] < 65536
    assert gloo_address(b"") is None and gloo_address(value[:20]) is None


def test_the_connections_a_group_made_are_found_and_shut_down() -> None:
    """What `GlooBackend.sever` cuts: the connections made while a group formed
    (`rendezvous.gloo_connecting`), not a listening socket made meanwhile (Gloo's listener ends
    the process when an accept on it fails) nor an older connection; shutting them down wakes a
    reader with the end of its stream, at both ends."""
    import threading

    from dataparallel.backends.connections import shut_down
    from dataparallel.backends.rendezvous import gloo_connecting

    with socket.create_server(("127.0.0.1", 0)) as server:
        older = socket.create_connection(server.getsockname())
        older_peer = server.accept()[0]
        with gloo_connecting(None) as made:
            new = socket.create_connection(server.getsockname())
            listener = socket.create_server(("127.0.0.1", 0))
        peer = server.accept()[0]
        with older, older_peer, new, peer, listener:
            assert len(made) == 1 and made <= set(connections())
            got: list[bytes] = []
            reader = threading.Thread(target=lambda: got.append(new.recv(1)))
            reader.start()
            assert shut_down(made) == 1
            reader.join()  # woken by the shutdown: no data ever comes
            assert got == [b""] and peer.recv(1) == b""
            older.sendall(b"o")
            assert older_peer.recv(1) == b"o"


# A world of one whose rendezvous store notes what Gloo writes under rank 0; prints it in hex.
_WRITES_ITS_ADDRESS = """
import datetime
import torch.distributed as dist

inner, written = dist.HashStore(), {}

class Noting(dist.Store):
    def set(self, key, value):
        written[key] = bytes(value)
        inner.set(key, value)

    def get(self, key):
        return bytes(inner.get(key))

    def wait(self, keys, timeout=None):
        inner.wait(keys, datetime.timedelta(seconds=30))

dist.init_process_group("gloo", store=Noting(), rank=0, world_size=1)
print(next(v for k, v in written.items() if k.rpartition("/")[2] == "0").hex())
dist.destroy_process_group()
"""


def test_a_connection_found_lost_cuts_the_others_to_its_host_and_no_others() -> None:
    """The peer's host has not answered one connection for the link timeout, so it answers
    none: `_fail` shuts down every other watched Gloo connection to that address too (a call
    may wait on another group's connection than the one found first), and no connection to
    another address. A reader blocked on the other connection to the lost address wakes."""
    import threading

    from dataparallel.backends.connections import _fail, _links

    with socket.create_server(("127.0.0.1", 0), backlog=3) as server:
        ends = [socket.create_connection(server.getsockname(), timeout=30) for _ in range(3)]
        peers = [server.accept()[0] for _ in ends]
        first, same, other = ends
        watched = {_inode(same): ("10.0.0.7", 2471), _inode(other): ("10.0.0.8", 1)}
        try:
            _links.watch(watched, 3600.0, _fail)  # never lost by itself: idle, and an hour
            got: list[bytes] = []
            reader = threading.Thread(target=lambda: got.append(same.recv(1)))
            reader.start()
            _fail(first, ("10.0.0.7", 2470))
            reader.join(timeout=30)  # a guard: the shutdown wakes it at once
            assert got == [b""], "the other connection to the lost host stayed open"
            other.sendall(b"x")
            assert peers[2].recv(1) == b"x"  # the connection to another host is left alone
            assert _links.forget("10.0.0.8", _fail) == {_inode(other)}
            assert _links.forget("10.0.0.7", _fail) == set()  # no longer watched
        finally:
            _links.forget("10.0.0.8", _fail)
            for sock in ends + peers:
                sock.close()


def _inode(sock: socket.socket) -> str:
    """The socket's inode, as `connections` names it."""
    return os.readlink(f"/proc/self/fd/{sock.fileno()}")[8:-1]

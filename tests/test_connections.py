"""This process's TCP connections (`backends/connections.py`): keep-alive on the new ones to
other hosts, and Gloo's words for a connection the kernel gave up on (`translate_error`).

What keep-alive is for, a link cut between two hosts while the launcher reaches both (a split),
is run across emulated hosts in tests/test_multihost.py; here, which connections get it.
"""

from __future__ import annotations

import socket

import pytest
from _jobs import outer_world_size

from dataparallel.backends.connections import connections, keep_alive
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


def test_keep_alive_goes_to_the_new_connections_to_other_addresses_only() -> None:
    """A connection made before the snapshot, or to loopback, is left as it was; a new one to
    an address of a network interface gets keep-alive: 1 s idle, 1 s apart, the link timeout
    (rounded up) unanswered."""
    if not hasattr(socket, "TCP_KEEPIDLE"):
        pytest.skip("TCP keep-alive's settings are Linux's")
    here = address_toward("192.0.2.1", 9)  # this machine's way out (TEST-NET-1: no one there)
    if here is None or here.startswith("127."):
        pytest.skip("this machine has no address but loopback")
    with socket.create_server((here, 0)) as server, socket.create_server(("127.0.0.1", 0)) as lo:
        old = socket.create_connection(server.getsockname(), timeout=30)
        accepted = [server.accept()[0]]
        before = set(connections())
        new = socket.create_connection(server.getsockname(), timeout=30)
        loop = socket.create_connection(lo.getsockname(), timeout=30)
        accepted += [server.accept()[0], lo.accept()[0]]
        try:
            assert keep_alive(before, 2.5) == 2  # `new`, and its accepted end
            assert _kept_alive(new) == (1, 1, 1, 3)
            assert _kept_alive(accepted[1])[0] == 1
            assert _kept_alive(old)[0] == 0 and _kept_alive(accepted[0])[0] == 0
            assert _kept_alive(loop)[0] == 0 and _kept_alive(accepted[2])[0] == 0
        finally:
            for sock in (old, new, loop, *accepted):
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

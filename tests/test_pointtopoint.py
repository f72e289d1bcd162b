"""`dp.send`, `dp.recv` and `dp.sendrecv`, eagerly and inside `jax.jit`, at any world size.

In a world of one only the message to oneself (`sendrecv` with dest and source both 0) and the
refusals run; under `mpiexec -n 3` or `dataparallel run -n 3 --backend gloo` every rank sends
round a ring, rank 0 sends each other rank its own message, and the two ends of a transfer that
differ raise on both ends, after which the world still works.
"""

from __future__ import annotations

from typing import Any

import numpy as np
import pytest

import dataparallel as dp
from dataparallel.errors import CollectiveMismatchError


def ring(rank: int, size: int) -> tuple[int, int]:
    """(the rank to the right, the rank to the left) on a ring of `size`."""
    return (rank + 1) % size, (rank - 1) % size


def tree_of(rank: int) -> dict[str, Any]:
    return {
        "f32": np.full((2, 3), rank, np.float32),
        "i64": np.arange(5, dtype=np.int64) * (rank + 1),
        "flag": np.array([rank % 2 == 1, True]),
        "pair": (np.float64(rank) + 0.5, np.full(1, rank, np.uint16)),
    }


def zeros_like(tree: dict[str, Any]) -> dict[str, Any]:
    import optree

    return optree.tree_map(lambda x: np.zeros_like(x), tree)


def assert_tree_equal(got: Any, want: Any) -> None:
    import optree

    for g, w in zip(optree.tree_leaves(got), optree.tree_leaves(want), strict=True):
        assert np.asarray(g).dtype == np.asarray(w).dtype
        np.testing.assert_array_equal(np.asarray(g), np.asarray(w))


def test_sendrecv_round_a_ring_in_place(rank: int, size: int) -> None:
    right, left = ring(rank, size)
    x = np.full(4, rank, np.float32)
    into = np.zeros(4, np.float32)
    got = dp.sendrecv(x, into, source=left, dest=right)
    assert got is into and (into == left).all()  # NumPy: written in place and returned
    assert (x == rank).all()


def test_a_tree_of_every_kind_travels_as_one_message(rank: int, size: int) -> None:
    right, left = ring(rank, size)
    got = dp.sendrecv(
        tree_of(rank), zeros_like(tree_of(0)), source=left, dest=right, sendtag=3, recvtag=3
    )
    assert_tree_equal(got, tree_of(left))


def test_frameworks_and_numbers(rank: int, size: int) -> None:
    torch = pytest.importorskip("torch")
    jnp = pytest.importorskip("jax.numpy")
    right, left = ring(rank, size)
    t = dp.sendrecv(torch.full((3,), float(rank)), torch.zeros(3), source=left, dest=right)
    assert torch.equal(t, torch.full((3,), float(left)))
    j = dp.sendrecv(
        jnp.full((2, 2), rank, jnp.bfloat16),
        jnp.zeros((2, 2), jnp.bfloat16),
        source=left,
        dest=right,
    )
    assert j.dtype == jnp.bfloat16 and (j == left).all()
    n = dp.sendrecv(float(rank), 0.0, source=left, dest=right)
    assert n == float(left)


def test_send_and_recv_pairs_with_tags(rank: int, size: int) -> None:
    if size == 1:
        pytest.skip("needs a peer")
    if rank == 0:
        for peer in range(1, size):
            dp.send({"a": np.full(3, peer), "b": np.arange(peer)}, dest=peer, tag=peer)
    else:
        got = dp.recv(
            {"a": np.zeros(3, np.int64), "b": np.zeros(rank, np.int64)}, source=0, tag=rank
        )
        assert (got["a"] == rank).all() and (got["b"] == np.arange(rank)).all()
    # and back: each rank answers rank 0, which receives them in rank order
    if rank == 0:
        for peer in range(1, size):
            assert dp.recv(np.zeros((), np.int32), source=peer) == peer * 10
    else:
        dp.send(np.array(rank * 10, np.int32), dest=0)


@pytest.mark.parametrize(
    "sent, expected, what",
    [
        (np.zeros(3), np.zeros(4), "float64\\[4\\]"),
        (np.zeros(3), np.zeros(3, np.float32), "float32\\[3\\]"),
        ({"a": np.zeros(3)}, [np.zeros(3)], "PyTreeSpec"),
        (np.zeros(3), np.zeros(3), "tag 1"),
    ],
    ids=["shape", "dtype", "tree", "tag"],
)
def test_the_two_ends_that_differ_both_raise(
    rank: int, size: int, sent: Any, expected: Any, what: str
) -> None:
    if size == 1:
        pytest.skip("needs a peer")
    tag = 1 if what == "tag 1" else 0
    if rank == 0:
        with pytest.raises(CollectiveMismatchError, match=f"rank 1 expects .*{what}"):
            dp.send(sent, dest=1)
    elif rank == 1:
        with pytest.raises(CollectiveMismatchError, match=f"rank 0 sends rank 1 .*{what}"):
            dp.recv(expected, source=0, tag=tag)
    right, left = ring(rank, size)  # nothing was sent: the next messages are the right ones
    assert (
        dp.sendrecv(np.full(2, rank), np.zeros(2, np.int64), source=left, dest=right) == left
    ).all()


def test_a_message_to_oneself_is_a_copy_and_lone_ones_are_refused(rank: int, size: int) -> None:
    got = dp.sendrecv({"x": np.arange(3.0)}, {"x": np.zeros(3)}, source=rank, dest=rank)
    assert (got["x"] == np.arange(3.0)).all()
    with pytest.raises(CollectiveMismatchError, match="to itself"):
        dp.sendrecv(np.zeros(3), np.zeros(2), source=rank, dest=rank)
    with pytest.raises(ValueError, match="only a sendrecv"):
        dp.send(np.zeros(3), dest=rank)
    with pytest.raises(ValueError, match="only a sendrecv"):
        dp.recv(np.zeros(3), source=rank)
    with pytest.raises(ValueError, match="not a rank of this world"):
        dp.send(np.zeros(3), dest=size)
    with pytest.raises(ValueError, match="any source"):
        dp.recv(np.zeros(3), source=-1)
    with pytest.raises(TypeError, match="not a rank"):
        dp.send(np.zeros(3), dest=1.0)  # type: ignore[arg-type]
    with pytest.raises(ValueError, match="tag"):
        dp.send(np.zeros(3), dest=rank, tag=1 << 20)


# --- inside jax.jit ---------------------------------------------------------------------------


@pytest.fixture(params=["ffi", "callback"])
def bridge(request: pytest.FixtureRequest, monkeypatch: pytest.MonkeyPatch) -> str:
    """Each jitted test on both ways into the program: the XLA FFI call, and the ordered
    io_callback taken where it cannot run."""
    jax = pytest.importorskip("jax")
    from dataparallel.jax import traced

    if request.param == "callback":
        monkeypatch.setattr(traced, "ffi_reason", lambda: "forced by the test")
    jax.clear_caches()
    return str(request.param)


def test_jitted_sendrecv_runs_every_time(rank: int, size: int, bridge: str) -> None:
    jax = pytest.importorskip("jax")
    jnp = jax.numpy
    right, left = ring(rank, size)

    @jax.jit
    def shift(x: Any) -> Any:
        return dp.sendrecv(x, jax.tree.map(jnp.zeros_like, x), source=left, dest=right)

    for i in range(3):
        got = shift(
            {"a": jnp.full(3, rank + i, jnp.float32), "b": jnp.full((), rank, jnp.bfloat16)}
        )
        assert (got["a"] == left + i).all() and got["b"] == left


def test_jitted_send_and_recv(rank: int, size: int, bridge: str) -> None:
    jax = pytest.importorskip("jax")
    jnp = jax.numpy
    if size == 1:
        pytest.skip("needs a peer")
    last = size - 1

    @jax.jit
    def relay(x: Any) -> Any:  # rank 0 -> rank last, whose result is what it received
        if rank == 0:
            dp.send(x * 2, dest=last)  # its result unused: kept by the ordered effect
            return x
        if rank == last:
            return dp.recv(jnp.empty_like(x), source=0)
        return x

    for i in range(2):
        got = relay(jnp.arange(4.0) + 10 * rank + i)
        if rank == last:
            assert (got == (jnp.arange(4.0) + i) * 2).all()


def test_jitted_ends_that_differ_raise_when_traced(rank: int, size: int) -> None:
    jax = pytest.importorskip("jax")
    jnp = jax.numpy
    if size == 1:
        pytest.skip("needs a peer")
    if rank in (0, 1):
        peer = 1 - rank
        shape = (3,) if rank == 0 else (4,)
        with pytest.raises(CollectiveMismatchError, match="differ"):
            jax.jit(lambda x: dp.sendrecv(x, x, source=peer, dest=peer))(jnp.zeros(shape))
    right, left = ring(rank, size)
    got = jax.jit(lambda x: dp.sendrecv(x, x, source=left, dest=right))(jnp.full(2, rank * 1.0))
    assert (got == left).all()


def test_mpi_calls_under_a_timeout_poll_their_requests(rank: int, size: int) -> None:
    """With a timeout MPI's engine starts `Isendrecv`, `Isend`, `Irecv` and polls them."""
    engine = dp.get_backend()
    if engine.name != "mpi" or size == 1:
        pytest.skip("MPI's requests, between peers")
    timed = engine.duplicate()  # collective: every rank
    timed.timeout = 60.0  # type: ignore[attr-defined]
    try:
        right, left = ring(rank, size)
        got = dp.sendrecv(np.full(3, rank), np.zeros(3, np.int64), left, right, backend=timed)
        assert (got == left).all()
        if rank == 0:
            dp.send(np.arange(4.0), dest=size - 1, backend=timed)
        elif rank == size - 1:
            assert (dp.recv(np.zeros(4), source=0, backend=timed) == np.arange(4.0)).all()
    finally:
        timed.close()

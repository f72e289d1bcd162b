"""Point-to-point: `send`, `recv` and `sendrecv` between two ranks, eagerly and inside `jax.jit`.

A data-parallel program needs none of them; a program ported from mpi4jax (a halo exchange
between neighbouring subdomains) does, and torch.distributed offers them, so they are here, with
mpi4jax's names and arguments. Each call moves a whole tree as one message, its leaves' bytes in
one buffer (a single contiguous leaf as it is), so that a send and its receive match one to one
whatever the trees hold.

The two ends agree first, as the ranks of a collective do (unless `DATAPARALLEL_CHECK=0`): the
sender and the receiver of each transfer swap a header (a digest of the tree's structure, dtypes,
shapes and tag, and that description), in two steps shaped like the data (headers along the
data's direction, then against it), so a program whose data cannot deadlock cannot deadlock on
its headers either. A difference raises `CollectiveMismatchError` on both ends of that transfer,
and no data is sent. Inside `jax.jit` the ends agree once, when the program is traced.

A rank's message to itself is a copy: `sendrecv` with `dest` and `source` both this rank (a
periodic edge held by one rank). A lone `send` or `recv` to itself would wait forever: it raises
`ValueError`, as does a receive from any source (it could not be checked against its sender).
"""

from __future__ import annotations

import numpy as np

from dataparallel.arrays import tree
from dataparallel.backends.base import Backend
from dataparallel.collectives import traced
from dataparallel.collectives._call import Leaf, context, leaves_of
from dataparallel.errors import CollectiveMismatchError
from dataparallel.groups import Group, backend_of
from dataparallel.protocol import digest
from dataparallel.types import Tree, TreeT

__all__ = [
    "HEADER_TAG",
    "agree_pair",
    "check_copy",
    "check_ends",
    "check_peer",
    "check_tag",
    "recv",
    "send",
    "sendrecv",
]

HEADER_TAG = 32767  # the largest tag every MPI must offer: the headers' own, below it the users'
_HEADER_BYTES = 512  # the digest (8 bytes) and as much of the description as fits


def send(
    x: Tree,
    dest: int,
    *,
    tag: int = 0,
    backend: Backend | None = None,
    group: Group | None = None,
) -> None:
    """Send `x` (an array, a number, or a pytree of them) to rank `dest`, which receives it with
    `dp.recv` (or `dp.sendrecv`) given a template of the same structure, shapes and dtypes."""
    _exchange("send", x, dest, None, None, tag, 0, backend_of(backend, group))


def recv(
    x: TreeT,
    source: int,
    *,
    tag: int = 0,
    backend: Backend | None = None,
    group: Group | None = None,
) -> TreeT:
    """Receive rank `source`'s message into `x` and return it (mutable arrays written in place,
    JAX arrays and numbers new: always use the return value). `x` is the template: the sender's
    tree must have its structure, shapes and dtypes."""
    got: TreeT = _exchange("recv", None, None, x, source, 0, tag, backend_of(backend, group))
    return got


def sendrecv(
    sendbuf: Tree,
    recvbuf: TreeT,
    source: int,
    dest: int,
    *,
    sendtag: int = 0,
    recvtag: int = 0,
    backend: Backend | None = None,
    group: Group | None = None,
) -> TreeT:
    """Send `sendbuf` to rank `dest` and receive rank `source`'s message into `recvbuf`, at once
    (mpi4jax's and MPI's `sendrecv`: a ring of them cannot deadlock). Returns the received tree
    as `recv` does. `dest` and `source` both this rank: a copy of `sendbuf` into `recvbuf`."""
    got: TreeT = _exchange(
        "sendrecv", sendbuf, dest, recvbuf, source, sendtag, recvtag, backend_of(backend, group)
    )
    return got


def check_peer(peer: object, engine: Backend, what: str, call: str) -> int:
    """Return `peer` as a rank of `engine`, or raise saying what was wrong."""
    if isinstance(peer, bool) or not isinstance(peer, (int, np.integer)):
        raise TypeError(f"dp.{call}: {what}={peer!r} is not a rank: give an int.")
    if not 0 <= int(peer) < engine.size:
        hint = " (a receive from any source cannot be checked: name the rank)" if peer < 0 else ""
        raise ValueError(
            f"dp.{call}: {what}={peer} is not a rank of this world of {engine.size}{hint}."
        )
    return int(peer)


def check_tag(tag: object, call: str) -> int:
    if isinstance(tag, bool) or not isinstance(tag, (int, np.integer)):
        raise TypeError(f"dp.{call}: tag {tag!r} is not an int.")
    if not 0 <= int(tag) < HEADER_TAG:
        raise ValueError(f"dp.{call}: tag {tag} is out of range: give 0 to {HEADER_TAG - 1}.")
    return int(tag)


def check_ends(
    call: str, engine: Backend, dest: object, source: object, sendtag: object, recvtag: object
) -> tuple[int, int, int, int, bool]:
    """Return `dest` and `source` as ranks of `engine` (this rank where there is no such
    transfer: None), both tags, and whether the message is to this rank itself; raise saying
    what was wrong, and for a message to itself that is not a `sendrecv` to and from it (the one
    such call with a meaning: a copy)."""
    sending, receiving = dest is not None, source is not None
    to = check_peer(dest, engine, "dest", call) if sending else engine.rank
    of = check_peer(source, engine, "source", call) if receiving else engine.rank
    tags = check_tag(sendtag, call), check_tag(recvtag, call)
    to_self, from_self = sending and to == engine.rank, receiving and of == engine.rank
    if to_self != from_self or (to_self and call != "sendrecv"):
        raise ValueError(
            f"dp.{call} on rank {engine.rank}: a message to this rank itself is only a sendrecv "
            f"with dest and source both {engine.rank} (a copy); got "
            f"dest={to if sending else None}, source={of if receiving else None}."
        )
    return to, of, tags[0], tags[1], to_self


def check_copy(rank: int, sent: str | None, expected: str | None) -> None:
    """Raise `CollectiveMismatchError` where a `sendrecv` to this rank itself sends other than
    it expects (`describe`'s lines of both)."""
    if sent != expected:
        raise CollectiveMismatchError(
            f"dp.sendrecv on rank {rank} to itself: it sends {sent} and expects {expected}."
        )


def describe(flat: tree.Flat, dtypes: list[str], shapes: list[tuple[int, ...]], tag: int) -> str:
    """What both ends of a transfer must agree on, as one line."""
    leaves = ", ".join(f"{d}{list(s)}" for d, s in zip(dtypes, shapes, strict=True))
    return f"tree {flat.structure()} of [{leaves}], tag {tag}"


def agree_pair(
    engine: Backend,
    call: str,
    sent: str | None,
    dest: int,
    expected: str | None,
    source: int,
) -> None:
    """Swap headers with the peers of this rank's transfers; raise `CollectiveMismatchError`
    on both ends of a transfer whose two descriptions differ. `sent`: what this rank sends to
    `dest`, `expected`: what it expects from `source` (None: no such transfer). Neither peer is
    this rank."""
    along = np.empty(_HEADER_BYTES, np.uint8) if expected is not None else None
    engine.sendrecv(_header(call, sent), dest, along, source, HEADER_TAG, HEADER_TAG)
    against = np.empty(_HEADER_BYTES, np.uint8) if sent is not None else None
    engine.sendrecv(_header(call, expected), source, against, dest, HEADER_TAG, HEADER_TAG)
    me, problems = engine.rank, []
    if sent is not None and against is not None and _digest_of(against) != digest(sent):
        problems.append(
            f"rank {me} sends rank {dest} {sent} (dp.{call}), and rank {dest} expects "
            f"{_text_of(against)}"
        )
    if expected is not None and along is not None and _digest_of(along) != digest(expected):
        problems.append(
            f"rank {source} sends rank {me} {_text_of(along)}, and rank {me} expects {expected} "
            f"(dp.{call})"
        )
    if problems:
        raise CollectiveMismatchError(
            f"dp.{call}: the two ends of a point-to-point transfer differ: "
            + "; ".join(problems)
            + ". Nothing was sent: give the receiving call a template of the sent tree's "
            "structure, shapes and dtypes, and the same tag."
        )


def _header(call: str, description: str | None) -> np.ndarray | None:
    if description is None:
        return None
    header = np.zeros(_HEADER_BYTES, np.uint8)
    header[:8] = np.frombuffer(digest(description).to_bytes(8, "little"), np.uint8)
    text = f"{description} (dp.{call})".encode()[: _HEADER_BYTES - 8]
    header[8 : 8 + len(text)] = np.frombuffer(text, np.uint8)
    return header


def _digest_of(header: np.ndarray) -> int:
    return int.from_bytes(header[:8].tobytes(), "little")


def _text_of(header: np.ndarray) -> str:
    return header[8:].tobytes().rstrip(b"\0").decode(errors="replace")


def _exchange(
    call: str,
    sendbuf: Tree | None,
    dest: int | None,
    recvbuf: Tree | None,
    source: int | None,
    sendtag: int,
    recvtag: int,
    engine: Backend | None,
) -> Tree:
    """The three calls' one path: checked, agreed with the peers, moved, written back."""
    if traced.is_traced((sendbuf, recvbuf)) or traced.tracing():  # inside jax.jit
        return traced.call(
            call,
            (sendbuf, recvbuf),
            engine,
            dest=dest,
            source=source,
            sendtag=sendtag,
            recvtag=recvtag,
        )
    ctx = context(engine)
    b = ctx.backend
    sending, receiving = dest is not None, source is not None
    dest, source, sendtag, recvtag, to_self = check_ends(call, b, dest, source, sendtag, recvtag)
    send_flat = tree.flatten(sendbuf, "sendbuf") if sending else None
    recv_flat = tree.flatten(recvbuf, "recvbuf") if receiving else None
    send_leaves = leaves_of(send_flat) if send_flat is not None else []
    recv_leaves = leaves_of(recv_flat) if recv_flat is not None else []
    sent = _describe(send_flat, send_leaves, sendtag)
    expected = _describe(recv_flat, recv_leaves, recvtag)
    if to_self:
        check_copy(b.rank, sent, expected)
    elif ctx.settings.check:
        agree_pair(b, call, sent, dest, expected, source)
    outgoing = _outgoing(send_leaves) if sending else None
    targets = [_target(leaf) for leaf in recv_leaves]
    incoming = None
    if receiving:
        incoming = targets[0][0] if len(targets) == 1 else np.empty(_total(targets), np.uint8)
    if to_self:
        if incoming is not None and outgoing is not None:
            incoming[...] = outgoing
    else:
        out = outgoing if outgoing is not None and outgoing.size else None
        into = incoming if incoming is not None and incoming.size else None
        if out is not None or into is not None:
            b.sendrecv(out, dest, into, source, sendtag, recvtag)
    if recv_flat is None or incoming is None:
        return None
    return tree.unflatten(recv_flat.spec, _landed(recv_leaves, targets, incoming))


def _describe(flat: tree.Flat | None, leaves: list[Leaf], tag: int) -> str | None:
    if flat is None:
        return None
    return describe(flat, [leaf.dtype for leaf in leaves], [leaf.shape for leaf in leaves], tag)


def _outgoing(leaves: list[Leaf]) -> np.ndarray:
    """The bytes sent: one contiguous leaf as it is, else every leaf's bytes in one buffer."""
    parts = [np.ascontiguousarray(_host(leaf)).reshape(-1).view(np.uint8) for leaf in leaves]
    if len(parts) == 1:
        return parts[0]
    return np.concatenate(parts) if parts else np.empty(0, np.uint8)


def _host(leaf: Leaf) -> np.ndarray:
    if leaf.device == "cpu":
        work = leaf.family.work(leaf.value)[0]
        if isinstance(work, np.ndarray):
            return work
    return leaf.family.to_host(leaf.value)


def _target(leaf: Leaf) -> tuple[np.ndarray, np.ndarray, bool]:
    """Where a leaf's bytes land: (its bytes, its host array, whether that is the leaf itself)."""
    view = leaf.family.host_view(leaf.value) if leaf.device == "cpu" else None
    if view is not None and view.flags.c_contiguous:
        return view.reshape(-1).view(np.uint8), view, True
    host = np.ascontiguousarray(leaf.family.to_host(leaf.value))
    return host.reshape(-1).view(np.uint8), host, False


def _total(targets: list[tuple[np.ndarray, np.ndarray, bool]]) -> int:
    return sum(t[0].size for t in targets)


def _landed(
    leaves: list[Leaf], targets: list[tuple[np.ndarray, np.ndarray, bool]], incoming: np.ndarray
) -> list[object]:
    """Each leaf's received value: written in place (a view), or made from its host copy."""
    out: list[object] = []
    offset = 0
    for leaf, (raw, host, is_view) in zip(leaves, targets, strict=True):
        if raw is not incoming:
            raw[...] = incoming[offset : offset + raw.size]
        offset += raw.size
        if is_view:
            leaf.family.mark_written([leaf.value])
            out.append(leaf.value)
        else:
            out.append(leaf.family.from_host(leaf.value, host))
    return out

"""How Gloo (and NCCL's store) processes find each other: Flashlight's rendezvous methods.

Rendezvous (`init_method`), as in Flashlight:

- `"env://"` (or none): torchrun's `RANK`, `WORLD_SIZE`, `MASTER_ADDR`, `MASTER_PORT`
  (`dataparallel run --backend gloo` sets them).
- `"tcp://host:port"` with `rank=` and `world_size=`: rank 0 listens on `host:port`.
- `"file:///dir"` with `rank=` and `world_size=`: a directory every rank can reach (a shared file
  system across hosts). The rendezvous file is `dir/dataparallel-rendezvous`, or
  `dir/dataparallel-rendezvous-ID` with `"file:///dir?job=ID"`. A file left by a job that did not
  finish cleanly would mislead the next job: use a fresh directory or job id per job. A clean
  finish removes the file (`remove_if_every_store_left`, where torch's own removal can miss it).

Network interface: Gloo binds to the address its hostname resolves to, else to loopback, which
  breaks jobs across hosts wherever the hostname does not resolve to a routable address (common
  in containers). Unless `GLOO_SOCKET_IFNAME` is set, this module binds Gloo to the interface
  through which rank 0's address is reached (env:// and tcp://; file:// has no address to go by).
"""

from __future__ import annotations

import contextlib
import datetime
import itertools
import os
import socket
import struct
import urllib.parse
from collections.abc import Iterator
from pathlib import Path
from types import ModuleType
from typing import Any, NamedTuple

from dataparallel.backends.connections import connections, forget_lost, keep_alive
from dataparallel.config import Settings
from dataparallel.errors import CollectiveTimeoutError

__all__ = [
    "RENDEZVOUS_FILE",
    "Meeting",
    "Rendezvous",
    "address_toward",
    "gloo_connecting",
    "interface_address",
    "interface_toward",
    "is_here",
    "parse_init_method",
    "remove_if_every_store_left",
    "rendezvous_error",
    "rendezvous_store",
]

RENDEZVOUS_FILE = "dataparallel-rendezvous"

_SCHEMES = ("env://", "tcp://host:port", "file:///dir")


class Rendezvous:
    """Where and how the ranks meet: the `init_method` torch gets, and who this process is.

    `master` is rank 0's (host, port) when known (env://, tcp://); `file` the rendezvous file.
    """

    def __init__(
        self,
        url: str,
        rank: int,
        world_size: int,
        *,
        file: Path | None = None,
        master: tuple[str, int] | None = None,
    ) -> None:
        self.url, self.rank, self.world_size = url, rank, world_size
        self.file, self.master = file, master

    def __repr__(self) -> str:
        return f"Rendezvous({self.url!r}, rank={self.rank}, world_size={self.world_size})"


def parse_init_method(
    init_method: str | None, rank: int | None, world_size: int | None, settings: Settings
) -> Rendezvous:
    """Check `init_method` and the rank and size it needs, before any process communicates.

    Args:
        init_method: `None` or `"env://"`, `"tcp://host:port"`, `"file:///dir"`.
        rank, world_size: as given to `dp.initialize()`.
        settings: the launcher's variables (`RANK`, `WORLD_SIZE`, `MASTER_ADDR`, `MASTER_PORT`).

    Raises:
        ValueError: an unknown scheme, a malformed address, or a rank or size missing or out
            of range.

    >>> parse_init_method("tcp://10.0.0.1:29500", 1, 2, Settings())
    Rendezvous('tcp://10.0.0.1:29500', rank=1, world_size=2)
    """
    method = init_method or "env://"
    if method == "env://":
        missing = [
            name
            for name, value in (
                ("RANK", settings.rank if rank is None else rank),
                ("WORLD_SIZE", settings.world_size if world_size is None else world_size),
                ("MASTER_ADDR", settings.master_addr),
                ("MASTER_PORT", settings.master_port),
            )
            if value is None
        ]
        if missing:
            raise ValueError(
                f"The Gloo rendezvous env:// needs {', '.join(missing)} in the environment "
                "(torchrun and `dataparallel run --backend gloo` set them); or rendezvous "
                "explicitly: dp.initialize('gloo', init_method='tcp://HOST:PORT', rank=R, "
                "world_size=N)."
            )
        rank = settings.rank if rank is None else rank
        world_size = settings.world_size if world_size is None else world_size
        assert rank is not None and world_size is not None
        assert settings.master_addr is not None and settings.master_port is not None
        _check_rank(method, rank, world_size)
        master = (settings.master_addr, settings.master_port)
        return Rendezvous("env://", rank, world_size, master=master)
    parsed = urllib.parse.urlsplit(method)
    if parsed.scheme not in ("tcp", "file"):
        raise ValueError(
            f"init_method={init_method!r} is not a Gloo rendezvous: use one of "
            f"{', '.join(_SCHEMES)}, or 'mpi' with backend='mpi'."
        )
    if rank is None or world_size is None:
        raise ValueError(
            f"init_method={init_method!r} needs rank= and world_size= (got rank={rank}, "
            f"world_size={world_size}): pass both to dp.initialize(), or use init_method='env://' "
            "with RANK, WORLD_SIZE, MASTER_ADDR and MASTER_PORT set (as torchrun does)."
        )
    _check_rank(method, rank, world_size)
    if parsed.scheme == "tcp":
        try:
            port = parsed.port
        except ValueError:
            port = None
        if not parsed.hostname or port is None:
            raise ValueError(
                f"init_method={init_method!r} is not a TCP address: use 'tcp://HOST:PORT', where "
                "rank 0 listens (e.g. 'tcp://10.0.0.1:29500')."
            )
        master = (parsed.hostname, port)
        return Rendezvous(f"tcp://{parsed.netloc}", rank, world_size, master=master)
    if parsed.netloc not in ("", "localhost") or not parsed.path.startswith("/"):
        raise ValueError(
            f"init_method={init_method!r} does not name an absolute directory: use three slashes, "
            "'file:///path/to/shared/dir'."
        )
    directory = Path(urllib.parse.unquote(parsed.path))
    job = urllib.parse.parse_qs(parsed.query).get("job", [""])[0]
    if directory.exists() and not directory.is_dir():
        raise ValueError(
            f"init_method={init_method!r}: {directory} is a file, but file:// names a directory "
            "shared by every rank (Flashlight's FILE_SYSTEM rendezvous), where dataparallel "
            f"keeps its own '{RENDEZVOUS_FILE}' file: pass a directory."
        )
    file = directory / (f"{RENDEZVOUS_FILE}-{job}" if job else RENDEZVOUS_FILE)
    return Rendezvous(f"file://{file}", rank, world_size, file=file)


def _check_rank(method: str, rank: int, world_size: int) -> None:
    if world_size < 1 or not 0 <= rank < world_size:
        raise ValueError(
            f"rank={rank}, world_size={world_size} for {method}: world_size must be positive "
            "and rank in [0, world_size)."
        )


def interface_toward(host: str, port: int) -> str | None:
    """Return the network interface through which this machine reaches `host` (None: unknown).

    Gloo binds to the address its hostname resolves to, else to loopback: in containers, where
    the hostname often resolves to 127.0.1.1 or not at all, ranks on other hosts then cannot
    connect. Binding to the interface that routes to rank 0 avoids that (and for a rank 0 on
    loopback, binds to loopback without looking the hostname up).
    """
    local = address_toward(host, port)
    return None if local is None else _interface_of(local)


def address_toward(host: str, port: int) -> str | None:
    """Return this machine's IPv4 address on the route to `host` (None: no route, unknown)."""
    try:
        address = socket.gethostbyname(host)
        with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as probe:
            probe.connect((address, port))  # UDP: picks the route, sends nothing
            return str(probe.getsockname()[0])
    except OSError:
        return None


def is_here(host: str) -> bool:
    """Return whether `host` names this machine: `localhost`, its hostname, or a name or
    address of which one address can be bound here.

    The one answer for every part that asks (the launcher placing ranks, the MPI launcher's
    beacon, an elastic worker's watch of its store); what a name that resolves to nothing
    means differs between them, so it raises and each caller says.

    Raises:
        OSError: `host` resolves to no address (`socket.gaierror`).

    >>> is_here("127.0.0.1"), is_here("192.0.2.1")  # TEST-NET-1 is never an address here
    (True, False)
    """
    if host == "localhost" or host == socket.gethostname():
        return True
    try:
        infos = socket.getaddrinfo(host, None, type=socket.SOCK_STREAM)
    except UnicodeError as exc:  # a name that is not even a valid label
        raise socket.gaierror(socket.EAI_NONAME, f"{host!r} is not a host name: {exc}") from exc
    for family, _, _, _, address in infos:
        with socket.socket(family, socket.SOCK_STREAM) as sock:
            try:
                sock.bind((address[0], 0))
            except OSError:
                continue
            return True
    return False


def interface_address(interface: str) -> str | None:
    """Return the IPv4 address of network interface `interface` (Linux), or None."""
    return next((address for name, address in _addresses() if name == interface), None)


def _interface_of(address: str) -> str | None:
    """Return the name of the interface whose IPv4 address is `address` (Linux), or None."""
    return next((name for name, each in _addresses() if each == address), None)


def _addresses() -> Iterator[tuple[str, str]]:
    """Each network interface's name and IPv4 address (Linux; none elsewhere)."""
    try:
        import fcntl
    except ImportError:  # not POSIX
        return
    siocgifaddr = 0x8915
    with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as s:
        for _, name in socket.if_nameindex():
            try:
                request = struct.pack("256s", name.encode()[:15])
                reply = fcntl.ioctl(s.fileno(), siocgifaddr, request)
            except OSError:
                continue
            yield name, socket.inet_ntoa(reply[20:24])


@contextlib.contextmanager
def gloo_connecting(interface: str | None) -> Iterator[set[str]]:
    """Make Gloo bind to `interface` while a group is made (torch reads GLOO_SOCKET_IFNAME;
    None: Gloo's own choice), and give the connections it made to other hosts TCP keep-alive
    (`connections.keep_alive`, within the link timeout): a peer that stops answering then fails
    the call waiting on it instead of leaving it to Gloo's timeout. Yields a set that holds,
    once the block is done, every connection made in it (socket inodes: `GlooBackend.sever`).
    The peers the watch found lost before are forgotten (`connections.found_lost`)."""
    forget_lost()
    before = set(connections())
    made: set[str] = set()
    if interface is not None:
        os.environ["GLOO_SOCKET_IFNAME"] = interface
    try:
        yield made
    finally:
        if interface is not None:
            os.environ.pop("GLOO_SOCKET_IFNAME", None)
    new = {inode: peer for inode, peer in connections().items() if inode not in before}
    made.update(new)
    keep_alive(new, Settings.from_env().link_timeout)


def rendezvous_error(exc: BaseException, rendezvous: Rendezvous) -> BaseException:
    """Return the error to raise when `init_process_group` failed, with what to check."""
    first = str(exc).strip().splitlines()[0] if str(exc).strip() else type(exc).__name__
    where = (
        f"Gloo rendezvous at {rendezvous.url} (rank {rendezvous.rank} of {rendezvous.world_size})"
    )
    hint = (
        f"Check that all {rendezvous.world_size} ranks were started with the same init_method "
        "and distinct ranks, and that rank 0's address can be reached from every host."
    )
    if rendezvous.file is not None:
        hint += (
            f" If {rendezvous.file} was left by an earlier job that did not finish cleanly, "
            "delete it, or give each job its own directory or 'file:///dir?job=ID'."
        )
    if "timed out" in str(exc).lower() or "timeout" in str(exc).lower():
        return CollectiveTimeoutError(f"{where} timed out ({first}). {hint}")
    if isinstance(exc, RuntimeError) and "address already in use" in str(exc).lower():
        return RuntimeError(
            f"{where} failed: the port is taken ({first}). Choose a free port for rank 0."
        )
    return exc


# One TCP store per rendezvous address for the life of the process, deliberately not cleared by
# dp.finalize() (`dataparallel.caches` says so): a world made again meets through it under a fresh
# key prefix, instead of binding the port anew while the first server may still be listening (a
# rank could then reach the stale one and its keys). Keyed on the address, not on a world.
_STORES: dict[tuple[str, int, int], object] = {}
# Worlds met through a store by this process: every rank makes the same worlds in the same order,
# so the count names the same prefix on every rank.
_GENERATIONS = itertools.count()


class Meeting(NamedTuple):
    """The store a world's ranks meet through, and its file for file:// (None otherwise)."""

    store: Any  # torch.distributed.PrefixStore
    file: Path | None


def rendezvous_store(
    dist: ModuleType,
    rendezvous: Rendezvous,
    timeout: datetime.timedelta | None,
    *,
    agent_store: bool = False,
) -> Meeting:
    """Return the store this world's ranks meet through, under a key prefix of its own.

    With `agent_store` (torchrun's agent serves a store on `MASTER_PORT` already:
    `TORCHELASTIC_USE_AGENT_STORE=True`), every rank is a client of it, as torch's own env://
    rendezvous does there; rank 0 binding the port again makes torch log an error-looking line.

    Every world made in this process (`dp.initialize` after `dp.finalize`) gets a fresh prefix:
    torch names its groups again from the start in each, so their keys would otherwise collide
    with those of the world before, which the TCP store, kept, still holds: a rank would connect
    to the old world's addresses. A file:// world after the first meets in a file of its own,
    `RENDEZVOUS_FILE.N` (N: the worlds this process made before): torch removes a rendezvous file
    when the last store on it is let go, which could race with a rank of the next world opening it.
    """
    wait = timeout if timeout is not None else datetime.timedelta(minutes=30)  # torch's default
    generation = next(_GENERATIONS)
    file = None
    if rendezvous.master is None:
        assert rendezvous.file is not None
        file = rendezvous.file
        if generation:
            file = file.with_name(f"{file.name}.{generation}")
        base = dist.FileStore(str(file), rendezvous.world_size)
        base.set_timeout(wait)
    else:
        host, port = rendezvous.master
        key = (host, port, rendezvous.world_size)
        base = _STORES.get(key)
        if base is None:
            serve = rendezvous.rank == 0 and not agent_store
            base = _STORES[key] = dist.TCPStore(
                host, port, rendezvous.world_size, serve, timeout=wait
            )
    return Meeting(dist.PrefixStore(f"dataparallel/{generation}/", base), file)


# torch's keys for the counters (FileStore.cpp: cleanupKey_, refCountKey_); user keys start "/".
_FINISHED = b"cleanup/"
_REFERENCES = b"refcount/"
_LENGTH = struct.Struct("=I")  # each key and value: a native uint32 length, then the bytes


def remove_if_every_store_left(path: Path, workers: int) -> bool:
    """Remove torch's FileStore file at `path` when no store holds it and `workers` have
    finished; return whether it was removed. Best effort: an unreadable or missing file is
    left as it is (torch's own destructor may have removed it already).

    torch's `FileStore` removes its file in the destructor of the last store, but counts in two
    locked steps: it adds one to the finished workers, then takes one from the live references,
    and removes the file only when its own two readings say "last" (references 0 and finished ==
    world size). Two ranks finishing at once can each read themselves not last (A finishes, B
    finishes, B drops a reference, A drops the last one but read "1 finished" before B's), and
    the file stays (benchmarks/NOTES.md, "The file:// rendezvous file"). This reads the same two
    counters after this process's store is gone, under the same lock torch takes, and removes the
    file when they say everyone has finished: the last rank to drop its reference then always sees
    the final counts, whatever the interleaving.
    """
    import fcntl  # POSIX, as torch's FileStore

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

"""Joining a Gloo process group of `torch.distributed`, for `GlooBackend.create`.

- `torch.distributed` is imported here, or the error says what to install.
- rendezvous (`init_method`): see `backends/rendezvous.py`; the network interface is chosen toward
  rank 0 (`interface_toward`).
- an existing `torch.distributed` default group (the user's own `init_process_group`) is left
  alone: the library works on a private Gloo group over the same processes, which waits as long
  as the setting's timeout (as does every group made for the engine).
- the local rank and size are the launcher's where it set them consistently, else found by
  the engine from the host names.
- every Gloo group the library makes (this one, the engine's groups, an elastic round's) is
  made by `gloo_group`: one place binds it, watches its connections, and bounds its connects
  where an elastic round asks (`Connects`, kept with the round's group: every group made over
  it while it is torch's default group connects within the round's limit).
"""

from __future__ import annotations

import datetime
import weakref
from collections.abc import Callable
from pathlib import Path
from types import ModuleType
from typing import TYPE_CHECKING, NamedTuple

from dataparallel.backends.rendezvous import (
    Meeting,
    gloo_connecting,
    interface_toward,
    parse_init_method,
    rendezvous_error,
    rendezvous_store,
)
from dataparallel.config import Settings
from dataparallel.errors import BackendUnavailableError

if TYPE_CHECKING:
    from torch.distributed import ProcessGroup

__all__ = [
    "GLOO_CONNECTS",
    "Connects",
    "Joined",
    "gloo_group",
    "import_torch_distributed",
    "join_group",
]


class Joined(NamedTuple):
    """A Gloo group joined: what `GlooBackend` is made from."""

    dist: ModuleType  # torch.distributed
    group: ProcessGroup | None  # None: torch's default group, which this process made
    owns_default_group: bool
    local: tuple[int, int] | None  # (local rank, local size) from the launcher, if it set them
    store_file: Path | None = None  # file:// rendezvous: the file the ranks met in
    # Every group made for the engine waits this long (None: torch's default, 30 minutes).
    timeout: datetime.timedelta | None = None
    # The network interface the group was bound to (None: Gloo's own choice): the engine's later
    # groups bind to it too.
    interface: str | None = None
    # The group's connections (socket inodes), where it was made over an existing default group
    # (an elastic round's): what `GlooBackend.sever` cuts.
    sockets: frozenset[str] = frozenset()


def import_torch_distributed() -> ModuleType:
    """Import `torch.distributed`, or raise `BackendUnavailableError` saying what to install."""
    try:
        import torch.distributed as dist
    except ImportError as exc:
        raise BackendUnavailableError(
            "The 'gloo' backend needs PyTorch: pip install 'dataparallel[torch]' "
            "(or pip install torch)."
        ) from exc
    if not dist.is_available() or not dist.is_gloo_available():
        raise BackendUnavailableError(
            "This PyTorch build has no torch.distributed with Gloo: install a standard build "
            "(pip install torch), or use backend='mpi'."
        )
    return dist


# Gloo waits five times its timeout for a pair's first connect (`transport/tcp/pair.h`).
GLOO_CONNECTS = 5


class Connects(NamedTuple):
    """How every Gloo group connects while the default group is an elastic round's.

    For the groups of an elastic round (`elastic/rounds.py`), whose members all arrived in the
    round: one that has not connected to another within `limit` seconds cannot reach it, and
    waiting torch's five timeouts (52 minutes at the elastic default) would hold up every
    member. Only there: the store's waits for the members' addresses take Gloo's connect
    deadline too, and only a round's store keeps its own (`forming.watching`), so elsewhere a
    member arriving late would fail the group."""

    limit: float  # seconds
    # The error for a group that did not connect: from torch's error and the group's name.
    unconnected: Callable[[BaseException, str], BaseException]


# The limit of each round's group, while it lives: the groups made over it take it.
_round_groups: weakref.WeakKeyDictionary[ProcessGroup, Connects] = weakref.WeakKeyDictionary()


def gloo_group(
    make: Callable[[datetime.timedelta | None], ProcessGroup | None],
    interface: str | None,
    timeout: datetime.timedelta | None,
    name: str,
    connects: Connects | None = None,
) -> tuple[ProcessGroup | None, set[str]]:
    """Make a Gloo group by `make(timeout)` (torch's `init_process_group` or `new_group`) as
    every group of the library is made: bound to `interface`, its connections watched
    (`rendezvous.gloo_connecting`), and, where a limit applies, connected within it, its
    collectives then given `timeout` (torch takes one timeout for the connects and the
    collectives: None is torch's default). The limit is `connects` for an elastic round's own
    group (torch's default group, which `make` makes; it keeps the limit while it lives), else
    the current default group's, if an elastic round made it. Return the group (None: torch's
    default group, now made) and its connections (socket inodes).

    Raises:
        What the limit's `unconnected` says for a group that did not connect within it (`name`
        says which group it was); else what `make` raises.
    """
    import torch.distributed as dist

    default = dist.group.WORLD if dist.is_initialized() else None
    if connects is None and default is not None:
        connects = _round_groups.get(default)
    connecting = timeout
    if connects is not None:
        connecting = datetime.timedelta(seconds=connects.limit / GLOO_CONNECTS)
    try:
        with gloo_connecting(interface) as made:
            group = make(connecting)
    except RuntimeError as exc:
        if connects is None:
            raise
        raise connects.unconnected(exc, name) from exc
    if connects is not None:
        c10d = dist.distributed_c10d
        made_default = dist.group.WORLD
        if group is None and made_default is not None:  # the round's own: the groups made
            _round_groups[made_default] = connects  # over it connect within its limit
        if not c10d._rank_not_in_group(group):  # a member: its collectives wait `timeout`
            c10d._set_pg_timeout(timeout or c10d.default_pg_timeout, group)
    return group, made


def join_group(
    init_method: str | None, rank: int | None, world_size: int | None, settings: Settings
) -> Joined:
    """Join the Gloo group through `init_method`; over an initialized `torch.distributed`, make
    a private Gloo group over its processes instead (`init_method` is not consulted).

    Raises:
        BackendUnavailableError: PyTorch, or its Gloo, is missing.
        ValueError: a malformed `init_method`, or a rank or size missing or out of range.
        CollectiveTimeoutError: not every rank arrived within `settings.timeout`.
    """
    dist = import_torch_distributed()
    if dist.is_initialized():
        return _over_existing_group(dist, rank, world_size, settings)
    rendezvous = parse_init_method(init_method, rank, world_size, settings)
    if rendezvous.file is not None:
        rendezvous.file.parent.mkdir(parents=True, exist_ok=True)
    timeout = datetime.timedelta(seconds=settings.timeout) if settings.timeout is not None else None
    interface = None
    if settings.gloo_socket_ifname is None and rendezvous.master is not None:
        interface = interface_toward(*rendezvous.master)
    agent = settings.agent_store and rendezvous.url == "env://"
    met: list[Meeting] = []  # its store's connection is made with the group's, and watched

    def make(connecting: datetime.timedelta | None) -> None:
        met.append(rendezvous_store(dist, rendezvous, timeout, agent_store=agent))
        dist.init_process_group(
            "gloo",
            store=met[0].store,
            rank=rendezvous.rank,
            world_size=rendezvous.world_size,
            timeout=connecting,
        )

    try:
        gloo_group(make, interface, timeout, "the world's group")
    except (RuntimeError, TimeoutError) as exc:
        raise rendezvous_error(exc, rendezvous) from exc
    local = None
    if rendezvous.url == "env://" or (
        settings.rank == rendezvous.rank and settings.world_size == rendezvous.world_size
    ):
        local = _launcher_local(settings)
    return Joined(
        dist,
        None,
        owns_default_group=True,
        local=local,
        store_file=met[0].file,
        timeout=timeout,
        interface=interface,
    )


def _over_existing_group(
    dist: ModuleType, rank: int | None, world_size: int | None, settings: Settings
) -> Joined:
    actual = (dist.get_rank(), dist.get_world_size())
    for given, value, what in (
        (rank, actual[0], "rank"),
        (world_size, actual[1], "world_size"),
    ):
        if given is not None and given != value:
            raise ValueError(
                f"{what}={given} was given, but torch.distributed is already initialized "
                f"with {what} {value}: drop the argument."
            )
    # The program's group waits as long as the program chose; this one, as long as the group an
    # elastic round makes (`dataparallel.elastic`): torch's own default is 30 minutes.
    seconds = settings.group_timeout
    timeout = datetime.timedelta(seconds=seconds) if seconds is not None else None
    # An elastic worker's round bound its group toward the launcher's store (its hosts'
    # names may resolve to nothing): this one, and those made from it, bind there too.
    interface = None
    if settings.gloo_socket_ifname is None and settings.elastic_store is not None:
        interface = interface_toward(*settings.elastic_store)
    group, made = gloo_group(
        lambda connecting: dist.new_group(backend="gloo", timeout=connecting),
        interface,
        timeout,
        "the world's group over torch's default group",
    )
    local = _launcher_local(settings) if settings.world_size == actual[1] else None
    return Joined(
        dist,
        group,
        owns_default_group=False,
        local=local,
        timeout=timeout,
        interface=interface,
        sockets=frozenset(made),
    )


def _launcher_local(settings: Settings) -> tuple[int, int] | None:
    """Return (LOCAL_RANK, LOCAL_WORLD_SIZE) when the launcher set both consistently."""
    lr, ls = settings.local_rank, settings.local_world_size
    if lr is None or ls is None or not 0 <= lr < ls:
        return None
    return lr, ls

"""`torch.distributed` initialized alongside the world, so torch's ecosystem works in every job.

`DistributedSampler`, `dist.all_reduce`, `DistributedDataParallel`, and libraries that check
`dist.is_initialized()` (torchmetrics, Lightning) need torch's default process group. The Gloo
engine is one already; under MPI, NCCL and a world of one, `dp.initialize()` makes a Gloo group
(plus NCCL for CUDA tensors on an NCCL world) over the same processes in the same rank order,
through the world's own rendezvous, so nothing needs `MASTER_ADDR` or a port agreed beforehand.

It is made at `dp.initialize()` when torch is imported already, or else as torch is first
imported in this world: the order of two imports must never decide whether a metric is global,
and a NumPy or JAX program that never imports torch never pays for torch. It is not made when
torch's default group exists already (the user's own, left alone) or with
`DATAPARALLEL_TORCH_DISTRIBUTED=0`.

Making the group is collective, so it starts with a collective call's handshake: a rank that
imports torch where another does not fails loudly with `CollectiveMismatchError` on every rank
instead of waiting forever. `dp.finalize()` destroys the group it made. A program that calls
`dist.init_process_group()` after `dp.initialize()` (a Horovod program) gets its own group, as
no engine of this library runs on the one made here; under Gloo the engine *is* torch's default
group and that call fails saying what to do (docs/migrate/ddp.md).
"""

from __future__ import annotations

import datetime
import functools
import importlib.abc
import importlib.machinery
import socket
import sys
from collections.abc import Callable, Mapping, Sequence
from types import ModuleType
from typing import TYPE_CHECKING

from dataparallel.backends.base import Backend
from dataparallel.backends.gloo.group import gloo_group
from dataparallel.backends.rendezvous import interface_toward
from dataparallel.config import Settings
from dataparallel.errors import DataParallelError

if TYPE_CHECKING:
    from torch.distributed import Store

__all__ = ["check_calls_with", "join"]

_STORE_PREFIX = "dataparallel-torch/"


def join(backend: Backend, settings: Settings) -> Callable[[], None] | None:
    """Initialize torch's default process group over `backend`'s processes, where it is wanted:
    now when torch is imported, else as torch is first imported while this world lasts.

    Collective over the world when it acts (every rank decides alike: same code, same imports).

    Returns:
        What destroys the group made (for `dp.finalize()`) and stops waiting for torch's import,
        or None when there is nothing to undo. Under Gloo, what takes away the explanation a
        later `init_process_group` call gets.
    """
    if backend.name == "gloo":
        return _explain_the_engines_group(backend)
    if not settings.torch_distributed:
        return None
    if "torch" in sys.modules:
        return _make_group(backend, settings)
    made: list[Callable[[], None]] = []

    def make() -> None:
        assert _verify, "dataparallel/__init__.py hands the handshake in"
        _verify[0](backend, _AT_IMPORT)
        finish = _make_group(backend, settings)
        if finish is not None:
            made.append(finish)

    stop_waiting = _after_import("torch", make)

    def finish() -> None:
        stop_waiting()
        for undo in made:
            undo()

    return finish


def check_calls_with(verify: Callable[[Backend, Mapping[str, str]], None]) -> None:
    """Make `verify` the check a group made at a later import begins with.

    That check is the handshake every collective begins with (`protocol.verify_same_call`),
    which sits a layer above this module: the public face (`dataparallel/__init__.py`, always
    imported before any world is made) hands it in.
    """
    _verify[:] = [verify]


_verify: list[Callable[[Backend, Mapping[str, str]], None]] = []

# What a rank that imports torch where another does not sees in the mismatch, on every rank.
_AT_IMPORT = {
    "collective": "torch.distributed's default group, made as torch is first imported",
    "fix": "import torch on every rank (best before dp.initialize()), or set "
    "DATAPARALLEL_TORCH_DISTRIBUTED=0 to go without torch's group",
}


def _make_group(backend: Backend, settings: Settings) -> Callable[[], None] | None:
    """Make torch's default group now (torch imported); return what destroys it, or None."""
    try:
        import torch
        import torch.distributed as dist
    except ImportError:
        return None
    if not dist.is_available() or not dist.is_gloo_available() or dist.is_initialized():
        return None
    wait = datetime.timedelta(seconds=settings.timeout or 1800.0)
    store, toward = _store(dist, backend, settings, wait)
    kind = "gloo"
    if backend.name == "nccl" and torch.cuda.is_available() and dist.is_nccl_available():
        kind = "cpu:gloo,cuda:nccl"
    # Gloo binds to the address its hostname resolves to, else loopback: bind to the interface
    # that reaches rank 0's store instead, as the Gloo engine does (`rendezvous.interface_toward`).
    interface = None
    if settings.gloo_socket_ifname is None and toward is not None:
        interface = interface_toward(*toward)
    hook = sys.excepthook  # init_process_group wraps it; the world manages its own

    def make(connecting: datetime.timedelta | None) -> None:
        dist.init_process_group(
            kind,
            store=dist.PrefixStore(_STORE_PREFIX, store),
            rank=backend.rank,
            world_size=backend.size,
            timeout=connecting,
        )

    gloo_group(make, interface, wait, "torch.distributed's default group")
    sys.excepthook = hook
    group = dist.group.WORLD

    def destroy() -> None:
        if dist.is_initialized() and dist.group.WORLD is group:
            dist.destroy_process_group()

    # A program's own init_process_group gets the default group: ours gives way first (and
    # `destroy` leaves the program's group alone afterwards).
    restore = _before_init_process_group(dist, destroy)

    def finish() -> None:
        restore()
        destroy()

    return finish


def _explain_the_engines_group(backend: Backend) -> Callable[[], None] | None:
    """Under Gloo, make a later `init_process_group` fail saying what to do, where the engine
    is torch's default group (`GlooBackend.owns_default_group`)."""
    dist = sys.modules.get("torch.distributed")
    if dist is None or not getattr(backend, "owns_default_group", False):
        return None

    def refuse() -> None:
        if dist.is_initialized():
            raise ValueError(
                "torch.distributed.init_process_group() after dp.initialize('gloo'): "
                "dataparallel's Gloo engine is torch's default process group already, so "
                "torch.distributed works as it is. Drop the call, or guard it with `if not "
                "dist.is_initialized():`, or call init_process_group() before dp.initialize() "
                "(dataparallel then works on a private group beside yours)."
            )

    return _before_init_process_group(dist, refuse)


def _before_init_process_group(dist: ModuleType, first: Callable[[], None]) -> Callable[[], None]:
    """Run `first` at the start of every `init_process_group` call until the returned function
    is called. torch's name is replaced where scripts reach it (`dist.init_process_group`)."""
    modules = [dist, dist.distributed_c10d]
    original = dist.distributed_c10d.init_process_group

    @functools.wraps(original)
    def init_process_group(*args: object, **kwargs: object) -> object:
        first()
        return original(*args, **kwargs)

    for module in modules:
        module.init_process_group = init_process_group

    def restore() -> None:
        for module in modules:
            if module.init_process_group is init_process_group:
                module.init_process_group = original

    return restore


def _after_import(name: str, then: Callable[[], None]) -> Callable[[], None]:
    """Call `then` once the top-level module `name` is first imported (its code run), on the
    importing thread, inside that `import` statement (an error of `then` is the import's); return
    what stops waiting. Nothing is imported here: a program that never imports `name` pays one
    name comparison per import.
    """
    finder = _AfterImport(name, then)
    sys.meta_path.insert(0, finder)

    def stop_waiting() -> None:
        if finder in sys.meta_path:
            sys.meta_path.remove(finder)

    return stop_waiting


class _AfterImport(importlib.abc.MetaPathFinder):
    """The import system's first finder, until its module is imported: it finds nothing itself,
    but gives the spec the other finders find a loader whose `exec_module` then calls `then`.
    The loader stays the one the module would have had (only its `exec_module` is wrapped, on
    that one instance), so `torch.__spec__.loader` and resource readers are unchanged."""

    def __init__(self, name: str, then: Callable[[], None]) -> None:
        self.name = name
        self.then = then

    def find_spec(
        self,
        fullname: str,
        path: Sequence[str] | None,
        target: ModuleType | None = None,
    ) -> importlib.machinery.ModuleSpec | None:
        if fullname != self.name:
            return None
        for finder in sys.meta_path:
            find = getattr(finder, "find_spec", None)
            if finder is self or find is None:
                continue
            spec = find(fullname, path, target)
            if spec is not None:
                break
        else:
            return None
        loader = spec.loader
        execute = getattr(loader, "exec_module", None)
        if loader is None or execute is None:
            return spec  # not a module this import system runs: nothing to wait for

        def exec_module(module: ModuleType) -> None:
            del loader.exec_module  # the loader's own again
            execute(module)
            if self in sys.meta_path:
                sys.meta_path.remove(self)
                self.then()

        loader.exec_module = exec_module
        return spec


def _store(
    dist: ModuleType, backend: Backend, settings: Settings, wait: datetime.timedelta
) -> tuple[Store, tuple[str, int] | None]:
    """Return the store the ranks meet through (rank 0's TCPStore, its address broadcast), and
    that address (None in a world of one)."""
    if backend.size == 1:
        single: Store = dist.HashStore()
        return single, None
    if backend.rank == 0:
        host = settings.master_addr or socket.gethostname()
        try:  # torch's store retries an unknown name until its timeout: say so now instead
            socket.getaddrinfo(host, None)
        except OSError as e:
            problem = (
                f"torch.distributed alongside the world: rank 0's host name {host!r} does not "
                f"resolve ({e}); set MASTER_ADDR to an address of rank 0's host that every rank "
                "can reach, or DATAPARALLEL_TORCH_DISTRIBUTED=0 to go without torch's group"
            )
            backend.broadcast_object(problem, 0)
            raise DataParallelError(problem) from e
        server = dist.TCPStore(host, 0, backend.size, True, timeout=wait, wait_for_workers=False)
        backend.broadcast_object((host, int(server.port)), 0)
        return server, (host, int(server.port))
    received = backend.broadcast_object(None, 0)
    if isinstance(received, str):
        raise DataParallelError(received)
    assert isinstance(received, tuple)
    host, port = received
    client: Store = dist.TCPStore(host, port, backend.size, False, timeout=wait)
    return client, (host, port)

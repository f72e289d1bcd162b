"""Process-group state: the one global of the library, its lifecycle (`initialize`, `finalize`),
and the calls that read it. What `initialize` checks and installs around the engine is
`startup.py`."""

from __future__ import annotations

import atexit
import builtins
import contextlib
import dataclasses
import datetime
import os
import sys
import threading
from collections.abc import Callable, Hashable, Iterator
from dataclasses import dataclass, field
from typing import Any, Protocol, TypeVar

from dataparallel import caches, runnotes, torch_distributed
from dataparallel.arrays.comm_thread import CommThread, Privates
from dataparallel.arrays.pool import BufferPool
from dataparallel.arrays.trace import Timeline
from dataparallel.backends import registry
from dataparallel.backends.base import Backend, released
from dataparallel.config import Settings
from dataparallel.errors import NotInitializedError
from dataparallel.gpus import choose_device, cuda_device_count, point_frameworks_at
from dataparallel.startup import (
    abort_on_uncaught_exceptions,
    check_mpi_not_finalized,
    check_not_alone,
    check_slurm_step,
    excepthook_restorer,
    seconds,
    world_note,
)

__all__ = [
    "Plans",
    "World",
    "abandon",
    "choose_device",
    "cuda_device_count",
    "current",
    "device",
    "finalize",
    "form",
    "formed_again",
    "get_backend",
    "initialize",
    "initialized",
    "is_main",
    "local_rank",
    "local_size",
    "looping",
    "on_lost_member",
    "print",
    "rank",
    "size",
    "timeline",
]


T = TypeVar("T")


class _Freeable(Protocol):
    """What the world needs of a group (`groups.Group`) to end it: freeing twice does nothing."""

    def free(self) -> None: ...

    def release(self, *, cut: bool = False) -> Callable[[], None]: ...


class Waitable(Protocol):
    """What is in flight until waited on (`dp.Request`, a checkpoint's `SaveFuture`)."""

    def wait(self) -> object: ...


class Plans(dict[Hashable, Any]):
    """What the collectives decided about calls this world has made, by the calls' signatures
    (their call plans, `CallPlan`): the oldest go first beyond `KEPT` plans or `KEPT_BYTES` of the
    buffers they hold. A plan is anything with an `nbytes`; a digest (an int) holds none. (Its
    values are `Any`: each caller knows what it keeps, and a `cast` on every call costs.)
    Looked up with `get` (a dict's: no Python frame on every call's path), kept with `put`."""

    KEPT = 1024
    KEPT_BYTES = 64 << 20

    def __init__(self) -> None:
        super().__init__()
        self.nbytes = 0

    def put(self, key: Hashable, plan: object) -> None:
        """Keep `plan` for `key`, letting the oldest plans go while there are too many."""
        self[key] = plan
        self.nbytes += getattr(plan, "nbytes", 0)
        while len(self) > self.KEPT or (self.nbytes > self.KEPT_BYTES and len(self) > 1):
            self.nbytes -= getattr(self.pop(next(iter(self))), "nbytes", 0)

    def clear(self) -> None:
        super().clear()
        self.nbytes = 0


@dataclass
class World:
    """Everything `initialize` sets up: the backend, the settings it read, the device it chose."""

    backend: Backend
    settings: Settings
    device: int | None
    verbose: bool = False
    pending: list[Waitable] = field(default_factory=list)  # what is not yet waited on
    buffers: BufferPool = field(default_factory=BufferPool)
    recording: Timeline | None = None
    plans: Plans = field(default_factory=Plans)  # by signature (collectives/_plans.py)
    # Engines whose calls never meet the caller's, and the thread that makes calls off the
    # caller's thread (`arrays/comm_thread.py`): both made on first use.
    private: Privates = field(default_factory=Privates)
    comm_thread: CommThread = field(default_factory=CommThread)
    # Puts back the `sys.excepthook` of before `initialize` (which, and torch.distributed's
    # `init_process_group` under it, wrapped it).
    restore_excepthook: Callable[[], None] | None = None
    # The groups made in this world (`dp.new_group`): their engines are freed with it.
    groups: list[_Freeable] = field(default_factory=list)
    # Destroys torch.distributed's default group where the world made it (`torch_distributed.py`).
    torch_group: Callable[[], None] | None = None

    @property
    def timeline(self) -> Timeline | None:
        """The timeline that records this process's collectives, while one is open."""
        recording = self.recording
        return recording if recording is not None and not recording.closed else None


class _Rejoin(Protocol):
    """What `initialize` and `form` call when a world, or a group over it, cannot form."""

    def __call__(
        self, error: BaseException, leave_world: Callable[[], None] | None = None
    ) -> None: ...


_world: World | None = None
# What `initialize` does when its world cannot form (`on_lost_member`); None: it raises.
_on_lost_member: _Rejoin | None = None
# How many `@dp.elastic.run` functions are running (`looping`): `form` lets errors through there.
_looping = 0
# Whether `form` made a new world since `formed_again` was last asked.
_formed_again = False


def on_lost_member(rejoin: _Rejoin | None) -> None:
    """Have `initialize` call `rejoin(error)` when making the world fails with `error`, and then
    try again; `rejoin` raises to give up (None: `initialize` raises at once). `form` calls
    `rejoin(error, leave_world)`: `leave_world()` leaves the world first, once `rejoin` has found
    a lost member.

    An elastic run's worker (`dataparallel run --min-np`) sets this: a member lost while the
    world forms leaves the launcher's round without it, and `rejoin` joins that round instead
    (`dataparallel.elastic`). Elsewhere the processes are fixed, and a failure is final.
    """
    global _on_lost_member
    _on_lost_member = rejoin


def form(make: Callable[[World], T]) -> T:
    """Return `make(world)`: a collective step on the world that the program makes outside its
    collective calls, at the same point on every rank, such as a wrapper's construction making
    a group over the world (a private duplicate) and agreeing on its settings.

    In an elastic run's worker (`on_lost_member` set), outside `@dp.elastic.run`'s function, a
    member lost meanwhile does what it does in `initialize`: this worker leaves the world, joins
    the launcher's next round, makes a world of it, and `make` runs again there. Outside the
    loop nothing would catch the error and the run would end; the others meet this worker in
    the new world at the same step (`make` again, or, if they had gone on into the loop, its
    re-forming, which makes the same group first: `TorchState.sync`). The loop then runs the
    reset callbacks as it starts (`formed_again`), so that what the program computed from the
    old world (its size) is computed again. Inside the loop's function the error propagates:
    the loop re-forms, rolls back and resets.
    """
    global _formed_again
    while True:
        active = current()
        try:
            return make(active)
        except BaseException as exc:
            if _on_lost_member is None or _looping:
                raise
            _on_lost_member(exc, _leave)  # raises unless a member was lost
            initialize(timeout=active.settings.timeout)
            _formed_again = True


def _leave() -> None:
    """Leave the world whose group could not form (one of its members is gone)."""
    abandon()


@contextlib.contextmanager
def looping() -> Iterator[None]:
    """Run the block as `@dp.elastic.run`'s loop: `form` lets a lost member's error through."""
    global _looping
    _looping += 1
    try:
        yield
    finally:
        _looping -= 1


def formed_again() -> bool:
    """Return whether `form` made a new world since this was last asked (and forget it)."""
    global _formed_again
    again, _formed_again = _formed_again, False
    return again


def initialize(
    backend: str = "auto",
    *,
    init_method: str | None = None,
    rank: int | None = None,
    world_size: int | None = None,
    gpu_devices: list[int] | None = None,
    timeout: float | None = None,
    verbose: bool = False,
) -> Backend:
    """Set up the process group and return its backend.

    Idempotent: a second call returns the active backend; one that names another backend than the
    active one raises `ValueError`. After `finalize()`, a new world can be made in the same process,
    on any engine (every rank must do it alike); under MPI only while MPI itself is initialized:
    `finalize()` leaves it so, but once the program (or the interpreter's exit) has called
    `MPI_Finalize`, MPI cannot start again in this process.

    Args:
        backend: `"auto"` (default), `"mpi"`, `"gloo"`, `"nccl"` or `"single"`. `"auto"` picks MPI
            when an MPI launcher started the process (or MPI is already initialized), Gloo when
            torchrun's `RANK`, `WORLD_SIZE` and `MASTER_ADDR` are set, else a world of one.
        init_method: rendezvous for Gloo/NCCL: `"env://"`, `"tcp://host:port"` or `"file:///dir"`
            (Flashlight's methods); `"mpi"` selects the MPI backend.
        rank: this process's rank, for `tcp://` and `file://`.
        world_size: the number of processes, for `tcp://` and `file://`.
        gpu_devices: GPU index per local rank; default: round robin over the visible GPUs.
        timeout: seconds before a blocked collective or rendezvous fails: a positive, finite
            number (default: none).
        verbose: print the world's shape from every rank once initialized.

    Returns:
        The active `Backend`.

    Raises:
        ValueError: `timeout` is not positive and finite, or `backend` is not the active one.
        TypeError: `timeout` is not a number.
        BackendUnavailableError: the engine cannot be used here, e.g. it finds itself alone
            while the launcher started several processes, or MPI was finalized.
    """
    global _world
    if _world is not None:
        active = _world.backend.name
        if backend not in ("auto", active):
            raise ValueError(
                f"dp.initialize({backend!r}) was called, but the {active!r} backend is active: "
                "a process has one world. Call dp.finalize() first to switch, or drop the "
                "second call."
            )
        return _world.backend
    settings = Settings.from_env()
    if timeout is not None:
        settings = dataclasses.replace(settings, timeout=seconds(timeout))
    name = registry.choose(backend, init_method, settings)
    if backend == "auto" and name == "single":
        check_slurm_step(settings)
    if name == "mpi":
        check_mpi_not_finalized()
    note = world_note(settings, rank, world_size)
    hook_before = sys.excepthook  # torch.distributed's init_process_group wraps it too
    while True:  # again after `_on_lost_member` found a new membership
        note(runnotes.INITIALIZING)
        try:
            made = registry.load(name).create(
                init_method=init_method, rank=rank, world_size=world_size, settings=settings
            )
        except BaseException as exc:
            note(runnotes.FAILED)
            if _on_lost_member is None:
                raise
            _on_lost_member(exc)
            continue
        note(runnotes.READY)
        check_not_alone(made, name, settings)
        gpu = choose_device(made.local_rank, cuda_device_count(), gpu_devices)
        if gpu is not None:
            point_frameworks_at(gpu)
            made.bind_device(gpu)  # NCCL makes its communicator there
        _world = World(backend=made, settings=settings, device=gpu, verbose=verbose)
        try:
            _world.torch_group = torch_distributed.join(made, settings)
        except BaseException as exc:
            _world = None
            made.close()
            if _on_lost_member is None:
                raise
            _on_lost_member(exc)
            continue
        break
    if settings.timeline:
        _world.recording = Timeline(settings.timeline, made.rank, made.size)
    # After the exit hooks of the engine (`create`) and the timeline, so that it runs first.
    atexit.unregister(_finalize_at_exit)
    atexit.register(_finalize_at_exit)
    if made.size > 1:
        _abort_on_uncaught_exceptions(made)
    _world.restore_excepthook = excepthook_restorer(hook_before)
    if verbose:
        print(f"initialized {made.name} backend, local rank {made.local_rank}, GPU {gpu}")
    return made


def _abort_on_uncaught_exceptions(made: Backend) -> None:
    """End the whole job on an uncaught exception while `made` is the world's engine."""
    abort_on_uncaught_exceptions(made, lambda: _world is not None and _world.backend is made)


def initialized() -> bool:
    """Return whether `initialize()` has set up the process group."""
    return _world is not None


def finalize() -> None:
    """Wait for requests in flight, then tear the process group down. Safe to call twice; run at
    the interpreter's exit for a program that did not call it (`_finalize_at_exit`).

    In order: the requests in flight are waited for, the communication thread is stopped, the
    timeline closed, the private duplicates of the engines (`World.private`), the groups' engines
    (`dp.new_group`) and then the engine are closed; `sys.excepthook` is put back as it was
    before `initialize`, and every cache registered in `dataparallel.caches` is cleared, so that
    a world made next starts afresh (any engine can be made again; MPI only while `MPI.Finalize`
    has not run, see `initialize`). A step that fails (a request whose peer died) does not stop
    the others: the first error is raised once everything is closed.

    Under MPI, leaving is collective: it waits until every rank leaves (at `dp.finalize()` or at
    its end), and ends the job when another rank waits in a collective that this one will never
    join (see `backends/mpi/board.py`), so that a rank that finishes early cannot hang the job.
    """
    global _world
    if _world is None:
        return
    world, _world = _world, None
    steps: list[Callable[[], object]] = [request.wait for request in world.pending]
    steps.append(world.comm_thread.close)
    if world.recording is not None:
        steps.append(world.recording.close)
    steps.append(world.private.close)
    steps += [group.free for group in world.groups]
    if world.torch_group is not None:
        steps.append(world.torch_group)
    steps.append(world.backend.close)
    first = _end(world, steps)
    if first is not None:
        raise first


def _finalize_at_exit() -> None:
    """`finalize`, at the interpreter's exit, for a program that ended without calling it.

    Every thread the world started must have ended before the interpreter finalizes: from then
    on CPython (3.11, 3.12) ends a thread that takes the GIL back with `pthread_exit`, whose
    unwinding through a C++ destructor on the thread's stack calls `std::terminate` ("terminate
    called without an active exception", exit status -6). torch takes the GIL back in
    destructors: at the end of every call that let it go (pybind11's `gil_scoped_release`),
    and when it frees a tensor (it lets the GIL go meanwhile, and a tensor made from NumPy
    memory, as every buffer of the engines is, takes it again to free that). So the
    communication thread still running a job, or only dropping its last one, once the
    interpreter finalizes, aborts the process after its work is done; `finalize`
    joins it, and the hierarchy's lanes (`Hierarchy.close`), before closing the engines, in that
    order, while the interpreter is whole. The engines' own exit hooks cannot: each closes one
    engine, and none knows the thread that uses it."""
    finalize()


def abandon() -> None:
    """Leave a world that lost a member, or that an elastic run re-forms: as `finalize`, but
    nothing in flight is waited for and nothing is raised (the peers' errors say only that one
    is gone).

    A call in flight ends only once its peers close their side, and a peer may be waiting for
    this process in a call this process never made, or abandoned, having failed first: each
    waiting for the other to leave, neither would. So every engine's connections are cut first
    (`Backend.sever`): the calls in flight fail here and at the peers. Then every engine is
    released, and what is left of closing each (which waits for its calls in flight: Gloo joins
    its worker threads) runs on a thread of its own, side by side, for engines that could not
    cut; the communication thread is stopped last (its calls fail, or end as the peers leave).
    """
    global _world
    if _world is None:
        return
    world, _world = _world, None
    finishes = world.private.release(cut=True)
    finishes += [group.release(cut=True) for group in world.groups]
    finishes.append(released(world.backend, cut=True))
    closing = [threading.Thread(target=_quietly, args=(f,), daemon=True) for f in finishes]
    for thread in closing:
        thread.start()
    steps: list[Callable[[], object]] = [world.comm_thread.close, *(t.join for t in closing)]
    if world.recording is not None:
        steps.append(world.recording.close)
    if world.torch_group is not None:
        steps.append(world.torch_group)
    _end(world, steps)


def _end(world: World, steps: list[Callable[[], object]]) -> BaseException | None:
    """Run `steps`, each whatever the ones before raised, then put `sys.excepthook` back as
    it was before `initialize` and clear every registered cache, whatever happens; return the
    first error (None: none). An engine left open because a step before it failed (a request
    whose peer died) would keep its connections, and a peer waiting on them would wait out the
    timeout."""
    first: BaseException | None = None
    try:
        for step in steps:
            try:
                step()
            except Exception as error:
                first = first or error
    finally:
        if world.restore_excepthook is not None:
            world.restore_excepthook()
        caches.clear_all()
    return first


def _quietly(step: Callable[[], object]) -> None:
    with contextlib.suppress(Exception):
        step()


def current() -> World:
    """Return the active world, or raise `NotInitializedError`."""
    if _world is None:
        raise NotInitializedError(
            "dataparallel is not initialized: call dp.initialize() first "
            "(it picks MPI, Gloo or a world of one from how the process was launched)."
        )
    return _world


def get_backend() -> Backend:
    """Return the active backend (`.name` is `"mpi"`, `"gloo"`, `"nccl"` or `"single"`)."""
    return current().backend


class _Grouped(Protocol):
    """What `rank` and `size` need of a group (`dataparallel.groups.Group`)."""

    @property
    def backend(self) -> Backend: ...


def rank(group: _Grouped | None = None) -> int:
    """Return this process's rank in the world, or in `group` (0-based)."""
    return current().backend.rank if group is None else group.backend.rank


def size(group: _Grouped | None = None) -> int:
    """Return the number of processes in the world, or in `group`."""
    return current().backend.size if group is None else group.backend.size


def local_rank() -> int:
    """Return this process's rank among the processes on its node.

    Note: FluxMPI's `local_rank()` is the world rank, which is `dp.rank()` here.
    """
    return current().backend.local_rank


def local_size() -> int:
    """Return the number of processes on this node."""
    return current().backend.local_size


def is_main() -> bool:
    """Return whether this is rank 0, where logging, checkpoints and progress bars belong."""
    return rank() == 0


def device() -> int | None:
    """Return the GPU index this process was given, or None when it has no GPU."""
    return current().device


def print(*args: object, **kwargs: Any) -> None:
    """Print with a timestamp and a `[rank/size]` prefix, flushed at once.

    Under `dataparallel run --backend gloo`, which prefixes every line with `[rank R] ` already,
    the `[rank/size]` prefix of its world is left out: one prefix per line.

    Never communicates, so a print on one rank alone cannot deadlock (FluxMPI's is collective).
    """
    where = f"{rank()}/{size()}" if _world is not None else "-/-"
    stamp = datetime.datetime.now().strftime("%H:%M:%S.%f")[:-3]
    head = f"[{stamp}] [{where}] "
    # Where the launcher prefixes every line with `[rank R] ` of this very world, once is enough.
    world = _world
    if world is not None and world.settings.prefixed and world.settings.world_size == size():
        head = f"[{stamp}] "
    text = kwargs.pop("sep", " ").join(map(str, args))
    end = kwargs.pop("end", "\n")
    kwargs.setdefault("flush", True)
    # One write per line, so lines from ranks sharing a terminal never interleave mid-line.
    builtins.print(f"{head}{text}{end}", end="", **kwargs)


def timeline(path: str | os.PathLike[str]) -> Timeline:
    """Record every collective of this process into the Chrome-trace file `path`.

    In a world of one the file is `path`; with several ranks each rank writes its own, named from
    it (`trace.json` becomes `trace.rank0.json`, `trace.rank1.json`, ...; a `{rank}` in `path` is
    replaced instead). Setting `DATAPARALLEL_TIMELINE=path` does the same from `dp.initialize()`
    on. Returns the `Timeline`; close it (or leave its `with` block, or call `dp.finalize()`) to
    finish the file.

    >>> import dataparallel as dp, numpy as np, tempfile, os, json, pathlib
    >>> _ = dp.initialize("single")
    >>> path = os.path.join(tempfile.mkdtemp(), "trace.json")
    >>> with dp.timeline(path):
    ...     _ = dp.allreduce(np.ones(4))
    >>> events = json.loads(pathlib.Path(path).read_text())
    >>> sorted({e["name"] for e in events if e.get("ph") == "X"})
    ['allreduce', 'pack', 'queue', 'unpack']
    """
    active = current()
    if active.recording is not None:
        active.recording.close()
    active.recording = Timeline(path, active.backend.rank, active.backend.size)
    return active.recording

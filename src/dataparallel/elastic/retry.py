"""`elastic.run`: call the training function again, on a re-formed world, after a lost rank or
an added one (Horovod's `hvd.elastic.run`).

On `RankFailedError` (a rank died: raised by whatever collective this rank was in, or carried
by another library's error: a jitted JAX step raises JAX's `JaxRuntimeError`, `library_error`)
the state rolls back to its last commit; on `HostsUpdatedInterrupt` (workers added, seen at a
commit) it does not. Either way the world is re-formed from the launcher's newest round
(`rounds.py`), the reset callbacks run, the state is synchronized from the new rank 0, and the
function is called again. Outside an elastic run (no `dataparallel run --min-np` launcher) the
errors propagate. A world re-formed before the loop (a wrapper made there lost a member while
forming its group: `world.form`) has the reset callbacks run as the loop starts. A worker that
can join no round (`rounds.NoWorldError`) ends: waiting again would wait for ever.
"""

from __future__ import annotations

import contextlib
import functools
from collections.abc import Callable
from typing import Concatenate, ParamSpec, TypeVar

from dataparallel import world
from dataparallel.elastic import rounds
from dataparallel.elastic.state import HostsUpdatedInterrupt, State
from dataparallel.errors import DataParallelError, RankFailedError, library_error

__all__ = ["reform_world", "run", "run_fn"]

P = ParamSpec("P")
R = TypeVar("R")
S = TypeVar("S", bound=State)


def reform_world(
    leave: Callable[[], None] = world.abandon, enter: Callable[[], object] | None = None
) -> None:
    """Leave this world (`leave`, which waits for nothing in flight: a peer may never answer;
    its errors, from peers that died, are dropped), join the launcher's next round and make a
    world of it (`enter`; default: `dp.initialize` with the timeout the world had)."""
    joined = rounds.current()
    assert joined is not None
    timeout = world.current().settings.timeout if world.initialized() else None
    with contextlib.suppress(DataParallelError, RuntimeError):
        leave()
    rounds.leave()
    rounds.join(joined.generation)
    if enter is None:
        world.initialize(timeout=timeout)
    else:
        enter()


def run_fn(
    func: Callable[Concatenate[S, P], R], reset: Callable[[], None]
) -> Callable[Concatenate[S, P], R]:
    """Wrap `func(state, ...)` to survive lost and added workers, re-forming with `reset`."""

    @functools.wraps(func)
    def wrapper(state: S, *args: P.args, **kwargs: P.kwargs) -> R:
        elastic = rounds.current() is not None
        if elastic and not world.initialized():
            world.initialize()
        skip_sync, reform = False, False
        formed_again = world.formed_again()  # before the loop (`world.form`): reset first
        with world.looping():
            while True:
                try:
                    if reform:  # a worker lost meanwhile fails this too: roll back, re-form
                        reset()
                    if reform or formed_again:
                        formed_again = False
                        state.on_reset()
                    if not skip_sync:
                        state.sync()
                    return func(state, *args, **kwargs)
                except RankFailedError as error:
                    if not elastic:
                        raise
                    rounds.report_split(error)
                    state.restore()
                    skip_sync = False
                except HostsUpdatedInterrupt as interrupt:
                    if not elastic:
                        raise
                    skip_sync = interrupt.skip_sync
                except Exception as error:
                    if not (elastic and isinstance(library_error(error), RankFailedError)):
                        raise
                    rounds.report_split(error)
                    state.restore()
                    skip_sync = False
                reform = True

    return wrapper


def run(func: Callable[Concatenate[S, P], R]) -> Callable[Concatenate[S, P], R]:
    """Decorate `func(state, ...)`: see the module's notes (`@dp.elastic.run`)."""
    return run_fn(func, reform_world)

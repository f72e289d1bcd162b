"""The registry of module-level caches: `dp.finalize()` clears every one (equinox's `_caches.py`).

The world (`world.py`) is the library's one global. A cache that cannot hang on it (it lives in a
layer below the world, or is a pure function of its key that every world may share) registers here
instead, so that `dp.finalize()` leaves nothing behind that was made for, or keyed on, the world it
ends, and a world made after it starts from nothing.

>>> cache: dict[str, int] = {}
>>> _ = register(cache.clear)
>>> cache["x"] = 1
>>> clear_all()
>>> cache
{}
>>> unregister(cache.clear)

What does not register: the TCP stores of `backends/rendezvous.py` are kept for the life of the
process on purpose (a world made again meets through the same store, under a fresh prefix, instead
of binding its port again while the old server may still answer).
"""

from __future__ import annotations

import threading
from collections.abc import Callable

__all__ = ["clear_all", "register", "registered", "unregister"]

_callbacks: list[Callable[[], None]] = []
_lock = threading.Lock()


def register(clear: Callable[[], None]) -> Callable[[], None]:
    """Have `clear_all()` (run by `dp.finalize()`) call `clear`; return `clear` (a decorator).

    `clear` empties one cache: it takes no argument, communicates with no one, and may be called
    when the cache is already empty. Register once, at import; registering it again is a no-op.
    """
    with _lock:
        if clear not in _callbacks:
            _callbacks.append(clear)
    return clear


def unregister(clear: Callable[[], None]) -> None:
    """Stop calling `clear` (nothing happens when it was not registered)."""
    with _lock:
        if clear in _callbacks:
            _callbacks.remove(clear)


def registered() -> tuple[Callable[[], None], ...]:
    """Return the registered callbacks, in the order `clear_all()` runs them."""
    with _lock:
        return tuple(_callbacks)


def clear_all() -> None:
    """Run every registered callback, in the order they were registered.

    `world.finalize()` calls it after the world's backend is closed. Each callback runs even when
    one before it raised; the first error is raised once all have run, the later ones noted on it.
    """
    first: BaseException | None = None
    for clear in registered():
        try:
            clear()
        except Exception as error:
            if first is None:
                first = error
            else:
                first.add_note(f"clearing {clear!r} raised too: {error!r}")
    if first is not None:
        raise first

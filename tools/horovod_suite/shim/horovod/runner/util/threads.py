"""`in_thread`, the one helper of `horovod.runner.util.threads` that `test/utils/common.py` uses."""

from __future__ import annotations

import threading
from collections.abc import Callable
from typing import Any


def in_thread(
    target: Callable[..., Any],
    args: tuple[Any, ...] = (),
    name: str | None = None,
    daemon: bool = True,
    silent: bool = False,
) -> threading.Thread:
    """Run `target(*args)` in a new thread and return the thread (started).

    With `silent=True`, an exception in `target` is swallowed instead of printed.
    """

    def run() -> None:
        try:
            target(*args)
        except Exception:
            if not silent:
                raise

    thread = threading.Thread(target=run, name=name, daemon=daemon)
    thread.start()
    return thread

"""`ctrl_c.py DIR`: rank 0 waits in a collective that rank 1 never joins; rank 1 sleeps 600 s.

Each rank writes its pid to DIR/<rank>.pid, for the test to press Ctrl-C: rank 1 once it has
initialized, rank 0 once it is blocked in the collective (`_note_when_blocked`).
"""

import os
import sys
import threading
import time
from pathlib import Path

import numpy as np

import dataparallel as dp


def _note_when_blocked(path: Path) -> None:
    """Write this process's pid to `path` once the main thread is blocked in C code.

    The switch interval is an hour: the main thread lets this one have the GIL only when it
    releases it itself (a blocking call in C, or I/O). Its frame found at the same instruction
    at several such moments in a row is blocked there.
    """
    sys.setswitchinterval(3600)
    main = threading.main_thread().ident
    assert main is not None

    def watch() -> None:
        last, same = None, 0
        while same < 5:
            time.sleep(0.01)  # lets the main thread go on, until it releases the GIL again
            frame = sys._current_frames()[main]
            where = (frame, frame.f_lasti)
            same, last = (same + 1 if where == last else 0), where
        path.write_text(str(os.getpid()))

    threading.Thread(target=watch, name="note-when-blocked", daemon=True).start()


dp.initialize()
pid = Path(sys.argv[1]) / f"{dp.rank()}.pid"
if dp.rank() == 0:
    _note_when_blocked(pid)
    dp.allreduce(np.ones(1))  # blocked in MPI's C code, where Python sees no signal
else:
    pid.write_text(str(os.getpid()))
time.sleep(600)

"""`cli_sleep.py DIR`: write this rank's pid to DIR/<rank>.pid, then sleep 600 s."""

import os
import sys
import time
from pathlib import Path

rank = int(os.environ.get("RANK") or os.environ.get("PMI_RANK") or 0)
(Path(sys.argv[1]) / f"{rank}.pid").write_text(str(os.getpid()))
time.sleep(600)

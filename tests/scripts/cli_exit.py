"""`cli_exit.py CODE WHO`: call sys.exit(CODE) on rank WHO (or on `all`); the others sleep 600 s."""

import os
import sys
import time

code, who = sys.argv[1], sys.argv[2]
rank = int(os.environ.get("RANK") or os.environ.get("PMI_RANK") or 0)
value = int(code) if code.lstrip("-").isdigit() else code
if who == "all":
    sys.exit(value)
if rank == int(who):
    sys.exit(value)
time.sleep(600)

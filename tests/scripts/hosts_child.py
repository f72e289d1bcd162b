"""`hosts_child.py DIR`: start a child that sleeps, note both pids in DIR/pids, print `ready`,
then sleep 600 s (a rank with a data loader's worker)."""

import subprocess
import sys
import time
from pathlib import Path

child = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(600)"])
(Path(sys.argv[1]) / "pids").write_text(f"{child.pid}\n")
print("ready", flush=True)
time.sleep(600)

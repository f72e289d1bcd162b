"""Print the launcher variables this rank sees as one JSON line."""

import json
import os
import sys

names = ("RANK", "WORLD_SIZE", "LOCAL_RANK", "LOCAL_WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT")
sys.stdout.write(json.dumps({name: os.environ.get(name) for name in names}) + "\n")
sys.stdout.flush()
sys.stderr.write(f"stderr of rank {os.environ.get('RANK')}\n")

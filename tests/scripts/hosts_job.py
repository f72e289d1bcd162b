"""One rank of a job across emulated hosts (`tests/test_multihost.py`), started by -H.

usage: hosts_job.py allreduce | allreduce-then-wait | allreduce-then-pause FILE | fail | sleep
  allreduce  an allreduce of 1 Mi float32 (rank + 1 each), checked on every rank against the
             sum; prints `RESULT {json}` with the rank, its hostname and its local rank and size
  allreduce-then-wait  the same, then the last rank prints `stalls` and waits (10 minutes)
             while the others print `waits` and wait for it in a barrier
  allreduce-then-pause FILE  the same, then the last rank prints `pauses` and waits until
             FILE exists while the others print `waits` and enter a second allreduce, where
             it joins them (the test cuts a link meanwhile)
  fail       the last rank raises; the others wait (10 minutes)
  sleep      every rank prints `ready` and waits (10 minutes)
"""

import json
import os
import socket
import sys
import time

mode = sys.argv[1]
rank, size = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
if mode.startswith("allreduce"):
    import numpy as np

    import dataparallel as dp

    dp.initialize()
    total = dp.allreduce(np.full(1 << 20, rank + 1, dtype=np.float32), op="sum")
    expected = size * (size + 1) / 2
    if not (total == expected).all():
        raise SystemExit(f"rank {rank}: the allreduce gave {total[:3]}..., not {expected}")
    result = {
        "rank": dp.rank(),
        "size": dp.size(),
        "hostname": socket.gethostname(),
        "local": [int(os.environ["LOCAL_RANK"]), int(os.environ["LOCAL_WORLD_SIZE"])],
        "cwd": os.getcwd(),
        "forwarded": os.environ.get("HOSTS_JOB_MARK"),
    }
    sys.stdout.write(f"RESULT {json.dumps(result)}\n")
    if mode == "allreduce-then-wait":
        last = rank == size - 1
        print("stalls" if last else "waits", flush=True)
        if last:
            time.sleep(600)
        dp.barrier()  # waits on the last rank, which never comes
    if mode == "allreduce-then-pause":
        last = rank == size - 1
        print("pauses" if last else "waits", flush=True)
        while last and not os.path.exists(sys.argv[2]):
            time.sleep(0.01)
        dp.allreduce(np.ones(1 << 16, dtype=np.float32))
        print("allreduced again", flush=True)
    dp.finalize()
elif mode == "fail":
    if rank == size - 1:
        raise RuntimeError(f"rank {rank} fails on purpose on {socket.gethostname()}")
    time.sleep(600)
else:
    print("ready", flush=True)
    time.sleep(600)

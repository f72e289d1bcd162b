"""`alone.py BACKEND`: `dp.initialize(BACKEND)`, which must fail if it makes a world of one."""

import sys

import dataparallel as dp

dp.initialize(sys.argv[1])
print(f"UNREACHABLE: rank {dp.rank()} of {dp.size()}", flush=True)

"""Print the launcher variables this rank sees as one JSON line (torchrun's, every one)."""

import json
import os
import sys

names = (
    "RANK",
    "WORLD_SIZE",
    "LOCAL_RANK",
    "LOCAL_WORLD_SIZE",
    "MASTER_ADDR",
    "MASTER_PORT",
    "GROUP_RANK",
    "GROUP_WORLD_SIZE",
    "ROLE_RANK",
    "ROLE_NAME",
    "ROLE_WORLD_SIZE",
    "TORCHELASTIC_RESTART_COUNT",
    "TORCHELASTIC_MAX_RESTARTS",
    "TORCHELASTIC_RUN_ID",
    "TORCHELASTIC_USE_AGENT_STORE",
    "TORCH_NCCL_ASYNC_ERROR_HANDLING",
)
sys.stdout.write(json.dumps({name: os.environ.get(name) for name in names}) + "\n")
sys.stdout.flush()
sys.stderr.write(f"stderr of rank {os.environ.get('RANK')}\n")

"""Elastic training: lose a worker, keep training; add one, keep training (Horovod's names).

Under `dataparallel run -n N --min-np M --max-np K --backend gloo script.py`, decorate the
training function with `@dp.elastic.run`, keep what it changes in a `State` and `commit()` it
every few steps: when a worker dies, the survivors roll back to the last commit, re-form a world
of themselves and go on; workers the launcher adds receive the state from rank 0 and join in.
See docs/elastic.md.
"""

from dataparallel.elastic.retry import run
from dataparallel.elastic.rounds import WorkerRemoved
from dataparallel.elastic.sampler import ElasticSampler
from dataparallel.elastic.state import (
    HostsUpdatedInterrupt,
    ObjectState,
    State,
    TorchState,
    TreeState,
)
from dataparallel.errors import RankFailedError

__all__ = [
    "ElasticSampler",
    "HostsUpdatedInterrupt",
    "ObjectState",
    "RankFailedError",
    "State",
    "TorchState",
    "TreeState",
    "WorkerRemoved",
    "run",
]

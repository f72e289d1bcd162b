"""Horovod's API over dataparallel: change one import line and keep the script.

`import dataparallel.horovod.torch as hvd` gives Horovod 0.28's public PyTorch API by name and
meaning (`docs/horovod.md` lists what differs). It is a thin layer: every call hands over to
dataparallel's own API (`dp.allreduce`, `dp.DistributedOptimizer`, `dp.new_group`, `dp.join`,
...), so a Horovod script gains what dataparallel does (pip install, a failing rank ends the job,
mismatch errors that name ranks and leaves) without a line of it written twice.

`import dataparallel.horovod as horovod` gives the top-level package's names: `horovod.run`
(call a function on N ranks from Python, over `dataparallel run`) and `horovod.__version__`.
"""

from __future__ import annotations

from dataparallel.horovod._run import run
from dataparallel.version import VERSION

__all__ = ["HOROVOD_API_VERSION", "__version__", "run"]

HOROVOD_API_VERSION = "0.28.1"
"""The Horovod release whose API this package reproduces."""

__version__ = f"{HOROVOD_API_VERSION}+dataparallel.{VERSION}"
"""`0.28.1+dataparallel.X.Y.Z`: Horovod's version with a PEP 440 local label saying what this is.

Code that compares `horovod.__version__` against a Horovod release
(`Version(v) >= Version("0.21")`) sees 0.28.1; `X.Y.Z` is `dataparallel.__version__`.
"""

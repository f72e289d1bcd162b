"""The NCCL engine, through CuPy: `NCCLBackend` (`backend.py`) for CUDA buffers over a host
engine's fallback, and what NCCL can do in this process (`support.py`)."""

from dataparallel.backends.nccl.backend import NCCLBackend
from dataparallel.backends.nccl.support import INSTALL_HINT, unavailable_reason

__all__ = ["INSTALL_HINT", "NCCLBackend", "unavailable_reason"]

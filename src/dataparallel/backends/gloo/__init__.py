"""The Gloo engine, through `torch.distributed`: `GlooBackend` (`backend.py`), and joining its
process group (`group.py`)."""

from dataparallel.backends.gloo.backend import GlooBackend

__all__ = ["GlooBackend"]

"""Engines behind one protocol over flat buffers (see `base.py`); each loads its package lazily."""

from dataparallel.backends.base import Backend, ReduceOp, Request

__all__ = ["Backend", "ReduceOp", "Request"]

"""Engines behind one protocol over flat buffers (`base.py`); each loads its package lazily.

`registry.py` names them and holds the one auto-selection rule; `rendezvous.py` is how Gloo (and
NCCL under torchrun) find their peers.
"""

from dataparallel.backends.base import Backend, DeviceBuffer, DoneHandle, Handle, ReduceOp

__all__ = ["Backend", "DeviceBuffer", "DoneHandle", "Handle", "ReduceOp"]

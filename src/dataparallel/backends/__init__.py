"""Engines behind one protocol over flat buffers (`base.py`); each loads its package lazily.

One package per engine (`mpi/`, `gloo/`, `nccl/`), so that a framework is imported only where the
engine is that framework's own, and only when the engine is chosen; `single.py` is the world of
one. `registry.py` names them and holds the one auto-selection rule; `rendezvous.py` is how Gloo
(and NCCL under torchrun) find their peers; `half.py` reduces 16-bit floats where an engine cannot.
"""

from dataparallel.backends.base import Backend, DeviceBuffer, DoneHandle, Handle, ReduceOp

__all__ = ["Backend", "DeviceBuffer", "DoneHandle", "Handle", "ReduceOp"]

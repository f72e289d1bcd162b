"""The public collectives over arrays, numbers and pytrees of them.

Each file holds one kind of collective, written in the same order: find the backend (`context`),
identify the leaves (`leaves_of`), make the handshake in which every rank checks that every rank
makes the same call (`agree`), run the leaves through `Fusion` (`run`), rebuild the tree.
`_call.py` is that skeleton; the reductions execute a plan made by it once per signature
(`_plans.py`). Mutable
arrays are written in place and returned; immutable values (JAX arrays, numbers) come back new:
always use the return value.
"""

from __future__ import annotations

from dataparallel.collectives.broadcasts import broadcast, ibroadcast
from dataparallel.collectives.exchanges import alltoall
from dataparallel.collectives.gathers import allgather
from dataparallel.collectives.join import join
from dataparallel.collectives.objects import allgather_object, barrier, broadcast_object
from dataparallel.collectives.reductions import allreduce, allreduce_gradients, iallreduce, reduce
from dataparallel.collectives.requests import Request, wait_all
from dataparallel.collectives.scatters import reducescatter
from dataparallel.collectives.state import synchronize_tree

__all__ = [
    "Request",
    "allgather",
    "allgather_object",
    "allreduce",
    "allreduce_gradients",
    "alltoall",
    "barrier",
    "broadcast",
    "broadcast_object",
    "iallreduce",
    "ibroadcast",
    "join",
    "reduce",
    "reducescatter",
    "synchronize_tree",
    "wait_all",
]

"""The collectives over arrays, numbers and pytrees of them; their public names are `dp.<name>`.

This package re-exports nothing: `dp.allreduce`, `dp.broadcast`, `dp.Request` and the rest are the
one public door, and code inside the library imports each from the module that defines it.

Each file holds one kind of collective, written in the same order: find the backend (`context`),
identify the leaves (`leaves_of`), make the handshake in which every rank checks that every rank
makes the same call (`agree`), run the leaves through `Fusion` (`run`), rebuild the tree.
`_call.py` is that skeleton; the reductions execute a plan made by it once per signature
(`_plans.py`). Mutable arrays are written in place and returned; immutable values (JAX arrays,
numbers) come back new: always use the return value.
"""

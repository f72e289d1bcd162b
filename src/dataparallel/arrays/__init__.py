"""The array layer: between trees of arrays and the engines' flat buffers.

It sits above the backends: it hands flat buffers to a `Backend` through the protocol of
`dataparallel.backends` (never through a particular engine), and knows no world of its own, so
that every world, group and engine is driven by the same code. A framework (torch, JAX, CuPy) is
imported only once the program has handed over an array of it, never to find out whether it exists.

Dtypes, the buffer pool, devices, array families, trees, fusion buckets, compression and the
trace; `docs/design.md` draws where it sits.
"""

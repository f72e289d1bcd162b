"""The array layer: between trees of arrays and flat buffers (no world, no backend, no framework).

Dtypes, the buffer pool, devices, array families, trees, fusion buckets, compression and the
trace; `docs/design.md` draws where it sits.
"""

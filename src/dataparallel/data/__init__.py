"""A rank's share of a dataset and batches of it: the container and the loader.

- `loader`: the container and the loader, and `shard_indices`, the one rule that splits samples.
- `sources`: reading a dataset of any form (arrays, tuples or dicts of arrays, indexables).
"""

from __future__ import annotations

from dataparallel.data.loader import DistributedDataContainer, DistributedDataLoader, shard_indices

__all__ = ["DistributedDataContainer", "DistributedDataLoader", "shard_indices"]

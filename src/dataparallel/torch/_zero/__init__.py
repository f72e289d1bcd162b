"""`ZeroRedundancyOptimizer` (ZeRO stages 1 and 2): optimizer state, and at stage 2 gradients,
sharded across ranks; `fully_shard` (stage 3): parameters too. Its rooms:

- `optimizer`: the class, what it is made with, its step and `clip_grad_norm_`;
- `layout`: slabs, buckets, every rank's segment of each, this rank's pieces;
- `gradients`: stage 2's reduce-scatters, started from gradient hooks during backward;
- `gather`: the exchange of the updated segments after a step, and `overlap_with_forward`;
- `state`: checkpoints that move between world sizes;
- `join`: a rank that ran out of data under `dp.torch.join`;
- `fully_shard`: stage 3, the parameters sharded too, per module (`fully_shard`,
  `FullyShardedModule`), gathered for each module's forward and backward.

Usage, semantics and departures from torch's: docs/zero.md.
"""

"""A DDP script ported to dataparallel: dp.initialize() instead of init_process_group, the rest
unchanged (DistributedSampler, dist.all_reduce, DistributedDataParallel)."""

import sys

import torch
import torch.distributed as dist
from torch.nn.parallel import DistributedDataParallel
from torch.utils.data import DataLoader, DistributedSampler, TensorDataset

import dataparallel as dp


def say(line: str) -> None:
    """Print `line` in one write (mpiexec interleaves the ranks' output by writes)."""
    sys.stdout.write(line + "\n")
    sys.stdout.flush()


dp.initialize()
assert dist.is_initialized(), "torch.distributed was not initialized alongside the world"
assert (dist.get_rank(), dist.get_world_size()) == (dp.rank(), dp.size())
data = TensorDataset(torch.arange(12.0).reshape(12, 1), torch.ones(12, 1))
sampler = DistributedSampler(data, shuffle=False)
loader = DataLoader(data, batch_size=2, sampler=sampler)
seen = [int(x.item()) for batch, _ in loader for x in batch]
count = torch.tensor([len(seen)])
dist.all_reduce(count)
torch.manual_seed(0)
model = DistributedDataParallel(torch.nn.Linear(1, 1))
for batch, target in loader:
    loss = torch.nn.functional.mse_loss(model(batch), target)
    loss.backward()
grads = [p.grad.clone() for p in model.parameters()]
every = [torch.zeros_like(grads[0]) for _ in range(dp.size())]
dist.all_gather(every, grads[0])  # DDP averaged the gradients: every rank holds the same ones
same = all(torch.equal(every[0], g) for g in every)
say(
    f"ddp rank={dist.get_rank()} size={dist.get_world_size()} backend={dp.get_backend().name} "
    f"samples={','.join(map(str, seen))} total={count.item()} same_grads={same}",
)
dp.finalize()
assert not dist.is_initialized(), "dp.finalize() left torch.distributed initialized"

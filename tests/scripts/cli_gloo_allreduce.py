"""Join the Gloo rendezvous from torchrun's variables and print the allreduce of the ranks."""

import torch
import torch.distributed as dist

dist.init_process_group("gloo", init_method="env://")
value = torch.tensor([float(dist.get_rank())])
dist.all_reduce(value)
print(f"sum={int(value.item())} size={dist.get_world_size()}", flush=True)
dist.destroy_process_group()

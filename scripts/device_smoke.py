"""One process, world 1: init tdx, then a CPU and a CUDA all_reduce (GPU host smoke test)."""
import os
import tempfile

import torch
import torch.distributed as dist

import torchdist_ext  # noqa: F401

store = dist.FileStore(os.path.join(tempfile.mkdtemp(), "s"), 1)
dist.init_process_group("tdx", store=store, rank=0, world_size=1)
t = torch.ones(8)
dist.all_reduce(t)
print("cpu ok", t.sum().item(), flush=True)
c = torch.ones(8, device="cuda")
dist.all_reduce(c)
print("cuda ok", c.sum().item(), flush=True)
dist.destroy_process_group()

"""Time in-place float32 all_reduce on 2 local ranks (1 MiB and 16 MiB) for the backends
given, e.g. `python scripts/cpu_allreduce_probe.py tdx,gloo`. Each figure is the max over
ranks of the mean of 10 calls after 3 warm-ups. Environment knobs (TDX_SPIN_US,
TDX_UCX_PEER_ERRORS, ...) pass through to the ranks."""

from __future__ import annotations

import sys
import time

import torch
import torch.distributed as dist

from torchdist_ext.testing import run_ranks


def _time(rank: int, n: int, size: int) -> float:
    t = torch.ones(size // 4)
    for _ in range(3):
        dist.all_reduce(t)
    dist.barrier()
    start = time.perf_counter()
    for _ in range(10):
        dist.all_reduce(t)
    return (time.perf_counter() - start) / 10 * 1e6


if __name__ == "__main__":
    for backend in (sys.argv[1] if len(sys.argv) > 1 else "tdx,gloo").split(","):
        for size in (1 << 20, 16 << 20):
            us = max(run_ranks(_time, 2, backend=backend, args=(size,)))
            print(f"{backend:5s} {size >> 20:3d} MiB  {us:9.0f} us", flush=True)

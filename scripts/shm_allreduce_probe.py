"""Time in-place float32 all_reduce on W local ranks for backends or pinned tdx algorithms,
e.g. `python scripts/shm_allreduce_probe.py 2 gloo,tdx:shm,tdx:cma`. Each figure is the
max over ranks of the mean per-op time after 3 warm-ups (20 calls up to 4 MiB, 5 above).
The bench (`python -m torchdist_ext.bench`) gives fuller tables; this is the quick look
behind the cma/shm comparison in docs/PERFORMANCE.md."""

from __future__ import annotations

import sys
import time

import torch
import torch.distributed as dist

import torchdist_ext
from torchdist_ext.testing import run_ranks

SIZES = [4096, 1 << 20, 16 << 20]


def _body(rank: int, world: int, algo: str | None) -> dict[int, float]:
    if algo:
        torchdist_ext.set_algorithm("allreduce", algo)
    out = {}
    for size in SIZES:
        t = torch.ones(size // 4)
        iters = 20 if size <= (4 << 20) else 5
        for _ in range(3):
            dist.all_reduce(t)
        dist.barrier()
        start = time.perf_counter()
        for _ in range(iters):
            dist.all_reduce(t)
        slowest = torch.tensor([(time.perf_counter() - start) / iters], dtype=torch.float64)
        dist.all_reduce(slowest, op=dist.ReduceOp.MAX)
        out[size] = slowest.item()
    return out


if __name__ == "__main__":
    world = int(sys.argv[1]) if len(sys.argv) > 1 else 2
    for spec in (sys.argv[2] if len(sys.argv) > 2 else "gloo,tdx").split(","):
        backend, _, algo = spec.partition(":")
        times = run_ranks(_body, world, backend=backend, args=(algo or None,), timeout=300)[0]
        print(f"{world} ranks {spec:16s}",
              "  ".join(f"{s >> 10} KiB: {t * 1e6:.0f} us" for s, t in times.items()), flush=True)

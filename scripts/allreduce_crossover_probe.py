"""Where one tdx all_reduce algorithm overtakes another on this machine, measured so that a
noisy, shared host cannot tilt the comparison: inside one process group the algorithms
take turns (round r runs each of them on a batch of calls), and each figure is the median
over rounds of the batch's mean time, the slowest rank's.

    python scripts/allreduce_crossover_probe.py [world] [algorithms] [sizes]
    python scripts/allreduce_crossover_probe.py 2 shm,shm_direct 4K,16K,64K,256K,1M

Behind the shared-memory cost terms in csrc/algorithms/registry.cpp and the crossover
notes in docs/PERFORMANCE.md."""

from __future__ import annotations

import statistics
import sys
import time

import torch
import torch.distributed as dist

import torchdist_ext
from torchdist_ext.testing import run_ranks

ROUNDS = 9


def _bytes(text: str) -> int:
    units = {"K": 1 << 10, "M": 1 << 20, "G": 1 << 30}
    text = text.strip().upper()
    return int(float(text[:-1]) * units[text[-1]]) if text[-1] in units else int(text)


def _body(rank: int, world: int, algos: list[str], sizes: list[int]) -> dict:
    out = {}
    for size in sizes:
        t = torch.ones(max(1, size // 4))
        batch = max(3, min(50, (4 << 20) // max(size, 1)))
        per = {a: [] for a in algos}
        for _ in range(ROUNDS):
            for a in algos:
                torchdist_ext.set_algorithm("allreduce", a)
                dist.all_reduce(t)
                dist.barrier()
                start = time.perf_counter()
                for _ in range(batch):
                    dist.all_reduce(t)
                took = torch.tensor([(time.perf_counter() - start) / batch], dtype=torch.float64)
                dist.all_reduce(took, op=dist.ReduceOp.MAX)
                per[a].append(took.item())
        torchdist_ext.set_algorithm("allreduce", "auto")
        out[size] = {a: statistics.median(v) for a, v in per.items()}
        out[size]["auto"] = torchdist_ext.predict("allreduce", size, world)[0]
    return out


if __name__ == "__main__":
    world = int(sys.argv[1]) if len(sys.argv) > 1 else 2
    algos = (sys.argv[2] if len(sys.argv) > 2 else "shm,shm_direct").split(",")
    sizes = [_bytes(s) for s in (sys.argv[3] if len(sys.argv) > 3 else "4K,16K,64K,256K,1M").split(",")]
    res = run_ranks(_body, world, args=(algos, sizes), timeout=600)[0]
    print(f"{world} ranks, median of {ROUNDS} interleaved rounds, us per call")
    print(f"{'size':>8s} " + " ".join(f"{a:>11s}" for a in algos) + "   fastest     auto picks")
    for size, row in res.items():
        best = min(algos, key=lambda a: row[a])
        print(f"{size:8d} " + " ".join(f"{row[a] * 1e6:11.1f}" for a in algos)
              + f"   {best:11s} {row['auto']}")

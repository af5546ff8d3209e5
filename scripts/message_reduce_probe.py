"""Time one collective with one algorithm pinned at a list of sizes (MiB), 2 ranks or WORLD.

Made to find size cliffs in the message algorithms that reduce what they receive
(``direct`` all_reduce, ``ring`` reduce_scatter): the median of 5 timed calls after 2
warm-ups, the slowest rank's, in ms.

    OMP_NUM_THREADS=1 .venv/bin/python scripts/message_reduce_probe.py all_reduce direct 8,12,16,20
    OMP_NUM_THREADS=1 .venv/bin/python scripts/message_reduce_probe.py reduce_scatter ring 16,32,48
    OMP_NUM_THREADS=1 .venv/bin/python scripts/message_reduce_probe.py all_reduce shm 1,4,16,64 4
"""

from __future__ import annotations

import os
import sys
import time

import torch
import torch.distributed as dist

from torchdist_ext.testing import run_ranks

COLLECTIVE = {"all_reduce": "allreduce", "reduce_scatter": "reduce_scatter"}


def _time(rank: int, n: int, op: str, algo: str, sizes: list[int]) -> dict[int, float]:
    import torchdist_ext

    torchdist_ext.set_algorithm(COLLECTIVE[op], algo)
    out = {}
    for mib in sizes:
        x = torch.ones(mib << 18)  # float32
        y = torch.empty(x.numel() // n)

        def call() -> None:
            if op == "all_reduce":
                dist.all_reduce(x)
            else:
                dist.reduce_scatter_tensor(y, x)

        for _ in range(2):
            call()
        times = []
        for _ in range(5):
            dist.barrier()
            start = time.perf_counter()
            call()
            times.append(time.perf_counter() - start)
        out[mib] = sorted(times)[2] * 1e3
    return out


def main() -> None:
    if len(sys.argv) not in (4, 5) or sys.argv[1] not in COLLECTIVE:
        sys.exit(__doc__)
    op, algo, sizes = sys.argv[1], sys.argv[2], [int(s) for s in sys.argv[3].split(",")]
    world = int(sys.argv[4]) if len(sys.argv) == 5 else 2
    env = {k: v for k, v in os.environ.items() if k.startswith(("TDX_", "UCX_"))}
    results = run_ranks(_time, world, args=(op, algo, sizes), timeout=300, env=env)
    print(f"{op} {algo}: " + ", ".join(f"{s} MiB {max(r[s] for r in results):.2f} ms"
                                      for s in sizes))


if __name__ == "__main__":
    main()

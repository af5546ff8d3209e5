"""Point-to-point between 2 local ranks: half the ping-pong time of a blocking
send/recv pair, per size, for several configurations taking turns.

    python scripts/p2p_probe.py                       # tdx as configured, and gloo
    python scripts/p2p_probe.py "tdx TDX_UCX_PEER_ERRORS=1" "tdx" gloo

Each configuration is a backend followed by environment settings for its ranks. Every
round runs each configuration once (all sizes), so a busy host's slow spells land on all
of them; the figure printed is the median over rounds of each round's median. Every
message is checked.
"""

from __future__ import annotations

import os
import statistics
import sys
import time

import torch
import torch.distributed as dist

from torchdist_ext.testing import run_ranks

SIZES = (8, 4 << 10, 64 << 10, 1 << 20, 16 << 20, 64 << 20)
ROUNDS = 3


def _iters(nbytes: int) -> int:
    return 200 if nbytes <= 64 << 10 else (40 if nbytes <= 1 << 20 else 8)


def _pingpong(rank: int, n: int, sizes: tuple[int, ...]) -> dict:
    out = {}
    for nbytes in sizes:
        buf = torch.full((max(1, nbytes // 4),), float(rank))
        peer = 1 - rank
        want = torch.full_like(buf, float(peer))
        times = []
        wrong = 0
        for i in range(_iters(nbytes) + 3):
            dist.barrier()
            start = time.perf_counter()
            if rank == 0:
                dist.send(torch.zeros_like(buf), peer)  # rank 1 fills it before sending back
                dist.recv(buf, peer)
            else:
                got = torch.empty_like(buf)
                dist.recv(got, peer)
                dist.send(torch.full_like(buf, float(rank)), peer)
            elapsed = time.perf_counter() - start
            if rank == 0:
                wrong += int((buf != want).sum())
            if i >= 3:
                times.append(elapsed / 2)
        out[nbytes] = (statistics.median(times) * 1e6, wrong)
    return out


def _size(nbytes: int) -> str:
    for unit, scale in (("MiB", 1 << 20), ("KiB", 1 << 10)):
        if nbytes >= scale:
            return f"{nbytes // scale} {unit}"
    return f"{nbytes} B"


def _config(spec: str) -> tuple[str, dict[str, str]]:
    backend, *settings = spec.split()
    return backend, dict(s.split("=", 1) for s in settings)


def main(specs: list[str]) -> None:
    results: dict[str, dict[int, list[float]]] = {s: {b: [] for b in SIZES} for s in specs}
    wrong = 0
    for r in range(ROUNDS):
        for spec in specs:
            backend, env = _config(spec)
            env.setdefault("TDX_SPIN_US", os.environ.get("TDX_SPIN_US", "50"))
            got = run_ranks(_pingpong, 2, backend=backend, timeout=300, args=(SIZES,), env=env)
            for nbytes, (us, bad) in got[0].items():
                results[spec][nbytes].append(us)
                wrong += bad
        print(f"round {r + 1}/{ROUNDS} done", file=sys.stderr)
    print("| size | " + " | ".join(specs) + " |")
    print("|---:|" + "---:|" * len(specs))
    for nbytes in SIZES:
        cells = [f"{statistics.median(results[s][nbytes]):.0f}" for s in specs]
        print(f"| {_size(nbytes)} | " + " | ".join(cells) + " |")
    print(f"wrong elements: {wrong}")


if __name__ == "__main__":
    main(sys.argv[1:] or ["tdx TDX_UCX_PEER_ERRORS=1", "tdx", "gloo"])

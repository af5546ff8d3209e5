"""Mismatch detection (TDX_DEBUG=DETAIL): ranks that call different collectives, dtypes,
shapes, roots or reduce ops, or pinned different algorithms, get an error naming both
calls, not a hang or corruption."""

from __future__ import annotations

import torch
import torch.distributed as dist

import torchdist_ext
from torchdist_ext.testing import run_ranks


def _pinned_differently(rank: int, g) -> None:
    torchdist_ext.set_algorithm("allreduce", "ring" if rank == 0 else "rhd")
    try:
        dist.all_reduce(torch.ones(10), group=g)
    finally:
        torchdist_ext.set_algorithm("allreduce", "auto")


def _mismatches(rank: int, n: int) -> dict:
    cases = {
        "shape": lambda g: dist.all_reduce(torch.ones(10 if rank == 0 else 20), group=g),
        "dtype": lambda g: dist.all_reduce(
            torch.ones(10, dtype=torch.float32 if rank == 0 else torch.float64), group=g),
        "root": lambda g: dist.broadcast(torch.ones(10), src=rank, group=g),
        "redop": lambda g: dist.all_reduce(
            torch.ones(10), op=dist.ReduceOp.SUM if rank == 0 else dist.ReduceOp.MAX, group=g),
        "op": lambda g: (dist.all_reduce(torch.ones(10), group=g) if rank == 0
                         else dist.broadcast(torch.ones(10), src=0, group=g)),
        "algorithm": lambda g: _pinned_differently(rank, g),
    }
    groups = {name: dist.new_group(backend="tdx") for name in cases}
    out = {}
    for name, call in cases.items():
        try:
            call(groups[name])
            out[name] = "no error"
        except Exception as e:  # noqa: BLE001 - the type is checked by the caller
            out[name] = f"{type(e).__name__}: {e}"
    # A matching call on a fresh group still works with the check on.
    t = torch.full((4,), float(rank))
    dist.all_reduce(t)
    out["ok"] = t.tolist()
    return out


def test_mismatched_calls_raise_naming_both_ranks() -> None:
    results = run_ranks(_mismatches, 2, timeout=60, env={"TDX_DEBUG": "DETAIL"})
    for rank, res in enumerate(results):
        assert res["ok"] == [1.0] * 4, res["ok"]
        for name in ("shape", "dtype", "root", "redop", "op", "algorithm"):
            msg = res[name]
            assert msg.startswith("DistBackendError") and "collective mismatch" in msg, (rank, name, msg)
            assert "rank 0" in msg and "rank 1" in msg, (rank, name, msg)

"""Fuzzed bad input: thousands of random invalid calls, each a clear Python exception at the
call (never a crash, hang or a broken group); afterwards the group still works."""

from __future__ import annotations

import random

import torch
import torch.distributed as dist

from torchdist_ext.testing import run_ranks

CALLS = 2000


def _bad_call(rng: random.Random, rank: int, n: int):
    """One invalid call, chosen the same way on every rank (same seed)."""
    size = rng.choice([0, 1, 7, 64])
    dtype = rng.choice([torch.float32, torch.float64, torch.int32, torch.bool])
    t = torch.ones(size, dtype=torch.float32 if dtype == torch.bool else dtype)
    bad_rank = rng.choice([-1, n, n + 5, 1 << 20])
    kind = rng.randrange(12)
    if kind == 0:
        return lambda: dist.broadcast(t, src=bad_rank)
    if kind == 1:
        return lambda: dist.reduce(t, dst=bad_rank)
    if kind == 2:  # bitwise reduce op on a floating tensor
        f = torch.ones(size)
        op = rng.choice([dist.ReduceOp.BAND, dist.ReduceOp.BOR, dist.ReduceOp.BXOR])
        return lambda: dist.all_reduce(f, op=op)
    if kind == 3:  # complex tensors cannot be reduced by tdx
        c = torch.ones(size, dtype=torch.complex64)
        return lambda: dist.all_reduce(c, op=dist.ReduceOp.MAX)
    if kind == 4:  # wrong number of outputs
        outs = [torch.empty_like(t) for _ in range(n + rng.choice([-1, 1, 3]))]
        return lambda: dist.all_gather(outs, t)
    if kind == 5:  # output of the wrong size
        out = torch.empty(size * n + rng.choice([1, 2, 5]), dtype=t.dtype)
        return lambda: dist.all_gather_into_tensor(out, t)
    if kind == 6:
        inp = torch.ones(size * n + rng.choice([1, 3]), dtype=t.dtype)
        return lambda: dist.reduce_scatter_tensor(t, inp)
    if kind == 7:  # splits that do not add up
        out = torch.empty(n * 2, dtype=t.dtype)
        inp = torch.ones(n * 2, dtype=t.dtype)
        splits = [3] * n
        return lambda: dist.all_to_all_single(out, inp, splits, splits)
    if kind == 8:
        return lambda: dist.send(t, dst=bad_rank)
    if kind == 9:
        return lambda: dist.recv(t, src=bad_rank)
    if kind == 10:  # a tag out of range
        return lambda: dist.isend(t, dst=(rank + 1) % n, tag=-rng.randrange(1, 100))
    # mixed dtypes in one list argument
    outs = [torch.empty(size, dtype=torch.float64 if i == 0 else torch.float32) for i in range(n)]
    return lambda: dist.all_gather(outs, torch.ones(size))


def _fuzz(rank: int, n: int) -> dict:
    rng = random.Random(1234)
    raised = 0
    ours = 0
    unexpected = []
    for i in range(CALLS):
        call = _bad_call(rng, rank, n)
        try:
            work = call()
            if work is not None and hasattr(work, "wait"):
                work.wait()
            unexpected.append(f"call {i} did not raise")
        except (ValueError, TypeError, RuntimeError, IndexError) as e:
            raised += 1
            ours += f"[tdx r{rank}/{n} " in str(e)  # the backend's own, naming rank and group
            if not str(e).strip():
                unexpected.append(f"call {i}: {type(e).__name__} with an empty message")
    t = torch.full((8,), float(rank + 1))
    dist.all_reduce(t)  # the group must still work after all that
    return {"raised": raised, "ours": ours, "unexpected": unexpected[:10], "sum": t[0].item()}


def test_random_invalid_calls_raise_cleanly() -> None:
    results = run_ranks(_fuzz, 3, timeout=240)
    for rank, r in enumerate(results):
        assert not r["unexpected"], (rank, r["unexpected"])
        assert r["raised"] == CALLS, (rank, r["raised"])
        assert r["sum"] == 6.0, (rank, r["sum"])
        # The rest are torch's own checks, made before the backend sees the call (1684 of
        # the seeded 2000 were the backend's when this was written).
        assert r["ours"] >= 0.8 * CALLS, (rank, r["ours"], "errors naming rank and group")

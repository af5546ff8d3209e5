"""Soak: thousands of mixed valid collectives with random sizes and dtypes at 4 ranks.

Every rank draws the same op sequence from one seed. Each input is a function of
(rank, iteration, index), so every rank computes the expected output locally and checks
it exactly. Resident memory (VmRSS) is read after a warm-up and at the end; a leak per op
(a buffer, an endpoint, a request) would show as growth.
"""

from __future__ import annotations

import random
import time

import pytest
import torch
import torch.distributed as dist

from torchdist_ext.testing import run_ranks

WORLD = 4
SEED = 20261123
MAX_COUNT = 1 << 16
DTYPES = [torch.float32, torch.float64, torch.float16, torch.bfloat16,
          torch.int32, torch.int64, torch.int8, torch.uint8]
KINDS = ["all_reduce", "broadcast", "reduce", "all_gather_into_tensor",
         "reduce_scatter_tensor", "all_to_all_single", "barrier", "isend_irecv"]
# Weights: mostly collectives, a few point-to-point pairs and barriers.
WEIGHTS = [28, 12, 10, 12, 12, 12, 6, 8]
R = dist.ReduceOp


def _rss() -> int:
    """Resident set size in bytes, from /proc/self/status."""
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith("VmRSS:"):
                return int(line.split()[1]) * 1024
    raise RuntimeError("no VmRSS in /proc/self/status")


def _count(rng: random.Random) -> int:
    """0..64K elements: a few empty, many small, a good share near the top."""
    roll = rng.random()
    if roll < 0.05:
        return 0
    if roll < 0.6:
        return rng.randint(1, 1024)
    return rng.randint(1025, MAX_COUNT)


def _value(rank: int, it: int, count: int, dtype: torch.dtype, op: str = "SUM",
           salt: int = 0) -> torch.Tensor:
    """Rank `rank`'s input at iteration `it`: small integers, exact in every dtype even
    after reducing four of them."""
    i = torch.arange(count, dtype=torch.int64)
    k = rank * 13 + it * 7 + salt * 5
    if op == "PRODUCT":
        v = torch.where((i + k) % 5 == 0, 2, 1)
    elif op in ("BAND", "BOR", "BXOR"):
        v = (i * 11 + k) % 64
    elif op in ("MIN", "MAX"):
        v = (i * 3 + k) % 23
    else:  # SUM, AVG: values 1..8; sums at most 32 and averages in quarters are exact
        v = (i + k) % 8 + 1
    return v.to(dtype)


def _reduce(inputs: list[torch.Tensor], op: str, dtype: torch.dtype) -> torch.Tensor:
    wide = torch.float64 if dtype.is_floating_point else torch.int64
    s = torch.stack([t.to(wide) for t in inputs])
    if op == "SUM":
        out = s.sum(0)
    elif op == "AVG":
        out = s.sum(0) / len(inputs)
    elif op == "PRODUCT":
        out = s.prod(0)
    elif op == "MIN":
        out = s.min(0).values
    elif op == "MAX":
        out = s.max(0).values
    else:
        fn = {"BAND": torch.bitwise_and, "BOR": torch.bitwise_or, "BXOR": torch.bitwise_xor}[op]
        out = s[0]
        for t in s[1:]:
            out = fn(out, t)
    return out.to(dtype)


def _ops_for(dtype: torch.dtype) -> list[str]:
    if dtype.is_floating_point:
        return ["SUM", "AVG", "PRODUCT", "MIN", "MAX"]
    return ["SUM", "PRODUCT", "MIN", "MAX", "BAND", "BOR", "BXOR"]


def _soak(rank: int, n: int, ops: int, warmup: int, seed: int) -> dict:
    rng = random.Random(seed)  # the same stream on every rank
    fails: list[str] = []
    counts = dict.fromkeys(KINDS, 0)
    rss_warm = None
    start = time.monotonic()
    warm_t = start

    def check(it: int, what: str, got: torch.Tensor, want: torch.Tensor) -> None:
        if got.dtype != want.dtype or got.shape != want.shape or not torch.equal(got, want):
            if len(fails) < 20:
                bad = 0
                if got.shape == want.shape and got.numel():
                    bad = int((got.double() - want.double()).abs().argmax())
                fails.append(f"r{rank} op {it} {what}: got {got.flatten()[bad:bad + 3].tolist()} "
                             f"want {want.flatten()[bad:bad + 3].tolist()} at {bad} "
                             f"(shape {tuple(got.shape)} vs {tuple(want.shape)})")
            else:
                fails.append("...")

    for it in range(ops):
        if it == warmup:
            rss_warm = _rss()
            warm_t = time.monotonic()
        kind = rng.choices(KINDS, WEIGHTS)[0]
        dtype = rng.choice(DTYPES)
        count = _count(rng)
        async_op = rng.random() < 0.25
        counts[kind] += 1
        what = f"{kind} {str(dtype)[6:]} n={count}"

        def done(work) -> None:
            if async_op:
                work.wait()

        if kind == "all_reduce":
            op = rng.choice(_ops_for(dtype))
            t = _value(rank, it, count, dtype, op)
            done(dist.all_reduce(t, op=getattr(R, op), async_op=async_op))
            want = _reduce([_value(r, it, count, dtype, op) for r in range(n)], op, dtype)
            check(it, f"{what} {op}", t, want)
        elif kind == "broadcast":
            root = rng.randrange(n)
            t = _value(rank, it, count, dtype) if rank == root else torch.zeros(count, dtype=dtype)
            done(dist.broadcast(t, src=root, async_op=async_op))
            check(it, f"{what} root={root}", t, _value(root, it, count, dtype))
        elif kind == "reduce":
            # The ranks other than the root may run ahead into the next op (shm_direct).
            root = rng.randrange(n)
            op = rng.choice(_ops_for(dtype))
            t = _value(rank, it, count, dtype, op)
            done(dist.reduce(t, dst=root, op=getattr(R, op), async_op=async_op))
            if rank == root:
                want = _reduce([_value(r, it, count, dtype, op) for r in range(n)], op, dtype)
                check(it, f"{what} {op} root={root}", t, want)
            else:
                check(it, f"{what} {op} root={root} (input kept)", t,
                      _value(rank, it, count, dtype, op))
        elif kind == "all_gather_into_tensor":
            count //= n
            out = torch.zeros(count * n, dtype=dtype)
            done(dist.all_gather_into_tensor(out, _value(rank, it, count, dtype),
                                             async_op=async_op))
            want = torch.cat([_value(r, it, count, dtype) for r in range(n)])
            check(it, what, out, want)
        elif kind == "reduce_scatter_tensor":
            count //= n
            op = rng.choice(["SUM", "MIN", "MAX"])
            out = torch.zeros(count, dtype=dtype)
            done(dist.reduce_scatter_tensor(out, _value(rank, it, count * n, dtype, op),
                                            op=getattr(R, op), async_op=async_op))
            full = _reduce([_value(r, it, count * n, dtype, op) for r in range(n)], op, dtype)
            check(it, f"{what} {op}", out, full[rank * count:(rank + 1) * count])
        elif kind == "all_to_all_single":
            # Uneven splits: splits[src][dst] elements go from src to dst.
            per = max(count // (n * n), 0)
            splits = [[rng.randint(0, 2 * per) for _ in range(n)] for _ in range(n)]
            send = splits[rank]
            recv = [splits[src][rank] for src in range(n)]
            inp = torch.cat([_value(rank, it, send[d], dtype, salt=d) for d in range(n)])
            out = torch.zeros(sum(recv), dtype=dtype)
            done(dist.all_to_all_single(out, inp, recv, send, async_op=async_op))
            want = torch.cat([_value(src, it, recv[src], dtype, salt=rank) for src in range(n)])
            check(it, f"{what} splits={splits}", out, want)
        elif kind == "barrier":
            done(dist.barrier(async_op=async_op))
        else:  # a pair of isend/irecv around a ring, at a random distance
            step = rng.randrange(1, n)
            dst, src = (rank + step) % n, (rank - step) % n
            got = torch.zeros(count, dtype=dtype)
            works = [dist.irecv(got, src), dist.isend(_value(rank, it, count, dtype), dst)]
            for w in works:
                w.wait()
            check(it, f"{what} step={step}", got, _value(src, it, count, dtype))
    dist.barrier()
    end = time.monotonic()
    return {
        "fails": fails,
        "counts": counts,
        "rss_warm": rss_warm,
        "rss_end": _rss(),
        "seconds": end - start,
        "seconds_after_warmup": end - warm_t,
    }


def _run(ops: int, warmup: int, timeout: float) -> list[dict]:
    start = time.monotonic()
    results = run_ranks(_soak, WORLD, timeout=timeout, args=(ops, warmup, SEED))
    wall = time.monotonic() - start
    fails = [f for r in results for f in r["fails"]]
    assert not fails, f"{len(fails)} wrong results, first: " + "\n".join(fails[:10])
    counts = results[0]["counts"]
    assert sum(counts.values()) == ops
    assert all(counts[k] > 0 for k in KINDS), counts
    for rank, r in enumerate(results):
        growth = (r["rss_end"] - r["rss_warm"]) / r["rss_warm"]
        print(f"rank {rank}: {ops} ops in {r['seconds']:.1f} s, RSS after {warmup} ops "
              f"{r['rss_warm'] / 2**20:.1f} MiB, at the end {r['rss_end'] / 2**20:.1f} MiB "
              f"({growth * 100:+.2f} %)")
        assert growth < 0.05, (
            f"rank {rank}: resident memory grew {growth * 100:.1f} % over {ops - warmup} ops "
            f"({r['rss_warm'] >> 10} KiB -> {r['rss_end'] >> 10} KiB)")
    print(f"{ops} ops x {WORLD} ranks, wall {wall:.1f} s (spawn included), op mix {counts}")
    return results


def test_soak_short() -> None:
    """600 mixed ops: every result exact; memory checked after 200 ops of warm-up."""
    _run(600, 200, timeout=240)


@pytest.mark.slow
def test_soak_10k() -> None:
    """10,000 mixed ops: every result exact; RSS grows < 5 % from op 1000 to the end."""
    _run(10_000, 1000, timeout=1500)

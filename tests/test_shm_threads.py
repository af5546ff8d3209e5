"""Shared-memory all_reduce with each rank's copies and reductions split over helper
threads (TDX_SHM_THREADS): every dtype and reduce op, counts around the thread and chunk
boundaries, exact against the float64/int64 reference and bit-for-bit against the
single-threaded run (the reduction order per element does not change with threads)."""

from __future__ import annotations

import os
import sys

import pytest
import torch
import torch.distributed as dist

from torchdist_ext.testing import run_ranks

try:  # tests/ is on sys.path under pytest's default (prepend) import mode
    from test_collectives import close, ops_for, redop, reference, value
except ImportError:  # pragma: no cover - other import modes / rootdirs
    sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
    from test_collectives import close, ops_for, redop, reference, value

DTYPES = [torch.float32, torch.float64, torch.bfloat16, torch.int32, torch.int64,
          torch.uint8, torch.bool]
# 0 and 1; a count whose passes stay under one part per thread (one thread runs them);
# a prime that splits unevenly into parts and pieces; one past a 1 MiB half in float32
# (two chunks, the second of one element); several halves of float64.
COUNTS = [0, 1, 4099, 300_007, 262_145, 600_001]


def _sweep(rank: int, n: int) -> list[str]:
    import torchdist_ext

    fails: list[str] = []
    for dtype in DTYPES:
        for count in COUNTS:
            for op in ops_for(dtype):
                mine = value(rank, count, dtype, op)
                t = mine.clone()
                dist.all_reduce(t, op=redop(op))
                algo = torchdist_ext.flight_recorder()[-1]["path"]
                want = reference([value(q, count, dtype, op) for q in range(n)], op, n, dtype)
                if not close(t, want, n if op == "AVG" else 0):
                    bad = (t.double() - want.double()).abs().argmax().item() if count else 0
                    fails.append(f"r{rank}/{n} {op} {dtype} count={count} ({algo}): got "
                                 f"{t.flatten()[bad:bad + 2].tolist()}, want "
                                 f"{want.flatten()[bad:bad + 2].tolist()} at {bad}")
    return fails


def _results(rank: int, n: int) -> list[bytes]:
    out = []
    for dtype in (torch.float32, torch.bfloat16):
        for op in ("SUM", "AVG", "PREMUL_SUM"):
            t = value(rank, 600_001, dtype, op)
            dist.all_reduce(t, op=redop(op))
            out.append(t.view(torch.uint8).numpy().tobytes())  # plain bytes cross processes
    return out


@pytest.mark.parametrize("world", [2, 3])
def test_threaded_shm_all_reduce_every_dtype_and_op(world: int) -> None:
    env = {"TDX_SHM_THREADS": "3", "TDX_ALGO": "allreduce:shm"}
    fails = [f for r in run_ranks(_sweep, world, timeout=240, env=env) for f in r]
    assert not fails, "\n".join(fails[:20])


def test_threads_do_not_change_a_rounded_result() -> None:
    """Sums in float32 and bfloat16 round: the same bits with 1 and with 4 threads."""
    env = {"TDX_ALGO": "allreduce:shm"}
    one = run_ranks(_results, 3, timeout=120, env={**env, "TDX_SHM_THREADS": "1"})
    four = run_ranks(_results, 3, timeout=120, env={**env, "TDX_SHM_THREADS": "4"})
    for rank in range(3):
        for a, b in zip(one[rank], four[rank]):
            assert a == b, rank


def _bad_threads(rank: int, n: int) -> str:
    return "created"


@pytest.mark.parametrize("bad", ["0", "17", "many"])
def test_a_thread_count_out_of_range_is_refused(bad: str) -> None:
    from torchdist_ext.testing import RankFailure

    with pytest.raises(RankFailure, match="TDX_SHM_THREADS"):
        run_ranks(_bad_threads, 2, timeout=60, env={"TDX_SHM_THREADS": bad})


def _threads_started(rank: int, n: int) -> int:
    dist.all_reduce(torch.ones(1000))  # the group's own threads and window are up
    before = len(os.listdir("/proc/self/task"))
    dist.all_reduce(torch.ones(1 << 20))  # 4 MiB: passes of 2 MiB, worth every helper
    return len(os.listdir("/proc/self/task")) - before


def test_the_helpers_take_part() -> None:
    """With 3 threads a large all_reduce starts the 2 helpers (and no more)."""
    env = {"TDX_ALGO": "allreduce:shm"}
    assert run_ranks(_threads_started, 2, timeout=60, env={**env, "TDX_SHM_THREADS": "3"}) \
        == [2, 2]
    assert run_ranks(_threads_started, 2, timeout=60, env={**env, "TDX_SHM_THREADS": "1"}) \
        == [0, 0]

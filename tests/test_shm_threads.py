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


# shm: the window's passes split; cma: the reads of peers' buffers in place split.
@pytest.mark.parametrize("algo", ["shm", "cma"])
@pytest.mark.parametrize("world", [2, 3])
def test_threaded_all_reduce_every_dtype_and_op(world: int, algo: str) -> None:
    env = {"TDX_SHM_THREADS": "3", "TDX_ALGO": f"allreduce:{algo}"}
    fails = [f for r in run_ranks(_sweep, world, timeout=240, env=env) for f in r]
    assert not fails, "\n".join(fails[:20])


@pytest.mark.parametrize("algo", ["shm", "cma"])
def test_threads_do_not_change_a_rounded_result(algo: str) -> None:
    """Sums in float32 and bfloat16 round: the same bits with 1 and with 4 threads."""
    env = {"TDX_ALGO": f"allreduce:{algo}"}
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


def _placed(rank: int, n: int) -> dict:
    import torchdist_ext

    return torchdist_ext.placement()


def test_auto_shares_the_cpus_out_among_the_ranks() -> None:
    """The default (auto): the CPUs the ranks may run on together, divided among them, at
    most 8; a number is taken as it is. The group reports what its window will use."""
    from torchdist_ext import _C

    cpus = _C._usable_cpus()
    placed = run_ranks(_placed, 2, timeout=60)
    assert [p["pass_threads"] for p in placed] == [max(1, min(8, cpus // 2))] * 2
    # One rank has every CPU to itself (not one, as when counting one thread per rank).
    placed = run_ranks(_placed, 1, timeout=60)
    assert placed[0]["pass_threads"] == (min(8, cpus) if placed[0]["windows"] else 1)
    placed = run_ranks(_placed, 2, timeout=60, env={"TDX_SHM_THREADS": "5"})
    assert [p["pass_threads"] for p in placed] == [5, 5]
    # Two ranks pinned to one CPU each: auto has no spare core to give.
    placed = run_ranks(_placed, 2, timeout=60, affinity={0: [0], 1: [0]})
    assert [p["pass_threads"] for p in placed] == [1, 1]
    # Without windows the all_reduce has no passes to split.
    placed = run_ranks(_placed, 2, timeout=60, env={"TDX_SHM": "0", "TDX_SHM_THREADS": "5"})
    assert [p["pass_threads"] for p in placed] == [1, 1]


def _nothing(rank: int, n: int) -> None:
    return None


def test_ranks_must_agree_on_the_thread_count() -> None:
    """Threads change the model's price of the window all_reduce, so ranks that disagree
    could pick different algorithms for one op: the group refuses to start, naming both.
    Without windows the count does nothing, and ranks may differ."""
    from torchdist_ext.testing import RankFailure

    with pytest.raises(RankFailure) as info:
        run_ranks(_nothing, 2, timeout=60, rank_env={1: {"TDX_SHM_THREADS": "3"}})
    msg = str(info.value)
    assert ("TDX_SHM_THREADS is auto on rank 0 but 3 on this rank" in msg
            or "TDX_SHM_THREADS is 3 on rank 1 but auto on this rank" in msg), msg
    assert "same value on every rank" in msg, msg
    assert run_ranks(_nothing, 2, timeout=60, env={"TDX_SHM": "0"},
                     rank_env={1: {"TDX_SHM_THREADS": "3"}}) == [None, None]


def _subgroup_threads(rank: int, n: int) -> int:
    import torchdist_ext

    groups = [dist.new_group([r]) for r in range(n)]  # every rank creates every group
    return torchdist_ext.placement(groups[rank])["pass_threads"]


def test_a_subgroup_keeps_to_its_share_of_the_job() -> None:
    """A one-rank subgroup of a 2-rank job may not take every CPU of the host for its
    threads: the job's ranks of this host share them out, as the default group does."""
    from torchdist_ext import _C

    cpus = _C._usable_cpus()
    assert run_ranks(_subgroup_threads, 2, timeout=60) == [max(1, min(8, cpus // 2))] * 2


def test_the_model_prices_the_split_passes() -> None:
    """With the default thread exponent, 0.5, the window all_reduce's byte terms shrink
    by sqrt(threads); its steps and every other algorithm keep their price
    (tests/test_thread_exponent.py prices other exponents)."""
    import math

    import torchdist_ext
    from torchdist_ext import _C

    nbytes = float(16 << 20)
    one = _C._algorithm_cost("allreduce", "shm", nbytes, 2)
    four = _C._algorithm_cost("allreduce", "shm", nbytes, 2, pass_threads=4)
    model = torchdist_ext.cost_model()["shm"]
    fixed = model["alpha"] * one["steps"]
    assert four["seconds"] - fixed == pytest.approx((one["seconds"] - fixed) / 2, rel=1e-9)
    # A 1 MiB half cut into 2 pieces of 512 KiB splits at most 8 ways (64 KiB a part):
    # 9 threads are priced as the 8 the pass can use.
    nine = _C._algorithm_cost("allreduce", "shm", nbytes, 2, pass_threads=9)
    assert nine["seconds"] - fixed == pytest.approx((one["seconds"] - fixed) / math.sqrt(8),
                                                    rel=1e-9)
    # 64 KiB at 2 ranks: pieces of 32 KiB, not worth a helper, so no speedup.
    small = float(64 << 10)
    assert _C._algorithm_cost("allreduce", "shm", small, 2, pass_threads=8)["seconds"] == \
        _C._algorithm_cost("allreduce", "shm", small, 2)["seconds"]
    # cma splits its reads of a rank's piece (8 MiB here): 4 ways, priced as sqrt(4).
    cma_one = _C._algorithm_cost("allreduce", "cma", nbytes, 2)
    cma_four = _C._algorithm_cost("allreduce", "cma", nbytes, 2, pass_threads=4)
    cma_fixed = torchdist_ext.cost_model()["cma"]["alpha"] * cma_one["steps"]
    assert (cma_one["ways"], cma_four["ways"]) == (1, 4)
    assert cma_four["seconds"] - cma_fixed == pytest.approx(
        (cma_one["seconds"] - cma_fixed) / 2, rel=1e-9)
    for coll, name in (("allreduce", "shm_direct"),
                       ("allreduce", "ring"), ("broadcast", "shm"), ("reduce", "shm")):
        assert _C._algorithm_cost(coll, name, nbytes, 2, pass_threads=4)["seconds"] == \
            _C._algorithm_cost(coll, name, nbytes, 2)["seconds"], (coll, name)
    # predict() takes the count, checked.
    assert torchdist_ext.predict("allreduce", nbytes, 2, pass_threads=4)[1] <= \
        torchdist_ext.predict("allreduce", nbytes, 2)[1]
    for bad in (0, 17, 2.5, "4"):
        with pytest.raises(ValueError, match="pass_threads"):
            torchdist_ext.predict("allreduce", nbytes, 2, pass_threads=bad)
    with pytest.raises(ValueError, match="same_host"):
        torchdist_ext.predict("allreduce", nbytes, 2, same_host=False, pass_threads=4)


def test_python_and_the_backend_agree_on_the_most_threads() -> None:
    from torchdist_ext import _C, calibration

    assert calibration.MAX_THREADS == _C._MAX_PASS_THREADS


# Ways that change from pass to pass, so helpers a pass does not name sit some passes
# out and join a later one (17 is more than the pool has and is cut to 16).
WAYS = [2, 9, 1, 3, 16, 2, 17, 5, 2]


@pytest.mark.parametrize("nbytes,grain", [(0, 1), (1, 1), (65_535, 4), (131_072, 4096),
                                          (1_048_579, 16_384), (2_097_152, 3)])
def test_the_helper_pool_covers_every_byte_once(nbytes: int, grain: int) -> None:
    """Passes through the helper pool alone: each covers every byte exactly once, in
    parts cut on the grain, however many helpers the previous pass named."""
    from torchdist_ext import _C

    r = _C._pass_pool_check(nbytes, grain, WAYS, repeats=40)
    assert r["passes"] == 40 * len(WAYS)
    assert r["exact"] and r["cut_on_grain"], r
    # A pass splits into parts of 64 KiB at least, and at most 16 of them.
    assert r["most_parts"] == max(1, min(16, nbytes // (64 << 10))), r


def test_the_helper_pool_serves_one_caller_at_a_time() -> None:
    """Threads passing at once: one holds the helpers, the others run their passes
    alone; every pass still covers its bytes exactly once."""
    import threading

    from torchdist_ext import _C

    results: list[dict] = []

    def caller(ways: list[int]) -> None:
        results.append(_C._pass_pool_check(1 << 20, 64, ways, repeats=60))

    threads = [threading.Thread(target=caller, args=(w,)) for w in ([4], [16, 2], WAYS)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=120)
    assert not any(t.is_alive() for t in threads), "a pass never finished"
    assert len(results) == 3 and all(r["exact"] and r["cut_on_grain"] for r in results), \
        results


def test_bad_pool_check_arguments_are_refused() -> None:
    from torchdist_ext import _C

    with pytest.raises(ValueError, match="grain"):
        _C._pass_pool_check(10, 0, [2])
    with pytest.raises(ValueError, match="ways"):
        _C._pass_pool_check(10, 1, [])


def test_a_forked_child_has_a_pool_of_its_own() -> None:
    """The parent's helpers are not in a forked child: its passes run on helpers of
    its own (or alone), never waiting for threads that do not exist."""
    import signal
    import time

    from torchdist_ext import _C

    assert _C._pass_pool_check(1 << 20, 64, [4], repeats=2)["exact"]  # helpers running
    pid = os.fork()
    if pid == 0:  # pragma: no cover - the child reports through its exit status
        signal.alarm(60)
        r = _C._pass_pool_check(1 << 20, 64, [4, 16, 2], repeats=20)
        os._exit(0 if r["exact"] and r["most_parts"] == 16 else 3)
    deadline = time.monotonic() + 90
    while time.monotonic() < deadline:
        done, status = os.waitpid(pid, os.WNOHANG)
        if done:
            break
        time.sleep(0.05)
    else:
        os.kill(pid, signal.SIGKILL)
        os.waitpid(pid, 0)
        pytest.fail("the forked child's passes never finished")
    assert os.waitstatus_to_exitcode(status) == 0

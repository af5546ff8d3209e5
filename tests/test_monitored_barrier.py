"""torch's monitored_barrier on tdx: every rank reports to rank 0, which names the ranks
that did not arrive in the barrier's own timeout (the first of them, or every one with
wait_all_ranks=True) or were lost, in torch's wording; the other ranks are released only
when all arrived, and raise otherwise."""

from __future__ import annotations

import os
import re
import time
from datetime import timedelta

import pytest
import torch
import torch.distributed as dist

from torchdist_ext.testing import run_ranks


def _all_arrive(rank: int, n: int) -> list[float]:
    times = []
    for _ in range(3):
        start = time.monotonic()
        dist.monitored_barrier(timeout=timedelta(seconds=10))
        times.append(time.monotonic() - start)
    dist.monitored_barrier(wait_all_ranks=True)  # the group's timeout
    # The group goes on working around it.
    t = torch.full((5,), float(rank))
    dist.all_reduce(t)
    assert t.tolist() == [n * (n - 1) / 2] * 5
    return times


@pytest.mark.parametrize("world", [1, 2, 3, 5])
def test_monitored_barrier_passes_when_every_rank_arrives(world: int) -> None:
    for times in run_ranks(_all_arrive, world, timeout=60):
        assert max(times) < 10


def _some_stay_away(rank: int, n: int, absent: list[int], wait_all: bool,
                    leaving: int | None = None) -> dict:
    out: dict = {}
    if rank not in absent:
        start = time.monotonic()
        try:
            dist.monitored_barrier(timeout=timedelta(seconds=2), wait_all_ranks=wait_all)
            out["error"] = None
        except Exception as e:  # noqa: BLE001 - the type is checked by the caller
            out["error"] = f"{type(e).__name__}: {e}"
        out["seconds"] = time.monotonic() - start
    # Absent ranks wait here until the others have given up, then leave; the group is
    # broken by the failed barrier, so nothing more runs on it.
    _meet(n if leaving is None else leaving)
    return out


def _meet(count: int) -> None:
    """Waits until `count` ranks got here (20 s at most)."""
    store = dist.distributed_c10d._get_default_store()
    store.add("done", 1)
    deadline = time.monotonic() + 20
    while store.add("done", 0) < count and time.monotonic() < deadline:
        time.sleep(0.05)


@pytest.mark.parametrize("debug", ["", "DETAIL"])
def test_rank_zero_names_the_first_rank_that_did_not_arrive(debug: str) -> None:
    """Also under DETAIL, where ops compare fingerprints first: not this one, whose
    exchange would time out without naming anyone."""
    out = run_ranks(_some_stay_away, 4, timeout=30, args=([2, 3], False),
                    env={"TDX_DEBUG": debug} if debug else None)
    err0 = out[0]["error"]
    assert err0 and err0.startswith("DistBackendError"), out[0]
    assert "Rank 2 failed to pass monitoredBarrier in 2000 ms" in err0, err0
    assert "rank 2: did not arrive" in err0 and "rank 3" not in err0, err0
    assert 1.5 < out[0]["seconds"] < 6, out[0]
    # Rank 1 arrived; it hears that rank 0 gave up (or times out waiting for rank 0).
    err1 = out[1]["error"]
    assert err1 and err1.startswith("DistBackendError") and "rank 0" in err1, out[1]
    assert "monitored_barrier" in err1, err1
    assert out[1]["seconds"] < 8, out[1]


def test_wait_all_ranks_names_every_rank_that_did_not_arrive() -> None:
    out = run_ranks(_some_stay_away, 4, timeout=30, args=([1, 3], True))
    err0 = out[0]["error"]
    assert "Ranks 1, 3 failed to pass monitoredBarrier in 2000 ms" in err0, err0
    assert "rank 1: did not arrive; rank 3: did not arrive" in err0, err0
    assert "arrived: ranks 0, 2" in err0, err0
    assert out[2]["error"] and "rank 0" in out[2]["error"], out[2]


def test_ranks_wait_for_rank_zero() -> None:
    """Rank 0 never calls: the others are not released, and say rank 0 did not."""
    out = run_ranks(_some_stay_away, 3, timeout=30, args=([0], False))
    for r in (1, 2):
        err = out[r]["error"]
        assert err and err.startswith("DistBackendError"), out[r]
        assert f"rank {r} reached monitored_barrier, but rank 0 did not release it" in err, err
        assert 1.5 < out[r]["seconds"] < 8, out[r]


def _one_dies(rank: int, n: int) -> dict:
    if rank == 2:
        time.sleep(1)  # the others are in the barrier by now
        os._exit(0)  # gone without a word
    start = time.monotonic()
    try:
        dist.monitored_barrier(timeout=timedelta(seconds=20), wait_all_ranks=True)
        return {"error": None}
    except Exception as e:  # noqa: BLE001 - the type is checked by the caller
        return {"error": f"{type(e).__name__}: {e}", "seconds": time.monotonic() - start}


def test_a_lost_rank_is_named_at_once() -> None:
    """A rank that died is named when its connection fails, not at the 20 s timeout."""
    out = run_ranks(_one_dies, 3, timeout=20, may_exit=[2])
    err0 = out[0]["error"]
    assert err0 and "Rank 2 failed to pass monitoredBarrier" in err0, out[0]
    assert "lost" in err0, err0
    assert out[0]["seconds"] < 10, out[0]


def _bad_timeout(rank: int, n: int) -> str:
    pg = dist.distributed_c10d._get_default_group()
    opts = dist.BarrierOptions()
    opts.timeout = timedelta(seconds=0)
    try:
        pg.monitored_barrier(timedelta(seconds=0))
    except Exception as e:  # noqa: BLE001 - the message is checked by the caller
        return f"{type(e).__name__}: {e}"
    return "no error"


def test_a_timeout_of_zero_is_refused() -> None:
    for msg in run_ranks(_bad_timeout, 2, timeout=30):
        assert "timeout" in msg and ("positive" in msg or "0" in msg), msg


def _lost_and_absent(rank: int, n: int) -> dict:
    """Rank 3 dies while the others wait, rank 4 never calls: with wait_all_ranks rank 0
    names both, and the ranks that arrived end with rank 0's error, not their own view
    of the loss."""
    if rank == 3:
        time.sleep(1)
        os._exit(0)
    return _some_stay_away(rank, n, [4], True, leaving=n - 1)


def test_rank_zero_reports_every_missing_rank_however_the_others_see_it() -> None:
    out = run_ranks(_lost_and_absent, 5, timeout=30, may_exit=[3])
    err0 = out[0]["error"]
    assert "Ranks 3, 4 failed to pass monitoredBarrier in 2000 ms" in err0, err0
    assert re.search(r"rank 3: [^;]*lost", err0) and "rank 4: did not arrive" in err0, err0
    for r in (1, 2):
        assert "Ranks 3, 4 failed to pass monitoredBarrier" in out[r]["error"], out[r]


def _late_zero(rank: int, n: int) -> dict:
    if rank == 0:
        time.sleep(1)  # rank 0 reaches the barrier last (a checkpoint to write, say)
    return _some_stay_away(rank, n, [3], False)


def test_a_late_rank_zero_still_names_the_missing_rank_everywhere() -> None:
    """The others wait for rank 0 a grace longer than its own timeout, so it is rank 0's
    error, naming rank 3, that every rank ends with."""
    out = run_ranks(_late_zero, 4, timeout=30)
    for r in (0, 1, 2):
        assert "Rank 3 failed to pass monitoredBarrier in 2000 ms" in out[r]["error"], out[r]


def _wrong_op(rank: int, n: int, op: str) -> dict:
    if rank == n - 1:
        try:
            if op == "barrier":
                dist.barrier()  # not the monitored one
            else:
                dist.all_reduce(torch.ones(4))
        except Exception:  # noqa: BLE001 - it fails when rank 0 gives up; not checked
            pass
        _meet(n)
        return {}
    return _some_stay_away(rank, n, [], False)


@pytest.mark.parametrize("op", ["barrier", "all_reduce"])
def test_a_rank_that_calls_another_op_does_not_count_as_arrived(op: str) -> None:
    """A plain barrier's message to rank 0 at the same step is not a report; another
    collective's message carries another kind, and rank 0 finds it without waiting out
    the barrier's 2 s timeout."""
    out = run_ranks(_wrong_op, 2, timeout=30, args=(op,),
                    env={"TDX_SHM": "0", "TDX_ALGO": "barrier:dissemination"})
    err0 = out[0]["error"]
    assert err0 and "Rank 1 failed to pass monitoredBarrier" in err0, out[0]
    if op == "barrier":
        assert "called another op" in err0, err0
    else:
        assert "it called all_reduce here" in err0 and out[0]["seconds"] < 1.5, out[0]

"""kill -9 of a rank during a collective: every survivor's op raises DistBackendError
naming the lost rank within the group timeout + 5 s. No hangs."""

from __future__ import annotations

import os
import re
import signal
import time
from pathlib import Path

import pytest
import torch
import torch.distributed as dist

from torchdist_ext.testing import log_to_file, run_ranks

TIMEOUT = 15.0
# The requirement is the group timeout + 5 s; a dead rank on this host is noticed through
# its pidfd at once (the slowest survivor measured 1.2 s, at world 5 on 2 cores), so a
# survivor that needs more than this fell back to the timeout: a regression.
NOTICED = 5.0
OPS = ["all_reduce", "broadcast", "reduce", "all_gather_into_tensor", "reduce_scatter_tensor",
       "all_to_all_single", "gather", "scatter", "barrier", "send_recv", "recv_any_source"]


def _call(op: str, n: int, async_op: bool = False):
    big = 1 << 20
    if op == "all_reduce":
        return dist.all_reduce(torch.ones(big), async_op=async_op)
    if op == "broadcast":
        return dist.broadcast(torch.ones(big), src=0, async_op=async_op)
    if op == "reduce":  # the ranks other than the root wait for nobody in shm_direct
        return dist.reduce(torch.ones(big), dst=0, async_op=async_op)
    if op == "gather":
        mine = torch.ones(big // n)
        slots = [torch.empty(big // n) for _ in range(n)] if dist.get_rank() == 0 else None
        return dist.gather(mine, slots, dst=0, async_op=async_op)
    if op == "scatter":
        out = torch.empty(big // n)
        parts = [torch.ones(big // n) for _ in range(n)] if dist.get_rank() == 0 else None
        return dist.scatter(out, parts, src=0, async_op=async_op)
    if op == "all_gather_into_tensor":
        return dist.all_gather_into_tensor(torch.empty(big * n), torch.ones(big), async_op=async_op)
    if op == "reduce_scatter_tensor":
        return dist.reduce_scatter_tensor(torch.empty(big), torch.ones(big * n), async_op=async_op)
    if op == "send_recv":  # a ring of point-to-point exchanges
        rank = dist.get_rank()
        out = torch.ones(big)
        inp = torch.empty(big)
        works = [dist.isend(out, (rank + 1) % n), dist.irecv(inp, (rank - 1) % n)]
        if async_op:
            return works
        for w in works:
            w.wait()
        return None
    if op == "recv_any_source":  # rank 0 takes one message from each other rank, any order
        rank = dist.get_rank()
        if rank == 0:
            works = [dist.irecv(torch.empty(big)) for _ in range(n - 1)]
        else:
            works = [dist.isend(torch.ones(big), 0)]
        if async_op:
            return works
        for w in works:
            w.wait()
        return None
    if op == "all_to_all_single":
        return dist.all_to_all_single(torch.empty(big * n), torch.ones(big * n), async_op=async_op)
    return dist.barrier(async_op=async_op)


def _trial(rank: int, n: int, op: str, victim: int, log_dir: str | None = None) -> dict:
    if log_dir is not None:
        log_to_file(log_dir, rank)
    dist.all_reduce(torch.ones(4))  # everyone is connected and alive here
    if rank == victim:
        _call(op, n, async_op=True)  # in flight when the process dies
        time.sleep(0.005)
        os.kill(os.getpid(), signal.SIGKILL)
    start = time.monotonic()
    try:
        # The first ops may complete before the death is noticed, and so may ops whose
        # data does not pass through the victim on this rank (a broadcast leaf fed by the
        # root); once it is noticed, the group refuses every op.
        while time.monotonic() - start < TIMEOUT:
            _call(op, n)
        return {"error": "no error", "seconds": time.monotonic() - start}
    except Exception as e:  # noqa: BLE001 - the type is checked by the caller
        return {"error": f"{type(e).__name__}: {e}", "seconds": time.monotonic() - start}


def _check_survivors(results: list, op: str, victim: int) -> tuple[float, int]:
    """Every survivor raised DistBackendError naming the victim in time; returns the
    slowest survivor's seconds to its error, and its rank."""
    slowest = (0.0, -1)
    for rank, r in enumerate(results):
        if rank == victim:
            continue
        assert r["error"].startswith("DistBackendError"), (op, victim, rank, r)
        assert f"rank {victim}" in r["error"], (op, victim, rank, r["error"])
        assert r["seconds"] < TIMEOUT + 5, (op, victim, rank, r)
        assert r["seconds"] < NOTICED, ("noticed late, at the timeout?", op, victim, rank, r)
        slowest = max(slowest, (r["seconds"], rank))
    return slowest


# UCX's own warnings and errors, as it prints them ("[time] [host:pid:thread] file:line
# UCX  ERROR ..."). A survivor has been told which rank died by the backend's error: a
# UCX line on top of it (a failed shmat of the dead rank's segment, say) is noise.
_UCX_LINE = re.compile(r"\bUCX\s+(ERROR|WARN)")


def _check_no_ucx_lines(log_dir: Path, results: list, op: str, victim: int) -> None:
    """No survivor's output (standard output and error, to the end of its process) holds
    a line of UCX's at warning level or above."""
    for rank in range(len(results)):
        if rank == victim:
            continue
        lines = [line for line in (log_dir / f"rank{rank}.log").read_text().splitlines()
                 if _UCX_LINE.search(line)]
        assert not lines, (op, victim, rank, lines)


@pytest.mark.parametrize("op", OPS)
def test_kill_during_op(op: str, tmp_path: Path) -> None:
    n = 3
    for victim in (0, n - 1):
        logs = tmp_path / str(victim)
        logs.mkdir()
        results = run_ranks(_trial, n, timeout=TIMEOUT, args=(op, victim, str(logs)),
                            may_exit=[victim])
        _check_survivors(results, op, victim)
        _check_no_ucx_lines(logs, results, op, victim)


def test_kill_during_direct_reduce() -> None:
    """shm_direct reduce: the root waits for every rank, the others for nobody, so a
    survivor that is not the root notices a death only at a later op's window half."""
    n = 3
    for victim in (0, 1):
        results = run_ranks(_trial, n, timeout=TIMEOUT, args=("reduce", victim),
                            may_exit=[victim], env={"TDX_ALGO": "reduce:shm_direct"})
        _check_survivors(results, "reduce", victim)


def test_kill_during_threaded_cma_all_reduce() -> None:
    """cma over 3 threads per rank: the reads of a dead rank's buffer fail on helper
    threads, which may not throw; the caller's thread must still name the victim."""
    n = 3
    env = {"TDX_ALGO": "allreduce:cma", "TDX_SHM_THREADS": "3"}
    for victim in (0, n - 1):
        results = run_ranks(_trial, n, timeout=TIMEOUT, args=("all_reduce", victim),
                            may_exit=[victim], env=env)
        _check_survivors(results, "all_reduce", victim)


def test_kill_sender_part_way_through_an_any_source_message() -> None:
    """With every message sent eagerly, in fragments (UCX_RNDV_THRESH=inf), a sender that
    dies part way leaves rank 0's any-source receive matched to a message that will never
    end: UCX neither cancels nor fails it, and no lost endpoint names it. The broken
    group abandons it after a short grace instead of leaving it to the group timeout.
    The death lands mid-message in about a third of trials; six give that case a chance
    of about nine in ten."""
    for _ in range(6):
        results = run_ranks(_trial, 3, timeout=TIMEOUT, args=("recv_any_source", 2),
                            may_exit=[2], env={"UCX_RNDV_THRESH": "inf"})
        _check_survivors(results, "recv_any_source", 2)


@pytest.mark.slow
@pytest.mark.parametrize("transport", ["default", "ucx-only"])
@pytest.mark.parametrize("world", [2, 4, 5])
def test_kill_sweep(world: int, transport: str, tmp_path: Path) -> None:
    """Every op x every victim rank at more world sizes; "ucx-only" (TDX_SHM=0) sends all
    collective data through UCX instead of the shared-memory windows. Prints the slowest
    survivor's time to its error."""
    env = {"TDX_SHM": "0"} if transport == "ucx-only" else None
    slowest, trials = (0.0, "-"), 0
    for op in OPS:
        for victim in range(world):
            logs = tmp_path / f"{op}-{victim}"
            logs.mkdir()
            results = run_ranks(_trial, world, timeout=TIMEOUT, args=(op, victim, str(logs)),
                                may_exit=[victim], env=env)
            trials += 1
            seconds, rank = _check_survivors(results, op, victim)
            _check_no_ucx_lines(logs, results, op, victim)
            slowest = max(slowest, (seconds, f"{op}, victim {victim}, rank {rank}"))
    print(f"world {world} {transport}: {trials} trials, {trials * (world - 1)} survivors, "
          f"slowest error after {slowest[0]:.2f} s ({slowest[1]})")


def _point_to_point_after_loss(rank: int, n: int, victim: int) -> dict:
    dist.all_reduce(torch.ones(4))
    if rank == victim:
        os.kill(os.getpid(), signal.SIGKILL)
    start = time.monotonic()
    try:  # notice the loss first
        while time.monotonic() - start < TIMEOUT:
            dist.all_reduce(torch.ones(4))
    except Exception:  # noqa: BLE001 - only the refusal below is checked
        pass
    # Ranks 0 and 1 both survive and could still reach each other: the exchange is
    # refused all the same, at once, naming the lost rank.
    other = 1 - rank
    t = torch.ones(16)
    start = time.monotonic()
    errors = []
    for work in (dist.isend(t, other), dist.irecv(torch.empty(16), other)):
        try:
            work.wait()
            errors.append("no error")
        except Exception as e:  # noqa: BLE001 - the type is checked by the caller
            errors.append(f"{type(e).__name__}: {e}")
    return {"errors": errors, "seconds": time.monotonic() - start}


def test_point_to_point_refused_once_a_member_is_lost() -> None:
    """A group that lost a member refuses point-to-point ops too, even between two live
    ranks: a later op must not run on some ranks and fail on others."""
    results = run_ranks(_point_to_point_after_loss, 3, timeout=TIMEOUT, args=(2,),
                        may_exit=[2])
    for rank in (0, 1):
        r = results[rank]
        for err in r["errors"]:
            assert err.startswith("DistBackendError"), (rank, r)
            assert "rank 2" in err and "unusable" in err, (rank, err)
        assert r["seconds"] < 1.0, (rank, r)


def _killed_part_way_through_a_message(rank: int, n: int) -> dict:
    count = (256 << 20) // 4  # more than 20 ms of copying, even through shared memory
    dist.all_reduce(torch.ones(4))
    if rank == 1:
        dist.isend(torch.ones(count), 0)
        time.sleep(0.02)  # some fragments are on their way, most are not
        os.kill(os.getpid(), signal.SIGKILL)
    start = time.monotonic()
    try:
        dist.recv(torch.empty(count), 1)
        return {"error": None, "seconds": time.monotonic() - start}
    except Exception as e:  # noqa: BLE001 - the type is checked by the caller
        return {"error": f"{type(e).__name__}: {e}", "seconds": time.monotonic() - start}


def test_receive_of_a_message_cut_off_by_a_kill_fails_at_once() -> None:
    """A 256 MiB message sent eagerly in fragments (UCX_RNDV_THRESH=inf), the sender killed
    20 ms in: UCX cannot cancel the receive it has begun to fill, so the transport fails
    it once the fragments already sent have landed, naming the lost rank, instead of
    leaving it to the group timeout."""
    r = run_ranks(_killed_part_way_through_a_message, 2, timeout=TIMEOUT,
                  env={"UCX_RNDV_THRESH": "inf"}, may_exit=[1])[0]
    assert r["error"] and r["error"].startswith("DistBackendError"), r
    assert "rank 1" in r["error"], r
    assert r["seconds"] < 5.0, r


def _survive_with_logs(rank: int, n: int, log_dir: str) -> dict:
    """Rank n-1 dies while 4 MiB all_reduces (rendezvous sends) are in flight over UCX.
    UCX logs to standard output, the backend to standard error: both go to a file, read
    by the test after the ranks' transports have stopped."""
    log_to_file(log_dir, rank)
    t = torch.ones(1 << 20)
    dist.all_reduce(t)
    if rank == n - 1:
        dist.all_reduce(t, async_op=True)
        time.sleep(0.005)
        os.kill(os.getpid(), signal.SIGKILL)
    try:
        for _ in range(50):
            dist.all_reduce(t)
        return {"error": "no error"}
    except Exception as e:  # noqa: BLE001 - the type is checked by the caller
        return {"error": f"{type(e).__name__}: {e}"}


def test_transfers_left_to_a_dead_rank_are_summed_up_not_listed(tmp_path) -> None:
    """A survivor's sends to a dead rank stay unfinished in UCX, which printed a warning
    for each such request, buffer and registered region when the transport stopped
    ("object ... was not returned to mpool", "ucp_rcache: destroying inuse region"; up
    to tens of lines per survivor), after the backend's error had named the rank. They
    are counted into one line instead (at TDX_DEBUG=INFO; each is shown at DETAIL). The
    line on the lost connection names the rank that printed it and the rank it lost."""
    summaries = []
    for attempt in range(2):
        logs = tmp_path / str(attempt)
        logs.mkdir()
        results = run_ranks(_survive_with_logs, 3, timeout=TIMEOUT, args=(str(logs),),
                            may_exit=[2], env={"TDX_SHM": "0", "TDX_DEBUG": "INFO",
                                               "UCX_LOG_LEVEL": "warn", "UCX_LOG_FILE": ""})
        for rank in (0, 1):
            assert results[rank]["error"].startswith("DistBackendError"), results[rank]
            text = (logs / f"rank{rank}.log").read_text()
            raw = [line for line in text.splitlines()
                   if "was not returned to mpool" in line or "destroying inuse region" in line
                   or "unexpected tag-receive descriptor" in line]
            assert not raw, (attempt, rank, raw)
            summaries += [line for line in text.splitlines() if "stopped with" in line]
            # The transport's lines name the ranks: the printing one and the lost one.
            lost = [line for line in text.splitlines() if "rank 2 (endpoint" in line]
            assert lost and all(f"[tdx r{rank} transport]" in line for line in lost), \
                (attempt, rank, text[-2000:])
    # Not vacuous: some survivor stopped with a transfer to the dead rank unfinished.
    assert any("stopped with 0 UCX" not in s for s in summaries), summaries

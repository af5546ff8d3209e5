"""Bad arguments raise at the call, before anything is sent, and name the op; the group
keeps working afterwards."""

from __future__ import annotations

import datetime
import os
import re
import subprocess
import sys
import time

import pytest
import torch
import torch.distributed as dist

from torchdist_ext.testing import RankFailure, log_to_file, run_ranks


def _expect_error(fails: list[str], what: str, fn, *needles: str, ours: bool = True) -> None:
    """`fn` must raise naming each needle; errors the backend raises (``ours``) must also
    name this rank and its group ("[tdx r<rank>/<size> pg=...]")."""
    try:
        fn()
    except (RuntimeError, ValueError, TypeError) as e:
        msg = str(e)
        if ours:
            rank, n = dist.get_rank(), dist.get_world_size()
            needles = needles + (f"r{rank}/{n}", "pg=")
        for needle in needles:
            if needle not in msg:
                fails.append(f"{what}: message lacks {needle!r}: {msg[:300]}")
        return
    fails.append(f"{what}: no error raised")


def _bad_calls(rank: int, n: int) -> list[str]:
    fails: list[str] = []
    pg = dist.distributed_c10d._get_default_group()
    _expect_error(fails, "BXOR on float",
                  lambda: dist.all_reduce(torch.ones(3), op=dist.ReduceOp.BXOR),
                  "all_reduce", "BXOR")
    _expect_error(fails, "AVG on bool",
                  lambda: dist.all_reduce(torch.ones(3, dtype=torch.bool), op=dist.ReduceOp.AVG),
                  "AVG", "bool")
    _expect_error(fails, "all_gather wrong size",
                  lambda: dist.all_gather([torch.empty(4) if r == rank else torch.empty(3)
                                           for r in range(n)], torch.ones(3)),
                  "all_gather", "4")
    _expect_error(fails, "all_gather wrong count",
                  lambda: pg.allgather([[torch.empty(3)] * (n + 1)], [torch.ones(3)]),
                  "all_gather", str(n + 1))
    _expect_error(fails, "all_gather wrong dtype",
                  lambda: dist.all_gather([torch.empty(3, dtype=torch.int32)] * n, torch.ones(3)),
                  "dtype", ours=False)  # torch's own check, before the backend
    _expect_error(fails, "all_to_all list length",
                  lambda: dist.all_to_all([torch.empty(2)] * (n + 1), [torch.ones(2)] * (n + 1)),
                  "all_to_all")
    _expect_error(fails, "all_to_all_single bad splits",
                  lambda: dist.all_to_all_single(torch.empty(n), torch.ones(n), [1] * n, [2] * n),
                  "all_to_all_single", "sum")
    _expect_error(fails, "all_gather_into_tensor bad size",
                  lambda: dist.all_gather_into_tensor(torch.empty(n * 3 + 1), torch.ones(3)),
                  "all_gather_into_tensor")
    _expect_error(fails, "reduce_scatter_tensor bad size",
                  lambda: dist.reduce_scatter_tensor(torch.empty(3), torch.ones(n * 3 + 1)),
                  "reduce_scatter_tensor")
    bopts = dist.BroadcastOptions()
    bopts.rootRank = n + 3
    _expect_error(fails, "broadcast bad root",
                  lambda: pg.broadcast([torch.ones(2)], bopts), "broadcast", str(n + 3))
    _expect_error(fails, "send bad dst",
                  lambda: pg.send([torch.ones(2)], n + 1, 0), "send", str(n + 1))
    _expect_error(fails, "p2p bad tag",
                  lambda: pg.send([torch.ones(2)], 0, -5), "tag")
    # torch's dispatcher passes sparse tensors to all_reduce alone (which takes them);
    # another op reached directly on the backend refuses them.
    _expect_error(fails, "sparse tensor",
                  lambda: pg._get_backend(torch.device("cpu")).broadcast(
                      [torch.ones(3).to_sparse()], dist.BroadcastOptions()),
                  "Sparse", "dense")
    _expect_error(fails, "all_reduce into an expanded tensor",
                  lambda: dist.all_reduce(torch.zeros(1).expand(4)),
                  "all_reduce", "share memory", "clone")
    _expect_error(fails, "recv into an expanded tensor",
                  lambda: pg.recv([torch.zeros(1).expand(4)], (rank + 1) % n, 0),
                  "recv", "share memory")
    # reduce_scatter outputs inside the input: only this rank's own block is in place.
    buf = torch.ones(n * 4 + 1)
    _expect_error(fails, "reduce_scatter_tensor output shifted from its block",
                  lambda: dist.reduce_scatter_tensor(buf[rank * 4 + 1:rank * 4 + 5], buf[:n * 4]),
                  "reduce_scatter_tensor", "this rank's block", f"[{rank * 4}, {rank * 4 + 4})",
                  f"from element {rank * 4 + 1}")
    other = (rank + 1) % n
    ins = list(torch.ones(n * 4).chunk(n))
    _expect_error(fails, "reduce_scatter output is another rank's input block",
                  lambda: dist.reduce_scatter(ins[other], ins),
                  "reduce_scatter", f"input_list[{other}]")
    # The in-place forms themselves are fine.
    flat = torch.ones(n * 4)
    dist.reduce_scatter_tensor(flat.chunk(n)[rank], flat)
    ins = [torch.ones(4) for _ in range(n)]
    dist.reduce_scatter(ins[rank], ins)
    if flat.chunk(n)[rank].tolist() != [float(n)] * 4 or ins[rank].tolist() != [float(n)] * 4:
        fails.append(f"in-place reduce_scatter gave {flat.tolist()} and {ins[rank].tolist()}")
    # So are an empty list form aliasing itself, and this rank's block viewed
    # non-contiguously (staged through a copy, so written only after the input is read).
    x = torch.empty(0)
    dist.reduce_scatter(x, [x] * n)
    flat = torch.arange(n * 4, dtype=torch.float32)
    blocks = flat.view(n, 2, 2)
    out = blocks[rank].t()
    dist.reduce_scatter_tensor(out, flat)
    want = (torch.arange(rank * 4, rank * 4 + 4, dtype=torch.float32) * n).view(2, 2)
    if not torch.equal(out, want):  # the output's own element order
        fails.append(f"reduce_scatter_tensor into a transposed own block gave {blocks[rank]}")
    # A rank that only reads its tensor may pass an expanded one: a broadcast's root.
    src = torch.full((1,), 5.0).expand(4) if rank == 0 else torch.zeros(4)
    dist.broadcast(src, src=0)
    if src.tolist() != [5.0] * 4:
        fails.append(f"broadcast from an expanded root tensor gave {src.tolist()}")
    # The group still works after all of that.
    t = torch.full((5,), float(rank))
    dist.all_reduce(t)
    if not torch.equal(t, torch.full((5,), float(sum(range(n))))):
        fails.append("group broken after refused calls")
    return fails


def test_bad_arguments_raise_at_the_call() -> None:
    fails = [f for r in run_ranks(_bad_calls, 3) for f in r]
    assert not fails, "\n".join(fails)


def _size_mismatch(rank: int, n: int) -> dict:
    # Ranks disagree on the size: the receiver must get an error, never corrupt memory.
    import time

    g = dist.new_group(backend="tdx")
    t = torch.full((10 if rank == 1 else 20,), float(rank))
    start = time.monotonic()
    out: dict = {}
    try:
        dist.broadcast(t, src=1, group=g)  # the root sends 10 floats, rank 0 expects 20
        out["error"] = "ok"
    except Exception as e:  # noqa: BLE001 - the type is asserted by the caller
        out["error"] = type(e).__name__ + ": " + str(e)
    out["seconds"] = time.monotonic() - start
    # Nothing was written past the root's 10 elements (or at all, on a failure).
    out["tail intact"] = bool((t[10:] == float(rank)).all()) if rank == 0 else True
    # A fresh group still works.
    x = torch.ones(3)
    dist.all_reduce(x, group=dist.new_group(backend="tdx"))
    out["after"] = x.tolist()
    return out


@pytest.mark.parametrize("shm", ["1", "0"])
def test_mismatched_sizes_fail_cleanly(shm: str) -> None:
    results = run_ranks(_size_mismatch, 2, timeout=30, env={"TDX_SHM": shm})
    receiver = results[0]
    assert receiver["error"].startswith("DistBackendError"), results
    assert "rank 1" in receiver["error"], results
    assert receiver["seconds"] < 5.0, results  # not at the 30 s timeout
    assert all(r["tail intact"] and r["after"] == [2.0] * 3 for r in results), results


def _peer_gone(rank: int, n: int) -> tuple[str, float]:
    import os
    import time

    if rank == 1:
        os._exit(0)  # vanish without a word, as a killed rank would
    t = torch.ones(1 << 16)
    start = time.monotonic()
    try:
        dist.all_reduce(t)
    except Exception as e:  # noqa: BLE001
        return type(e).__name__ + ": " + str(e), time.monotonic() - start
    return "ok", time.monotonic() - start


def test_lost_peer_raises_dist_backend_error() -> None:
    # Rank 1 vanishes without a word; rank 0's all_reduce must raise DistBackendError
    # naming rank 1 at once (its pidfd reports the exit), not at the 20 s timeout.
    error, seconds = run_ranks(_peer_gone, 2, timeout=20, may_exit=[1])[0]
    assert error.startswith("DistBackendError"), error
    assert "rank 1" in error and "all_reduce" in error, error
    assert seconds < 5.0, ("noticed late, at the timeout?", seconds, error)


def _late_message(rank: int, n: int) -> dict:
    import time
    from datetime import timedelta

    g = dist.new_group(backend="tdx", timeout=timedelta(seconds=2))
    out: dict = {}
    if rank == 0:
        try:
            dist.recv(torch.empty(4), 1, group=g, tag=3)  # rank 1 has not sent yet
            out["first"] = "no error"
        except Exception as e:  # noqa: BLE001 - the type is checked by the caller
            out["first"] = f"{type(e).__name__}: {e}"
    dist.barrier()
    if rank == 1:
        # Too late for that receive. Rank 0 told the group when it gave up, so this send
        # is refused if the notice has arrived by now (it races the barrier above).
        try:
            dist.send(torch.full((4,), 7.0), 0, group=g, tag=3)
            out["late send"] = "no error"
        except Exception as e:  # noqa: BLE001 - the type is checked by the caller
            out["late send"] = f"{type(e).__name__}: {e}"
    dist.barrier()
    if rank == 0:
        start = time.monotonic()
        got = torch.zeros(4)
        try:
            dist.recv(got, 1, group=g, tag=3)
            out["second"] = f"no error, received {got.tolist()}"
        except Exception as e:  # noqa: BLE001 - the type is checked by the caller
            out["second"] = f"{type(e).__name__}: {e}"
        out["seconds"] = time.monotonic() - start
    dist.destroy_process_group(g)
    return out


def test_failed_point_to_point_breaks_the_group() -> None:
    """A receive that timed out leaves its message to arrive later, where it would fill
    the next receive of the same tag: the group refuses that receive instead."""
    r, sender = run_ranks(_late_message, 2, timeout=60)
    late = sender["late send"]
    assert late == "no error" or (late.startswith("DistBackendError")
                                  and "rank 0 gave up on the group" in late
                                  and "timed out" in late), sender
    assert r["first"].startswith("DistBackendError"), r
    assert r["second"].startswith("DistBackendError"), r
    assert "unusable" in r["second"] and "recv" in r["second"], r
    assert r["seconds"] < 1.0, r


def _coalesced_p2p_timeout(rank: int, n: int) -> dict:
    """A batch of a send that completes and a receive nobody sends to: when the batch's
    wait times out, the group is given up for the receive, not for the finished send."""
    import datetime

    g = dist.new_group(backend="tdx")
    out: dict = {}
    if rank == 0:
        works = dist.batch_isend_irecv([dist.P2POp(dist.isend, torch.ones(4), 1, group=g, tag=1),
                                        dist.P2POp(dist.irecv, torch.empty(4), 1, group=g, tag=2)])
        try:
            for w in works:
                w.wait(timeout=datetime.timedelta(seconds=1))
            out["batch"] = "no error"
        except Exception as e:  # noqa: BLE001 - the type is checked by the caller
            out["batch"] = f"{type(e).__name__}: {e}"
    else:
        dist.recv(torch.empty(4), 0, group=g, tag=1)
    try:
        dist.barrier(group=g)
        out["after"] = "no error"
    except Exception as e:  # noqa: BLE001 - the type is checked by the caller
        out["after"] = f"{type(e).__name__}: {e}"
    dist.destroy_process_group(g)
    return out


def test_a_coalesced_point_to_point_timeout_names_the_op_that_timed_out() -> None:
    results = run_ranks(_coalesced_p2p_timeout, 2, timeout=60)
    assert results[0]["batch"].startswith("DistBackendError"), results[0]
    for rank, r in enumerate(results):
        after = r["after"]
        assert after.startswith("DistBackendError"), (rank, after)
        assert "recv (Float[4] on cpu) from rank 1 tag 2" in after, (rank, after)
        assert "timed out" in after and "send (" not in after, (rank, after)


def _slow_peer(rank: int, n: int, coalesced: bool = False) -> dict:
    import time

    ts = [torch.ones(4) for _ in range(4)]
    out: dict = {}
    pg, cpu = dist.group.WORLD, torch.device("cpu")
    dist.barrier()  # both ranks start the clock together
    if rank == 0:
        start = time.monotonic()
        if coalesced:  # one Work for the block
            pg._start_coalescing(cpu)
            for t in ts:
                dist.all_reduce(t, async_op=True)
            work = pg._end_coalescing(cpu)
        else:
            work = [dist.all_reduce(t, async_op=True) for t in ts][-1]
        try:
            work.wait()  # no timeout of its own: it ends when the op (or block) does
            out["last"] = "ok"
        except Exception as e:  # noqa: BLE001 - the caller checks
            out["last"] = f"{type(e).__name__}: {e}"
        out["seconds"] = time.monotonic() - start
        out["values"] = [t[0].item() for t in ts]
    else:
        for t in ts:  # each op starts 1 s after the last: well within the 3 s timeout
            time.sleep(1.0)
            dist.all_reduce(t)
    return out


def test_wait_counts_the_timeout_from_the_op_not_the_call() -> None:
    """Four ops queued at once, each run within the group timeout: waiting on the last
    must not fail because the four together took longer than the timeout."""
    r = run_ranks(_slow_peer, 2, timeout=3)[0]
    assert r["last"] == "ok" and r["values"] == [2.0] * 4, r
    assert r["seconds"] > 3.0, r  # the point of the test: longer than one timeout


def _explicit_wait_timeout(rank: int, n: int) -> dict:
    import time
    from datetime import timedelta

    out: dict = {}
    t = torch.ones(4)
    if rank == 0:
        work = dist.all_reduce(t, async_op=True)  # rank 1 joins 3 s later
        start = time.monotonic()
        try:
            work.wait(timeout=timedelta(seconds=0.5))
            out["wait"] = "ok"
        except Exception as e:  # noqa: BLE001 - the caller checks
            out["wait"] = f"{type(e).__name__}: {e}"
        out["seconds"] = time.monotonic() - start
    else:
        time.sleep(3)
        try:
            dist.all_reduce(t)
        except Exception:  # noqa: BLE001 - rank 0 may have given up on the group by now
            pass
    return out


def test_explicit_wait_timeout_is_honoured() -> None:
    """wait(timeout) on a collective raises at that timeout (not the group's 30 s)."""
    r = run_ranks(_explicit_wait_timeout, 2, timeout=30)[0]
    assert r["wait"].startswith("DistBackendError") and "did not complete" in r["wait"], r
    assert 0.4 < r["seconds"] < 2.0, r


def _wait_timeouts_while_a_rank_is_late(rank: int, n: int) -> dict:
    import time
    from datetime import timedelta

    g = dist.new_group(backend="tdx", timeout=timedelta(seconds=30))
    dist.barrier(group=g)  # the window, where there is one, is made
    out: dict = {}
    first, second = torch.ones(5), torch.ones(7)
    if rank == n - 1:
        time.sleep(3)
    w1 = dist.all_reduce(first, group=g, async_op=True)
    w2 = dist.all_reduce(second, group=g, async_op=True)
    if rank < n - 1:
        for name, work, seconds in (("queued", w2, 1.0), ("running", w1, 0.5)):
            try:
                work.wait(timeout=timedelta(seconds=seconds))
                out[name] = "no error"
            except Exception as e:  # noqa: BLE001 - the caller checks
                out[name] = f"{type(e).__name__}: {e}"
    w1.wait()
    w2.wait()
    out["sums"] = first.tolist() + second.tolist()
    return out


@pytest.mark.parametrize("shm", ["1", "0"], ids=["window", "messages"])
def test_a_wait_timeout_on_a_collective_says_where_the_op_stands(shm: str) -> None:
    """wait(timeout) on a collective that runs out says what the rank was waiting for:
    the late rank (or, on messages, a neighbour that waits for it), or the op queued
    ahead whose turn it is. Then the ops finish when the late rank comes."""
    results = run_ranks(_wait_timeouts_while_a_rank_is_late, 3, timeout=60,
                        env={"TDX_SHM": shm})
    where = "in the shared-memory window" if shm == "1" else "on messages"
    late = "2" if shm == "1" else "[12]"
    for rank, r in enumerate(results):
        assert r["sums"] == [3.0] * 12, (rank, r)
        if rank == 2:
            continue
        queued, running = r["queued"], r["running"]
        assert queued.startswith("DistBackendError") and "did not complete" in queued, r
        assert re.search(r"It has not started on this rank: op #\d+, queued ahead of it, "
                         rf"still runs \(its latest stall: a wait for rank {late} {where}\)\.",
                         queued), r
        assert running.startswith("DistBackendError") and "did not complete" in running, r
        assert re.search(rf"Its latest stall on this rank was a wait for rank {late} {where}\.",
                         running), r
        assert "The op goes on under the group timeout" in running, r


def test_coalesced_block_waits_for_its_ops_not_one_timeout() -> None:
    """A coalesced block of collectives, each within the group timeout of its own start,
    is not failed because the block as a whole took longer than one timeout."""
    r = run_ranks(_slow_peer, 2, timeout=3, args=(True,))[0]
    assert r["last"] == "ok" and r["values"] == [2.0] * 4, r
    assert r["seconds"] > 3.0, r


def _abort_while_stuck(rank: int, n: int) -> dict:
    import time

    out: dict = {}
    if rank == 0:
        work = dist.all_reduce(torch.ones(4), async_op=True)  # rank 1 never calls it
        time.sleep(0.3)
        start = time.monotonic()
        dist.distributed_c10d._abort_process_group()
        out["abort_seconds"] = time.monotonic() - start
        try:
            work.wait()
            out["work"] = "ok"
        except Exception as e:  # noqa: BLE001 - the caller checks
            out["work"] = f"{type(e).__name__}: {e}"
        # The abort took the default group away; the harness destroys one at the end.
        import os
        import tempfile

        store = dist.FileStore(os.path.join(tempfile.mkdtemp(), "solo"), 1)
        dist.init_process_group("tdx", store=store, rank=0, world_size=1)
    else:
        time.sleep(3)
    return out


def test_abort_does_not_wait_for_peers() -> None:
    r = run_ranks(_abort_while_stuck, 2, timeout=60)[0]
    assert r["abort_seconds"] < 2.0, r
    assert r["work"].startswith("DistBackendError") and "abort" in r["work"], r


def _abort_during_shutdown(rank: int, n: int) -> dict:
    import threading
    import time

    sub = dist.new_group([0, 1])
    dist.all_reduce(torch.ones(1), group=sub)  # connected, so the goodbyes can go out
    out: dict = {}
    if rank == 0:
        # The shutdown waits for rank 1's goodbye, which comes only after 9 s.
        ended: dict = {}

        def shut() -> None:
            sub.shutdown()
            ended["at"] = time.monotonic()

        t = threading.Thread(target=shut)
        t.start()
        time.sleep(0.5)
        start = time.monotonic()
        sub.abort()
        out["abort_seconds"] = time.monotonic() - start
        t.join(30)
        out["shutdown_after_abort"] = ended.get("at", float("inf")) - start
    else:
        time.sleep(9)
        sub.shutdown()
    dist.barrier()
    return out


def test_abort_cuts_short_a_shutdown_waiting_for_peers() -> None:
    """abort() from another thread while a shutdown waits for a peer's goodbye returns
    at once, and so does the shutdown, instead of both waiting out the goodbye wait."""
    r = run_ranks(_abort_during_shutdown, 2, timeout=60)[0]
    # Milliseconds when idle; the bound leaves room for a loaded host. Without the cut,
    # both took until rank 1's goodbye (8.5 s).
    assert r["abort_seconds"] < 4.0, r
    assert r["shutdown_after_abort"] < 4.0, r


def _abort_during_point_to_point(rank: int, n: int) -> dict:
    import random
    import threading
    import time

    rng = random.Random(7)
    out: dict = {"trials": 0, "raised": 0, "other": []}
    big = torch.ones(1024, 1024).t()  # staged (a contiguous copy) before it is posted
    for _ in range(12):
        sub = dist.new_group([0, 1])
        dist.barrier()
        if rank == 0:
            delay = rng.uniform(0.0, 0.02)
            aborter = threading.Thread(target=lambda: (time.sleep(delay), sub.abort()))
            aborter.start()
            try:
                # Until the abort lands: posts racing a shutdown on another thread must
                # raise, never crash or leave a request posted.
                for i in range(400):
                    dist.isend(big if i % 2 else torch.ones(3), 1, group=sub)
                    dist.irecv(torch.empty(3), 1, group=sub)
            except Exception as e:  # noqa: BLE001 - the type is checked below
                out["raised"] += 1
                if "shut down" not in str(e) and "abort" not in str(e):
                    out["other"].append(f"{type(e).__name__}: {e}")
            aborter.join(30)
            out["trials"] += 1
        dist.barrier()
        if rank == 1:
            sub.shutdown()
    return out


def test_point_to_point_racing_an_abort_raises_and_never_crashes() -> None:
    """Sends and receives posted from one thread while another aborts the group: each
    raises a clear error once the shutdown has begun (the posting thread keeps the
    transport alive; it used to read the group's reference as the shutdown dropped it)."""
    r = run_ranks(_abort_during_point_to_point, 2, timeout=60)[0]
    assert r["trials"] == 12 and r["raised"] == 12, r
    assert not r["other"], r


def _timeout_of_centuries(rank: int, n: int) -> dict:
    import datetime

    out: dict = {}
    # Past about 292 years, now + timeout in nanoseconds overflowed into the past, and
    # every op timed out at once.
    g = dist.new_group(backend="tdx", timeout=datetime.timedelta(days=10**6))
    t = torch.full((1000,), float(rank + 1))
    dist.all_reduce(t, group=g)  # through the shared-memory windows
    out["all_reduce"] = t[0].item()
    x = torch.zeros(4)
    if rank == 0:
        dist.send(torch.ones(4), 1, group=g)
    else:
        dist.recv(x, 0, group=g)
    out["recv"] = x.tolist()
    work = dist.all_reduce(torch.ones(4), group=g, async_op=True)
    out["wait"] = work.wait(timeout=datetime.timedelta(days=10**6))
    dist.destroy_process_group(g)
    return out


def test_a_timeout_of_centuries_waits_rather_than_expiring_at_once() -> None:
    results = run_ranks(_timeout_of_centuries, 2, timeout=60)
    for rank, r in enumerate(results):
        assert r["all_reduce"] == 3.0 and r["wait"] is True, r
        assert r["recv"] == ([1.0] * 4 if rank == 1 else [0.0] * 4), r


def _window_setup_fails(rank: int, n: int) -> dict:
    import datetime
    import os

    out: dict = {}
    sub = dist.new_group([0, 1], timeout=datetime.timedelta(seconds=2))
    if rank == 0:
        # Rank 1 never joins: the window's setup times out waiting for it.
        try:
            dist.all_reduce(torch.ones(8), group=sub)
            out["op"] = "ok"
        except Exception as e:  # noqa: BLE001 - the caller reads the text
            out["op"] = f"{type(e).__name__}: {e}"
        # The group still exists; its window must not.
        out["left"] = sorted(f for f in os.listdir("/dev/shm")
                             if f.startswith(f"tdx_{os.getpid()}_"))
    dist.barrier()
    return out


def test_a_window_whose_setup_failed_is_gone_at_once() -> None:
    """A window's setup that fails part way (a peer that never came) drops the window and
    its name in /dev/shm with the op, not when the group is destroyed."""
    r = run_ranks(_window_setup_fails, 2, timeout=30, env={"TDX_ALGO": "allreduce:shm"})[0]
    assert r["op"].startswith("DistBackendError") and "shared memory" in r["op"], r
    assert r["left"] == [], r


def _nothing(rank: int, n: int) -> None:
    return None


def test_tuning_that_ranks_must_share_is_compared_at_creation() -> None:
    """TDX_SEGMENT_BYTES set on one rank only: the group refuses to start on every rank,
    naming the variable and both values, instead of failing mid-op with a size error."""
    with pytest.raises(RankFailure) as info:
        run_ranks(_nothing, 2, timeout=60, rank_env={1: {"TDX_SEGMENT_BYTES": "131072"}})
    msg = str(info.value)
    assert "TDX_SEGMENT_BYTES is" in msg and "131072" in msg, msg
    assert "same value on every rank" in msg, msg


_ENV_PROBE = """
import os, sys, tempfile, torch, torch.distributed as dist, torchdist_ext
store = dist.FileStore(os.path.join(tempfile.mkdtemp(), "store"), 1)
try:
    dist.init_process_group("tdx", store=store, rank=0, world_size=1)
    t = torch.ones(3)
    dist.all_reduce(t)
    print("ran", t.tolist())
except Exception as e:  # noqa: BLE001 - the message is what is checked
    print(type(e).__name__, e)
"""


def test_a_slot_larger_than_a_window_can_map_is_refused_at_creation() -> None:
    """TDX_SHM_SLOT_BYTES near 2^63: one slot per rank would wrap the window's size, and
    the slots would lie past the mapping. Refused when the group is created, by name."""
    out = subprocess.run([sys.executable, "-c", _ENV_PROBE], capture_output=True, text=True,
                         timeout=120,
                         env={**os.environ, "TDX_SHM_SLOT_BYTES": str(2**63 - 1)})
    assert out.returncode == 0, out.stderr[-2000:]
    assert "TDX_SHM_SLOT_BYTES=9223372036854775807 is more than a slot may hold (2^48" in \
        out.stdout, out.stdout


def test_a_root_check_other_than_0_or_1_is_refused_at_creation() -> None:
    out = subprocess.run([sys.executable, "-c", _ENV_PROBE], capture_output=True, text=True,
                         timeout=120, env={**os.environ, "TDX_ROOT_CHECK": "2"})
    assert out.returncode == 0, out.stderr[-2000:]
    assert "TDX_ROOT_CHECK must be 0 or 1, not 2" in out.stdout, out.stdout


@pytest.mark.parametrize("var, value, ok", [
    ("TDX_FLIGHT_OPS", "100ops", False),  # a number followed by a unit
    ("TDX_SPIN_US", "50us", False),
    ("TDX_SHM", "yes", False),  # no number at all
    ("TDX_SPIN_US", " 50 ", True),  # spaces around a number are fine
])
def test_a_knob_that_is_not_a_whole_number_is_an_error_naming_it(var: str, value: str,
                                                                  ok: bool) -> None:
    """A leading number is not enough: "50us" read as 50 would run with a setting
    nobody asked for. The error names the variable and its value."""
    out = subprocess.run([sys.executable, "-c", _ENV_PROBE], capture_output=True, text=True,
                         timeout=120, env={**os.environ, var: value})
    assert out.returncode == 0, out.stderr[-2000:]
    if ok:
        assert out.stdout.startswith("ran [1.0, 1.0, 1.0]"), out.stdout
    else:
        assert f"{var}={value} is not an integer" in out.stdout, out.stdout


def _one_leaves_early(rank: int, n: int, calls_before: int) -> dict:
    """Rank 0 issues `calls_before` all_reduces and destroys the group (run_ranks' own
    teardown); the others issue one more, which rank 0 never calls."""
    import time

    out: dict = {}
    for _ in range(calls_before):
        t = torch.ones(8)
        dist.all_reduce(t)
        assert t.tolist() == [float(n)] * 8
    if rank == 0:
        return out
    start = time.monotonic()
    try:
        dist.all_reduce(torch.ones(8))
        out["error"] = None
    except Exception as e:  # noqa: BLE001 - the type is checked by the caller
        out["error"] = f"{type(e).__name__}: {e}"
    out["seconds"] = time.monotonic() - start
    return out


@pytest.mark.parametrize("shm", ["1", "0"])
@pytest.mark.parametrize("calls_before", [0, 2])
def test_a_rank_that_destroys_the_group_early_is_named_at_once(shm: str,
                                                               calls_before: int) -> None:
    """A member's goodbye says how many collectives it issued: the ranks waiting in one
    it never called fail at once naming it (they used to wait out its 10 s goodbye wait,
    then see it as lost), and its earlier ops complete as usual."""
    out = run_ranks(_one_leaves_early, 3, timeout=30, args=(calls_before,),
                    env={"TDX_SHM": shm})
    for r in (1, 2):
        err = out[r]["error"]
        assert err and err.startswith("DistBackendError"), out[r]
        assert f"rank 0 shut the group down" in err, err
        assert f"after issuing {calls_before} collective" in err, err
        assert out[r]["seconds"] < 5, out[r]


# UCX's warnings printed where the ranks' logs go (its defaults, pinned against the
# environment's): a test that no such line appears must not pass because none could.
UCX_WARNINGS_SHOWN = {"UCX_LOG_LEVEL": "warn", "UCX_LOG_FILE": ""}


def _refuse_and_leave(rank: int, n: int, log_dir: str) -> str:
    """The root refuses its scatter list and leaves the group (run_ranks' teardown); the
    others fail their scatter and leave too. UCX logs to standard output, the backend to
    standard error: both go to a file."""
    log_to_file(log_dir, rank)
    out = torch.zeros(3)
    try:
        dist.scatter(out, [torch.zeros(3)] if rank == n - 1 else None, src=n - 1)
        return "no error"
    except Exception as e:  # noqa: BLE001 - the type is checked by the caller
        return f"{type(e).__name__}: {e}"


@pytest.mark.parametrize("shm", ["1", "0"])
def test_members_leaving_a_broken_group_leave_no_transport_noise(tmp_path, shm: str) -> None:
    """Every member of a broken group shuts it down without waiting for the others. A
    goodbye sent to a member that had stopped its transport made UCX log "shmat(...)
    failed" on the sender, and one that came after its receive was cancelled an
    "unexpected tag-receive descriptor ... was not matched" on the receiver: raw UCX lines
    beside the backend's own clear errors. Now such a shutdown listens a moment for its
    peers' goodbyes, a member gone without listening (abort()) gets none, and late ones
    are counted, not listed, when the transport stops. A goodbye also fits UCX's
    eager-short size (its reason cut to 64 bytes): a longer one went through a buffer of
    the receiver's mapped on first use, and one that came after a broken receiver's
    moment of listening still made the sender log the failed shmat (1 run in 16)."""
    for attempt in range(2):  # the lines depended on timing: twice cuts the odds of a miss
        logs = tmp_path / f"{shm}-{attempt}"
        logs.mkdir()
        out = run_ranks(_refuse_and_leave, 4, timeout=30, args=(str(logs),),
                        env={"TDX_SHM": shm, **UCX_WARNINGS_SHOWN})
        assert out[3].startswith("ValueError") and "scatter list" in out[3], out[3]
        for r in range(3):
            assert out[r].startswith("DistBackendError") and "rank 3" in out[r], (r, out[r])
        for r in range(4):
            text = (logs / f"rank{r}.log").read_text()
            noise = [line for line in text.splitlines() if re.search(r"UCX\s+(ERROR|WARN)", line)]
            assert not noise, (attempt, r, noise)


def _root_leaves_while_read(rank: int, n: int) -> list[float]:
    """The broadcast's root finishes first and destroys the group at once; the others
    arrive late and must still get its data (the root's goodbye counts the op)."""
    import time

    t = torch.arange(1 << 20, dtype=torch.float32) if rank == 0 else torch.zeros(1 << 20)
    if rank != 0:
        time.sleep(0.5)
    dist.broadcast(t, 0)
    return [float(t[0]), float(t[-1])]


def test_a_goodbye_after_the_last_op_fails_nothing() -> None:
    for shm in ("1", "0"):
        for r, got in enumerate(run_ranks(_root_leaves_while_read, 3, timeout=30,
                                          env={"TDX_SHM": shm})):
            assert got == [0.0, float((1 << 20) - 1)], (shm, r, got)


def _new_group_after_a_death(rank: int, n: int, members: list[int]) -> dict:
    dist.barrier()
    if rank == n - 1:
        os.kill(os.getpid(), 9)
    time.sleep(1.0)  # the default group's watch has seen the death by now
    start = time.monotonic()
    try:
        dist.new_group(members)
        err = "no error"
    except Exception as e:  # noqa: BLE001 - the type is checked by the caller
        err = f"{type(e).__name__}: {e}"
    return {"error": err, "seconds": time.monotonic() - start}


@pytest.mark.parametrize("members, named", [
    ([0, 1, 2], "rank 2 is gone"),
    # Group ranks differ from global ones: both are named.
    ([1, 2], "rank 1 (global rank 2) is gone"),
])
def test_a_group_with_a_member_already_dead_fails_at_once(members: list[int],
                                                          named: str) -> None:
    """new_group waits for its members in the store, whose own timeout is minutes: a
    member that another group already saw die is named at once instead."""
    results = run_ranks(_new_group_after_a_death, 3, timeout=30, args=(members,),
                        may_exit=[2])
    for rank in (0, 1):
        if rank not in members:
            assert results[rank]["error"] == "no error", results[rank]
            continue
        r = results[rank]
        assert r["error"].startswith("DistBackendError") and named in r["error"], (rank, r)
        assert r["seconds"] < 5.0, (rank, r)


def _new_group_with_a_late_member(rank: int, n: int) -> dict:
    dist.barrier()
    if rank == n - 1:
        time.sleep(4.0)  # after the others' 2 s
    start = time.monotonic()
    try:
        dist.new_group(list(range(n)), timeout=datetime.timedelta(seconds=2))
        err = "no error"
    except Exception as e:  # noqa: BLE001 - the type is checked by the caller
        err = f"{type(e).__name__}: {e}"
    return {"error": err, "seconds": time.monotonic() - start}


def test_a_group_whose_member_does_not_come_fails_at_its_timeout() -> None:
    """Not at the store's timeout (minutes): at the new group's own, naming the member
    that did not come and those that did."""
    results = run_ranks(_new_group_with_a_late_member, 3, timeout=30)
    for rank in (0, 1):
        r = results[rank]
        assert r["error"].startswith("DistBackendError"), (rank, r)
        assert "rank 2 did not join the group within 2000 ms" in r["error"], (rank, r)
        assert "done so far: ranks 0, 1; not: rank 2" in r["error"], (rank, r)
        assert 1.5 < r["seconds"] < 5.0, (rank, r)
    # The late member finds the others gone from the set-up, and fails in its turn.
    assert results[2]["error"].startswith("DistBackendError"), results[2]


def _subgroup_loses_a_member(rank: int, n: int) -> dict:
    sub = dist.new_group([1, 2])
    if rank:  # members connected before the death
        dist.all_reduce(torch.ones(4), group=sub)
    dist.barrier()
    if rank == 2:
        os.kill(os.getpid(), 9)
    if rank == 0:
        return {}
    start = time.monotonic()
    try:
        while time.monotonic() - start < 10:
            dist.all_reduce(torch.ones(1 << 16), group=sub)
        return {"error": "no error"}
    except Exception as e:  # noqa: BLE001 - the type is checked by the caller
        return {"error": f"{type(e).__name__}: {e}"}


def test_a_subgroup_error_maps_its_ranks_to_global_ones() -> None:
    """A subgroup's errors name its own ranks (rank 1 of [1, 2] is global rank 2): they
    say which global rank each is."""
    results = run_ranks(_subgroup_loses_a_member, 3, timeout=30, may_exit=[2])
    err = results[1]["error"]
    assert err.startswith("DistBackendError") and "rank 1" in err, err
    assert "its ranks 0..1 are global ranks 1, 2]" in err, err


def _p2p_wait_timeout(rank: int, n: int, batch: bool) -> dict:
    out: dict = {}
    got, big = torch.empty(4), torch.ones(1 << 22)  # 16 MiB: a rendezvous send
    if rank == 0:  # rank 1 posts nothing in time
        if batch:  # several sends: each must not add to the block's time
            work = dist.batch_isend_irecv([dist.P2POp(dist.irecv, got, 1)] + [
                dist.P2POp(dist.isend, big, 1, tag=t) for t in range(4)])[-1]
        else:
            work = dist.isend(big, 1)
        start = time.monotonic()
        try:
            work.wait(timeout=datetime.timedelta(seconds=1))
            out["wait"] = "ok"
        except Exception as e:  # noqa: BLE001 - the caller checks
            out["wait"] = f"{type(e).__name__}: {e}"
        out["seconds"] = time.monotonic() - start
    else:
        time.sleep(4)
    return out


@pytest.mark.parametrize("batch", [False, True])
def test_a_rendezvous_send_ends_at_its_wait_timeout(batch: bool) -> None:
    """UCX cannot cancel a rendezvous send: wait(timeout) must still end at its timeout
    (not a second later), naming the op, alone or in a batch of four with a receive."""
    r = run_ranks(_p2p_wait_timeout, 2, timeout=30, args=(batch,))[0]
    assert r["wait"].startswith("DistBackendError"), r
    assert "timed out: the peer never posted the matching op" in r["wait"], r
    assert "within 1000 ms (the limit of this wait" in r["wait"], r  # the limit that ran out
    # In a batch every op timed out: the error names whichever ended first (the sends end
    # at once, the receive once its cancel has run).
    assert "send (Float[4194304] on cpu) to rank 1" in r["wait"] or (
        batch and "recv (Float[4] on cpu) from rank 1" in r["wait"]), r
    # A wait that overran by a second (the cancel's own wait) would take 2 s; 0.7 s of
    # slack under that keeps a busy host from failing the test.
    assert 0.95 < r["seconds"] < 1.7, r


def _non_positive_timeouts(rank: int, n: int) -> list[str]:
    errors = []
    for seconds in (0, -1):
        try:
            dist.new_group(timeout=datetime.timedelta(seconds=seconds))
            errors.append("no error")
        except ValueError as e:
            errors.append(str(e))
    try:
        dist.set_timeout(datetime.timedelta(0))
        errors.append("no error")
    except (ValueError, RuntimeError) as e:
        errors.append(str(e))
    dist.all_reduce(torch.ones(4))  # the group itself is untouched
    return errors


def test_a_timeout_that_is_not_positive_is_refused() -> None:
    """A zero or negative timeout would fail ops at random (by which rank came first):
    refused where it is set, naming the group."""
    for errors in run_ranks(_non_positive_timeouts, 2, timeout=60):
        assert len(errors) == 3, errors
        for e in errors:
            assert "the timeout must be positive" in e and "pg=" in e, errors


def _p2p_through_futures(rank: int, n: int) -> dict:
    """Rank 0 waits only through futures: on a receive and a rendezvous-sized send that
    rank 1 never matches, on a callback chained to such a receive, and on a receive
    posted 2 s before it asks for the future, which rank 1 matches 3.5 s after the post.
    Each case on a group of its own with a 3 s timeout; rank 1 stays alive throughout."""
    out: dict = {}
    timeout = datetime.timedelta(seconds=3)
    groups = [dist.new_group(backend="tdx", timeout=timeout) for _ in range(4)]
    if rank == 1:
        time.sleep(3.5)
        dist.send(torch.full((2,), 7.0), 0, group=groups[3])
        time.sleep(6)  # alive: rank 0 must not learn of anything from an exit
        dist.barrier()
        return out

    def attempt(name: str, call) -> None:
        start = time.monotonic()
        try:
            out[name] = call()
        except Exception as e:  # noqa: BLE001 - the caller checks the type
            out[name] = f"{type(e).__name__}: {e}"
        out[name + " seconds"] = time.monotonic() - start

    start = time.monotonic()
    late = dist.irecv(torch.zeros(2), 1, group=groups[3])
    recv = dist.irecv(torch.zeros(2), 1, group=groups[0])
    attempt("irecv", lambda: recv.get_future().wait())
    send = dist.isend(torch.zeros(1 << 20), 1, group=groups[1])
    attempt("isend", lambda: send.get_future().wait())
    chained = dist.irecv(torch.zeros(2), 1, group=groups[2])
    attempt("then", lambda: chained.get_future().then(lambda f: f.value()).wait())
    # The clock starts at get_future(), as at wait(): not at the post, 2 s before here.
    time.sleep(max(0.0, 2.0 - (time.monotonic() - start)))
    attempt("late", lambda: late.get_future().wait()[0].tolist())
    dist.barrier()
    return out


def test_point_to_point_waited_through_its_future_ends_at_the_timeout() -> None:
    """A point-to-point op has no deadline until someone waits; one waited for through
    its future (as comm hooks and pipeline schedules do) used to wait for as long as its
    peer lived. Now get_future() starts the group timeout as wait() does."""
    r = run_ranks(_p2p_through_futures, 2, timeout=60)[0]
    for name in ("irecv", "isend", "then"):
        # torch wraps an error a callback met in a RuntimeError that quotes it.
        assert "DistBackendError" in str(r[name]), (name, r)
        assert "timed out" in r[name] and "rank 1" in r[name], (name, r)
        assert 2.5 < r[name + " seconds"] < 5.0, (name, r)
    assert r["late"] == [7.0, 7.0], r

"""Mismatch detection (TDX_DEBUG=DETAIL): ranks that call different collectives, dtypes,
shapes, roots or reduce ops, or pinned different algorithms, get an error naming both
calls, not a hang or corruption."""

from __future__ import annotations

import time

import pytest
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


def _barrier_after(g, out: dict, name: str) -> None:
    """The group's next op (a barrier) after the case `name`: its outcome and how long it
    took, under "`name` after" and "`name` seconds"; then the group is destroyed."""
    start = time.monotonic()
    try:
        dist.barrier(group=g)
        out[name + " after"] = "no error"
    except Exception as e:  # noqa: BLE001 - the type is checked by the caller
        out[name + " after"] = f"{type(e).__name__}: {e}"
    out[name + " seconds"] = time.monotonic() - start
    dist.destroy_process_group(g)


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
        # Each message names both ranks and both sides of what differed.
        sides = {"shape": ("numel=10", "numel=20"), "dtype": ("dtype=Float", "dtype=Double"),
                 "root": ("root=0", "root=1"), "redop": ("op=SUM", "op=MAX"),
                 "op": ("all_reduce", "broadcast"),
                 "algorithm": ("allreduce:ring", "allreduce:rhd")}
        for name, (first, second) in sides.items():
            msg = res[name]
            assert msg.startswith("DistBackendError") and "collective mismatch" in msg, (rank, name, msg)
            assert "rank 0" in msg and "rank 1" in msg, (rank, name, msg)
            assert first in msg and second in msg, (rank, name, msg)


def _p2p(rank: int, n: int) -> dict:
    """Rank 0 sends, rank 1 receives into a tensor that differs in dtype or shape only
    (the same byte count: a length check alone cannot see it), or in size; each case on a
    group of its own, which it ends on both ranks. Then matching messages on the default
    group."""
    cases = {
        "dtype": (torch.ones(10), torch.empty(10, dtype=torch.int32)),
        "shape": (torch.ones(2, 5), torch.empty(10)),
        "size": (torch.ones(10), torch.empty(20)),
    }
    out = {}
    for tag, (name, (sent, recv_into)) in enumerate(cases.items()):
        g = dist.new_group(backend="tdx")
        try:
            if rank == 0:
                dist.send(sent, 1, tag=tag, group=g)
            elif name == "shape":  # from any source: the error still names the sender
                dist.recv(recv_into, tag=tag, group=g)
            else:
                dist.recv(recv_into, 0, tag=tag, group=g)
            out[name] = "no error"
        except Exception as e:  # noqa: BLE001 - the type is checked by the caller
            out[name] = f"{type(e).__name__}: {e}"
        # The sender, whose send completed, hears of it too: its next op on the group
        # (already running or not) raises, and so does the receiver's.
        _barrier_after(g, out, name)
    # Matching messages still arrive intact: empty, non-contiguous, batched.
    ok = []
    if rank == 0:
        dist.send(torch.empty(0), 1)
        dist.send(torch.arange(12.0).reshape(3, 4), 1)
        reqs = dist.batch_isend_irecv([dist.P2POp(dist.isend, torch.full((5,), 7), 1)])
        for r in reqs:
            r.wait()
    else:
        t = torch.empty(0)
        dist.recv(t, 0)
        ok.append(t.numel() == 0)
        t = torch.empty(4, 3).t()  # non-contiguous, shape (3, 4)
        dist.recv(t, 0)
        ok.append(torch.equal(t, torch.arange(12.0).reshape(3, 4)))
        t = torch.empty(5, dtype=torch.int64)
        for r in dist.batch_isend_irecv([dist.P2POp(dist.irecv, t, 0)]):
            r.wait()
        ok.append(torch.equal(t, torch.full((5,), 7)))
    out["ok"] = all(ok)
    return out


def test_point_to_point_mismatch_names_both_sides() -> None:
    results = run_ranks(_p2p, 2, timeout=60, env={"TDX_DEBUG": "DETAIL"})
    assert all(r["ok"] for r in results), results
    assert all(results[0][k] == "no error" for k in ("dtype", "shape", "size")), results[0]
    recv = results[1]
    for name, mine, theirs in (("dtype", "Int[10]", "Float[10]"),
                               ("shape", "Float[10]", "Float[2, 5]"),
                               ("size", "Float[20]", "Float[10]")):
        msg = recv[name]
        assert msg.startswith("DistBackendError") and "point-to-point mismatch" in msg, msg
        assert f"rank 0 sent {theirs}" in msg and f"this rank (1) receives {mine}" in msg, msg
        # Both ranks' next op on the group names both calls, and neither waits for it.
        for rank, r in enumerate(results):
            after = r[name + " after"]
            assert after.startswith("DistBackendError"), (rank, name, after)
            assert f"rank 0 sent {theirs} to rank 1" in after, (rank, name, after)
            assert f"expected {mine}" in after, (rank, name, after)
            assert r[name + " seconds"] < 10, (rank, name, r[name + " seconds"])


def _p2p_failures_told(rank: int, n: int) -> dict:
    """Without DETAIL: a receive that gets more bytes than it posted, one that gets fewer,
    and one that times out break the group on the receiver, which tells every member, so
    the sender's next op (a barrier) fails at once naming the receiver's op, not at the
    group timeout (60 s here)."""
    import datetime

    out: dict = {}
    # (name, what rank 0 sends, what rank 1 posts, rank 1 receives from any source, who
    # waits 0.5 s first: an any-source message too long may arrive before the receive is
    # posted, or after it, and each way UCX reports it on its own path)
    cases = (("longer", torch.ones(20), torch.empty(10), False, None),
             ("shorter", torch.ones(10), torch.empty(20), False, None),
             ("timeout", None, torch.empty(10), False, None),
             ("any longer, sent first", torch.ones(20), torch.empty(10), True, 1),
             ("any longer, posted first", torch.ones(20), torch.empty(10), True, 0))
    for name, sent, posted, any_source, waits in cases:
        g = dist.new_group(backend="tdx")
        dist.barrier(group=g)
        if waits == rank:
            time.sleep(0.5)
        try:
            if rank == 0:
                if sent is not None:
                    dist.send(sent, 1, group=g)
            else:
                work = dist.irecv(posted, None if any_source else 0, group=g)
                # 1 s for the receive that is to time out; the others end when the
                # message arrives, which a busy host may delay past 1 s (rank 0 sleeps
                # 0.5 s first in one case)
                wait_s = 1 if sent is None else 10
                work.wait(timeout=datetime.timedelta(seconds=wait_s))
            out[name] = "no error"
        except Exception as e:  # noqa: BLE001 - the type is checked by the caller
            out[name] = f"{type(e).__name__}: {e}"
        _barrier_after(g, out, name)
    return out


def test_point_to_point_failures_reach_the_other_ranks_without_detail() -> None:
    results = run_ranks(_p2p_failures_told, 2, timeout=60)
    for name in ("longer", "shorter", "timeout", "any longer, sent first",
                 "any longer, posted first"):
        assert results[1][name].startswith("DistBackendError"), (name, results[1])
        if name == "longer":
            assert "this rank's receive holds 10 elements (40 bytes)" in results[1][name], \
                results[1]
        if name == "shorter":
            assert "received 10 elements where 20 were expected (40 bytes where 80" in \
                results[1][name], results[1]
        any_source = name.startswith("any")
        if any_source:  # the receive names no rank: its error names the sender
            assert "the message came from rank 0" in results[1][name], (name, results[1])
        for rank, r in enumerate(results):
            after = r[name + " after"]
            assert after.startswith("DistBackendError"), (rank, name, after)
            assert "rank 1 gave up on the group" in after or rank == 1, (rank, name, after)
            if any_source:
                assert "the message came from rank 0" in after, (rank, name, after)
            else:
                assert ") from rank 0 tag 0" in after, (rank, name, after)
            assert r[name + " seconds"] < 10, (rank, name, r[name + " seconds"])


def _sender_in_flight(rank: int, n: int) -> dict:
    """Rank 0 posts a small send, then a rendezvous-sized one that rank 1 never receives;
    rank 1 receives the first into a tensor of another dtype. The mismatch notice must end
    rank 0's second send at once, not at the group timeout."""
    out: dict = {}
    start = time.monotonic()
    if rank == 0:
        first = dist.isend(torch.ones(10), 1, tag=1)
        second = dist.isend(torch.ones(4 << 20), 1, tag=2)  # 16 MiB: UCX's rendezvous
        for name, work in (("first", first), ("second", second)):
            try:
                work.wait()
                out[name] = "no error"
            except Exception as e:  # noqa: BLE001 - the type is checked by the caller
                out[name] = f"{type(e).__name__}: {e}"
    else:
        try:
            dist.recv(torch.empty(10, dtype=torch.int32), 0, tag=1)
            out["recv"] = "no error"
        except Exception as e:  # noqa: BLE001 - the type is checked by the caller
            out["recv"] = f"{type(e).__name__}: {e}"
    out["seconds"] = time.monotonic() - start
    return out


def test_point_to_point_mismatch_ends_the_senders_sends_in_flight() -> None:
    results = run_ranks(_sender_in_flight, 2, timeout=60, env={"TDX_DEBUG": "DETAIL"})
    sender, receiver = results
    assert "point-to-point mismatch" in receiver["recv"], receiver
    assert sender["first"] == "no error", sender
    assert sender["second"].startswith("DistBackendError"), sender
    assert "point-to-point mismatch: rank 0 sent Float[10] to rank 1" in sender["second"], sender
    assert sender["seconds"] < 10 and receiver["seconds"] < 10, results


def _one_sided_mismatches(rank: int, n: int) -> dict:
    """Without DETAIL, mismatches that only one rank's shared-memory op can see."""
    out: dict = {}

    def attempt(name: str, call) -> None:
        start = time.monotonic()
        try:
            call()
            out[name] = "no error"
        except Exception as e:  # noqa: BLE001 - the caller checks
            out[name] = f"{type(e).__name__}: {e}"
        out[name + " s"] = time.monotonic() - start

    # Split sizes that disagree: only rank 1, which expects 3 rows from rank 0 that
    # sends 2, can tell; rank 0 must not wait out the timeout for it.
    g = dist.new_group(backend="tdx")
    ins, outs = ([1, 2], [1, 1]) if rank == 0 else ([1, 1], [3, 1])
    attempt("all_to_all", lambda: dist.all_to_all_single(
        torch.zeros(sum(outs)), torch.zeros(sum(ins)), outs, ins, group=g))
    # A broadcast of 4 elements from root 0 into 5 on rank 1: the root's op is right (it
    # only sends) and may end; its next op must then fail at once, naming rank 1.
    g2 = dist.new_group(backend="tdx")
    attempt("broadcast", lambda: dist.broadcast(torch.zeros(4 if rank == 0 else 5), 0, group=g2))
    attempt("next", lambda: dist.all_reduce(torch.ones(1), group=g2))
    # The other way round, 5 elements into 4: the message is longer than rank 1's buffer.
    g3 = dist.new_group(backend="tdx")
    attempt("longer", lambda: dist.broadcast(torch.zeros(5 if rank == 0 else 4), 0, group=g3))
    if rank == 1:
        time.sleep(6)  # alive: the peer cannot learn of the failure from an exit
    dist.barrier()
    return out


@pytest.mark.parametrize("shm,algo", [("1", ""), ("0", ""), ("1", "allreduce:ring")],
                         ids=["windows", "messages", "window-then-message"])
def test_one_sided_mismatch_fails_the_other_ranks_at_once(shm: str, algo: str) -> None:
    """Through the windows (a failure notice in shared memory), through messages (a
    notice sent to every member, as across hosts), and from a failed window op to a
    message op (which no window notice reaches: the failing rank tells its peers)."""
    env = {"TDX_SHM": shm} | ({"TDX_ALGO": algo} if algo else {})
    r0, r1 = run_ranks(_one_sided_mismatches, 2, timeout=30, env=env)
    if shm == "1":
        assert "split sizes do not match" in r1["all_to_all"], r1
        assert "rank 1 gave up" in r0["all_to_all"] and "split sizes" in r0["all_to_all"], r0
        assert "collective mismatch" in r1["broadcast"], r1
        assert "collective mismatch" in r1["longer"], r1
    else:
        # Rank 0's own receives fit: it may finish before the notice, and never waits.
        # Sizes are told in elements as the caller counts them, and in bytes.
        assert "sent 2 elements where 3 were expected (8 bytes where 12" in r1["all_to_all"], r1
        assert r0["all_to_all"] == "no error" or "rank 1 gave up" in r0["all_to_all"], r0
        assert "sent 4 elements where 5 were expected (16 bytes where 20" in r1["broadcast"], r1
        assert "sent more than the 4 elements (16 bytes) this rank expected" in r1["longer"], r1
    assert r0["all_to_all s"] < 3.0, r0
    # The root only sends, so its broadcast is right and may end before rank 1 looks;
    # if rank 1's call is already in the window when the root checks the ranks that have
    # arrived, the root sees the mismatch too. Either way its next op fails at once.
    if r0["broadcast"] == "no error":
        assert "rank 1 gave up" in r0["next"], r0
    else:
        assert shm == "1" and "collective mismatch: rank 1 called" in r0["broadcast"], r0
        assert "unusable after an earlier failure" in r0["next"], r0
    assert r0["next s"] < 3.0, r0


def _record(out: dict, name: str, call) -> None:
    """Runs `call()`: its outcome under `name` ("no error", or the exception's type and
    text) and its time under "`name` seconds"."""
    start = time.monotonic()
    try:
        call()
        out[name] = "no error"
    except Exception as e:  # noqa: BLE001 - the type is checked by the caller
        out[name] = f"{type(e).__name__}: {e}"
    out[name + " seconds"] = time.monotonic() - start


def _each_on_a_group_of_its_own(n: int, cases: dict, first: bool) -> dict:
    """Runs each case, ``case(first, group)``, on a new group that it then destroys: the
    outcome under the case's name, its time under "<name> seconds"; then, under "ok",
    whether an all_reduce on the default group (untouched) still sums right."""
    out: dict = {}
    for name, call in cases.items():
        g = dist.new_group(backend="tdx")
        _record(out, name, lambda: call(first, g))
        dist.destroy_process_group(g)
    t = torch.ones(8)
    dist.all_reduce(t)  # the default group is untouched
    out["ok"] = t.tolist() == [float(n)] * 8
    return out


def _coalesced_pair(g, a: torch.Tensor, b: torch.Tensor) -> None:
    with dist._coalescing_manager(group=g, async_ops=True) as cm:
        dist.all_reduce(a, group=g)
        dist.all_reduce(b, group=g)
    cm.wait()


def _same_bytes_other_reduction(rank: int, n: int) -> dict:
    """Without DETAIL, ranks that reduce the same bytes as different dtypes, or with
    different reduce ops, in the shared-memory windows: each case on a group of its own.
    Rank 0 calls the first form, the others the second."""
    cases = {
        "dtype": lambda first, g: dist.all_reduce(
            torch.ones(64) if first else torch.ones(64, dtype=torch.int32), group=g),
        "op": lambda first, g: dist.all_reduce(
            torch.ones(64), op=dist.ReduceOp.SUM if first else dist.ReduceOp.MAX, group=g),
        # float32 against float64 of the same byte count: the chunks a half holds differ
        # in bytes, so without the check rank 0 took part of the next op's data as its own.
        "reduce_scatter": lambda first, g: dist.reduce_scatter_tensor(
            torch.empty(174762) if first else torch.empty(87381, dtype=torch.float64),
            torch.ones(174762 * n) if first else torch.ones(87381 * n, dtype=torch.float64),
            group=g),
        # Entry by entry: the first entries agree, the second does not.
        "coalesced": lambda first, g: _coalesced_pair(
            g, torch.ones(64, dtype=torch.int64),
            torch.ones(64) if first else torch.ones(64, dtype=torch.int32)),
    }
    return _each_on_a_group_of_its_own(n, cases, rank == 0)


# The calls of _same_bytes_other_reduction's cases, as errors name them: rank 0's, then
# the others'.
_OTHER_REDUCTION_CALLS = {"dtype": ("float32 SUM", "int32 SUM"),
                          "op": ("float32 SUM", "float32 MAX"),
                          "reduce_scatter": ("float32 SUM", "float64 SUM"),
                          "coalesced": ("float32 SUM", "int32 SUM")}


@pytest.mark.parametrize("allreduce", ["shm", "shm_direct"])
def test_windows_refuse_the_same_bytes_reduced_as_another_dtype_or_op(allreduce: str) -> None:
    results = run_ranks(_same_bytes_other_reduction, 3, timeout=60,
                        env={"TDX_ALGO": f"allreduce:{allreduce},reduce_scatter:shm"})
    for rank, r in enumerate(results):
        assert r["ok"], r
        for name, (first, second) in _OTHER_REDUCTION_CALLS.items():
            msg = r[name]
            assert msg.startswith("DistBackendError") and "collective mismatch" in msg, (rank, name, msg)
            assert first in msg or rank != 0, (rank, name, msg)
            assert second in msg, (rank, name, msg)
            assert r[name + " seconds"] < 10, (rank, name, r)


def _other_reduction_on_messages(rank: int, n: int) -> dict:
    """The cases of _same_bytes_other_reduction on the message path, plus a reduce whose
    root sums where the others take the maximum; then ops that agree: a coalesced
    all_reduce of two dtypes, and 300 broadcasts from one root, which only sends and may
    run ahead."""
    out = _same_bytes_other_reduction(rank, n)
    g = dist.new_group(backend="tdx")
    _record(out, "reduce", lambda: dist.reduce(
        torch.ones(64), 0, op=dist.ReduceOp.SUM if rank == 0 else dist.ReduceOp.MAX, group=g))
    dist.destroy_process_group(g)
    a, b = torch.full((100,), 1.5), torch.full((100,), rank, dtype=torch.int64)
    _coalesced_pair(None, a, b)
    out["agree coalesced"] = (a.tolist() == [1.5 * n] * 100 and
                              b.tolist() == [n * (n - 1) // 2] * 100)
    got = []
    for i in range(300):
        t = torch.full((16,), float(i if rank == 0 else -1))
        dist.broadcast(t, 0)
        got.append(t[0].item())
    out["agree broadcasts"] = got == [float(i) for i in range(300)]
    return out


@pytest.mark.parametrize("allreduce", ["ring", "rhd", "direct"])
def test_ranks_that_reduce_as_another_dtype_or_op_fail_on_the_message_path(allreduce: str) -> None:
    """Without DETAIL, on messages (TDX_SHM=0, as across hosts): each message's tag
    carries 4 bits of its step's dtype, reduce op and root, so a rank never reduces a
    peer's bytes as another dtype or with another op. Before, SUM against MAX gave a
    half-summed, half-maxed result and no error. The ranks that disagree raise in about
    0.2 s (the stalled wait's second look) instead of returning it."""
    results = run_ranks(_other_reduction_on_messages, 3, timeout=90,
                        env={"TDX_SHM": "0", "TDX_ALGO": f"allreduce:{allreduce}"})
    for rank, r in enumerate(results):
        assert r["ok"] and r["agree coalesced"] and r["agree broadcasts"], (rank, r)
        for name, (first, second) in _OTHER_REDUCTION_CALLS.items():
            msg = r[name]
            assert msg.startswith("DistBackendError") and "collective mismatch" in msg, (rank, name, msg)
            assert "another dtype, reduce op or root" in msg, (rank, name, msg)
            # A rank names its own call, or the call of the rank whose error ended its op.
            assert first in msg or second in msg, (rank, name, msg)
            assert r[name + " seconds"] < 5, (rank, name, r)
    # The reduce's root takes the messages; a rank that only sends may finish first.
    root = results[0]["reduce"]
    assert "collective mismatch" in root and "float32 SUM" in root, root
    assert results[0]["reduce seconds"] < 5, results[0]



def _roots_disagree_on_messages(rank: int, n: int) -> dict:
    """Without DETAIL, on messages, 3 ranks: rank 0 names one root and ranks 1 and 2
    another, each case on a group of its own with a 3 s timeout; then a fresh group."""
    import datetime

    cases = {
        # Rank 0 believes it is the root alone: it only sends.
        "broadcast": lambda g: dist.broadcast(torch.full((16,), float(rank)),
                                              0 if rank == 0 else 1, group=g),
        # Rank 0, the others' root, believes rank 1 is: nobody receives at all.
        "reduce": lambda g: dist.reduce(torch.ones(16), 1 if rank == 0 else 0, group=g),
        "gather": lambda g: dist.gather(torch.ones(16),
                                        [torch.empty(16) for _ in range(n)]
                                        if rank == (1 if rank == 0 else 0) else None,
                                        1 if rank == 0 else 0, group=g),
        "scatter": lambda g: dist.scatter(torch.empty(16),
                                          [torch.full((16,), float(r)) for r in range(n)]
                                          if rank == (0 if rank == 0 else 1) else None,
                                          0 if rank == 0 else 1, group=g),
    }
    out: dict = {}
    for name, call in cases.items():
        g = dist.new_group(backend="tdx", timeout=datetime.timedelta(seconds=3))
        _record(out, name, lambda: call(g))
        dist.destroy_process_group(g)
    g = dist.new_group(backend="tdx")
    t = torch.full((4,), float(rank))
    dist.broadcast(t, 2, group=g)
    out["ok"] = t.tolist() == [2.0] * 4
    return out


def test_ranks_that_disagree_on_the_root_fail_on_the_message_path() -> None:
    """Rooted ops on messages send with acknowledgement (TDX_ROOT_CHECK=1, the default),
    so no send completes unless a receive took it. Before, rank 0 returned its own data
    from the broadcast, nobody received anything in the reduce or the gather, every rank
    returned without an error, and the messages left behind were taken by the op 2048
    later of the same kind and root, which then returned them as its data. Now every rank
    whose call is not the others' raises: at once where two ranks each send the other
    their message, else at the group timeout (3 s) or at the notice of a rank that
    raised. Scatter's rank 2 takes its chunk from the root it named and may return."""
    results = run_ranks(_roots_disagree_on_messages, 3, timeout=120, env={"TDX_SHM": "0"})
    for rank, r in enumerate(results):
        assert r["ok"], (rank, r)
        for name in ("broadcast", "reduce", "gather", "scatter"):
            if name == "scatter" and rank == 2 and r[name] == "no error":
                continue
            assert r[name].startswith("DistBackendError"), (rank, name, r[name])
            assert r[name + " seconds"] < 3 + 5, (rank, name, r)
    # Where two ranks each send the other their message, the check names the root.
    texts = [r[name] for r in results for name in ("reduce", "gather")]
    assert any("with another root than this rank" in t for t in texts), texts


def _alone_with_another_root(rank: int, n: int) -> dict:
    """Without DETAIL, on messages, 3 ranks, a 60 s group timeout: rank 0 alone names
    itself the root of a broadcast, then of a scatter, each on a group of its own."""
    import datetime

    root = 0 if rank == 0 else 1
    cases = {
        "broadcast": lambda g: dist.broadcast(torch.full((16,), float(rank)), root, group=g),
        "scatter": lambda g: dist.scatter(torch.empty(16),
                                          [torch.full((16,), float(r)) for r in range(n)]
                                          if rank == root else None, root, group=g),
    }
    out: dict = {}
    for name, call in cases.items():
        g = dist.new_group(backend="tdx", timeout=datetime.timedelta(seconds=60))
        _record(out, name, lambda: call(g))
        dist.destroy_process_group(g)
    return out


def test_a_rank_alone_with_another_root_fails_long_before_the_timeout() -> None:
    """A broadcast root that alone names itself waits on a send nobody takes, and the
    ranks that wait for it wait on a send of their own to it or on their true root, which
    waits on it: no two ranks each send the other their message. The stalled ranks'
    announcements in the store carry the root they named, so one of them sees the other
    root within seconds (before, every rank waited out the group timeout, 60 s here)."""
    results = run_ranks(_alone_with_another_root, 3, timeout=150, env={"TDX_SHM": "0"})
    for name in ("broadcast", "scatter"):
        texts = [r[name] for r in results]
        for rank, r in enumerate(results):
            if name == "scatter" and rank == 2 and r[name] == "no error":
                continue  # it took its chunk from the root it named, which then failed
            assert r[name].startswith("DistBackendError"), (rank, name, r[name])
            assert r[name + " seconds"] < 15, (rank, name, r)
        # Scatter's root and a rank that believes it is one each send the other their
        # message: that check names the root first. A broadcast needs the store's.
        assert any(f"runs this op ({name}) with root" in t and "where this rank names root"
                   in t or name == "scatter" and "with another root than this rank" in t
                   for t in texts), texts


# (name, op, the rank that alone names root 16 where the others name root 0, the
# broadcast algorithm pinned)
_SIXTEEN_APART = (("broadcast, root 16 alone", "broadcast", 16, "tree"),
                  ("broadcast, leaf names 16", "broadcast", 0, "tree"),
                  ("chain broadcast, root 16 alone", "broadcast", 16, "chain"),
                  ("scatter, root 16 alone", "scatter", 16, "auto"),
                  ("scatter, leaf names 16", "scatter", 5, "auto"))


def _roots_sixteen_apart(rank: int, n: int) -> dict:
    """Without DETAIL, on messages, 18 ranks: one rank names root 16 where the others name
    root 0. The tags' 4-bit code of roots 0 and 16 is the same, so the tags alone cannot
    tell the two calls apart. Each case on a group of its own; the value a rank ended
    with is kept."""
    import datetime

    out: dict = {}
    for name, op, odd, algorithm in _SIXTEEN_APART:
        root = 16 if rank == odd else 0
        torchdist_ext.set_algorithm("broadcast", algorithm)
        g = dist.new_group(backend="tdx", timeout=datetime.timedelta(seconds=60))
        got = torch.full((16,), -1.0)
        if op == "broadcast":
            got.fill_(float(rank))
            _record(out, name, lambda: dist.broadcast(got, root, group=g))
        else:
            parts = ([torch.full((16,), float(100 * rank + i)) for i in range(n)]
                     if rank == root else None)
            _record(out, name, lambda: dist.scatter(got, parts, root, group=g))
        out[name + " value"] = got[0].item()
        dist.destroy_process_group(g)
    torchdist_ext.set_algorithm("broadcast", "auto")
    return out


def test_ranks_whose_roots_are_16_apart_never_return_the_other_roots_data() -> None:
    """Every rank either returns the true root's data (root 0's: a broadcast's 0, a
    scatter's chunk i for rank i), which ranks fed by root 0 alone may do, or raises
    within seconds; some rank names the mismatch. The odd rank's first message goes
    with acknowledgement and no rank takes it (a tree's goes to a rank whose parent
    under root 0 is another rank, a chain's carries another step), so the odd rank
    stalls and the store's announcements, which carry the whole root, show the two
    roots."""
    results = run_ranks(_roots_sixteen_apart, 18, timeout=240, env={"TDX_SHM": "0"})
    for name, op, odd, _ in _SIXTEEN_APART:
        texts = [r[name] for r in results]
        for rank, r in enumerate(results):
            if r[name] == "no error":
                assert rank != odd, (name, rank, r)
                expected = 0.0 if op == "broadcast" else float(rank)
                assert r[name + " value"] == expected, (name, rank, r[name + " value"])
            else:
                assert r[name].startswith("DistBackendError"), (name, rank, r[name])
            assert r[name + " seconds"] < 15, (name, rank, r[name + " seconds"])
        assert any("collective mismatch" in t for t in texts), (name, texts)


def _roots_disagree(rank: int, n: int) -> dict:
    """Without DETAIL, in the windows: both ranks believe they are the root of a
    broadcast or a scatter, or both believe the other is the root of a gather or a
    direct reduce. No rank of those roles waits for the other, so each used to finish
    with its own data and no error. Each case on a group of its own; then a barrier."""
    other = 1 - rank
    cases = {
        "broadcast": lambda g: dist.broadcast(torch.full((100,), float(rank)), rank, group=g),
        "scatter": lambda g: dist.scatter(torch.empty(100), [torch.ones(100)] * n, rank,
                                          group=g),
        "gather": lambda g: dist.gather(torch.ones(100), None, other, group=g),
        "reduce": lambda g: dist.reduce(torch.ones(100), other, group=g),
    }
    out: dict = {}
    for name, call in cases.items():
        g = dist.new_group(backend="tdx")
        errors = []
        start = time.monotonic()
        for step in (lambda: call(g), lambda: dist.barrier(group=g)):
            try:
                step()
            except Exception as e:  # noqa: BLE001 - the caller reads the text
                errors.append(f"{type(e).__name__}: {e}")
                break
        out[name] = errors
        out[name + " seconds"] = time.monotonic() - start
        dist.destroy_process_group(g)
    return out


def test_windows_catch_ranks_that_disagree_on_the_root_where_none_waits() -> None:
    results = run_ranks(_roots_disagree, 2, timeout=60, env={
        "TDX_ALGO": "broadcast:shm,scatter:shm,gather:shm,reduce:shm_direct"})
    for name in ("broadcast", "scatter", "gather", "reduce"):
        # Every rank fails, in the op or at its next one, within seconds; at least one
        # names the mismatch and both roots.
        assert all(r[name] for r in results), (name, results)
        assert all(r[name + " seconds"] < 10 for r in results), (name, results)
        texts = [r[name][0] for r in results]
        assert any("collective mismatch" in t and "root 0" in t and "root 1" in t
                   for t in texts), (name, texts)


def _different_collectives(rank: int, n: int) -> dict:
    """Without DETAIL, rank 0 calls one collective and rank 1 another as the same op of a
    group: the pairs move the same bytes, so only the op kind in the tags tells them
    apart. Each pair on a group of its own, which it ends."""
    cases = {
        "all_reduce/broadcast": lambda first, g: (
            dist.all_reduce(torch.ones(10), group=g) if first
            else dist.broadcast(torch.ones(10), src=0, group=g)),
        "all_gather/all_to_all": lambda first, g: (
            dist.all_gather_into_tensor(torch.empty(20), torch.ones(10), group=g) if first
            else dist.all_to_all_single(torch.empty(20), torch.ones(20), group=g)),
        "reduce_scatter/all_reduce": lambda first, g: (
            dist.reduce_scatter_tensor(torch.empty(10), torch.ones(20), group=g) if first
            else dist.all_reduce(torch.ones(20), group=g)),
    }
    return _each_on_a_group_of_its_own(n, cases, rank == 0)


def test_different_collectives_fail_at_once_on_the_message_path_without_detail() -> None:
    """The message path (TDX_SHM=0, as across hosts) without fingerprint checks: neither
    rank may take the other's bytes as its own op's, and each learns of the mismatch in
    well under the group timeout (60 s here), with both collectives named."""
    results = run_ranks(_different_collectives, 2, timeout=60, env={"TDX_SHM": "0"})
    for rank, r in enumerate(results):
        assert r["ok"], r
        for name in ("all_reduce/broadcast", "all_gather/all_to_all",
                     "reduce_scatter/all_reduce"):
            msg = r[name]
            first, second = name.split("/")
            assert msg.startswith("DistBackendError"), (rank, name, msg)
            assert "collective mismatch" in msg, (rank, name, msg)
            assert first in msg and second in msg, (rank, name, msg)
            assert r[name + " seconds"] < 5.0, (rank, name, r[name + " seconds"])


def _pinned_apart(rank: int, n: int, window_first: bool) -> dict:
    """Without DETAIL, on one host: rank 0 pins a message algorithm where the others run
    the shared-memory one auto picks. Each case on a group of its own, whose window a
    barrier made first (`window_first`) or the case's op makes; the pin goes back to
    auto after each."""
    import datetime

    cases = {
        "allreduce": ("ring", lambda g: dist.all_reduce(torch.ones(1000), group=g)),
        "broadcast": ("tree", lambda g: dist.broadcast(torch.ones(1000), 0, group=g)),
        "allgather": ("ring", lambda g: dist.all_gather_into_tensor(
            torch.empty(1000 * n), torch.ones(1000), group=g)),
    }
    out: dict = {}
    for name, (algo, call) in cases.items():
        g = dist.new_group(backend="tdx", timeout=datetime.timedelta(seconds=60))
        if window_first:
            dist.barrier(group=g)
        if rank == 0:
            torchdist_ext.set_algorithm(name, algo)
        _record(out, name, lambda: call(g))
        torchdist_ext.set_algorithm(name, "auto")
        dist.destroy_process_group(g)
    return out


@pytest.mark.parametrize("window_first", [True, False], ids=["window-made", "first-op"])
def test_ranks_that_pin_different_algorithms_fail_at_once_on_one_host(window_first: bool) -> None:
    """One rank on messages, the others in the window: each waited out the group timeout
    for the other, and the window ranks' error said rank 0 had not reached the op. Now a
    stalled wait reads the algorithm each rank announced for the op: in the window, or,
    while the window is being made, in the store; and a rank that sets the window up
    notices a message for the op from a rank that went to messages instead."""
    results = run_ranks(_pinned_apart, 3, timeout=60, args=(window_first,))
    for name, algo in (("allreduce", "ring"), ("broadcast", "tree"), ("allgather", "ring")):
        for rank, r in enumerate(results):
            msg = r[name]
            # Rank 0's broadcast only sends, and may finish before anyone notices.
            if rank == 0 and name == "broadcast" and msg == "no error":
                continue
            assert msg.startswith("DistBackendError"), (rank, name, msg)
            assert "collective mismatch" in msg, (rank, name, msg)
            call = {"allreduce": "all_reduce", "allgather": "all_gather"}.get(name, name)
            if not window_first:
                # Rank 0's message for the op, waiting at a rank that sets the window up,
                # tells first (rank 0's broadcast never stalls, so it never says its
                # way in the store); or the store does, naming the algorithm.
                assert (f"rank 0 runs this op ({call}) on messages" in msg
                        or f"'{algo}' (on messages)" in msg), (rank, name, msg)
            else:
                # Whichever rank noticed first names the other's algorithm and its own.
                assert f"'{algo}' (on messages)" in msg, (rank, name, msg)
            assert "(in the shared-memory window)" in msg, (rank, name, msg)
            assert "pin the same one on every rank" in msg, (rank, name, msg)
            # Through the store a rank says what it runs after a 1 s grace, and a check
            # reads the peer's answer a second later: about 2 s.
            limit = 5.0 if window_first else 10.0
            assert r[name + " seconds"] < limit, (rank, name, r[name + " seconds"])


def _one_pins_then_all_reduce(rank: int, n: int, case: str) -> dict:
    """Rank 0 alone pins an algorithm for the op of `case`, in whose role it waits on
    peers that never wait for it (a broadcast leaf, a reduce root): those run the op
    their way, finish it at once and go on to an all_reduce."""
    import datetime

    collective, algo, call = {
        "broadcast-leaf": ("broadcast", "tree",
                           lambda g: dist.broadcast(torch.ones(1000), 1, group=g)),
        "reduce-root": ("reduce", "tree",
                        lambda g: dist.reduce(torch.ones(1000), 0, group=g)),
        "broadcast-chain": ("broadcast", "chain",
                            lambda g: dist.broadcast(torch.ones(1000), 1, group=g)),
    }[case]
    g = dist.new_group(backend="tdx", timeout=datetime.timedelta(seconds=60))
    dist.barrier(group=g)  # the window, where there is one, is made
    if rank == 0:
        torchdist_ext.set_algorithm(collective, algo)
    out: dict = {}
    start = time.monotonic()
    for name, fn in (("op", call), ("after", lambda g: dist.all_reduce(torch.ones(10), group=g))):
        try:
            fn(g)
            out[name] = "no error"
        except Exception as e:  # noqa: BLE001 - the type is checked by the caller
            out[name] = f"{type(e).__name__}: {e}"
            break
    out["seconds"] = time.monotonic() - start
    torchdist_ext.set_algorithm(collective, "auto")
    return out


@pytest.mark.parametrize("case, env", [
    ("broadcast-leaf", {}), ("reduce-root", {}), ("broadcast-chain", {"TDX_SHM": "0"})])
def test_a_pin_on_a_rank_that_waits_for_peers_that_went_on(case, env) -> None:
    """The peers ran the op their way and went on, so their announcement for it was no
    longer the latest, and the pinned rank waited out the timeout (60 s here) for a
    message they would never send; on messages its error blamed a rank that had finished
    the op. Now a window keeps each rank's last 7 announcements, and a stalled rank
    compares a peer's announcement of an earlier op with its own way of running it."""
    results = run_ranks(_one_pins_then_all_reduce, 3, timeout=90, args=(case,), env=env)
    for rank, r in enumerate(results):
        msg = r["after"] if r["op"] == "no error" else r["op"]
        assert msg.startswith("DistBackendError"), (rank, r)
        assert "collective mismatch" in msg, (rank, r)
        # At once in the window; through the store, a grace of 1 s and a read after it.
        assert r["seconds"] < 10.0, (rank, r)


def _one_refuses(rank: int, n: int, window_first: bool) -> dict:
    """Rank 0 pins all_gather to 'rd', which 3 ranks cannot run; the others run auto.
    Then every rank runs a broadcast on a new group, which must still work."""
    import datetime

    out: dict = {}
    g = dist.new_group(backend="tdx", timeout=datetime.timedelta(seconds=60))
    if window_first:
        dist.barrier(group=g)
    if rank == 0:
        torchdist_ext.set_algorithm("allgather", "rd")
    start = time.monotonic()
    try:
        dist.all_gather_into_tensor(torch.empty(1000 * n), torch.ones(1000), group=g)
        out["error"] = "no error"
    except Exception as e:  # noqa: BLE001 - the type is checked by the caller
        out["error"] = f"{type(e).__name__}: {e}"
    out["seconds"] = time.monotonic() - start
    torchdist_ext.set_algorithm("allgather", "auto")
    dist.destroy_process_group(g)
    g = dist.new_group(backend="tdx", timeout=datetime.timedelta(seconds=60))
    t = torch.full((3,), float(rank))
    dist.broadcast(t, 2, group=g)
    out["after"] = t.tolist()
    return out


@pytest.mark.parametrize(
    "window_first, env, way",
    [(True, {}, "window"), (False, {}, "window"), (False, {"TDX_SHM": "0"}, "messages"),
     # A slot no /dev/shm can hold: the barrier's window set-up fails, and the group
     # runs on messages from then on.
     (True, {"TDX_SHM_SLOT_BYTES": str(1 << 44)}, "messages")],
    ids=["window-made", "first-op", "no-window", "window-failed"],
)
def test_a_rank_that_refuses_its_pin_ends_the_op_on_the_others(window_first, env,
                                                                 way) -> None:
    """The refusing rank raised at once and its peers, whose pins let them run the op,
    waited out the group timeout for it; the window ranks' error said it had not reached
    the op. Now the refusal is announced as a way of running the op: in the window at
    once, through the store after the 1 s grace."""
    results = run_ranks(_one_refuses, 3, timeout=60, args=(window_first,), env=env)
    assert "pinned to 'rd', which needs a power-of-two world size" in results[0]["error"]
    way = "(in the shared-memory window)" if way == "window" else "(on messages)"
    for rank in (1, 2):
        msg = results[rank]["error"]
        assert msg.startswith("DistBackendError"), (rank, msg)
        assert "collective mismatch: rank 0 refused this op" in msg, (rank, msg)
        assert way in msg, (rank, msg)
        assert "Pin the same algorithm on every rank" in msg, (rank, msg)
        # The store's grace and read: about 2 s; the window: at its first check.
        assert results[rank]["seconds"] < 10.0, (rank, results[rank]["seconds"])
    for r in results:
        assert r["after"] == [2.0, 2.0, 2.0], r


def _members_disagree(rank: int, n: int, other: list) -> dict:
    """Ranks 0 and 1 create a group of [0, 1]; rank 2 creates one of `other` as the same
    (first) new group, so torch gives both the same name. Then each sums 10**rank over
    its group three times, if it has one."""
    import datetime

    members = [0, 1] if rank < 2 else other
    out: dict = {"sums": [], "error": ""}
    try:
        g = dist.new_group(members, backend="tdx", timeout=datetime.timedelta(seconds=5))
        for _ in range(3):
            t = torch.full((4,), float(10 ** rank))
            dist.all_reduce(t, group=g)
            out["sums"].append(t.tolist())
    except Exception as e:  # noqa: BLE001 - the type is checked by the caller
        out["error"] = f"{type(e).__name__}: {e}"
    dist.barrier()  # the default group is untouched
    return out


@pytest.mark.parametrize("other", [[0, 2], [0, 1, 2]], ids=["same-size", "larger"])
def test_ranks_that_create_a_group_with_other_members_fail_instead_of_mixing(other) -> None:
    """torch names groups by the order of their creation, so ranks that pass new_group
    different lists share a name and store prefix; they used to run as one group, and
    rank 0 returned sums that included rank 2. Now the group records say which members
    each rank named: the odd rank always fails at creation, and the others either fail
    too or sum over [0, 1] alone."""
    results = run_ranks(_members_disagree, 3, timeout=60, args=(other,))
    odd = results[2]
    assert odd["error"].startswith("DistBackendError"), odd
    assert "new_group the same ranks" in odd["error"], odd
    assert odd["sums"] == [], odd
    for rank in (0, 1):
        r = results[rank]
        # Every sum a rank got is [0, 1]'s; a rank that failed said why.
        assert all(s == [11.0] * 4 for s in r["sums"]), (rank, r)
        assert r["error"] == "" or r["error"].startswith("DistBackendError"), (rank, r)

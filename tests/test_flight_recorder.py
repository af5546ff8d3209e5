"""The flight recorder: the last ops of a group, their state and the step each reached;
dumped to TDX_DUMP_DIR when an op fails."""

from __future__ import annotations

import os
import time

import pytest
import torch
import torch.distributed as dist

import torchdist_ext
from torchdist_ext.testing import log_to_file, run_ranks


def _record(rank: int, n: int) -> list:
    t = torch.ones(1000)
    dist.all_reduce(t)
    dist.broadcast(t, src=0)
    dist.barrier()
    sub = dist.new_group([0, 1], backend="tdx")
    if rank < 2:
        dist.all_reduce(t, group=sub)
    return [torchdist_ext.flight_recorder(), torchdist_ext.flight_recorder(sub) if rank < 2 else []]


def test_records_ops_in_order() -> None:
    results = run_ranks(_record, 3)
    for rank, (world, sub) in enumerate(results):
        ops = [e["op"] for e in world]
        assert ops[-3:] == ["all_reduce", "broadcast", "barrier"], (rank, ops)
        seqs = [e["seq"] for e in world]
        assert seqs == sorted(seqs) and len(set(seqs)) == len(seqs), seqs
        for e in world[-3:]:
            assert e["state"] == "done" and e["duration_ms"] >= 0 and e["error"] == "", e
            assert "tdx r" in e["detail"], e
        # 3 ranks: every collective moves bytes, so each reached at least one step.
        assert all(e["steps_done"] > 0 for e in world[-3:]), world[-3:]
        if rank < 2:
            assert [e["op"] for e in sub] == ["all_reduce"] and sub[0]["state"] == "done", sub


def _p2p_record(rank: int, n: int) -> list:
    import datetime

    t = torch.arange(6.0)
    if rank == 0:
        dist.send(t, 1, tag=5)
    else:
        dist.recv(t, 0, tag=5)
        dist.recv(t, tag=6)  # from any source
    if rank == 0:
        dist.send(t, 1, tag=6)
    dist.all_reduce(t)
    g = dist.new_group(backend="tdx")
    if rank == 1:  # a receive nobody sends to: it times out and is recorded failed
        try:
            dist.irecv(t, 0, group=g, tag=7).wait(timeout=datetime.timedelta(seconds=1))
        except Exception:  # noqa: BLE001 - the record is what is checked
            pass
    return [torchdist_ext.flight_recorder(), torchdist_ext.flight_recorder(g)]


def test_point_to_point_ops_are_recorded() -> None:
    """send and recv (from a rank and from any source) take their place in the record
    among the collectives, with path p2p and their end state; a timed-out receive is
    recorded failed with its reason."""
    (world0, _), (world1, g1) = run_ranks(_p2p_record, 2)
    assert [e["op"] for e in world0] == ["send", "send", "all_reduce"], world0
    assert [e["op"] for e in world1] == ["recv", "recv_any_source", "all_reduce"], world1
    for e in world0[:2] + world1[:2]:
        assert e["path"] == "p2p" and e["state"] == "done" and e["seq"] == 0, e
        assert "Float[6]" in e["detail"] and e["duration_ms"] >= 0, e
    assert "tag 5" in world0[0]["detail"] and "to rank 1" in world0[0]["detail"], world0
    assert "from rank any" in world1[1]["detail"], world1
    assert [e["op"] for e in g1] == ["recv"] and g1[0]["state"] == "failed", g1
    assert "timed out" in g1[0]["error"], g1


def _timeout(rank: int, n: int, dump_dir: str) -> dict:
    t = torch.ones(1000)
    dist.all_reduce(t)  # both ranks take part
    if rank == 1:
        time.sleep(8)  # never joins the second all_reduce, but stays alive past rank 0's timeout
        return {}
    err = ""
    start = time.monotonic()
    try:
        dist.all_reduce(t)
    except Exception as e:  # noqa: BLE001 - the type is checked by the caller
        err = f"{type(e).__name__}: {e}"
    seconds = time.monotonic() - start
    files = sorted(os.listdir(dump_dir)) if os.path.isdir(dump_dir) else []
    text = open(os.path.join(dump_dir, files[0])).read() if files else ""
    return {"error": err, "record": torchdist_ext.flight_recorder(), "files": files, "text": text,
            "seconds": seconds}


def test_timeout_leaves_evidence(tmp_path) -> None:
    dump_dir = str(tmp_path / "dumps")
    results = run_ranks(_timeout, 2, timeout=4, args=(dump_dir,), env={"TDX_DUMP_DIR": dump_dir})
    r0 = results[0]
    assert r0["error"].startswith("DistBackendError") and "rank 1" in r0["error"], r0["error"]
    assert 3.5 < r0["seconds"] < 7.0, r0["seconds"]  # the 4 s group timeout, not less or never
    last = r0["record"][-1]
    assert last["op"] == "all_reduce" and last["state"] == "failed", last
    done = r0["record"][-2]
    assert done["state"] == "done", r0["record"]
    # The send may complete (eager), the receive never does: fewer steps than a whole op.
    assert "timed out" in last["error"] and last["steps_done"] < done["steps_done"], last
    assert r0["files"] == ["tdx_flight_0_r0.txt"] or r0["files"][0].startswith("tdx_flight_"), r0
    assert "failed" in r0["text"] and "all_reduce" in r0["text"], r0["text"]


def test_needs_a_tdx_group() -> None:
    with pytest.raises((ValueError, RuntimeError)):
        torchdist_ext.flight_recorder()  # no process group at all in the test process


def _one_never_calls(rank: int, n: int, op: str, warm: bool) -> dict:
    t = torch.ones(1 << 16)
    if warm:
        dist.all_reduce(t)  # everyone connected, and the window set up
    if rank == n - 1:
        time.sleep(6)  # never calls the next op, and outlives the others' timeout
        return {}
    start = time.monotonic()
    try:
        if op == "all_gather":
            dist.all_gather_into_tensor(torch.empty(n * t.numel()), t)
        else:
            dist.all_reduce(t)
        err = "no error"
    except Exception as e:  # noqa: BLE001 - the type is checked by the caller
        err = f"{type(e).__name__}: {e}"
    return {"error": err, "seconds": time.monotonic() - start}


@pytest.mark.parametrize("shm, op, warm", [
    ("0", "all_reduce", True),
    ("1", "all_reduce", True),
    # Its ranks wait on one peer at a time: the ranks it did not wait for count too.
    ("1", "all_gather", True),
    # The group's first op sets the window up, through the store.
    ("1", "all_reduce", False),
])
def test_a_timeout_names_the_ranks_that_reached_the_op_and_those_that_did_not(
        shm: str, op: str, warm: bool) -> None:
    """Over messages a rank waits on one peer, which may itself wait on the rank that
    never called (rank 1's ring neighbour is rank 0, not rank 2): every rank that reached
    the op says so, and each error lists who did and who did not. Windows list the ranks
    that got as far from the window itself. A rank's error may instead be the notice of
    a peer that timed out first, which quotes that peer's list."""
    results = run_ranks(_one_never_calls, 3, timeout=3, args=(op, warm), env={"TDX_SHM": shm})
    for rank, r in enumerate(results[:2]):
        assert r["error"].startswith("DistBackendError"), (rank, r)
        assert 2.5 < r["seconds"] < 8.0, (rank, r)
        if shm == "0" or not warm:
            assert "Reached this op and timed out on it: ranks 0, 1" in r["error"], (rank, r)
            assert "not timed out on it within 1 s: rank 2 " in r["error"], (rank, r)
        else:
            assert "ranks that got this far: 0, 1; not: 2)" in r["error"], (rank, r)


def _logged_table(rank: int, n: int, log_dir: str, dump_dir: str) -> dict:
    """Twelve ops, then a thirteenth that fails (rank 1 calls broadcast where rank 0 calls
    all_reduce; rank 1 queues three more behind it); the backend's log (standard error)
    goes to a file."""
    log_to_file(log_dir, rank, fds=(2,))
    t = torch.ones(100)
    for i in range(12):  # all_gather_into_tensor filled the op column's old width
        if i % 2:
            dist.all_gather_into_tensor(torch.empty(100 * n), t)
        else:
            dist.all_reduce(t)
    if rank == 0:
        # Rank 1 queues its four ops before rank 0 posts the one that exposes the
        # mismatch, so a busy host cannot fail the group before rank 1's last three are
        # queued (calls on a failed group are refused, which changes the record).
        time.sleep(0.5)
        works = [dist.all_reduce(t, async_op=True)]
    else:
        works = [dist.broadcast(t, src=0, async_op=True)]
        works += [dist.all_reduce(torch.ones(100), async_op=True) for _ in range(3)]
    for work in works:
        try:
            work.wait()
        except Exception:  # noqa: BLE001 - the record is what this test reads
            pass
    return {"record": torchdist_ext.flight_recorder(),
            "dump": open(os.path.join(dump_dir, f"tdx_flight_0_r{rank}.txt")).read()}


def test_the_logged_table_is_brief_and_the_file_complete(tmp_path) -> None:
    """Every rank of a failed group logs its flight record: the log gets the 8 ops up to
    the failed one, with a line counting the ops queued after it, without the group
    prefix or the error the line above gave; the file under TDX_DUMP_DIR keeps every op.
    The failed op names the algorithm it was running, not a placeholder."""
    logs, dumps = tmp_path / "logs", tmp_path / "dumps"
    logs.mkdir()
    results = run_ranks(_logged_table, 2, timeout=60, args=(str(logs), str(dumps)),
                        env={"TDX_SHM": "0", "TDX_DUMP_DIR": str(dumps)})
    for rank, r in enumerate(results):
        later = 3 if rank == 1 else 0
        failed = r["record"][12]
        assert failed["state"] == "failed" and failed["path"] not in ("host", "-", ""), failed
        assert len(r["record"]) == 13 + later, r["record"]
        assert len(r["dump"].splitlines()) == 14 + later, r["dump"]
        text = (logs / f"rank{rank}.log").read_text()
        lines = text.splitlines()
        head = next(i for i, line in enumerate(lines) if "flight recorder after" in line)
        assert "also in " in lines[head] and "flight_recorder()" in lines[head], lines[head]
        assert lines[head + 1].startswith("seq"), lines[head:head + 3]
        assert lines[head + 2] == "(5 earlier op(s) not shown)", lines[head:head + 3]
        rows = lines[head + 3:head + 11]
        assert [row.split()[0] for row in rows] == [str(s) for s in range(6, 14)], rows
        # Each op and path stands apart from the next column.
        assert [row.split()[1:3] for row in rows] == \
            [[e["op"], e["path"]] for e in r["record"][5:13]], rows
        assert rows[-1].endswith("| (the error above)"), rows[-1]
        assert not any("[tdx r" in row for row in rows), rows
        if later:
            assert lines[head + 11] == f"({later} later op(s) not shown)", lines[head + 11]

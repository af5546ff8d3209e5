"""Point-to-point ops, subgroups, splitting, re-initialisation and debug mode."""

from __future__ import annotations

import time

import pytest
import torch
import torch.distributed as dist

from torchdist_ext.testing import run_ranks


def _p2p(rank: int, n: int) -> list[str]:
    fails: list[str] = []
    right, left = (rank + 1) % n, (rank - 1) % n
    # blocking send/recv around a ring, several dtypes, tags keep messages apart
    for dtype in (torch.float32, torch.int64, torch.bfloat16, torch.bool):
        for tag in (0, 7):
            def payload(r: int) -> torch.Tensor:
                if dtype == torch.bool:
                    return (torch.arange(11) + r) % 3 == 0
                return (torch.arange(11) + r).to(dtype)

            out = payload(rank)
            inp = torch.empty(11, dtype=dtype)
            if rank % 2 == 0:
                dist.send(out, right, tag=tag)
                dist.recv(inp, left, tag=tag)
            else:
                dist.recv(inp, left, tag=tag)
                dist.send(out, right, tag=tag)
            want = payload(left)
            if not torch.equal(inp, want):
                fails.append(f"r{rank} send/recv {dtype} tag={tag}")
    # isend/irecv both directions at once; messages on one (peer, tag) arrive in order
    sends = [dist.isend(torch.full((3,), float(rank * 10 + i)), right) for i in range(4)]
    recvs = [torch.empty(3) for _ in range(4)]
    rworks = [dist.irecv(b, left) for b in recvs]
    for w in sends + rworks:
        w.wait()
    for i, b in enumerate(recvs):
        if not torch.equal(b, torch.full((3,), float(left * 10 + i))):
            fails.append(f"r{rank} isend/irecv order {i}: {b.tolist()}")
    # a large message (rendezvous protocol)
    big = torch.arange(1 << 20, dtype=torch.float32) + rank
    got = torch.empty_like(big)
    ws = [dist.isend(big, right), dist.irecv(got, left)]
    for w in ws:
        w.wait()
    if not torch.equal(got, torch.arange(1 << 20, dtype=torch.float32) + left):
        fails.append(f"r{rank} large isend/irecv")
    # batch_isend_irecv ring (coalesced into one work)
    s, r_ = torch.full((5,), float(rank)), torch.empty(5)
    ops = [dist.P2POp(dist.isend, s, right), dist.P2POp(dist.irecv, r_, left)]
    for w in dist.batch_isend_irecv(ops):
        w.wait()
    if not torch.equal(r_, torch.full((5,), float(left))):
        fails.append(f"r{rank} batch_isend_irecv")
    # A batch with a large (rendezvous) message, completed by the transport alone: nobody
    # waits on it, its future is taken before it ends, and a callback chains on it.
    small_in, big_in = torch.empty(7), torch.empty(300_000)
    big_out = torch.arange(300_000, dtype=torch.float32) + rank
    works = dist.batch_isend_irecv([
        dist.P2POp(dist.isend, torch.full((7,), float(rank)), right),
        dist.P2POp(dist.irecv, small_in, left),
        dist.P2POp(dist.isend, big_out, right),
        dist.P2POp(dist.irecv, big_in, left),
    ])
    chained = works[0].get_future().then(lambda f: "done")
    deadline = time.monotonic() + 30
    while not all(w.is_completed() for w in works) and time.monotonic() < deadline:
        time.sleep(0.001)
    if not all(w.is_completed() for w in works):
        fails.append(f"r{rank} batch never completed without a waiter")
    elif chained.wait() != "done":
        fails.append(f"r{rank} batch future callback")
    elif not (torch.equal(small_in, torch.full((7,), float(left)))
              and torch.equal(big_in, torch.arange(300_000, dtype=torch.float32) + left)):
        fails.append(f"r{rank} batch with a large message: wrong data")
    # recv from any source identifies the sender
    if rank == 0:
        seen = set()
        for _ in range(n - 1):
            t = torch.empty(1)
            src = dist.recv(t)
            seen.add(src)
            if t.item() != src * 100:
                fails.append(f"any-source payload {t.item()} from {src}")
        if seen != set(range(1, n)):
            fails.append(f"any-source senders {seen}")
    else:
        dist.send(torch.tensor([rank * 100.0]), 0)
    # non-contiguous and strided p2p
    if rank == 0:
        dist.send(torch.arange(12.0).reshape(3, 4).t(), 1)
    elif rank == 1:
        t = torch.empty(4, 3)
        dist.recv(t, 0)
        if not torch.equal(t, torch.arange(12.0).reshape(3, 4).t()):
            fails.append("non-contiguous send")
    dist.barrier()
    return fails


@pytest.mark.parametrize("world_size", [2, 3, 4])
def test_point_to_point(world_size: int) -> None:
    fails = [f for r in run_ranks(_p2p, world_size) for f in r]
    assert not fails, "\n".join(fails)


def _subgroups(rank: int, n: int) -> list[str]:
    fails: list[str] = []
    assert dist.get_backend() == "tdx"
    # non-contiguous, reordered members; roots are global ranks in the public API
    members = [3, 1] if n >= 4 else [n - 1, 0]
    g = dist.new_group(members)
    other = dist.new_group([r for r in range(n) if r not in members] or [0])
    if rank in members:
        t = torch.full((4,), float(rank))
        dist.all_reduce(t, group=g)
        if not torch.equal(t, torch.full((4,), float(sum(members)))):
            fails.append(f"r{rank} subgroup all_reduce {t.tolist()}")
        b = torch.full((2,), float(rank))
        dist.broadcast(b, src=members[0], group=g)
        if not torch.equal(b, torch.full((2,), float(members[0]))):
            fails.append(f"r{rank} subgroup broadcast")
        outs = [torch.empty(1) for _ in members]
        dist.all_gather(outs, torch.tensor([float(rank)]), group=g)
        # new_group orders members by global rank
        if [o.item() for o in outs] != [float(m) for m in sorted(members)]:
            fails.append(f"r{rank} subgroup all_gather order {outs}")
        if dist.get_rank(g) != sorted(members).index(rank):
            fails.append("group rank")
    # two groups with async ops in flight at the same time
    t1, t2 = torch.ones(1000), torch.ones(1000)
    w1 = dist.all_reduce(t1, async_op=True)
    if rank in members:
        w2 = dist.all_reduce(t2, group=g, async_op=True)
        w2.wait()
        if not torch.equal(t2, torch.full((1000,), float(len(members)))):
            fails.append(f"r{rank} subgroup all_reduce beside the world's: {t2[:4].tolist()}")
    w1.wait()
    if not torch.equal(t1, torch.full((1000,), float(n))):
        fails.append(f"r{rank} world all_reduce beside the subgroup's: {t1[:4].tolist()}")
    # split_group over the default group. torch splits only a group bound to an
    # accelerator device (init_process_group(device_id=...)), whatever the backend, and
    # this harness binds none: torch must refuse with its own error, and this says when
    # it stops doing so.
    if hasattr(dist, "split_group"):
        halves = [list(range(0, n // 2)), list(range(n // 2, n))]
        halves = [h for h in halves if h]
        bound = dist.distributed_c10d._get_default_group().bound_device_id is not None
        try:
            sg = dist.split_group(split_ranks=halves)
        except RuntimeError as e:
            sg = None
            if bound or "No device associated" not in str(e):
                fails.append(f"split_group: {e}")
        else:
            if not bound:
                fails.append("split_group ran without a bound device: check its result here")
        if sg is not None:
            mine = next(h for h in halves if rank in h)
            t = torch.ones(3)
            dist.all_reduce(t, group=sg)
            if not torch.equal(t, torch.full((3,), float(len(mine)))):
                fails.append(f"r{rank} split_group all_reduce {t.tolist()}")
    seq = dist.distributed_c10d._get_default_group()._get_backend(torch.device("cpu"))
    if not hasattr(seq, "_get_sequence_number_for_group"):
        fails.append("no sequence number hook")
    elif seq._get_sequence_number_for_group() <= 0:
        fails.append("sequence number did not advance")
    dist.destroy_process_group(g)
    dist.destroy_process_group(other)
    dist.barrier()
    return fails


@pytest.mark.parametrize("world_size", [3, 4])
def test_subgroups_and_split(world_size: int) -> None:
    fails = [f for r in run_ranks(_subgroups, world_size) for f in r]
    assert not fails, "\n".join(fails)


def _debug_detail(rank: int, n: int) -> float:
    t = torch.full((16,), float(rank))
    dist.all_reduce(t)
    dist.broadcast(t, src=0)
    dist.barrier()
    return t[0].item()


def test_torch_distributed_debug_detail() -> None:
    vals = run_ranks(_debug_detail, 2, env={"TORCH_DISTRIBUTED_DEBUG": "DETAIL"})
    assert vals == [1.0, 1.0]


def _reinit(rank: int, n: int, store_dir: str) -> list[float]:
    import os
    from datetime import timedelta

    # The harness's group is up; tear it down and build new ones three times.
    out = []
    dist.destroy_process_group()
    for i in range(3):
        store = dist.FileStore(os.path.join(store_dir, f"s{i}"), n)
        dist.init_process_group("tdx", store=store, rank=rank, world_size=n,
                                timeout=timedelta(seconds=60))
        t = torch.full((4,), float(rank + i))
        dist.all_reduce(t)
        out.append(t[0].item())
        dist.destroy_process_group()
    store = dist.FileStore(os.path.join(store_dir, "final"), n)
    dist.init_process_group("tdx", store=store, rank=rank, world_size=n)
    return out


def test_repeated_init_destroy(tmp_path) -> None:
    results = run_ranks(_reinit, 3, args=(str(tmp_path),))
    want = [float(sum(range(3)) + 3 * i) for i in range(3)]
    assert results == [want] * 3


def _fnv_group_id(name: str) -> int:
    """The backend's first candidate id for a group name (FNV-1a folded to 20 bits)."""
    h = 1469598103934665603
    for c in name.encode():
        h = ((h ^ c) * 1099511628211) % (1 << 64)
    return (h ^ (h >> 20) ^ (h >> 40)) & ((1 << 20) - 1)


def _colliding_groups(rank: int, n: int, names: tuple[str, str]) -> list[float]:
    from datetime import timedelta

    import torchdist_ext

    store = dist.distributed_c10d._get_default_store()
    groups = [torchdist_ext._C._create_backend(dist.PrefixStore(name, store), rank, n,
                                               timedelta(seconds=30), name, list(range(n)))
              for name in names]
    a = torch.full((4,), 1.0 + rank)
    b = torch.full((4,), 100.0 * (rank + 1))
    opts = dist.AllreduceOptions()
    # The two ranks issue the two groups' ops in opposite orders: with one id between
    # them, each op's messages would land in the other group's op.
    if rank == 0:
        works = [groups[0].allreduce([a], opts)]
        time.sleep(0.3)
        works.append(groups[1].allreduce([b], opts))
    else:
        works = [groups[1].allreduce([b], opts)]
        time.sleep(0.3)
        works.append(groups[0].allreduce([a], opts))
    for w in works:
        w.wait()
    for g in groups:
        g.shutdown()
    return [a[0].item(), b[0].item()]


def test_groups_whose_names_hash_alike_keep_their_messages_apart() -> None:
    names = ("1898", "2109")  # torch's own default group names, colliding in 20 bits
    assert _fnv_group_id(names[0]) == _fnv_group_id(names[1])
    results = run_ranks(_colliding_groups, 2, args=(names,), timeout=60,
                        env={"TDX_SHM": "0"})  # messages, not the window, carry the data
    assert results == [[3.0, 300.0]] * 2, results


def _message_left_for_a_later_group(rank: int, n: int, names: tuple[str, str]) -> dict:
    from datetime import timedelta

    import torchdist_ext

    store = dist.distributed_c10d._get_default_store()

    def group(name: str):
        return torchdist_ext._C._create_backend(dist.PrefixStore(name, store), rank, n,
                                                timedelta(seconds=30), name, list(range(n)))

    first = group(names[0])
    if rank == 0:  # rank 1 never receives it: it waits in rank 1's transport
        first.send([torch.full((4,), -1.0)], 1, 5).wait()
    dist.barrier()  # after the message, on the same connection
    first_id = first.tag_id
    first.shutdown()
    for k in range(40):  # more destroyed groups than an id is otherwise held for
        group(f"filler-{k}").shutdown()
    second = group(names[1])  # its name hashes to the first group's id
    got = torch.zeros(4)
    if rank == 0:
        second.send([torch.full((4,), 7.0)], 1, 5).wait()
    else:
        second.recv([got], 0, 5).wait()
    out = {"first_id": first_id, "second_id": second.tag_id, "got": got.tolist()}
    second.shutdown()
    return out


def test_a_message_no_op_took_never_reaches_a_later_group_under_its_id() -> None:
    """A message sent to a group and never received waits in the transport, which the
    default group keeps alive. A later group under the same id, with the same sender and
    tag, would receive it as its own: the first group's id is held for good instead."""
    names = ("1898", "2109")  # colliding in 20 bits (see above)
    r0, r1 = run_ranks(_message_left_for_a_later_group, 2, args=(names,), timeout=90,
                       env={"TDX_SHM": "0"})
    assert r1["got"] == [7.0] * 4, r1
    assert r0["first_id"] == r1["first_id"] == _fnv_group_id(names[0])
    assert r0["second_id"] == r1["second_id"] != r0["first_id"], (r0, r1)


def _receive_left_posted(rank: int, n: int, store_dir: str) -> dict:
    import os

    import torchdist_ext

    stale = torch.zeros(2)
    work = dist.irecv(stale, src=0) if rank == 1 else None  # never matched
    dist.barrier()
    dist.destroy_process_group()
    # The transport stops once the last reference goes; the cancelled receive's
    # completion may hold one for a moment on the transport's own thread.
    deadline = time.monotonic() + 5
    while torchdist_ext.transport_info()["running"] and time.monotonic() < deadline:
        time.sleep(0.01)
    out = {"running_after_destroy": torchdist_ext.transport_info()["running"]}
    if work is not None:
        try:
            work.wait()
            out["left_posted"] = "no error"
        except Exception as e:  # noqa: BLE001 - the caller checks
            out["left_posted"] = f"{type(e).__name__}: {e}"
    # The new default group has the old one's name: its first message must not land in
    # the receive the old group left posted.
    store = dist.FileStore(os.path.join(store_dir, "again"), n)
    dist.init_process_group("tdx", store=store, rank=rank, world_size=n)
    if rank == 0:
        dist.send(torch.tensor([42.0, 43.0]), 1)
    else:
        fresh = torch.zeros(2)
        dist.recv(fresh, 0)
        out.update(fresh=fresh.tolist(), stale=stale.tolist())
    return out


def test_receive_left_posted_at_destroy_takes_nothing_later(tmp_path) -> None:
    results = run_ranks(_receive_left_posted, 2, args=(str(tmp_path),), timeout=60)
    assert [r["running_after_destroy"] for r in results] == [False, False], results
    assert results[1]["fresh"] == [42.0, 43.0] and results[1]["stale"] == [0.0, 0.0], results
    # ended by the destroy, not left to take a later message
    assert "shut down" in results[1]["left_posted"], results

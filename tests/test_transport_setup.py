"""How the UCX transport sets itself up: whether TCP is loaded, how each peer is watched,
and that `import torchdist_ext` leaves UCX's TCP settings to the transport."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest
import torch
import torch.distributed as dist

import torchdist_ext
from torchdist_ext.testing import run_ranks


def test_import_sets_no_tcp_variables() -> None:
    base = {k: v for k, v in os.environ.items() if not k.startswith("UCX_")}
    code = ("import json, os, torchdist_ext; "
            "print(json.dumps(sorted(k for k in os.environ if k.startswith('UCX_TCP'))))")
    out = subprocess.run([sys.executable, "-c", code], env=base, check=True,
                         capture_output=True, text=True, timeout=120)
    assert json.loads(out.stdout.strip().splitlines()[-1]) == []


def test_transport_info_without_a_group() -> None:
    # Nothing was ever given up on in this process, so nothing is held.
    assert torchdist_ext.transport_info() == {"running": False, "held_bytes": 0}


def _info(rank: int, n: int, subgroup: bool) -> dict:
    if subgroup:  # the default group is gloo's; tdx starts with a subgroup
        pg = dist.new_group(backend="tdx")
    else:
        pg = None
    t = torch.ones(8)
    dist.all_reduce(t, group=pg)
    other = 1 - rank
    got = torch.empty(4)
    if rank == 0:
        dist.send(torch.arange(4.0), other, group=pg)
    else:
        dist.recv(got, other, group=pg)
    info = torchdist_ext.transport_info()
    peers = [e for e in info["endpoints"] if e["pid"] != os.getpid()]
    return {"tcp": info["tcp"], "peers": peers,
            "ok": bool((t == n).all()) and (rank == 0 or torch.equal(got, torch.arange(4.0)))}


# env -> (TCP loaded, the peer watched, UCX peer errors on it)
CASES = {
    "default": ({}, False, True, False),
    "tcp-on": ({"TDX_UCX_TCP": "1"}, True, True, False),
    "peer-errors-always": ({"TDX_UCX_PEER_ERRORS": "1"}, True, True, True),
    "peer-errors-never": ({"TDX_UCX_PEER_ERRORS": "0"}, False, True, False),
    "users-tls": ({"UCX_TLS": "tcp,self"}, True, True, False),
    # the user's list stays as it is (not widened to "everything but tcp")
    "users-tls-no-tcp": ({"UCX_TLS": "sm,self"}, False, True, False),
}


@pytest.mark.parametrize("case", sorted(CASES))
def test_transport_setup(case: str) -> None:
    env, tcp, watched, peer_errors = CASES[case]
    for rank, r in enumerate(run_ranks(_info, 2, timeout=60, args=(False,), env=env)):
        assert r["ok"], (case, rank, r)
        assert r["tcp"] is tcp, (case, rank, r)
        assert len(r["peers"]) == 1, (case, rank, r)
        peer = r["peers"][0]
        assert peer["same_host"] and not peer["lost"], (case, rank, peer)
        assert peer["watched"] is watched, (case, rank, peer)
        assert peer["peer_errors"] is peer_errors, (case, rank, peer)


def test_transport_started_by_a_subgroup_keeps_tcp() -> None:
    """Only the default group knows where every rank runs: a transport that a later
    group starts keeps TCP, since a later group may span hosts."""
    for rank, r in enumerate(run_ranks(_info, 2, backend="gloo", timeout=60, args=(True,))):
        assert r["ok"], (rank, r)
        assert r["tcp"] is True, (rank, r)
        assert r["peers"][0]["watched"] and not r["peers"][0]["peer_errors"], (rank, r)


def _crowding(rank: int, n: int) -> dict:
    t = torch.ones(1 << 16)
    dist.all_reduce(t)
    assert torch.equal(t, torch.full_like(t, float(n)))
    return {"rndv": torchdist_ext.transport_info()["rndv_thresh"],
            "crowded": torchdist_ext.placement()["crowded"],
            "cpus": sorted(os.sched_getaffinity(0))}


@pytest.mark.skipif(torchdist_ext._C._usable_cpus() < 2 or "UCX_RNDV_THRESH" in os.environ,
                    reason="needs 2 usable CPUs to pin ranks apart, and UCX's threshold "
                           "left to the transport")
def test_ranks_pinned_to_a_core_each_are_not_crowded() -> None:
    """Two ranks, each pinned to a CPU of its own: each process sees one CPU, but
    together they have two, so the group is not crowded and UCX keeps its own rendezvous
    threshold. Pinned to the same CPU, they are crowded, and messages up to 1 MiB go
    eagerly."""
    a, b = sorted(os.sched_getaffinity(0))[:2]
    for pins, crowded in (({0: [a], 1: [b]}, False), ({0: [a], 1: [a]}, True)):
        for rank, r in enumerate(run_ranks(_crowding, 2, timeout=60, affinity=pins)):
            assert r["cpus"] == pins[rank], (rank, r)
            assert r["crowded"] is crowded, (pins, rank, r)
            assert r["rndv"] == ("1m" if crowded else ""), (pins, rank, r)


def _attempt(rank: int, port: int, delay: float, q) -> None:
    import datetime
    import time

    store = dist.TCPStore("127.0.0.1", port, is_master=False,
                          timeout=datetime.timedelta(seconds=20))
    time.sleep(delay)
    try:
        dist.init_process_group("tdx", store=store, rank=rank, world_size=2,
                                timeout=datetime.timedelta(seconds=10))
        t = torch.ones(2)
        dist.all_reduce(t)
        dist.destroy_process_group()
        q.put((rank, "ok", str(t.tolist())))
    except Exception as e:  # noqa: BLE001 - checked by the caller
        q.put((rank, type(e).__name__, str(e)))


def test_attempts_on_one_store_never_read_each_others_keys() -> None:
    """Attempts of a job on one store (torchrun --max-restarts keeps its store, and every
    key in it) each get a group of their own: a later attempt's rank that comes first
    never reads the addresses, window names or cost model an earlier attempt left there
    (it used to connect to a process that was gone). Rank 1 comes 3 s late in the second
    attempt, rank 0 in the third."""
    import torch.multiprocessing as mp

    master = dist.TCPStore("127.0.0.1", 0, is_master=True, wait_for_workers=False)
    ctx = mp.get_context("spawn")
    q = ctx.Queue()
    results = {}
    for attempt, late in ((1, None), (2, 1), (3, 0)):
        procs = [ctx.Process(target=_attempt, args=(r, master.port, 3.0 if r == late else 0.0, q))
                 for r in range(2)]
        for p in procs:
            p.start()
        for p in procs:
            p.join(60)
        got = [q.get(timeout=5) for _ in procs]
        results[attempt] = {r: (kind, text) for r, kind, text in got}
    ok = {0: ("ok", "[2.0, 2.0]"), 1: ("ok", "[2.0, 2.0]")}
    assert results == {1: ok, 2: ok, 3: ok}, results

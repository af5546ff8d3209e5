"""Every algorithm of the registry: its plan's invariants without a network, then every
algorithm x world size 1..8 x counts {0, 1, prime, not divisible} through the backend
with values that identify their origin.

Plan invariants (worlds 1..16), checked by running all ranks' plans symbolically:
- every send is paired with a receive of the same size at the same step, in order, and
  is marked segmented exactly when that receive reduces (both sides cut it alike);
- a step never sends from memory it receives into (the executor posts them together);
- every contribution is reduced exactly once (element sets stay disjoint) and the
  result holds every rank's contribution;
- data-movement results hold exactly the expected origins;
- the number of steps with transfers, and the busiest rank's bytes, match the
  algorithm's declared cost (for pipelined plans, whose steps overlap transfers of
  different chunks, the bytes on the critical path: per step, the most any rank moves).
"""

from __future__ import annotations

import math
import os
import time
from collections import defaultdict

import pytest
import torch
import torch.distributed as dist

import torchdist_ext
from torchdist_ext import _C
from torchdist_ext.testing import run_ranks

PLANNED = [(a["collective"], a["name"]) for a in _C._algorithms() if a["has_plan"]]
ALL = [(a["collective"], a["name"]) for a in _C._algorithms()]
POW2_ONLY = {(a["collective"], a["name"]) for a in _C._algorithms() if a["power_of_two_only"]}
# Plans whose cost counts the bytes on the critical path rather than the busiest rank's.
PIPELINED = {("broadcast", "chain")}


def _counts(world: int) -> list[int]:
    return sorted({0, 1, 13, 3 * world + 1})


class Sim:
    """All ranks' buffers as lists of per-element labels (frozensets of origins)."""

    def __init__(self, coll: str, world: int, count: int, root: int, chunk_bytes: int = 0):
        self.coll, self.n, self.count, self.root = coll, world, count, root
        self.chunk_bytes = chunk_bytes
        self.data = {}
        self.send = {}
        self.recv = {}
        self.scratch = {}
        b = count  # block elements (elem_size 1: bytes == elements)
        for r in range(world):
            if coll == "allreduce":
                self.data[r] = [frozenset({(r, i)}) for i in range(count)]
            elif coll == "broadcast":
                self.data[r] = [frozenset({(r, i)}) for i in range(count)]
            elif coll == "reduce":
                self.data[r] = [frozenset({("out", r, i)}) for i in range(count)]
                self.send[r] = [[frozenset({(r, i)}) for i in range(count)]]
            elif coll == "allgather":
                self.recv[r] = [[frozenset({(r, i)}) if q == r else frozenset({("junk", r, q, i)})
                                 for i in range(b)] for q in range(world)]
            elif coll == "reduce_scatter":
                self.send[r] = [[frozenset({(r, q, i)}) for i in range(b)] for q in range(world)]
                self.recv[r] = [[frozenset({("junk", r, i)}) for i in range(b)]]
            elif coll == "alltoall":
                # Uneven splits: rank r sends (r + q) % 3 + count elements to q.
                self.send[r] = [[frozenset({(r, q, i)}) for i in range(self.split(r, q))]
                                for q in range(world)]
                self.recv[r] = [[frozenset({("junk", r, q, i)}) for i in range(self.split(q, r))]
                                for q in range(world)]
            elif coll == "gather":
                self.send[r] = [[frozenset({(r, i)}) for i in range(b)]]
                self.recv[r] = ([[frozenset({("junk", q, i)}) for i in range(b)] for q in range(world)]
                                if r == root else [])
            elif coll == "scatter":
                self.send[r] = ([[frozenset({(r, q, i)}) for i in range(b)] for q in range(world)]
                                if r == root else [])
                self.recv[r] = [[frozenset({("junk", r, i)}) for i in range(b)]]
            elif coll == "barrier":
                self.data[r] = []
            self.scratch[r] = []

    def split(self, src: int, dst: int) -> int:
        return (src + dst) % 3 + self.count

    def plan_args(self, r: int) -> dict:
        send = [len(x) for x in self.send.get(r, [])]
        recv = [len(x) for x in self.recv.get(r, [])]
        return dict(count=self.count, elem_size=1, send_bytes=send, recv_bytes=recv, root=self.root,
                    chunk_bytes=self.chunk_bytes)

    def region(self, r: int, span) -> tuple[list, int, int]:
        kind, block, off, nbytes = span
        buf = {"data": lambda: self.data[r], "scratch": lambda: self.scratch[r],
               "send": lambda: self.send[r][block], "recv": lambda: self.recv[r][block]}[kind]()
        assert off + nbytes <= len(buf), f"rank {r}: span {span} outside its buffer ({len(buf)})"
        return buf, off, nbytes


def _overlap(a, b) -> bool:
    if a[0] != b[0] or a[1] != b[1] or a[3] == 0 or b[3] == 0:
        return False
    return a[2] < b[2] + b[3] and b[2] < a[2] + a[3]


def simulate(coll: str, name: str, world: int, count: int, root: int = 0, chunk_bytes: int = 0):
    sim = Sim(coll, world, count, root, chunk_bytes)
    plans = {}
    for r in range(world):
        steps, scratch = _C._plan(coll, name, world, r, **sim.plan_args(r))
        plans[r] = steps
        sim.scratch[r] = [frozenset({("junk-scratch", r, i)}) for i in range(scratch)]
    nsteps = max(len(p) for p in plans.values())
    assert all(len(p) == nsteps for p in plans.values()), "ranks disagree on the step count"
    heard = {r: {r} for r in range(world)}  # for the barrier
    transfer_steps = 0
    moved = defaultdict(lambda: [0, 0])
    critical = 0  # per step, the most bytes any rank sends or receives; summed
    reduced = defaultdict(int)
    for s in range(nsteps):
        before = {r: list(moved[r]) for r in range(world)}
        sends = defaultdict(list)  # (src, dst) -> [payload]
        recvs = defaultdict(list)
        for r in range(world):
            acts = plans[r][s]
            for a in acts:
                if a["verb"] == "send":
                    for b in acts:
                        if b["verb"] in ("recv", "recv_reduce"):
                            assert not _overlap(a["src"], b["dst"]), (
                                f"{name} rank {r} step {s} sends from memory it receives into")
                    buf, off, nb = sim.region(r, a["src"])
                    sends[(r, a["peer"])].append((list(buf[off:off + nb]), a["segmented"]))
                    moved[r][0] += nb
                elif a["verb"] in ("recv", "recv_reduce"):
                    recvs[(a["peer"], r)].append(a)
                    moved[r][1] += a["dst"][3]
        if sends or recvs:
            transfer_steps += 1
        critical += max(max(moved[r][0] - before[r][0], moved[r][1] - before[r][1])
                        for r in range(world))
        assert set(sends) == set(recvs), f"{name} step {s}: unpaired transfers"
        snapshot_heard = {r: set(h) for r, h in heard.items()}
        for key, payloads in sends.items():
            src, dst = key
            assert len(payloads) == len(recvs[key]), f"{name} step {s} {key}: count mismatch"
            for (payload, segmented), a in zip(payloads, recvs[key]):
                # Both sides must cut the transfer alike: segmented exactly when reduced.
                assert segmented == (a["verb"] == "recv_reduce"), (
                    f"{name} step {s} {key}: send segmented={segmented} meets {a['verb']}")
                buf, off, nb = sim.region(dst, a["dst"])
                assert nb == len(payload), f"{name} step {s} {key}: size {len(payload)} into {nb}"
                for i, lab in enumerate(payload):
                    if a["verb"] == "recv":
                        buf[off + i] = lab
                    else:
                        assert not (buf[off + i] & lab), (
                            f"{name} step {s}: rank {dst} reduces a contribution twice")
                        buf[off + i] = buf[off + i] | lab
                if a["verb"] == "recv_reduce":
                    reduced[dst] += nb
                heard[dst] |= snapshot_heard[src]
        for r in range(world):
            for a in plans[r][s]:
                if a["verb"] in ("copy", "reduce"):
                    sbuf, soff, snb = sim.region(r, a["src"])
                    dbuf, doff, dnb = sim.region(r, a["dst"])
                    assert snb == dnb
                    vals = list(sbuf[soff:soff + snb])
                    for i, lab in enumerate(vals):
                        if a["verb"] == "copy":
                            dbuf[doff + i] = lab
                        else:
                            assert not (dbuf[doff + i] & lab), f"{name}: local reduce twice"
                            dbuf[doff + i] = dbuf[doff + i] | lab
                    if a["verb"] == "reduce":
                        reduced[r] += snb
    sim.critical = critical
    return sim, transfer_steps, moved, reduced, heard


def expected_check(sim: Sim, heard) -> None:
    n, c = sim.n, sim.count
    for r in range(n):
        if sim.coll == "allreduce":
            assert sim.data[r] == [frozenset((q, i) for q in range(n)) for i in range(c)]
        elif sim.coll == "broadcast":
            assert sim.data[r] == [frozenset({(sim.root, i)}) for i in range(c)]
        elif sim.coll == "reduce" and r == sim.root:
            assert sim.data[r] == [frozenset((q, i) for q in range(n)) for i in range(c)]
        elif sim.coll == "reduce":
            assert sim.data[r] == [frozenset({("out", r, i)}) for i in range(c)], "non-root output written"
        elif sim.coll == "allgather":
            assert sim.recv[r] == [[frozenset({(q, i)}) for i in range(c)] for q in range(n)]
        elif sim.coll == "reduce_scatter":
            assert sim.recv[r] == [[frozenset((q, r, i) for q in range(n)) for i in range(c)]]
        elif sim.coll == "alltoall":
            assert sim.recv[r] == [[frozenset({(q, r, i)}) for i in range(sim.split(q, r))]
                                   for q in range(n)]
        elif sim.coll == "gather" and r == sim.root:
            assert sim.recv[r] == [[frozenset({(q, i)}) for i in range(c)] for q in range(n)]
        elif sim.coll == "scatter":
            assert sim.recv[r] == [[frozenset({(sim.root, r, i)}) for i in range(c)]]
        elif sim.coll == "barrier":
            assert heard[r] == set(range(n)), f"rank {r} may leave before hearing from all"


def _total_bytes(coll: str, world: int, count: int) -> float:
    if coll in ("allgather", "reduce_scatter", "gather", "scatter", "alltoall"):
        return float(count * world)
    return float(count)


@pytest.mark.parametrize("coll,name", PLANNED, ids=[f"{c}:{n}" for c, n in PLANNED])
def test_plan_invariants(coll: str, name: str) -> None:
    for world in range(1, 17):
        if (coll, name) in POW2_ONLY and world & (world - 1):
            continue
        for count in ([0] if coll == "barrier" else _counts(world)):
            for root in sorted({0, world - 1, world // 2}):
                if root and coll not in ("broadcast", "reduce", "gather", "scatter"):
                    continue
                ctx = f"{coll}:{name} world={world} count={count} root={root}"
                try:
                    sim, steps, moved, reduced, heard = simulate(coll, name, world, count, root)
                    expected_check(sim, heard)
                except AssertionError as exc:
                    raise AssertionError(f"{ctx}: {exc}") from None
                cost = _C._algorithm_cost(coll, name, _total_bytes(coll, world, count), world)
                if count > 0 or coll == "barrier":
                    assert steps == cost["steps"], f"{ctx}: {steps} steps, declared {cost['steps']}"
                if coll == "alltoall" or count == 0:
                    continue
                busiest = max(max(v) for v in moved.values()) if moved else 0
                if (coll, name) in PIPELINED:
                    busiest = sim.critical
                # Uneven chunks add at most an element per step.
                assert abs(busiest - cost["bytes_moved"]) <= steps + 1e-9, (
                    f"{ctx}: busiest rank moves {busiest} B, declared {cost['bytes_moved']}")
                most_reduced = max(reduced.values()) if reduced else 0
                assert most_reduced <= cost["bytes_reduced"] + steps + count * (world > 1), (
                    f"{ctx}: reduces {most_reduced} B, declared {cost['bytes_reduced']}")


@pytest.mark.parametrize("chunk", [1, 2, 5])
def test_chain_broadcast_pipelines(chunk: int) -> None:
    """Small chunks make deep pipelines of small messages: K + N - 2 steps, each link
    carries every byte once, and the invariants above still hold."""
    for world in range(2, 10):
        for count in (1, 13, 40):
            for root in sorted({0, world - 1, world // 2}):
                ctx = f"chain world={world} count={count} root={root} chunk={chunk}"
                try:
                    sim, steps, moved, _, heard = simulate("broadcast", "chain", world, count, root, chunk)
                    expected_check(sim, heard)
                except AssertionError as exc:
                    raise AssertionError(f"{ctx}: {exc}") from None
                k = -(-count // chunk)
                assert steps == k + world - 2, f"{ctx}: {steps} steps"
                assert all(max(v) == count for v in moved.values()), f"{ctx}: {dict(moved)}"
                # Each step of the critical path carries one chunk (chunks differ by an
                # element at most).
                lo, hi = (k + world - 2) * (count // k), (k + world - 2) * -(-count // k)
                assert lo <= sim.critical <= hi, f"{ctx}: critical path {sim.critical} B"


def test_chain_wins_large_broadcasts_across_hosts() -> None:
    # The binomial tree's root sends the message log2 N times; the chain sends it once per
    # link with the levels overlapped, so the model prefers it for large messages at N >= 3.
    assert torchdist_ext.predict("broadcast", 1 << 24, 8, same_host=False)[0] == "chain"
    assert torchdist_ext.predict("broadcast", 1 << 24, 2, same_host=False)[0] == "tree"
    assert torchdist_ext.predict("broadcast", 4096, 8, same_host=False)[0] == "tree"


def test_crowded_hosts_price_a_wake_up_per_message_step() -> None:
    """Ranks that outnumber their host's CPUs add TDX_CROWDED_STEP_US to every message
    step (one host only; window algorithms pay nothing extra), which turns large
    broadcasts from the chain's many hops to the tree's few."""
    wake = int(os.environ.get("TDX_CROWDED_STEP_US") or 200) * 1e-6
    for coll, name in (("allreduce", "ring"), ("allreduce", "rhd"), ("broadcast", "chain"),
                       ("broadcast", "tree"), ("allgather", "ring")):
        for nbytes in (4096.0, float(1 << 22)):
            calm = _C._algorithm_cost(coll, name, nbytes, 4)
            crowded = _C._algorithm_cost(coll, name, nbytes, 4, crowded=True)
            assert crowded["seconds"] - calm["seconds"] == pytest.approx(
                wake * calm["steps"], rel=1e-9, abs=1e-15), (coll, name, nbytes)
            across = _C._algorithm_cost(coll, name, nbytes, 4, one_host=False, crowded=True)
            assert across["seconds"] == _C._algorithm_cost(coll, name, nbytes, 4,
                                                           one_host=False)["seconds"]
    shm = _C._algorithm_cost("allreduce", "shm", float(1 << 20), 4)
    assert _C._algorithm_cost("allreduce", "shm", float(1 << 20), 4,
                              crowded=True)["seconds"] == shm["seconds"]
    if wake >= 50e-6:
        for world in (3, 4):
            assert torchdist_ext.predict("broadcast", 1 << 22, world, same_host=False,
                                         one_host=True)[0] == "chain"
            assert torchdist_ext.predict("broadcast", 1 << 22, world, same_host=False,
                                         one_host=True, crowded=True)[0] == "tree"


def _crowded_group(rank: int, n: int, pin: str) -> dict:
    """Ranks pin themselves to the host's first CPU (``all``: every rank; ``others``:
    every rank but 0) before a new group; the group judges crowding from the union of its
    ranks' CPUs and prices with rank 0's model."""
    if pin == "all" or rank != 0:
        os.sched_setaffinity(0, {sorted(os.sched_getaffinity(0))[0]})
    group = dist.new_group(list(range(n)), backend="tdx")
    t = torch.full((1 << 20,), float(rank))  # 4 MiB
    dist.broadcast(t, src=0, group=group)
    assert torch.equal(t, torch.zeros_like(t))
    own_model = torchdist_ext.predict("broadcast", 1 << 22, n, same_host=False,
                                      one_host=True, crowded=True)[0]
    return {"crowded": torchdist_ext.placement(group)["crowded"],
            "path": torchdist_ext.flight_recorder(group)[-1]["path"],
            "predicted": torchdist_ext.predict("broadcast", 1 << 22, group=group)[0],
            "own_model": own_model}


@pytest.mark.parametrize("pin,rank0_wake_us", [("all", "0"), ("all", "200"), ("others", "200")])
def test_groups_agree_whether_they_are_crowded(pin: str, rank0_wake_us: str) -> None:
    results = run_ranks(_crowded_group, 3, timeout=120, args=(pin,), env={"TDX_SHM": "0"},
                        rank_env={0: {"TDX_CROWDED_STEP_US": rank0_wake_us},
                                  1: {"TDX_CROWDED_STEP_US": "200"},
                                  2: {"TDX_CROWDED_STEP_US": "200"}})
    # Pinned to one CPU together, the three share it; with rank 0 unpinned, two still
    # share one CPU, so the group is crowded either way (each rank's own view differs).
    crowded = True
    for rank, res in enumerate(results):
        assert res["crowded"] == crowded, (rank, res)
        # 4 MiB at 3 ranks: the chain unless rank 0's model charges the wake-ups.
        assert res["path"] == ("tree" if crowded and rank0_wake_us != "0" else "chain"), \
            (rank, res)
        # predict(group=...) answers with the group's model; predict(world) with this
        # rank's own, which differs from rank 0's on the other ranks when rank 0's is 0.
        assert res["predicted"] == res["path"], (rank, res)
        own_wake = rank0_wake_us if rank == 0 else "200"
        assert res["own_model"] == ("chain" if own_wake == "0" else "tree"), (rank, res)


def test_messages_on_one_host_are_priced_apart() -> None:
    """Message algorithms are priced on ``local`` when every rank shares a host (with or
    without windows) and on ``net`` across hosts; window algorithms on their own link.
    The two message links get different terms here, so pricing that ignored the
    placement would fail."""
    before = torchdist_ext.cost_model()
    try:
        torchdist_ext.set_cost_model({"net": {"alpha": 5e-5, "beta": 1e-9, "gamma": 1e-9},
                                      "local": {"alpha": 2e-6, "beta": 1e-11, "gamma": 1e-11}})
        model = torchdist_ext.cost_model()
        assert set(model) == {"net", "local", "shm", "cma"}
        ring = _C._algorithm_cost("allreduce", "ring", float(1 << 20), 4)
        assert ring["link"] == "net" and ring["priced_on"] == "local"
        across = _C._algorithm_cost("allreduce", "ring", float(1 << 20), 4, one_host=False)
        assert across["priced_on"] == "net" and across["steps"] == ring["steps"]
        shm = _C._algorithm_cost("allreduce", "shm", float(1 << 20), 4, one_host=False)
        assert shm["priced_on"] == "shm" and "one host" in shm["unusable"]
        for link, cost in (("local", ring), ("net", across)):
            t = model[link]
            want = t["alpha"] * cost["steps"] + t["beta"] * cost["bytes_moved"] + \
                t["gamma"] * cost["bytes_reduced"]
            assert cost["seconds"] == pytest.approx(want, rel=1e-12), link
        assert ring["seconds"] < across["seconds"] / 10
        # TDX_SHM=0 on one host: no windows, yet messages priced as same-host ones.
        local = torchdist_ext.predict("allreduce", 1 << 20, 4, same_host=False, one_host=True)
        assert local[0] in ("ring", "rhd", "direct")
        assert local[1] == pytest.approx(
            _C._algorithm_cost("allreduce", local[0], float(1 << 20), 4)["seconds"])
        remote = torchdist_ext.predict("allreduce", 1 << 20, 4, same_host=False)
        assert remote[1] == pytest.approx(
            _C._algorithm_cost("allreduce", remote[0], float(1 << 20), 4,
                               one_host=False)["seconds"])
        assert local[1] < remote[1] / 10
    finally:
        torchdist_ext.set_cost_model(before)
    try:
        torchdist_ext.set_algorithm("allreduce", "shm")
        with pytest.raises(ValueError, match="TDX_SHM=0"):
            torchdist_ext.predict("allreduce", 1 << 20, 4, same_host=False, one_host=True)
    finally:
        torchdist_ext.set_algorithm("allreduce", "auto")


def _priced_by_rank0(rank: int, n: int) -> dict:
    """Rank 0 alone changes its model before each new group; the group must run what rank
    0's model picks on every rank."""
    before = torchdist_ext.cost_model()
    free = {"alpha": 0.0, "beta": 0.0, "gamma": 0.0}
    dear = {"alpha": 1.0, "beta": 1.0, "gamma": 1.0}
    paths = {}
    try:
        for name, model in (("local free", {"local": free, "net": dear, "shm": dear,
                                            "cma": dear}),
                            ("net free", {"local": dear, "net": free, "shm": free,
                                          "cma": dear})):
            if rank == 0:
                torchdist_ext.set_cost_model(model)
            group = dist.new_group(list(range(n)), backend="tdx")
            t = torch.full((4099,), float(rank + 1))
            dist.all_reduce(t, group=group)
            assert torch.equal(t, torch.full((4099,), float(n * (n + 1) // 2))), name
            paths[name] = torchdist_ext.flight_recorder(group)[-1]["path"]
    finally:
        torchdist_ext.set_cost_model(before)
    return paths


@pytest.mark.parametrize("world", [2, 3])
def test_groups_price_same_host_messages_with_rank0s_local_terms(world: int) -> None:
    # Without the crowded host's wake-ups (3 ranks on 2 cores), free messages tie.
    results = run_ranks(_priced_by_rank0, world, timeout=120,
                        env={"TDX_CROWDED_STEP_US": "0"})
    for rank, paths in enumerate(results):
        # Messages free on this host: a message algorithm (the first listed on a tie).
        assert paths["local free"] == "ring", (rank, paths)
        # Messages free only between hosts: the window wins, since these ranks share one.
        assert paths["net free"] in ("shm", "shm_direct"), (rank, paths)


def test_registry_and_overrides() -> None:
    algos = torchdist_ext.algorithms()
    assert {"ring", "rhd", "direct", "shm", "shm_direct"} <= set(algos["allreduce"])
    assert torchdist_ext.algorithms("all_reduce") == {"allreduce": algos["allreduce"]}
    with pytest.raises(ValueError, match="unknown allreduce algorithm 'nope'"):
        torchdist_ext.set_algorithm("allreduce", "nope")
    with pytest.raises(ValueError, match="unknown collective"):
        torchdist_ext.set_algorithm("allreduse", "ring")
    try:
        torchdist_ext.set_algorithm("all_gather", "ring")  # torch's spelling: the same pin
        assert torchdist_ext.get_algorithm("allgather") == "ring"
        torchdist_ext.set_algorithm("allreduce", "ring")
        assert torchdist_ext.get_algorithm("allreduce") == "ring"
        assert torchdist_ext.get_algorithm("all_reduce") == "ring"
        assert torchdist_ext.predict("allreduce", 1 << 20, 4)[0] == "ring"
        with pytest.raises(ValueError, match="not both"):
            torchdist_ext.predict("allreduce", 1 << 20, 4, group=object())
        with pytest.raises(ValueError, match="not been initialized"):
            torchdist_ext.predict("allreduce", 1 << 20)  # no world: the default group's
        torchdist_ext.set_algorithm("allgather", "rd")
        with pytest.raises(ValueError, match="power-of-two"):
            torchdist_ext.predict("allgather", 1 << 20, 3)
        with pytest.raises(ValueError, match="one host"):
            torchdist_ext.set_algorithm("allreduce", "shm")
            torchdist_ext.predict("allreduce", 1 << 20, 4, same_host=False)
    finally:
        torchdist_ext.set_algorithm("allreduce", "auto")
        torchdist_ext.set_algorithm("allgather", "auto")
    # auto: the model's cheapest; the message algorithms across hosts.
    assert torchdist_ext.predict("allreduce", 1 << 24, 4)[0] in ("shm", "shm_direct", "cma")
    assert torchdist_ext.predict("allreduce", 1 << 24, 4, same_host=False)[0] in ("ring", "rhd")
    assert torchdist_ext.predict("allreduce", 64, 8, same_host=False)[0] in ("direct", "rhd")


def _pins(rank: int, world: int) -> tuple[str, str]:
    return torchdist_ext.get_algorithm("allreduce"), torchdist_ext.get_algorithm("broadcast")


def test_tdx_algo_pins_every_rank() -> None:
    """TDX_ALGO is read when torchdist_ext is imported: ranks started with it run the
    pinned algorithms (and the harness's env reaches them before that import)."""
    got = run_ranks(_pins, 2, timeout=120, env={"TDX_ALGO": "allreduce:ring,broadcast:chain"})
    assert got == [("ring", "chain")] * 2, got
    # torch.distributed's spelling of the op names works too.
    got = run_ranks(_pins, 2, timeout=120, env={"TDX_ALGO": "all_reduce:rhd,broadcast:chain"})
    assert got == [("rhd", "chain")] * 2, got


def _pin_while_queued(rank: int, world: int) -> str:
    import time

    a, b = torch.ones(4 << 20), torch.ones(1024)
    if rank == 1:
        time.sleep(0.5)  # rank 0 pins while both its ops wait for this rank
    wa = dist.all_reduce(a, async_op=True)
    wb = dist.all_reduce(b, async_op=True)
    if rank == 1:
        wa.wait()
        wb.wait()
    try:
        torchdist_ext.set_algorithm("allreduce", "ring")
        wa.wait()
        wb.wait()
        dist.all_reduce(b)  # issued after the pin on both ranks: runs ring on both
    finally:
        torchdist_ext.set_algorithm("allreduce", "auto")
    paths = [e["path"] for e in torchdist_ext.flight_recorder()[-3:]]
    return f"{a[0].item()} {b[0].item()}", paths


def test_pin_applies_to_ops_issued_after_it() -> None:
    """set_algorithm on one rank while its ops are queued, on the other after they ran:
    the queued ops keep the pins they were issued under, so the ranks still meet."""
    got = run_ranks(_pin_while_queued, 2, timeout=20)
    for values, paths in got:
        assert values == "2.0 4.0", got
        # Queued before the pin: auto's choice (a window on one host); after it: ring.
        assert paths[0] != "ring" and paths[1] != "ring" and paths[2] == "ring", got


def _sweep(rank: int, world: int, counts: list[int] | None = None,
           names: list[tuple[str, str]] | None = None) -> list[str]:
    """Runs every algorithm (pinned), or those in ``names``, on this rank at the usual
    counts or ``counts``; returns failures."""
    assert rank == dist.get_rank()
    failures = []

    def check(label, got, want):
        if not torch.equal(got, want):
            bad = (got != want).nonzero()
            failures.append(f"{label}: rank {rank} first bad index {bad[0].tolist()} "
                            f"got {got.flatten()[:8].tolist()} want {want.flatten()[:8].tolist()}")

    for coll, name in names or ALL:
        if (coll, name) in POW2_ONLY and world & (world - 1):
            continue
        torchdist_ext.set_algorithm(coll, name)
        try:
            counts_here = [0] if coll == "barrier" else (counts or _counts(world))
            if (coll, name) == ("broadcast", "chain") and counts is None:
                counts_here = counts_here + [100_003]  # 800 KB: a pipeline of 4 chunks
            for count in counts_here:
                i = torch.arange(count, dtype=torch.int64)
                label = f"{coll}:{name} world={world} count={count}"
                # Each rank's contribution sits in its own 4-bit field: a missing or
                # doubled contribution changes the sum visibly.
                mine = (i % 7 + 1) << (4 * rank)
                full = sum((i % 7 + 1) << (4 * q) for q in range(world)) if count else i
                if coll == "allreduce":
                    t = mine.clone()
                    dist.all_reduce(t)
                    check(label, t, full)
                    # MAX whose winner rotates over the ranks element by element, so an
                    # algorithm that copied one rank's data would not pass.
                    owner = i % world
                    f = ((i % 7 + 1) + 100 * (owner == rank) + rank).float() * 0.5
                    dist.all_reduce(f, op=dist.ReduceOp.MAX)
                    check(label + " max", f, ((i % 7 + 1) + 100 + owner).float() * 0.5)
                elif coll == "broadcast":
                    root = world - 1
                    t = (i * 10 + rank).clone()
                    dist.broadcast(t, src=root)
                    check(label, t, i * 10 + root)
                elif coll == "reduce":
                    root = world // 2
                    t = mine.clone()
                    dist.reduce(t, dst=root)
                    check(label, t, full if rank == root else mine)
                elif coll == "allgather":
                    out = torch.full((world * count,), -1, dtype=torch.int64)
                    dist.all_gather_into_tensor(out, i * 10 + rank)
                    want = torch.cat([i * 10 + q for q in range(world)]) if count else out
                    check(label, out, want)
                elif coll == "reduce_scatter":
                    blocks = torch.cat([(i + 100 * q) << (4 * rank) for q in range(world)]) if count \
                        else torch.zeros(0, dtype=torch.int64)
                    out = torch.full((count,), -1, dtype=torch.int64)
                    dist.reduce_scatter_tensor(out, blocks)
                    want = sum((i + 100 * rank) << (4 * q) for q in range(world)) if count else out
                    check(label, out, want)
                elif coll == "alltoall":
                    splits = [(rank + q) % 3 + count for q in range(world)]
                    recv_splits = [(q + rank) % 3 + count for q in range(world)]
                    src = torch.cat([torch.full((s,), rank * 100 + q, dtype=torch.int64)
                                     for q, s in enumerate(splits)])
                    out = torch.full((sum(recv_splits),), -1, dtype=torch.int64)
                    dist.all_to_all_single(out, src, recv_splits, splits)
                    want = torch.cat([torch.full((s,), q * 100 + rank, dtype=torch.int64)
                                      for q, s in enumerate(recv_splits)])
                    check(label, out, want)
                elif coll == "barrier":
                    dist.barrier()
                elif coll == "gather":
                    root = world - 1
                    lst = [torch.full((count,), -1, dtype=torch.int64) for _ in range(world)] \
                        if rank == root else None
                    dist.gather(i * 10 + rank, lst, dst=root)
                    if rank == root:
                        for q in range(world):
                            check(f"{label} block {q}", lst[q], i * 10 + q)
                elif coll == "scatter":
                    root = 0
                    out = torch.full((count,), -1, dtype=torch.int64)
                    lst = [i * 10 + q for q in range(world)] if rank == root else None
                    dist.scatter(out, lst, src=root)
                    check(label, out, i * 10 + rank)
                # The pin ran, not auto's choice (which would pass the checks above too).
                path = torchdist_ext.flight_recorder()[-1]["path"]
                if world > 1 and path != name:
                    failures.append(f"{label}: rank {rank} ran {path!r}")
        finally:
            torchdist_ext.set_algorithm(coll, "auto")
    return failures


@pytest.mark.parametrize("world", range(1, 9))
def test_every_algorithm_through_the_backend(world: int) -> None:
    results = run_ranks(_sweep, world, timeout=120)
    failures = [f for per_rank in results for f in per_rank]
    assert not failures, "\n".join(failures[:20])


@pytest.mark.parametrize("world", [3, 4])
def test_segmented_transfers_through_the_backend(world: int) -> None:
    """Messages many segments long (TDX_SEGMENT_BYTES=4096, 80 KB per rank): transfers
    the receiver reduces are cut into segments on both sides, the others move whole, and
    every message algorithm still gets exact results."""
    names = [(c, n) for c, n in PLANNED if c != "barrier"]
    results = run_ranks(_sweep, world, timeout=120, args=([10_007], names),
                        env={"TDX_SEGMENT_BYTES": "4096", "TDX_SHM": "0"})
    failures = [f for per_rank in results for f in per_rank]
    assert not failures, "\n".join(failures[:20])


def test_chain_plan_matches_its_cost_at_real_sizes() -> None:
    """At the sizes auto meets, K > 1: the plan's steps are the cost's, K = ceil(S / 256 KiB)
    up to 1024 chunks."""
    for nbytes in (256 * 1024 + 1, 1 << 20, 300 << 20):
        for world in (3, 8):
            steps, _ = _C._plan("broadcast", "chain", world, 1, count=nbytes, elem_size=1, root=0)
            cost = _C._algorithm_cost("broadcast", "chain", float(nbytes), world)
            k = min(1024, -(-nbytes // (256 * 1024)))
            assert len(steps) == cost["steps"] == k + world - 2, (nbytes, world)


def _long_chain(rank: int, world: int, nbytes: int) -> bool:
    torchdist_ext.set_algorithm("broadcast", "chain")
    i = torch.arange(nbytes, dtype=torch.int64)
    want = ((i * 7 + 3) % 251).to(torch.uint8)
    t = want.clone() if rank == 1 else torch.zeros(nbytes, dtype=torch.uint8)
    dist.broadcast(t, src=1)
    return bool(torch.equal(t, want))


def test_chain_broadcast_of_more_steps_than_the_tag_holds() -> None:
    """65 MiB: 260 chunks, 261 steps at 3 ranks, more than the tag's step field counts
    (it wraps); one message per pair and step, matched in order, keeps it exact."""
    assert all(run_ranks(_long_chain, 3, timeout=120, args=((65 << 20) + 3,),
                         env={"TDX_SHM": "0"}))


def _shm_on_some_ranks(rank: int, n: int) -> dict:
    """Rank 0 turns the windows off before a new group, the others leave them on: the group
    must agree on no windows, not hang with half its ranks in shared memory."""
    import os

    os.environ["TDX_SHM"] = "0" if rank == 0 else "1"
    try:
        group = dist.new_group(list(range(n)), backend="tdx")
    finally:
        os.environ.pop("TDX_SHM", None)
    out = {}
    for op in ("all_reduce", "broadcast", "barrier"):
        t = torch.full((70_001,), float(rank + 1))
        if op == "all_reduce":
            dist.all_reduce(t, group=group)
            ok = torch.equal(t, torch.full_like(t, float(n * (n + 1) // 2)))
        elif op == "broadcast":
            dist.broadcast(t, src=n - 1, group=group)
            ok = torch.equal(t, torch.full_like(t, float(n)))
        else:
            dist.barrier(group=group)
            ok = True
        out[op] = (ok, torchdist_ext.flight_recorder(group)[-1]["path"])
    out["placement"] = (torchdist_ext.placement(group), torchdist_ext.placement())
    return out


def test_ranks_that_disagree_on_tdx_shm_agree_on_no_windows() -> None:
    window = {a["name"] for a in _C._algorithms() if a["link"] != "net"}
    for rank, res in enumerate(run_ranks(_shm_on_some_ranks, 3, timeout=60)):
        group, world = res.pop("placement")
        crowded = 3 > _C._usable_cpus()
        threads = max(1, min(8, _C._usable_cpus() // 3))  # TDX_SHM_THREADS=auto
        assert group == {"one_host": True, "windows": False, "crowded": crowded,
                         "pass_threads": 1}, (rank, group)
        assert world == {"one_host": True, "windows": True, "crowded": crowded,
                         "pass_threads": threads}, (rank, world)
        for op, (ok, path) in res.items():
            assert ok, (rank, op, path)
            assert path not in window, (rank, op, path)


def _refused_pin(rank: int, n: int) -> dict:
    out: dict = {}
    for collective, name in (("allgather", "rd"), ("allreduce", "shm")):
        torchdist_ext.set_algorithm(collective, name)
        try:
            t = torch.full((5,), float(rank))
            if collective == "allgather":
                dist.all_gather([torch.empty(5) for _ in range(n)], t)
            else:
                dist.all_reduce(t)
            out[name] = "ran"
        except dist.DistBackendError as exc:
            out[name] = str(exc)
        finally:
            torchdist_ext.set_algorithm(collective, "auto")
    got = [torch.empty(5) for _ in range(n)]
    dist.all_gather(got, torch.full((5,), float(rank)))
    out["after"] = [g[0].item() for g in got]
    out["flight"] = [(e["state"], e["op"]) for e in torchdist_ext.flight_recorder()[-3:]]
    return out


@pytest.mark.parametrize("debug", ["WARN", "DETAIL"])
def test_a_pin_that_cannot_run_fails_its_op_and_not_the_group(debug: str) -> None:
    """Pinning rd at 3 ranks, or a window algorithm with TDX_SHM=0, is bad input that
    every rank refuses before any transfer: that op fails naming why and the fix, and the
    group's next op runs. Under DETAIL the fingerprint exchange before it moves none of
    the op's data, so the same holds."""
    results = run_ranks(_refused_pin, 3, timeout=120, env={"TDX_SHM": "0", "TDX_DEBUG": debug})
    for rank, res in enumerate(results):
        assert f"r{rank}/3" in res["rd"] and "all_gather" in res["rd"], res
        assert "pinned to 'rd', which needs a power-of-two world size" in res["rd"], res
        assert "set it back to 'auto'" in res["rd"], res
        assert "pinned to 'shm'" in res["shm"] and "TDX_SHM=0" in res["shm"], res
        assert res["after"] == [0.0, 1.0, 2.0], res
        states = [s for s, _ in res["flight"]]
        assert states[-1] == "done" and "done" not in states[:2], res


def _pinned_on_one_rank(rank: int, n: int) -> dict:
    """Rank 0 alone pins rd (which 3 ranks cannot run): it refuses op #1 while the others
    run it through the window, then its op #2 meets their op #1 there."""
    if rank == 0:
        torchdist_ext.set_algorithm("allgather", "rd")
    out: dict = {}
    for i in (1, 2):
        got = [torch.empty(4) for _ in range(n)]
        try:
            dist.all_gather(got, torch.full((4,), float(10 * i + rank)))
            out[i] = [g[0].item() for g in got]
        except dist.DistBackendError as exc:
            out[i] = str(exc)
        if rank == 0:
            torchdist_ext.set_algorithm("allgather", "auto")
    return out


def test_a_rank_that_skipped_an_op_is_caught_at_the_next_window_op() -> None:
    """The window stamps each op with the group's sequence number: ops that agree on
    kind and size but not on which op this is fail on every rank, naming both numbers,
    instead of pairing rank 0's second all_gather with the others' first."""
    results = run_ranks(_pinned_on_one_rank, 3, timeout=60)
    assert "pinned to 'rd'" in results[0][1], results
    for rank, res in enumerate(results):
        for i in (1, 2):
            # Nobody returns a gather that mixes the two ops.
            assert isinstance(res[i], str) or res[i] == [10.0 * i + q for q in range(3)], \
                (rank, res)
    # Rank 0's second op meets the others' first: all three say so, naming both numbers.
    # Ranks 1 and 2 may instead read rank 0's refusal of op #1 in the store first (their
    # window set-up stalled past the store check's grace), and rank 0 their notice of it.
    for rank, i in ((0, 2), (1, 1), (2, 1)):
        msg = results[rank][i]
        assert ("op #1" in msg and "op #2" in msg and "skipped on only some ranks" in msg
                or "rank 0 refused" in msg), (rank, msg)


def _refused_mid_coalesced(rank: int, n: int) -> dict:
    """direct holds every rank's buffer in scratch, up to 64 MiB x world: the first entry
    fits and runs, the second does not and is refused after it."""
    pg = dist.distributed_c10d._get_default_group()
    torchdist_ext.set_algorithm("allreduce", "direct")
    out: dict = {}
    small, big = torch.ones(4), torch.ones((64 << 20) // 4 // n + 1)
    try:
        pg.allreduce_coalesced([small, big]).wait()
        out["coalesced"] = "ran"
    except dist.DistBackendError as exc:
        out["coalesced"] = str(exc)
    torchdist_ext.set_algorithm("allreduce", "auto")
    out["small"] = small.tolist()
    try:
        dist.all_reduce(torch.ones(2))
        out["next"] = "ran"
    except dist.DistBackendError as exc:
        out["next"] = str(exc)
    return out


def test_the_scratch_limit_refusal_names_the_product_and_what_fits() -> None:
    """direct's limit is on bytes x ranks: the refusal gives both factors, the product
    and the most bytes per rank that fit, so 16 MiB + 12 bytes at 4 ranks does not read
    as within "64 MiB x world size"."""
    from torchdist_ext import _C

    why = _C._algorithm_cost("allreduce", "direct", float((16 << 20) + 12), 4)["unusable"]
    assert "16777228 bytes x 4 ranks = 67108912 bytes" in why, why
    assert "limit of 67108864" in why and "at most 16777216 bytes per rank" in why, why
    assert _C._algorithm_cost("allreduce", "direct", float(16 << 20), 4)["unusable"] == ""


def test_a_pin_refused_after_part_of_a_coalesced_op_breaks_the_group() -> None:
    """A refusal after earlier entries ran leaves written outputs behind, so unlike a
    refusal before any step it breaks the group: a retry must not reduce twice."""
    for rank, res in enumerate(run_ranks(_refused_mid_coalesced, 2, timeout=120)):
        assert "pinned to 'direct'" in res["coalesced"], (rank, res)
        assert res["small"] == [2.0] * 4, (rank, res)  # the first entry ran
        assert "unusable after an earlier failure" in res["next"], (rank, res)



WINDOW_REDUCTIONS = [("allreduce", "shm"), ("allreduce", "shm_direct"), ("reduce", "shm"),
                     ("reduce", "shm_direct"), ("reduce_scatter", "shm")]
SLOT_BYTES = 2 << 20  # halves of 1 MiB: 262,144 floats per chunk


def _window_order(coll: str, name: str, n: int, rank: int, count: int) -> list[torch.Tensor]:
    """Per element, the ranks in the order the window algorithm folds them: (index of the
    first rank, then ...) as a list of n index tensors, one per position."""
    i = torch.arange(count)
    if coll == "reduce_scatter":  # this rank's block: its own input first
        first = torch.full((count,), rank)
    elif name == "shm_direct":  # all_reduce: slot 0 first; reduce: the root's own first
        first = torch.full((count,), 0 if coll == "allreduce" else n - 1)
    else:  # the owner of the element's piece within its chunk starts from its own input
        per = SLOT_BYTES // 2 // 4
        j, cnt = i % per, torch.clamp(count - i // per * per, max=per)
        base, extra = cnt // n, cnt % n
        # pieceBegin(cnt, n, q) = q * base + min(q, extra): the last q whose begin <= j
        first = torch.zeros(count, dtype=torch.int64)
        for q in range(1, n):
            first = torch.where(q * base + torch.clamp(extra, max=q) <= j, q, first)
    if coll == "reduce" and name == "shm":  # the owner's slot, then every other slot
        rest = [torch.where(first <= q, q + 1, q) for q in range(n - 1)]
        return [first] + rest
    return [(first + k) % n for k in range(n)]


def _window_reductions_by_arrival(rank: int, n: int, count: int) -> dict:
    """Every window reduction, SUM and PREMUL_SUM by 0.5 (exact scaling, so the expected
    bits are known), on float32 values whose sums round differently in every order, with
    the ranks arriving in order, in reverse order and together. Returns the mismatches
    against the float32 sums in each algorithm's fold order, and the paths that ran."""
    g = torch.Generator().manual_seed(1234)
    inputs = [((torch.rand(n * count, generator=g, dtype=torch.float64) - 0.5)
               * torch.pow(10.0, torch.randint(-4, 5, (n * count,), generator=g).double())
               ).float() for _ in range(n)]
    out: dict = {"bad": [], "paths": set()}
    delays = {"in order": 0.03 * rank, "reversed": 0.03 * (n - 1 - rank), "together": 0.0}
    for op, factor in (("SUM", 1.0), ("PREMUL_SUM", 0.5)):
        redop = dist.ReduceOp.SUM if op == "SUM" else dist._make_nccl_premul_sum(factor)
        scaled = [x * factor for x in inputs]  # exact: a power of two
        for coll, name in WINDOW_REDUCTIONS:
            if coll == "reduce_scatter":
                parts = [x.chunk(n)[rank] for x in scaled]
            else:
                parts = [x[:count] for x in scaled]
            order = _window_order(coll, name, n, rank, count)
            stack = torch.stack(parts)
            want = stack.gather(0, order[0][None]).squeeze(0).clone()
            for pos in order[1:]:
                want = want + stack.gather(0, pos[None]).squeeze(0)  # float32, in order
            torchdist_ext.set_algorithm(coll, name)
            for arrival, delay in delays.items():
                dist.barrier()
                time.sleep(delay)
                if coll == "allreduce":
                    t = inputs[rank][:count].clone()
                    dist.all_reduce(t, op=redop)
                elif coll == "reduce":
                    t = inputs[rank][:count].clone()
                    dist.reduce(t, dst=n - 1, op=redop)
                else:
                    t = torch.empty(count)
                    dist.reduce_scatter_tensor(t, inputs[rank].clone(), op=redop)
                out["paths"].add((coll, name, torchdist_ext.flight_recorder()[-1]["path"]))
                if coll == "reduce" and rank != n - 1:
                    want_here = inputs[rank][:count]  # the other ranks' inputs are left alone
                else:
                    want_here = want
                if not torch.equal(t, want_here):
                    bad = (t != want_here).nonzero()[0].item()
                    out["bad"].append(f"rank {rank} {op} {coll}:{name} {arrival}: "
                                      f"{(t != want_here).sum().item()} elements differ, first "
                                      f"at {bad}: {t[bad].item()!r} != {want_here[bad].item()!r}")
            torchdist_ext.set_algorithm(coll, "auto")
    return out


@pytest.mark.parametrize("world", [3, 4])
def test_window_reductions_fold_in_a_fixed_order_whatever_arrives_first(world: int) -> None:
    """A rank folds peers' pieces in as they become ready, several at once a block at a
    time, but per element always in the same order: own input first, then the next ranks
    around. The results must equal the float32 sums in that order, bit for bit, however
    the ranks arrive (staggered by 30 ms each way, or together; on a loaded host the
    stagger may not split the runs, which this cannot tell). 300,007 floats: two window
    chunks, many 16 KiB blocks per piece. PREMUL_SUM by 0.5 checks that each rank scales
    its own input once and nobody else's."""
    count = 300_007
    results = run_ranks(_window_reductions_by_arrival, world, args=(count,), timeout=240,
                        env={"TDX_SHM_SLOT_BYTES": str(SLOT_BYTES)})
    bad = [b for res in results for b in res["bad"]]
    assert not bad, "\n".join(bad[:10])
    for res in results:
        assert res["paths"] == {(c, nm, nm) for c, nm in WINDOW_REDUCTIONS}, res["paths"]


def _predict_after_the_window_failed(rank: int, n: int) -> dict:
    out: dict = {"before": torchdist_ext.predict("allreduce", 4096)[0]}
    t = torch.full((1024,), float(rank))
    dist.all_reduce(t)  # tries the window, which cannot be made, and runs messages
    out["sum"] = t[0].item()
    out["ran"] = torchdist_ext.flight_recorder()[-1]["path"]
    out["after"] = torchdist_ext.predict("allreduce", 4096)[0]
    torchdist_ext.set_algorithm("allreduce", "shm")
    try:
        torchdist_ext.predict("allreduce", 4096)
        out["pinned"] = "no error"
    except (ValueError, RuntimeError) as exc:
        out["pinned"] = str(exc)
    finally:
        torchdist_ext.set_algorithm("allreduce", "auto")
    return out


def _host_rule_after_the_window_failed(rank: int, n: int) -> dict:
    from torchdist_ext import _C

    model = torchdist_ext.predict("allreduce", 4096, n, same_host=False, one_host=True)[0]
    other = next(a for a in ("ring", "rhd", "direct") if a != model)
    _C._set_cost_rules([{"collective": "allreduce", "world": n, "placement": "host",
                         "crowded": c, "threads": 1, "min_bytes": 0, "max_bytes": 1e9,
                         "algorithm": other} for c in (False, True)])
    group = dist.new_group(list(range(n)))
    t = torch.full((1024,), float(rank))
    dist.all_reduce(t, group=group)  # the window cannot be made: messages, by the rule
    return {"other": other, "sum": t[0].item(), "threads": torchdist_ext.placement(group)[
        "pass_threads"], "ran": torchdist_ext.flight_recorder(group)[-1]["path"],
        "after": torchdist_ext.predict("allreduce", 4096, group=group)[0]}


def test_a_group_without_its_window_follows_the_rules_for_no_windows() -> None:
    """A group that settled on 2 threads per rank for its window all_reduce, whose window
    then cannot be made, runs as a group with windows off: with 1 thread, so the rules
    measured without windows (1 thread) decide."""
    results = run_ranks(_host_rule_after_the_window_failed, 2, timeout=120,
                        env={"TDX_SHM_SLOT_BYTES": str(1 << 44), "TDX_SHM_THREADS": "2"})
    for res in results:
        assert res["threads"] == 2 and res["sum"] == 1.0, res
        assert res["ran"] == res["after"] == res["other"], res


def test_predict_for_a_group_whose_window_could_not_be_made() -> None:
    """A slot no /dev/shm can hold: the group's window fails at its first op, which runs
    a message algorithm instead. From then on predict(group) answers what the group
    runs, and refuses a pinned window algorithm as the op would."""
    results = run_ranks(_predict_after_the_window_failed, 2, timeout=120,
                        env={"TDX_SHM_SLOT_BYTES": str(1 << 44)})
    window_algos = {"shm", "shm_direct", "cma"}
    for res in results:
        assert res["before"] in window_algos, res
        assert res["sum"] == 1.0, res
        assert res["ran"] not in window_algos and res["after"] == res["ran"], res
        assert "pinned to 'shm'" in res["pinned"] and "could not be made" in res["pinned"], res

"""A foreign process writes garbage to every TCP port the ranks listen on while they run
collectives. Each rank must finish with exact results or raise a clear exception: no
crash, no hang, no wrong result.

The ranks' listening sockets are found from /proc: the socket inodes among
/proc/<pid>/fd, looked up in /proc/<pid>/net/tcp{,6} in state LISTEN. With the harness's
FileStore those are UCX's TCP listeners (one per interface); the TCPStore variant
re-initialises the group on a TCPStore hosted by rank 0 and adds the store's port;
the ranks create and destroy a group now and then, whose setup goes through the store.

A job on one host loads no UCX TCP transport (TDX_UCX_TCP=auto) and so listens on no
port at all, which the last test checks. The attacks run with TDX_UCX_TCP=1, as a job
that spans hosts must.

A connection that starts with UCX's TCP magic number and then lies (a forged handshake)
crashes UCX 1.22.0 itself; those cases are strict expected failures until UCX validates
what follows the magic.
"""

from __future__ import annotations

import os
import random
import socket
import struct
import threading
import time
from datetime import timedelta

import pytest
import torch
import torch.distributed as dist

from torchdist_ext.testing import RankFailure, run_ranks

WORLD = 3
TIMEOUT = 30.0          # group timeout; run_ranks adds 30 s before it kills the ranks
GARBAGE_SECONDS = 5.0   # at least this long of garbage while the ranks loop
MIN_CONNECTIONS = 20    # ... and at least this many garbage connections per port
MAX_ITERS = 100_000
SEED = 1123

LISTEN = "0A"
# A job that spans hosts loads UCX's TCP transport; this one is made to on one host.
EXPOSED = {"TDX_UCX_TCP": "1"}
UCX_TCP_MAGIC = (0xCAFEBABE12345678).to_bytes(8, "little")  # first 8 bytes a UCX peer sends


# -- the foreign side: finding the ports and writing garbage --------------------------------

def _socket_inodes(pid: int) -> set[str]:
    inodes = set()
    for fd in os.listdir(f"/proc/{pid}/fd"):
        try:
            link = os.readlink(f"/proc/{pid}/fd/{fd}")
        except OSError:  # closed meanwhile
            continue
        if link.startswith("socket:["):
            inodes.add(link[8:-1])
    return inodes


def _address(hex_addr: str, family: str) -> str:
    raw = bytes.fromhex(hex_addr)
    if family == "tcp":
        ip = socket.inet_ntop(socket.AF_INET, raw[::-1])
        return "127.0.0.1" if ip == "0.0.0.0" else ip
    # /proc prints IPv6 as four host-order 32-bit words
    raw = b"".join(raw[i:i + 4][::-1] for i in range(0, 16, 4))
    ip = socket.inet_ntop(socket.AF_INET6, raw)
    return "::1" if ip == "::" else ip


def listening_ports(pid: int) -> list[tuple[str, int]]:
    """(address, port) of every TCP socket that process `pid` listens on."""
    inodes = _socket_inodes(pid)
    found = []
    for family in ("tcp", "tcp6"):
        try:
            with open(f"/proc/{pid}/net/{family}") as f:
                lines = f.read().splitlines()[1:]
        except FileNotFoundError:
            continue
        for line in lines:
            fields = line.split()
            local, state, inode = fields[1], fields[3], fields[9]
            if state == LISTEN and inode in inodes:
                addr, port = local.split(":")
                found.append((_address(addr, family), int(port, 16)))
    return sorted(set(found))


class Garbage:
    """Connects to every target over and over and writes junk: random bytes, all 0xff
    (huge length fields) or all zeros; sent as one burst, several bursts, a trickle, a
    burst then a reset (RST), or on a connection held open that keeps receiving junk."""

    def __init__(self, seed: int) -> None:
        self.rng = random.Random(seed)
        self.targets: dict[tuple[str, int], str] = {}  # (addr, port) -> label
        self.stats: dict[tuple[str, int], dict[str, int]] = {}
        self.held: list[tuple[socket.socket, tuple[str, int]]] = []
        self.stop = threading.Event()

    def add(self, target: tuple[str, int], label: str) -> None:
        self.targets.setdefault(target, label)
        self.stats.setdefault(target, {"connections": 0, "bytes": 0,
                                       "refused": 0, "reset_by_peer": 0})

    def _junk(self, target: tuple[str, int], first: bool = False) -> bytes:
        shape = self.rng.random()
        size = self.rng.choice([1, 3, 8, 16, 64, 512, 4096, 65536])
        if shape < 0.45:
            return b"\xff" * size
        if shape < 0.55:
            return b"\x00" * size
        return self.rng.randbytes(size)

    def _send(self, s: socket.socket, target: tuple[str, int], data: bytes) -> None:
        s.sendall(data)
        self.stats[target]["bytes"] += len(data)

    def hit(self, target: tuple[str, int]) -> None:
        st = self.stats[target]
        family = socket.AF_INET6 if ":" in target[0] else socket.AF_INET
        s = socket.socket(family, socket.SOCK_STREAM)
        s.settimeout(2.0)
        try:
            s.connect(target)
        except (ConnectionRefusedError, socket.timeout, OSError):
            st["refused"] += 1
            s.close()
            return
        st["connections"] += 1
        kind = self.rng.randrange(5)
        try:
            self._send(s, target, self._junk(target, first=True)[:32 if kind == 1 else None])
            if kind == 1:    # trickle
                for _ in range(self.rng.randint(1, 5)):
                    time.sleep(0.005)
                    self._send(s, target, self._junk(target)[:32])
            elif kind == 2:  # reset (RST) instead of a close
                s.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, struct.pack("ii", 1, 0))
            elif kind == 3 and len(self.held) < 12:  # keep it open, write more later
                self.held.append((s, target))
                return
            elif kind == 4:  # more bursts on the same connection
                for _ in range(self.rng.randint(1, 3)):
                    self._send(s, target, self._junk(target))
        except (ConnectionResetError, BrokenPipeError, socket.timeout, OSError):
            st["reset_by_peer"] += 1
        s.close()

    def feed_held(self) -> None:
        for s, target in list(self.held):
            try:
                self._send(s, target, self._junk(target)[:4096])
            except (ConnectionResetError, BrokenPipeError, socket.timeout, OSError):
                self.stats[target]["reset_by_peer"] += 1
                s.close()
                self.held.remove((s, target))

    def round(self) -> None:
        before = sum(s["connections"] for s in self.stats.values())
        for target in list(self.targets):
            if self.stop.is_set():
                return
            self.hit(target)
        self.feed_held()
        if sum(s["connections"] for s in self.stats.values()) == before:
            time.sleep(0.05)  # every port refused: the ranks are tearing down

    def close(self) -> None:
        for s, _ in self.held:
            s.close()
        self.held.clear()


def _wait_for_ranks(tmp: str, stop: threading.Event,
                    errors: list[str]) -> tuple[dict[int, int], int | None] | None:
    """Each rank's pid, and the TCPStore's port if a rank reported one, once every rank
    has written its file; None (with the reason in `errors`) if they never do."""
    deadline = time.monotonic() + 60
    pids: dict[int, int] = {}
    store_port = None
    while len(pids) < WORLD and not stop.is_set():
        for r in range(WORLD):
            path = os.path.join(tmp, f"rank{r}")
            if r not in pids and os.path.exists(path):
                with open(path) as f:
                    pid, port = f.read().split()
                pids[r] = int(pid)
                if port != "-":
                    store_port = int(port)
        if time.monotonic() > deadline:
            errors.append(f"ranks never reported their pids (got {sorted(pids)})")
            return None
        time.sleep(0.05)
    return pids, store_port


def _attack(tmp: str, garbage: Garbage, errors: list[str]) -> None:
    """The foreign process's work: wait for the ranks, find their ports, write garbage
    until told to stop; tell the ranks when to start and when they may finish."""
    try:
        found = _wait_for_ranks(tmp, garbage.stop, errors)
        if found is None:
            return
        pids, store_port = found

        def scan() -> None:  # again now and then: a listener opened later is hit too
            for r, pid in pids.items():
                try:
                    ports = listening_ports(pid)
                except OSError:  # the rank has exited
                    continue
                for target in ports:
                    garbage.add(target, "store" if target[1] == store_port else f"rank {r} UCX")

        scan()
        for r in range(WORLD):
            if not any(label == f"rank {r} UCX" for label in garbage.targets.values()):
                errors.append(f"rank {r} (pid {pids[r]}) listens on no TCP port")
        if store_port is not None and "store" not in garbage.targets.values():
            errors.append(f"store port {store_port} not found among rank 0's listeners")
        garbage.round()
        open(os.path.join(tmp, "go"), "w").close()
        start = last_scan = time.monotonic()
        stopped = False
        while not garbage.stop.is_set():
            garbage.round()
            if time.monotonic() - last_scan > 1.0:
                scan()
                last_scan = time.monotonic()
            enough = all(s["connections"] >= MIN_CONNECTIONS for s in garbage.stats.values())
            if not stopped and enough and time.monotonic() - start >= GARBAGE_SECONDS:
                open(os.path.join(tmp, "stop"), "a").close()  # keep going until they finish
                stopped = True
    except Exception as e:  # noqa: BLE001 - reported by the test
        errors.append(f"garbage thread: {type(e).__name__}: {e}")
    finally:
        open(os.path.join(tmp, "go"), "a").close()
        open(os.path.join(tmp, "stop"), "a").close()
        garbage.close()


# -- the ranks -----------------------------------------------------------------------------

def _loop(rank: int, n: int, tmp: str, store_kind: str) -> dict:
    store_port = "-"
    if store_kind == "tcp":
        # Move the job onto a TCPStore hosted by rank 0, so its port is exposed as well.
        default_store = dist.distributed_c10d._get_default_store()
        if rank == 0:
            master = dist.TCPStore("127.0.0.1", 0, n, is_master=True,
                                   timeout=timedelta(seconds=TIMEOUT), wait_for_workers=False)
            default_store.set("tcp_port", str(master.port))
        port = int(default_store.get("tcp_port"))
        dist.destroy_process_group()
        store = master if rank == 0 else dist.TCPStore(
            "127.0.0.1", port, n, is_master=False, timeout=timedelta(seconds=TIMEOUT))
        dist.init_process_group("tdx", store=store, rank=rank, world_size=n,
                                timeout=timedelta(seconds=TIMEOUT))
        store_port = str(port) if rank == 0 else "-"

    fails: list[str] = []
    iters = groups = 0
    start = time.monotonic()
    try:
        t = torch.ones(64)
        dist.all_reduce(t)  # every rank connected: UCX listens and holds its endpoints
        with open(os.path.join(tmp, f"rank{rank}.tmp"), "w") as f:
            f.write(f"{os.getpid()} {store_port}")
        os.rename(os.path.join(tmp, f"rank{rank}.tmp"), os.path.join(tmp, f"rank{rank}"))
        go = os.path.join(tmp, "go")
        deadline = time.monotonic() + 60
        while not os.path.exists(go) and time.monotonic() < deadline:
            time.sleep(0.02)
        dist.barrier()
        rng = random.Random(SEED)  # same sizes on every rank
        stop = os.path.join(tmp, "stop")
        for it in range(MAX_ITERS):
            count = rng.choice([1, 17, 1000, 4096, 30000])
            base = torch.arange(count, dtype=torch.int64)
            t = ((base + it + rank) % 7).to(torch.float32)
            dist.all_reduce(t)
            want = sum(((base + it + r) % 7) for r in range(n)).to(torch.float32)
            if not torch.equal(t, want):
                fails.append(f"r{rank} iter {it} all_reduce n={count}")
            out = torch.empty(count * n, dtype=torch.int32)
            dist.all_gather_into_tensor(out, (base * 3 + rank + it).to(torch.int32))
            want = torch.cat([(base * 3 + r + it).to(torch.int32) for r in range(n)])
            if not torch.equal(out, want):
                fails.append(f"r{rank} iter {it} all_gather_into_tensor n={count}")
            if it % 200 == 199:  # a new group: its setup goes through the store
                g = dist.new_group(backend="tdx")
                t = torch.full((100,), float(rank + it))
                dist.all_reduce(t, group=g)
                if not torch.equal(t, torch.full((100,), float(sum(range(n)) + n * it))):
                    fails.append(f"r{rank} iter {it} all_reduce on a new group")
                dist.destroy_process_group(g)
                groups += 1
            iters += 1
            if it % 20 == 19:  # everyone stops at the same iteration
                flag = torch.tensor([1 if os.path.exists(stop) else 0])
                dist.all_reduce(flag, op=dist.ReduceOp.MAX)
                if flag.item():
                    break
        return {"error": None, "fails": fails[:10], "iters": iters,
                "groups": groups, "seconds": time.monotonic() - start}
    except Exception as e:  # noqa: BLE001 - the test checks the type and message
        return {"error": f"{type(e).__name__}: {e}", "fails": fails[:10], "iters": iters,
                "groups": groups, "seconds": time.monotonic() - start}


def _run(tmp: str, store_kind: str, env: dict | None = None) -> None:
    garbage = Garbage(SEED)
    errors: list[str] = []
    attacker = threading.Thread(target=_attack, args=(tmp, garbage, errors), daemon=True)
    attacker.start()
    start = time.monotonic()
    try:
        results = run_ranks(_loop, WORLD, timeout=TIMEOUT + 60, args=(tmp, store_kind), env=env)
    finally:
        garbage.stop.set()
        attacker.join(timeout=30)
    wall = time.monotonic() - start
    assert not attacker.is_alive(), "the garbage thread did not stop"
    assert not errors, errors

    for target, st in sorted(garbage.stats.items()):
        print(f"{garbage.targets[target]:>10} {target[0]}:{target[1]}: {st}")
    for rank, r in enumerate(results):
        print(f"rank {rank}: {r}")
    print(f"wall {wall:.1f} s")

    labels = set(garbage.targets.values())
    assert {f"rank {r} UCX" for r in range(WORLD)} <= labels, labels
    if store_kind == "tcp":
        assert "store" in labels, labels
    for target, st in garbage.stats.items():
        assert st["connections"] >= MIN_CONNECTIONS and st["bytes"] > 0, (target, st)
    for rank, r in enumerate(results):
        assert not r["fails"], f"rank {rank} got wrong results: {r['fails']}"
        if r["error"] is not None:
            # Failing is allowed, but only with a clear error from the backend.
            assert r["error"].split(":")[0] in ("DistBackendError", "RuntimeError"), r["error"]
            assert len(r["error"]) > 30, r["error"]
        else:
            assert r["iters"] > 0, r


@pytest.mark.parametrize("case", ["ucx-tcp", "shm", "tcpstore"])
def test_garbage_on_listening_ports(tmp_path, case: str) -> None:
    """Random bytes, all-0xff and all-zero junk on every UCX port (and the TCPStore's).
    ucx-tcp: no shared-memory windows and UCX's peer error handling on every endpoint, so
    every collective's data crosses UCX's TCP connections while the junk arrives; shm:
    collectives through shared-memory windows; tcpstore: the same on a TCPStore, whose
    port gets junk too."""
    env = dict(EXPOSED)
    if case == "ucx-tcp":
        env.update({"TDX_SHM": "0", "TDX_UCX_PEER_ERRORS": "1"})
    _run(str(tmp_path), "tcp" if case == "tcpstore" else "file", env=env)


# Connections that get past UCX 1.22.0's only check (its magic number). UCX then reads
# the bytes as messages of an established connection: a 1-byte message id and a 4-byte
# length, both trusted (its checks are assertions, compiled out of release builds).
FORGED = {
    # A length far beyond the receive buffer, then more bytes than the buffer holds: UCX
    # keeps reading past the buffer's end (what random junk after the magic mostly hits).
    "oversized-length": UCX_TCP_MAGIC + struct.pack("<BI", 0, 0x7FFFFFFF) + bytes(3 << 20),
    # Message id 33, UCX's own "put" request: copy 8 bytes to the address the packet names.
    "put-request": UCX_TCP_MAGIC + struct.pack("<BI", 33, 20)
    + struct.pack("<QQI", 0xDEAD0000, 8, 0) + bytes(8),
}


class UcxFault(AssertionError):
    """After a forged handshake arrived, a rank died from a signal, or the ranks' ops
    failed (UCX closed a connection it should not have; the op then timed out)."""


FORGED_TIMEOUT = 20.0  # group timeout: the failure it may end in is a timed-out op


def _forge(tmp: str, payload: bytes, errors: list[str], stop: threading.Event) -> None:
    """Wait for the ranks, send `payload` once to each of their UCX ports, let them run on
    for a few seconds, then tell them to finish."""
    held = []
    try:
        found = _wait_for_ranks(tmp, stop, errors)
        if found is None:
            return
        pids = found[0]
        open(os.path.join(tmp, "go"), "w").close()
        targets = [t for pid in pids.values() for t in listening_ports(pid)]
        if not targets:
            errors.append("the ranks listen on no TCP port")
        for target in targets:
            family = socket.AF_INET6 if ":" in target[0] else socket.AF_INET
            s = socket.socket(family, socket.SOCK_STREAM)
            s.settimeout(5.0)
            try:
                s.connect(target)
                s.sendall(payload)
            except OSError:  # the rank already died of an earlier one
                pass
            held.append(s)
        stop.wait(5.0)
    except Exception as e:  # noqa: BLE001 - reported by the test
        errors.append(f"forging thread: {type(e).__name__}: {e}")
    finally:
        open(os.path.join(tmp, "go"), "a").close()
        open(os.path.join(tmp, "stop"), "a").close()
        for s in held:
            s.close()


@pytest.mark.xfail(
    raises=UcxFault, strict=True,
    reason="UCX 1.22.0's TCP transport trusts the message id and length that follow its "
           "magic number on a new connection: an oversized length overflows its receive "
           "buffer, id 33 writes to an address from the packet. The rank dies with a "
           "signal inside ucp_worker_progress (plain UCX programs over UCX_TLS=tcp die the "
           "same way), or, when the kernel refuses the overflowing read, UCX drops "
           "messages and the ranks' op fails at the group timeout with a DistBackendError. "
           "Strict: when a UCX release fixes it, this test says so.")
@pytest.mark.parametrize("forged", sorted(FORGED))
def test_forged_ucx_handshake(tmp_path, forged: str) -> None:
    """One connection per UCX port that passes UCX's magic-number check and then lies."""
    tmp = str(tmp_path)
    errors: list[str] = []
    stop = threading.Event()
    forger = threading.Thread(target=_forge, args=(tmp, FORGED[forged], errors, stop),
                              daemon=True)
    forger.start()
    try:
        results = run_ranks(_loop, WORLD, timeout=FORGED_TIMEOUT, args=(tmp, "file"),
                            env=EXPOSED)
    except RankFailure as e:
        if "exited with codes" in str(e):
            raise UcxFault(str(e)) from None
        raise
    finally:
        stop.set()
        forger.join(timeout=30)
    assert not errors, errors
    for rank, r in enumerate(results):
        assert not r["fails"], (rank, r)  # never a wrong result
        if r["error"] is not None:
            assert r["error"].startswith("DistBackendError"), (rank, r)
            raise UcxFault(f"rank {rank}: {r['error']}")
        assert r["iters"] > 0, (rank, r)


def _unexposed(rank: int, n: int) -> dict:
    import torchdist_ext

    t = torch.full((1000,), float(rank))
    dist.all_reduce(t)
    got = torch.empty(100)
    if rank == 0:
        dist.send(torch.arange(100.0), 1)
    elif rank == 1:
        dist.recv(got, 0)
    return {"listening": listening_ports(os.getpid()),
            "tcp": torchdist_ext.transport_info()["tcp"],
            "ok": torch.equal(t, torch.full((1000,), float(sum(range(n)))))
            and (rank != 1 or torch.equal(got, torch.arange(100.0)))}


def test_single_host_job_listens_on_no_port() -> None:
    """By default a job on one host leaves UCX's TCP transport out (its ranks watch each
    other's processes instead), so it opens no TCP port and there is nothing to forge;
    collectives and point-to-point still work."""
    results = run_ranks(_unexposed, WORLD, timeout=60)
    for rank, r in enumerate(results):
        assert r["ok"], (rank, r)
        assert r["tcp"] is False, (rank, r)
        assert r["listening"] == [], (rank, r["listening"])

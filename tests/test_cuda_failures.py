"""Failure paths of CUDA ops on tdx: a killed peer, a rank that never calls, and a group
destroyed while its device work waits for a peer. Needs a GPU (``cuda`` marker).

Ranks share the host's GPU(s). ``TDX_CUDA_PEER_SYNC`` picks how the peer-memory path waits:
``host`` (the group's thread exchanges flags over UCX, as ``auto`` does for ranks sharing a
GPU) or ``gpu`` (the stream waits on flags in device memory; a watchdog on the group's
thread releases a wait that outlives the group timeout). In every case the survivors must
raise ``DistBackendError`` naming the missing rank within the group timeout + 5 s, their
streams must run again (``torch.cuda.synchronize`` returns), and the process must still be
able to run CUDA work and destroy its groups.

The rank functions take ``kind`` so that their logic can be dry-run on CPU tensors.
"""

from __future__ import annotations

import os
import signal
import sys
import time

import pytest
import torch
import torch.distributed as dist

from torchdist_ext.testing import run_ranks

try:  # tests/ is on sys.path under pytest's default (prepend) import mode
    from test_cuda import _rank_device as _device, _sync
except ImportError:  # pragma: no cover - other import modes / rootdirs
    sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
    from test_cuda import _rank_device as _device, _sync

TIMEOUT = 6.0
SYNCS = ["host", "gpu"]
BIG = 1 << 20
# torch.cuda._sleep cycles that hold a rank's stream well past the group timeout (about
# 10 s at the H100's 1.98 GHz boost clock).
STALL_CYCLES = 20_000_000_000


def _call(op: str, dev: torch.device, n: int, async_op: bool = False):
    if op == "all_reduce":
        return dist.all_reduce(torch.ones(BIG, device=dev), async_op=async_op)
    if op == "broadcast":
        return dist.broadcast(torch.ones(BIG, device=dev), src=0, async_op=async_op)
    if op == "all_gather_into_tensor":
        return dist.all_gather_into_tensor(torch.empty(BIG * n, device=dev),
                                           torch.ones(BIG, device=dev), async_op=async_op)
    if op == "send_recv":  # a ring of point-to-point exchanges
        rank = dist.get_rank()
        inp = torch.empty(BIG, device=dev)
        works = [dist.isend(torch.ones(BIG, device=dev), (rank + 1) % n),
                 dist.irecv(inp, (rank - 1) % n)]
        if async_op:
            return works
        for w in works:
            w.wait()
        return None
    raise ValueError(op)


def _after_error(dev: torch.device, out: dict) -> dict:
    """The survivor's stream runs again and the device still computes."""
    start = time.monotonic()
    try:
        _sync(dev)
        x = torch.arange(5, device=dev, dtype=torch.float32) * 2
        out["device_after"] = x.sum().item()
    except Exception as e:  # noqa: BLE001 - the caller checks
        out["device_after"] = f"{type(e).__name__}: {e}"
    out["sync_seconds"] = time.monotonic() - start
    return out


def _all_reduce_until_error(dev: torch.device, n: int) -> dict:
    """A survivor's side: all_reduce until one raises (the error may come from the op or
    from the next one), then check the device (see _after_error)."""
    out: dict = {}
    start = time.monotonic()
    try:
        for _ in range(3):
            _call("all_reduce", dev, n)
            _sync(dev)
        out["error"] = "no error"
    except Exception as e:  # noqa: BLE001 - the caller checks
        out["error"] = f"{type(e).__name__}: {e}"
    out["seconds"] = time.monotonic() - start
    return _after_error(dev, out)


def _connected(rank: int, n: int, kind: str) -> torch.device:
    """This rank's device, after one all_reduce: everyone connected, the peer path set up."""
    dev = _device(rank, kind)
    _call("all_reduce", dev, n)
    _sync(dev)
    return dev


def _killed(rank: int, n: int, op: str, victim: int, kind: str = "cuda") -> dict:
    dev = _connected(rank, n, kind)
    if rank == victim:
        _call(op, dev, n, async_op=True)  # queued when the process dies
        time.sleep(0.01)
        os.kill(os.getpid(), signal.SIGKILL)
    import torchdist_ext

    start = time.monotonic()
    out: dict = {}
    try:
        # Ops on the GPU path return once queued: synchronize so that each one has run
        # (or is stuck) before the next, as a training step's loss.item() would.
        while time.monotonic() - start < TIMEOUT + 10:
            _call(op, dev, n)
            _sync(dev)
        out["error"] = "no error"
    except Exception as e:  # noqa: BLE001 - the type is checked by the caller
        out["error"] = f"{type(e).__name__}: {e}"
    out["seconds"] = time.monotonic() - start
    out["paths"] = sorted({r["path"] for r in torchdist_ext.flight_recorder()})
    return _after_error(dev, out)


def _check(results: list, what: str, missing: int, limit: float) -> None:
    for rank, r in enumerate(results):
        if rank == missing:
            continue
        assert r["error"].startswith("DistBackendError"), (what, rank, r)
        assert f"rank {missing}" in r["error"], \
            (what, rank, r["error"])
        assert r["seconds"] < limit, (what, rank, r)
        assert r["device_after"] == 20.0, (what, rank, r)
        assert r["sync_seconds"] < 5.0, (what, rank, r)


@pytest.mark.cuda
@pytest.mark.parametrize("sync", SYNCS)
@pytest.mark.parametrize("op,victim", [("all_reduce", 1), ("broadcast", 0), ("send_recv", 1)])
def test_cuda_kill_during_op(op: str, victim: int, sync: str) -> None:
    results = run_ranks(_killed, 3, timeout=TIMEOUT, args=(op, victim), may_exit=[victim],
                        env={"TDX_CUDA_PEER_SYNC": sync})
    print(f"{op} sync={sync} victim {victim}: " + ", ".join(
        f"r{r}: {v['seconds']:.2f} s {v['paths']}" for r, v in enumerate(results) if v))
    _check(results, f"{op} sync={sync}", victim, TIMEOUT + 5)


def _stalled(rank: int, n: int, kind: str = "cuda") -> dict:
    """Rank 1 calls the op, but its stream is stuck behind a long kernel: its host side
    reaches the op (the exchanges over UCX see it), its device side does not."""
    dev = _connected(rank, n, kind)
    out: dict = {}
    if rank == 1:
        if kind == "cuda":
            torch.cuda._sleep(STALL_CYCLES)
        try:
            _call("all_reduce", dev, n)
        except Exception:  # noqa: BLE001 - this rank's own outcome is not checked
            pass
        time.sleep(TIMEOUT + 3)
        return out
    return _all_reduce_until_error(dev, n)


@pytest.mark.cuda
@pytest.mark.parametrize("sync", SYNCS)
def test_cuda_a_peer_whose_stream_never_reaches_the_op(sync: str) -> None:
    """With GPU-side flags the survivors' streams wait for rank 1's flags, which never
    come within the timeout: the watchdog releases them and names rank 1. With host
    synchronisation rank 1's own thread gives up waiting for its stream and tells the
    others."""
    results = run_ranks(_stalled, 3, timeout=TIMEOUT, env={"TDX_CUDA_PEER_SYNC": sync})
    print(f"stalled stream, sync={sync}: " + ", ".join(
        f"r{r}: {v['seconds']:.2f} s: {v['error'][:400]}" for r, v in enumerate(results)
        if v))
    _check(results, f"stalled stream, sync={sync}", 1, TIMEOUT + 5)


def _never_called(rank: int, n: int, kind: str = "cuda") -> dict:
    dev = _connected(rank, n, kind)
    out: dict = {}
    if rank == n - 1:  # never calls the op; stays alive past the others' timeout
        time.sleep(TIMEOUT + 2)
        return out
    return _all_reduce_until_error(dev, n)


@pytest.mark.cuda
@pytest.mark.parametrize("sync", SYNCS)
def test_cuda_timeout_names_the_rank_that_never_called(sync: str) -> None:
    results = run_ranks(_never_called, 3, timeout=TIMEOUT, env={"TDX_CUDA_PEER_SYNC": sync})
    print(f"never called, sync={sync}: " + ", ".join(
        f"r{r}: {v['seconds']:.2f} s: {v['error'][:300]}" for r, v in enumerate(results[:2])))
    for r in results[:2]:
        assert r["seconds"] > TIMEOUT - 0.5, r  # the group timeout, not earlier
    _check(results, f"never called, sync={sync}", 2, TIMEOUT + 5)


def _destroyed_while_stuck(rank: int, n: int, kind: str = "cuda") -> dict:
    dev = _device(rank, kind)
    g = dist.new_group([0, 1])
    dist.all_reduce(torch.ones(BIG, device=dev), group=g)
    _sync(dev)
    out: dict = {}
    if rank == 0:
        t = torch.ones(BIG, device=dev)
        work = dist.all_reduce(t, group=g, async_op=True)  # rank 1 never calls it
        time.sleep(0.5)
        start = time.monotonic()
        dist.destroy_process_group(g)
        out["destroy_seconds"] = time.monotonic() - start
        try:
            work.wait()
            _sync(dev)
            out["work"] = "ok"
        except Exception as e:  # noqa: BLE001 - the caller checks
            out["work"] = f"{type(e).__name__}: {e}"
        _after_error(dev, out)
    else:
        time.sleep(2)
        dist.destroy_process_group(g)
    # The default group still works on both ranks after the stuck one is gone.
    x = torch.full((BIG,), float(rank + 1), device=dev)
    dist.all_reduce(x)
    _sync(dev)
    out["default_after"] = x[:1].item()
    return out


@pytest.mark.cuda
@pytest.mark.parametrize("sync", SYNCS)
def test_cuda_destroy_while_device_work_waits_for_a_peer(sync: str) -> None:
    results = run_ranks(_destroyed_while_stuck, 2, timeout=TIMEOUT * 3,
                        env={"TDX_CUDA_PEER_SYNC": sync})
    r0 = results[0]
    print(f"destroy while stuck, sync={sync}: {r0}")
    assert r0["destroy_seconds"] < 10.0, r0
    assert r0["device_after"] == 20.0 and r0["sync_seconds"] < 5.0, r0
    assert all(r["default_after"] == 3.0 for r in results), results

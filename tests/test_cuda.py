"""CUDA tensors on tdx, against float64/int64 references computed on the CPU.

The GPU host has one GPU, so every rank runs on ``cuda:(rank % device_count)``: several
ranks share cuda:0. As in test_collectives.py, one spawn per world size runs a whole sweep
and returns a list of failures. Each failure names the rank, op, dtype, count and max error.

* ``test_cuda_collectives``: every collective on CUDA tensors. It covers every reduce op x
  dtype x count, an 8M-element all_reduce, in-place results that must land in the
  caller's storage, and non-contiguous tensors.
* ``test_cuda_stream_semantics``: producers on side streams, async waits, the lifetime of
  tensors that the caller drops while an op is in flight, and futures with ``then``.
* ``test_multi_reduce_kernel``: ``torchdist_ext._C._multi_reduce`` in a single process,
  CUDA against CPU and a float64 reference, with misaligned and aliased buffers.
* ``test_cuda_groups_come_and_go``: groups created and destroyed around CUDA ops, with
  tensors freed after their group is gone.
* ``test_cuda_ddp_matches_gloo``: DDP on CUDA over tdx, compared with DDP over gloo.

Nothing here touches CUDA at import time, so the module collects on a CPU-only machine
(conftest.py skips the ``cuda``-marked tests there).
"""

from __future__ import annotations

import os
import sys
import time

import pytest
import torch
import torch.distributed as dist
import torch.nn as nn
from torch.nn.parallel import DistributedDataParallel as DDP

from torchdist_ext.testing import new_gloo_group, run_ranks

try:  # tests/ is on sys.path under pytest's default (prepend) import mode
    from test_collectives import close, ops_for, redop, reference, value
except ImportError:  # pragma: no cover - other import modes / rootdirs
    sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
    from test_collectives import close, ops_for, redop, reference, value

WORLD_SIZES = [1, 2, 3, 4]
COUNTS = [0, 1, 7, 1000, 262147]  # the last one is odd, so it does not split evenly
FLOATS = [torch.float32, torch.float64, torch.float16, torch.bfloat16]
INTS = [torch.int8, torch.uint8, torch.int16, torch.int32, torch.int64]
DTYPES = FLOATS + INTS + [torch.bool]
BIG = 8 * 1024 * 1024  # float32 elements for the bandwidth-path all_reduce
SLEEP_CYCLES = 50_000_000  # torch.cuda._sleep: tens of milliseconds of GPU time
R = dist.ReduceOp


# --------------------------------------------------------------------------- helpers


def _rank_device(rank: int, kind: str = "cuda") -> torch.device:
    """This rank's device. kind="cpu" only exists to dry-run the sweeps without a GPU."""
    if kind == "cpu":
        return torch.device("cpu")
    device = torch.device("cuda", rank % torch.cuda.device_count())
    torch.cuda.set_device(device)
    return device


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def _mismatch(got: torch.Tensor, want: torch.Tensor) -> str:
    """Describe how `got` differs from `want`: the max error, where it is, and how many elements differ."""
    got, want = got.detach().cpu(), want.detach().cpu()
    if got.shape != want.shape or got.dtype != want.dtype:
        return (f"got shape {tuple(got.shape)} {got.dtype}, "
                f"want {tuple(want.shape)} {want.dtype}")
    if got.numel() == 0:
        return "empty tensors reported different"
    g, w = got.double().flatten(), want.double().flatten()
    err = (g - w).abs().nan_to_num(nan=float("inf"))
    bad = int(err.argmax())
    ndiff = int((err > 0).sum())
    return (f"max err {err[bad].item():.4g} at [{bad}] (got {g[bad].item()!r}, "
            f"want {w[bad].item()!r}); {ndiff}/{g.numel()} elements differ")


def _expecter(rank: int, n: int, fails: list[str]):
    def expect(what: str, got: torch.Tensor, want: torch.Tensor) -> bool:
        got = got.detach().cpu()
        # Every check names its reduce op as "op=..."; AVG rounds each share (close()).
        if close(got, want, avg_world=n if "op=AVG " in what else 0):
            return True
        fails.append(f"rank {rank}/{n} {what}: {_mismatch(got, want)}")
        return False

    return expect


def _poison(shape, dtype: torch.dtype, device: torch.device) -> torch.Tensor:
    """An output buffer whose contents cannot be mistaken for a correct result."""
    if dtype == torch.bool:
        fill = True
    elif dtype.is_floating_point:
        fill = float("nan")
    else:
        fill = 99  # value() never produces 99 for the ops it is used with here
    return torch.full(shape if isinstance(shape, tuple) else (shape,), fill, dtype=dtype,
                      device=device)


def _report(fails: list[str], limit: int = 60) -> str:
    more = f"\n... and {len(fails) - limit} more" if len(fails) > limit else ""
    return f"{len(fails)} failures:\n" + "\n".join(fails[:limit]) + more


# ------------------------------------------------------------- 1. collectives sweep


def _sweep(rank: int, n: int, kind: str = "cuda") -> list[str]:
    dev = _rank_device(rank, kind)
    fails: list[str] = []
    expect = _expecter(rank, n, fails)

    def on(t: torch.Tensor) -> torch.Tensor:
        return t.to(dev, copy=True)  # never an alias of a reference tensor

    for dtype in DTYPES:
        for count in COUNTS:
            tag = f"dtype={dtype} count={count}"
            roots = list(range(n)) if count <= 1000 else [n - 1]

            # all_reduce: every op the dtype supports. The result must be in the caller's
            # storage, so it is read through an alias taken before the call.
            for op in ops_for(dtype):
                t = on(value(rank, count, dtype, op))
                alias, ptr = t.view(-1), t.data_ptr()
                dist.all_reduce(t, op=redop(op))
                want = reference([value(r, count, dtype, op) for r in range(n)], op, n, dtype)
                if t.data_ptr() != ptr:
                    fails.append(f"rank {rank}/{n} all_reduce op={op} {tag}: the tensor's "
                                 f"storage was replaced (in-place result must stay there)")
                expect(f"all_reduce op={op} {tag}", alias, want)

            # broadcast
            for root in roots:
                src = value(root, count, dtype)
                t = on(src) if rank == root else _poison(count, dtype, dev)
                alias = t.view(-1)
                dist.broadcast(t, src=root)
                expect(f"broadcast root={root} {tag}", alias, src)

            # reduce (SUM, MAX); a non-root rank's input is left as it was
            for op in ("SUM", "MAX"):
                want = reference([value(r, count, dtype, op) for r in range(n)], op, n, dtype)
                for root in roots:
                    mine = value(rank, count, dtype, op)
                    t = on(mine)
                    alias = t.view(-1)
                    dist.reduce(t, dst=root, op=redop(op))
                    if rank == root:
                        expect(f"reduce op={op} root={root} {tag}", alias, want)
                    else:
                        expect(f"reduce op={op} root={root} non-root input changed {tag}",
                               alias, mine)

            # all_gather (list), all_gather_into_tensor (out of place and in place)
            mine = value(rank, count, dtype)
            everyone = [value(r, count, dtype) for r in range(n)]
            src = on(mine)
            outs = [_poison(count, dtype, dev) for _ in range(n)]
            dist.all_gather(outs, src)
            for r in range(n):
                expect(f"all_gather op=- [{r}] {tag}", outs[r], everyone[r])
            want = torch.cat(everyone)
            flat = _poison(n * count, dtype, dev)
            dist.all_gather_into_tensor(flat, src)
            expect(f"all_gather_into_tensor op=- {tag}", flat, want)
            flat = _poison(n * count, dtype, dev)
            flat[rank * count:(rank + 1) * count] = src
            dist.all_gather_into_tensor(flat, flat[rank * count:(rank + 1) * count])
            expect(f"all_gather_into_tensor in-place op=- {tag}", flat, want)

            # reduce_scatter_tensor (out of place and in place); reduce_scatter (list) on SUM
            for op in ("SUM", "AVG", "MAX") if dtype != torch.bool else ("SUM", "MAX"):
                full = [torch.cat([value(r * n + j, count, dtype, op) for j in range(n)])
                        for r in range(n)]
                want = reference([f[rank * count:(rank + 1) * count] for f in full], op, n, dtype)
                out = _poison(count, dtype, dev)
                dist.reduce_scatter_tensor(out, on(full[rank]), op=redop(op))
                expect(f"reduce_scatter_tensor op={op} {tag}", out, want)
                inp = on(full[rank])
                piece = inp[rank * count:(rank + 1) * count]
                dist.reduce_scatter_tensor(piece, inp, op=redop(op))
                expect(f"reduce_scatter_tensor in-place op={op} {tag}", piece, want)
                if op == "SUM":
                    out = _poison(count, dtype, dev)
                    pieces = (list(on(full[rank]).chunk(n)) if count else
                              [torch.empty(0, dtype=dtype, device=dev) for _ in range(n)])
                    dist.reduce_scatter(out, pieces, op=redop(op))
                    expect(f"reduce_scatter (list) op={op} {tag}", out, want)

            # all_to_all_single: even, and uneven with zero-size splits possible
            inp = on(torch.cat([value(rank * n + j, count, dtype) for j in range(n)]))
            out = _poison(n * count, dtype, dev)
            dist.all_to_all_single(out, inp)
            want = torch.cat([value(j * n + rank, count, dtype) for j in range(n)])
            expect(f"all_to_all_single even op=- {tag}", out, want)

            def size(s: int, d: int, c: int = count) -> int:
                return ((s + 1) * (d + 2) * 37 + c) % (c + 3)

            send_sizes = [size(rank, j) for j in range(n)]
            recv_sizes = [size(j, rank) for j in range(n)]
            inp = on(torch.cat([value(rank * n + j, send_sizes[j], dtype) for j in range(n)]))
            out = _poison(sum(recv_sizes), dtype, dev)
            dist.all_to_all_single(out, inp, recv_sizes, send_sizes)
            want = torch.cat([value(j * n + rank, recv_sizes[j], dtype) for j in range(n)])
            expect(f"all_to_all_single uneven {send_sizes}->{recv_sizes} op=- {tag}", out, want)

            # gather / scatter
            for root in roots:
                glist = [_poison(count, dtype, dev) for _ in range(n)] if rank == root else None
                dist.gather(src, glist, dst=root)
                if rank == root:
                    for r in range(n):
                        expect(f"gather root={root} [{r}] op=- {tag}", glist[r], everyone[r])
                out = _poison(count, dtype, dev)
                slist = ([on(value(root * n + j, count, dtype)) for j in range(n)]
                         if rank == root else None)
                dist.scatter(out, slist, src=root)
                expect(f"scatter root={root} op=- {tag}", out, value(root * n + rank, count, dtype))

            # send/recv: a ring of isend/irecv, then blocking send/recv between ranks 0 and 1
            if n > 1 and count > 0:
                nxt, prv = (rank + 1) % n, (rank - 1) % n
                payload = on(value(rank * 7 + 1, count, dtype))
                buf = _poison(count, dtype, dev)
                reqs = [dist.isend(payload, nxt), dist.irecv(buf, prv)]
                for q in reqs:
                    q.wait()
                expect(f"isend/irecv ring from rank {prv} op=- {tag}", buf,
                       value(prv * 7 + 1, count, dtype))
                if rank in (0, 1):
                    peer = 1 - rank
                    mine_p2p = on(value(100 + rank, count, dtype))
                    buf = _poison(count, dtype, dev)
                    if rank == 0:
                        dist.send(mine_p2p, peer)
                        dist.recv(buf, peer)
                    else:
                        dist.recv(buf, peer)
                        dist.send(mine_p2p, peer)
                    expect(f"send/recv from rank {peer} op=- {tag}", buf,
                           value(100 + peer, count, dtype))
                if dtype == torch.float32:  # receive into a strided view
                    base = torch.full((2 * count,), -3.0, device=dev)
                    view = base[::2]
                    reqs = [dist.isend(payload, nxt), dist.irecv(view, prv)]
                    for q in reqs:
                        q.wait()
                    expect(f"irecv into t[::2] op=- {tag}", view, value(prv * 7 + 1, count, dtype))
                    expect(f"irecv into t[::2] touched the gaps op=- {tag}", base[1::2],
                           torch.full((count,), -3.0))
        dist.barrier()

    # Non-contiguous CUDA tensors: t[::2] and a transposed 2-D tensor, for all_reduce and
    # broadcast. Elements outside the view must be left alone.
    m, rows, cols = 1001, 37, 53
    for dtype in DTYPES:
        tag = f"dtype={dtype}"
        own = value(rank, 2 * m, dtype)
        base = on(own)
        view = base[::2]
        dist.all_reduce(view)
        want = reference([value(r, 2 * m, dtype) for r in range(n)], "SUM", n, dtype)
        expect(f"all_reduce op=SUM t[::2] {tag} count={m}", view, want[::2])
        expect(f"all_reduce op=SUM t[::2] changed the gaps {tag} count={m}", base[1::2], own[1::2])

        b2 = on(value(rank, rows * cols, dtype, "MAX").reshape(rows, cols))
        tv = b2.t()
        dist.all_reduce(tv, op=R.MAX)
        want = reference([value(r, rows * cols, dtype, "MAX").reshape(rows, cols)
                          for r in range(n)], "MAX", n, dtype)
        expect(f"all_reduce op=MAX transposed {cols}x{rows} {tag} count={rows * cols}", tv, want.t())
        expect(f"all_reduce op=MAX transposed, read via base {tag} count={rows * cols}", b2, want)

        for root in range(n):
            src = value(root, m, dtype)
            filler = value(rank + 50, 2 * m, dtype)
            base = on(filler)
            view = base[::2]
            if rank == root:
                view.copy_(on(src))
            dist.broadcast(view, src=root)
            expect(f"broadcast root={root} t[::2] {tag} count={m}", view, src)
            expect(f"broadcast root={root} t[::2] changed the gaps {tag} count={m}",
                   base[1::2], filler[1::2])

            src2 = value(root, rows * cols, dtype).reshape(cols, rows)
            b2 = _poison((rows, cols), dtype, dev)
            tv = b2.t()
            if rank == root:
                tv.copy_(on(src2))
            dist.broadcast(tv, src=root)
            expect(f"broadcast root={root} transposed {cols}x{rows} {tag} count={rows * cols}",
                   tv, src2)

    # The bandwidth path: one large float32 SUM.
    t = on(value(rank, BIG, torch.float32))
    alias = t.view(-1)
    dist.all_reduce(t)
    want = reference([value(r, BIG, torch.float32) for r in range(n)], "SUM", n, torch.float32)
    expect(f"all_reduce op=SUM dtype=torch.float32 count={BIG}", alias, want)

    dist.barrier()
    _sync(dev)
    return fails


@pytest.mark.cuda
@pytest.mark.parametrize("world_size", WORLD_SIZES)
def test_cuda_collectives(world_size: int) -> None:
    fails = [f for r in run_ranks(_sweep, world_size, timeout=240, args=("cuda",)) for f in r]
    assert not fails, _report(fails)


# -------------------------------------------------------------- 2. stream semantics


def _streams(rank: int, n: int) -> list[str]:
    dev = _rank_device(rank)
    fails: list[str] = []
    expect = _expecter(rank, n, fails)
    N = 1 << 20
    total = float(sum(range(1, n + 1)))  # rank r contributes r + 1
    want_total = torch.full((N,), total)
    cur = torch.cuda.current_stream(dev)

    def tagged(what: str) -> str:
        return f"{what} op=SUM dtype=torch.float32 count={N}"

    # (a0) Producer on the current stream behind a slow kernel; no explicit sync anywhere.
    t = torch.zeros(N, device=dev)
    torch.cuda._sleep(SLEEP_CYCLES)
    t.fill_(rank + 1)
    dist.all_reduce(t)
    expect(tagged("(a0) slow producer on the current stream"), t, want_total)

    # (a) Producer on a side stream that is current during the call.
    for async_op in (False, True):
        t = torch.zeros(N, device=dev)
        s = torch.cuda.Stream(dev)
        s.wait_stream(cur)  # t's allocation/zeroing happened on `cur`
        with torch.cuda.stream(s):
            torch.cuda._sleep(SLEEP_CYCLES)
            t.fill_(rank + 1)
            w = dist.all_reduce(t, async_op=async_op)
            if async_op:
                w.wait()
            seen_on_s = t.clone()  # read on s itself, before any host synchronisation
        s.synchronize()
        expect(tagged(f"(a) side-stream producer async={async_op}, read on s"), seen_on_s,
               want_total)
        expect(tagged(f"(a) side-stream producer async={async_op}, after s.synchronize"), t,
               want_total)
        cur.wait_stream(s)

    # (b) wait() then read and write on the current stream without synchronising.
    t = torch.zeros(N, device=dev)
    torch.cuda._sleep(SLEEP_CYCLES)
    t.fill_(rank + 1)
    w = dist.all_reduce(t, async_op=True)
    w.wait()
    snapshot = t.clone()  # a kernel on the current stream: must see the result
    t.add_(1)  # must not be overwritten by a late copy-back
    expect(tagged("(b) async wait() then read on current stream"), snapshot, want_total)
    expect(tagged("(b) async wait() then add_(1) on current stream"), t, want_total + 1)
    torch.cuda.synchronize()
    deadline = time.monotonic() + 30.0
    while not w.is_completed() and time.monotonic() < deadline:
        time.sleep(0.01)
    if not w.is_completed():
        fails.append(f"rank {rank}/{n} (b) work.is_completed() still False 30 s after wait() "
                     f"and torch.cuda.synchronize()")
    elif not w.is_success():
        fails.append(f"rank {rank}/{n} (b) work.is_success() is False after completion")

    # (c) The caller drops its tensors while ops are in flight and the caching allocator
    # hands the same blocks to garbage tensors. The backend must keep its tensors alive:
    # results stay right and the garbage is not overwritten.
    works, garbage = [], []
    loops = 50
    for i in range(loops):
        kind = i % 3
        if kind == 0:  # all_reduce; the only reference left is the work's future
            t = torch.full((N,), float(rank + 1 + i), device=dev)
            w = dist.all_reduce(t, async_op=True)
            del t
            works.append((i, kind, w, None))
            dropped = N
        elif kind == 1:  # all_gather_into_tensor; input dropped, output kept
            inp = torch.full((N,), float(rank + i), device=dev)
            out = torch.empty(n * N, device=dev)
            w = dist.all_gather_into_tensor(out, inp, async_op=True)
            del inp
            works.append((i, kind, w, out))
            dropped = N
        else:  # reduce_scatter_tensor; input dropped, output kept
            inp = (torch.arange(n * N, device=dev) % 7 + (rank + i)).float()
            out = torch.empty(N, device=dev)
            w = dist.reduce_scatter_tensor(out, inp, async_op=True)
            del inp
            works.append((i, kind, w, out))
            dropped = n * N
        g = torch.empty(dropped, device=dev)
        g.fill_(-1e6 - i)
        garbage.append(g)
    for i, kind, w, out in works:
        w.wait()
        if kind == 0:
            got = w.get_future().wait()[0]
            want = torch.full((N,), float(n * (1 + i) + sum(range(n))))
            expect(f"(c) iter {i} all_reduce, input dropped, result via future op=SUM "
                   f"dtype=torch.float32 count={N}", got, want)
        elif kind == 1:
            want = torch.cat([torch.full((N,), float(r + i)) for r in range(n)])
            expect(f"(c) iter {i} all_gather_into_tensor, input dropped op=- "
                   f"dtype=torch.float32 count={N}", out, want)
        else:
            pattern = (torch.arange(n * N, dtype=torch.float64) % 7)[rank * N:(rank + 1) * N]
            want = (n * pattern + sum(range(n)) + n * i).float()
            expect(f"(c) iter {i} reduce_scatter_tensor, input dropped op=SUM "
                   f"dtype=torch.float32 count={N}", out, want)
    for i, g in enumerate(garbage):
        expect(f"(c) garbage tensor {i} was overwritten by an in-flight op op=- "
               f"dtype=torch.float32 count={g.numel()}", g, torch.full((g.numel(),), -1e6 - i))
    del works, garbage

    # (d) The future's value is the list of outputs; a then() callback sees the result.
    t = torch.zeros(N, device=dev)
    torch.cuda._sleep(SLEEP_CYCLES)
    t.fill_(rank + 1)
    w = dist.all_reduce(t, async_op=True)
    try:
        val = w.get_future().wait()
        if not isinstance(val, list) or len(val) != 1 or not isinstance(val[0], torch.Tensor):
            fails.append(f"rank {rank}/{n} (d) future value is {type(val).__name__} "
                         f"{val!r:.80}, want a list holding the output tensor")
        else:
            expect(tagged("(d) get_future().wait()[0]"), val[0], want_total)
            if val[0].data_ptr() != t.data_ptr():
                fails.append(f"rank {rank}/{n} (d) future value is not the caller's tensor")
        expect(tagged("(d) caller's tensor after get_future().wait()"), t, want_total)
    except Exception as e:  # noqa: BLE001 - report, keep checking
        fails.append(f"rank {rank}/{n} (d) get_future().wait() raised {e!r}")

    t2 = torch.zeros(N, device=dev)
    torch.cuda._sleep(SLEEP_CYCLES)
    t2.fill_(rank + 1)
    seen: dict[str, torch.Tensor] = {}

    def callback(f):
        v = f.value()[0]
        seen["inside"] = v.cpu()  # what the callback itself observes
        return v * 2

    try:
        doubled = dist.all_reduce(t2, async_op=True).get_future().then(callback).wait()
        expect(tagged("(d) values seen inside then() callback"), seen.get("inside", torch.empty(0)),
               want_total)
        expect(tagged("(d) value returned through then()"), doubled, want_total * 2)
    except Exception as e:  # noqa: BLE001
        fails.append(f"rank {rank}/{n} (d) future.then() raised {e!r}")

    dist.barrier()
    torch.cuda.synchronize()
    return fails


@pytest.mark.cuda
def test_cuda_stream_semantics() -> None:
    fails = [f for r in run_ranks(_streams, 2, timeout=180) for f in r]
    assert not fails, _report(fails)


def _groups_come_and_go(rank: int, n: int) -> list[str]:
    """Groups created and destroyed around CUDA ops: each group's peer-memory streams
    return to a process-wide pool (never destroyed), tensors an op used are freed after
    their group is gone (the allocator then records an event on that group's stream),
    and results stay exact."""
    import torchdist_ext

    dev = _rank_device(rank)
    fails: list[str] = []
    kept: list[torch.Tensor] = []
    peer_ops = 0
    for cycle in range(12):
        g = dist.new_group(backend="tdx")
        t = torch.full((1 << 20,), float(rank + cycle), device=dev)
        work = dist.all_reduce(t, group=g, async_op=True)
        work.wait()
        path = torchdist_ext.flight_recorder(g)[-1]["path"]
        peer_ops += path == "cuda-peer"
        want = float(sum(r + cycle for r in range(n)))
        if not bool((t == want).all()):
            fails.append(f"r{rank} cycle {cycle} ({path}): got {t[:2].tolist()}, want {want}")
        kept.append(t)
        dist.destroy_process_group(g)
        if len(kept) > 2:
            del kept[0]  # freed two groups after the one whose stream it was recorded on
        torch.cuda.synchronize(dev)
    kept.clear()
    torch.cuda.synchronize(dev)
    if n > 1 and peer_ops == 0:
        fails.append(f"r{rank}: no op took the peer-memory path (all staged)")
    x = torch.ones(1000, device=dev)
    dist.all_reduce(x)
    if not bool((x == n).all()):
        fails.append(f"r{rank}: the default group after the cycles gave {x[:2].tolist()}")
    return fails


@pytest.mark.cuda
@pytest.mark.parametrize("sync", ["auto", "gpu"])
def test_cuda_groups_come_and_go(sync: str) -> None:
    fails = [f for r in run_ranks(_groups_come_and_go, 2, timeout=180,
                                  env={"TDX_CUDA_PEER_SYNC": sync}) for f in r]
    assert not fails, _report(fails)


def _gather_from_another_block(rank: int, n: int, kind: str = "cuda") -> list[str]:
    """all_gather_into_tensor whose input lies in another rank's block of the output (as
    gloo allows): the peer path would read it while that rank writes it, so every rank
    stages, and each block holds its rank's input. Its own block (in place) and a
    separate input keep the peer path."""
    import torchdist_ext

    dev = _rank_device(rank, kind)
    fails: list[str] = []
    count = 4099
    for case in ("another block", "own block", "separate"):
        out = torch.full((n * count,), -1.0, device=dev)
        mine = torch.arange(count, dtype=torch.float32, device=dev) + 10000 * rank
        if case == "separate":
            inp = mine
        else:
            at = (rank + 1) % n if case == "another block" else rank
            inp = out[at * count:(at + 1) * count]
            inp.copy_(mine)
        dist.all_gather_into_tensor(out, inp)
        path = torchdist_ext.flight_recorder()[-1]["path"]
        if kind == "cuda" and case == "another block" and not path.startswith("staged"):
            fails.append(f"rank {rank}/{n} input in another block ran {path}, not staged")
        want = torch.cat([torch.arange(count, dtype=torch.float32) + 10000 * r
                          for r in range(n)])
        if not torch.equal(out.cpu(), want):
            bad = (out.cpu() != want).nonzero()[:3].flatten().tolist()
            fails.append(f"rank {rank}/{n} all_gather_into_tensor, input in {case}: wrong "
                         f"at {bad}")
    _sync(dev)
    return fails


@pytest.mark.cuda
def test_cuda_all_gather_input_in_another_block() -> None:
    fails = [f for r in run_ranks(_gather_from_another_block, 2, timeout=120) for f in r]
    assert not fails, _report(fails)


def test_all_gather_input_in_another_block_cpu() -> None:
    """The same on CPU tensors (the host path every rank falls back to on a GPU)."""
    fails = [f for r in run_ranks(_gather_from_another_block, 3, timeout=120, args=("cpu",))
             for f in r]
    assert not fails, _report(fails)


# ------------------------------------------------------- 3. the reduction kernel alone

KERNEL_COUNTS = [0, 1, 7, 4099, (1 << 20) + 3]
KERNEL_NINS = [1, 2, 3, 8]
KERNEL_TOL = {torch.float16: 2e-2, torch.bfloat16: 6e-2, torch.float32: 1e-5,
              torch.float64: 1e-12}
KERNEL_FACTOR = 0.37  # PREMUL_SUM factor; deliberately not a power of two
_GUARD = {torch.bool: True, **{dt: -77.0 for dt in FLOATS}}  # ints: 77


def _kernel_ops(dtype: torch.dtype) -> list[str]:
    if dtype == torch.bool:
        return ["SUM", "PRODUCT", "MIN", "MAX", "BAND", "BOR", "BXOR"]
    if dtype.is_floating_point:
        return ["SUM", "AVG", "PRODUCT", "MIN", "MAX", "PREMUL_SUM"]
    return ["SUM", "AVG", "PRODUCT", "MIN", "MAX", "BAND", "BOR", "BXOR", "PREMUL_SUM"]


def _data_class(op: str, dtype: torch.dtype) -> str:
    if dtype == torch.bool:
        if op in ("SUM", "MAX", "BOR"):
            return "or"
        return "and" if op in ("PRODUCT", "MIN", "BAND") else "xor"
    if op in ("SUM", "AVG", "PREMUL_SUM"):
        return "sum"
    return "prod" if op == "PRODUCT" else "any"


def _kernel_data(dtype: torch.dtype, count: int, cls: str, gen: torch.Generator,
                 nmax: int = 8) -> list[torch.Tensor]:
    """nmax random CPU inputs. Their range keeps every result representable (no overflow)."""
    xs = []
    for k in range(nmax):
        if dtype == torch.bool:
            p = {"or": 0.15, "and": 0.85, "xor": 0.5}[cls]
            xs.append(torch.rand(count, generator=gen) < p)
        elif dtype.is_floating_point:
            if cls == "sum":
                x = torch.randn(count, generator=gen, dtype=torch.float64)
            elif cls == "prod":  # magnitudes in [0.5, 2]: 8 factors never under/overflow
                mag = 0.5 + 1.5 * torch.rand(count, generator=gen, dtype=torch.float64)
                x = torch.where(torch.rand(count, generator=gen) < 0.5, -mag, mag)
            else:
                x = 100 * torch.randn(count, generator=gen, dtype=torch.float64)
            xs.append(x.to(dtype))
        else:
            info = torch.iinfo(dtype)
            signed = info.min < 0
            if cls == "sum":  # 8 of them sum without overflow
                lo, hi = info.min // 8, (info.max + 1) // 8
            elif cls == "prod":  # |product| <= 4
                if k < 2:
                    lo, hi = (-2, 3) if signed else (0, 3)
                else:
                    lo, hi = (-1, 2) if signed else (0, 2)
            else:
                lo, hi = info.min, info.max
            xs.append(torch.randint(lo, hi, (count,), generator=gen, dtype=dtype))
    return xs


def _kernel_reference(xs: list[torch.Tensor], op: str, dtype: torch.dtype, factor: float):
    """(want, bound): want is float64 for floating dtypes, else `dtype`; bound is the
    per-element float error allowed (None when the result must be exact)."""
    n = len(xs)
    if dtype == torch.bool:
        return reference(xs, op, n, dtype), None
    if not dtype.is_floating_point:
        if op == "PREMUL_SUM":  # by a fraction: each share truncated, the sum wraps
            shares = [(x.double() * factor).trunc().to(torch.int64) for x in xs]
            return torch.stack(shares).sum(0).to(dtype), None
        return reference(xs, op, n, dtype), None
    stack = torch.stack([x.double() for x in xs])
    if op == "SUM":
        want, scale = stack.sum(0), stack.abs().sum(0)
    elif op == "AVG":
        want, scale = stack.sum(0) / n, stack.abs().sum(0) / n
    elif op == "PREMUL_SUM":
        want, scale = (stack * factor).sum(0), abs(factor) * stack.abs().sum(0)
    elif op == "PRODUCT":
        want = stack.prod(0)
        scale = want.abs()
    elif op == "MIN":
        want, scale = stack.min(0).values, torch.zeros(stack.shape[1:], dtype=torch.float64)
    elif op == "MAX":
        want, scale = stack.max(0).values, torch.zeros(stack.shape[1:], dtype=torch.float64)
    else:
        raise AssertionError(op)
    exact = op in ("MIN", "MAX")
    # Relative to the sum of magnitudes (accumulation error), plus room for subnormals
    # that a device may flush to zero.
    slack = 0.0 if exact else n * torch.finfo(dtype).tiny
    return want, KERNEL_TOL[dtype] * scale + slack


def _kernel_check(got: torch.Tensor, want: torch.Tensor, bound) -> str | None:
    """None when got matches; otherwise a description with the max error."""
    if got.shape != want.shape:
        return f"shape {tuple(got.shape)}, want {tuple(want.shape)}"
    if bound is None:  # exact: ints and bool
        if got.dtype != want.dtype:
            return f"dtype {got.dtype}, want {want.dtype}"
        bad = got != want
        if not bool(bad.any()):
            return None
        idx = int(bad.nonzero()[0, 0])
        err = (got.double() - want.double()).abs().max().item()
        return (f"max err {err:.4g}; {int(bad.sum())}/{got.numel()} wrong, first at [{idx}]: "
                f"got {got[idx].item()} want {want[idx].item()}")
    err = (got.double() - want).abs().nan_to_num(nan=float("inf"))
    over = err > bound
    if not bool(over.any()):
        return None
    idx = int((err - bound).argmax())
    return (f"max err {err.max().item():.4g}; {int(over.sum())}/{got.numel()} beyond tolerance, "
            f"worst at [{idx}]: got {got[idx].item()!r} want {want[idx].item()!r} "
            f"(allowed {float(bound[idx]):.3g})")


def _sentinel(want: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """A fresh output that differs from the expected result in every element."""
    if dtype == torch.bool:
        return want.logical_not()
    if dtype.is_floating_point:
        return torch.full(want.shape, float("nan"), dtype=dtype, device=want.device)
    return want.bitwise_xor(1)


def _kernel_sweep(fn, devices: list[torch.device], counts=KERNEL_COUNTS, nins=KERNEL_NINS,
                  dtypes=DTYPES) -> list[str]:
    """fn(inputs, outputs, op, factor) against a float64 reference on every device in
    `devices`, and the devices against each other."""
    gen = torch.Generator().manual_seed(1234)
    fails: list[str] = []

    def call(label: str, ins, outs, op: str, factor: float) -> bool:
        try:
            fn(ins, outs, op, factor)
            return True
        except Exception as e:  # noqa: BLE001 - a failure string, keep sweeping
            fails.append(f"{label}: raised {type(e).__name__}: {str(e).splitlines()[0][:200]}")
            return False

    def check(label: str, got, want, bound) -> None:
        msg = _kernel_check(got, want, bound)
        if msg:
            fails.append(f"{label}: {msg}")

    for dtype in dtypes:
        guard = _GUARD.get(dtype, 77)
        for count in counts:
            host: dict[str, list[torch.Tensor]] = {}  # data class -> CPU inputs
            data: dict[str, dict[torch.device, list[torch.Tensor]]] = {}  # ... per device
            for op in _kernel_ops(dtype):
                cls = _data_class(op, dtype)
                if cls not in data:
                    host[cls] = _kernel_data(dtype, count, cls, gen, max(nins))
                    data[cls] = {d: [x.to(d) for x in host[cls]] for d in devices}
                factor = KERNEL_FACTOR if op == "PREMUL_SUM" else 1.0
                for nin in nins:
                    want_cpu, bound_cpu = _kernel_reference(host[cls][:nin], op, dtype, factor)
                    aligned = {}
                    for dev in devices:
                        xs = data[cls][dev][:nin]
                        want = want_cpu.to(dev)
                        bound = None if bound_cpu is None else bound_cpu.to(dev)
                        label = f"_multi_reduce[{dev}] op={op} dtype={dtype} nin={nin} count={count}"

                        # 1. fresh contiguous output, aligned inputs
                        out = _sentinel(want, dtype)
                        if call(label, xs, [out], op, factor):
                            check(label, out, want, bound)
                            aligned[dev] = out

                        # 2. misaligned: inputs[k] starts (k+1)%3 elements into its buffer;
                        #    output 0 starts one element in and has guards on both sides.
                        ins = []
                        for k, x in enumerate(xs):
                            off = (k + 1) % 3
                            b = torch.empty(count + off, dtype=dtype, device=dev)
                            ins.append(b[off:])
                            ins[-1].copy_(x)
                        gbase = torch.full((count + 2,), guard, dtype=dtype, device=dev)
                        o0 = gbase[1:count + 1]
                        o0.copy_(_sentinel(want, dtype))
                        o1 = _sentinel(want, dtype)
                        lab = label + " misaligned (views base[1:], base[2:])"
                        if call(lab, ins, [o0, o1], op, factor):
                            check(lab + " output 0 (offset 1)", o0, want, bound)
                            check(lab + " output 1 (aligned)", o1, want, bound)
                            if not (gbase[0].item() == guard and gbase[-1].item() == guard):
                                fails.append(f"{lab}: wrote outside output 0 (guards "
                                             f"{gbase[0].item()}, {gbase[-1].item()})")
                            for k, (v, x) in enumerate(zip(ins, xs)):
                                if not torch.equal(v, x):
                                    fails.append(f"{lab}: input {k} was modified")

                        # 3. in place: the output is inputs[0]
                        ins = [x.clone() for x in xs]
                        lab = label + " in-place (outputs=[inputs[0]])"
                        if call(lab, ins, [ins[0]], op, factor):
                            check(lab, ins[0], want, bound)
                            for k in range(1, nin):
                                if not torch.equal(ins[k], xs[k]):
                                    fails.append(f"{lab}: input {k} was modified")

                    # the devices against each other (CUDA vs CPU)
                    if len(aligned) == len(devices) > 1:
                        first, *rest = devices
                        ref = aligned[first]
                        for dev in rest:
                            other = aligned[dev].to(first)
                            b = None if bound_cpu is None else 2 * bound_cpu.to(first)
                            msg = _kernel_check(other, ref if b is None else ref.double(), b)
                            if msg:
                                fails.append(f"_multi_reduce {dev} vs {first} op={op} dtype={dtype} "
                                             f"nin={nin} count={count}: {msg}")
            del data, host
    for dev in devices:
        _sync(dev)
    return fails


def _kernel_errors(fn, devices: list[torch.device]) -> list[str]:
    """Bitwise ops on floating dtypes and AVG on bool must raise."""
    fails = []
    bad = [(dt, op) for dt in FLOATS for op in ("BAND", "BOR", "BXOR")] + [(torch.bool, "AVG")]
    for dev in devices:
        for dtype, op in bad:
            x = torch.ones(4, dtype=dtype, device=dev)
            out = torch.zeros(4, dtype=dtype, device=dev)
            try:
                fn([x, x.clone()], [out], op, 1.0)
                _sync(dev)
            except (RuntimeError, ValueError, TypeError):  # dtype errors are TypeError, as in torch
                continue
            except Exception as e:  # noqa: BLE001
                fails.append(f"_multi_reduce[{dev}] op={op} dtype={dtype} count=4: raised "
                             f"{type(e).__name__} ({e}), want RuntimeError, ValueError or TypeError")
                continue
            fails.append(f"_multi_reduce[{dev}] op={op} dtype={dtype} count=4: did not raise")
    return fails


@pytest.mark.cuda
def test_multi_reduce_kernel() -> None:
    import torchdist_ext

    fn = getattr(torchdist_ext._C, "_multi_reduce", None)
    assert fn is not None, "torchdist_ext._C._multi_reduce is missing"
    devices = [torch.device("cpu"), torch.device("cuda", 0)]
    torch.cuda.set_device(devices[1])
    fails = _kernel_errors(fn, devices) + _kernel_sweep(fn, devices)
    assert not fails, _report(fails)


def test_multi_reduce_kernel_cpu() -> None:
    """The CPU half of the sweep above, on every host: random signed data over each
    dtype's range, misaligned views with guards, in place, every op and dtype."""
    import torchdist_ext

    fn = torchdist_ext._C._multi_reduce
    devices = [torch.device("cpu")]
    # Counts past the kernels' 16-byte blocks and unrolled tails, not the GPU's million.
    fails = _kernel_errors(fn, devices) + _kernel_sweep(fn, devices, counts=[0, 1, 7, 4099, 65541])
    assert not fails, _report(fails)


# ------------------------------------------------------------------------- 4. DDP

DDP_STEPS = 5
DDP_BATCH = 8  # per rank


def _ddp_model(device: torch.device) -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(5, 16), nn.Tanh(), nn.Linear(16, 3)).to(device)


def _ddp_train(model: nn.Module, x, y, rank: int, world: int, hook: bool = False):
    opt = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    if hook:  # the comm-hook path relies on work.get_future() with CUDA tensors
        def allreduce_hook(state, bucket):
            t = bucket.buffer().div_(world)
            fut = dist.all_reduce(t, group=state, async_op=True).get_future()
            return fut.then(lambda f: f.value()[0])

        model.register_comm_hook(model.process_group, allreduce_hook)
    for s in range(DDP_STEPS):
        mine = slice(rank * DDP_BATCH, (rank + 1) * DDP_BATCH)
        opt.zero_grad()
        nn.functional.cross_entropy(model(x[s, mine]), y[s, mine]).backward()
        opt.step()
    return [p.detach().clone() for p in model.parameters()]


def _ddp(rank: int, world: int, kind: str = "cuda") -> list[str]:
    dev = _rank_device(rank, kind)
    ids = [dev.index] if dev.type == "cuda" else None
    gloo = new_gloo_group()
    g = torch.Generator().manual_seed(7)
    x = torch.randn(DDP_STEPS, world * DDP_BATCH, 5, generator=g).to(dev)
    y = torch.randint(0, 3, (DDP_STEPS, world * DDP_BATCH), generator=g).to(dev)
    ours = _ddp_train(DDP(_ddp_model(dev), device_ids=ids, bucket_cap_mb=0.0001), x, y, rank, world)
    hooked = _ddp_train(DDP(_ddp_model(dev), device_ids=ids), x, y, rank, world, hook=True)
    theirs = _ddp_train(DDP(_ddp_model(dev), device_ids=ids, process_group=gloo,
                            bucket_cap_mb=0.0001), x, y, rank, world)
    fails = []
    for i, (a, h, b) in enumerate(zip(ours, hooked, theirs)):
        for name, p in (("tdx", a), ("tdx + comm hook", h)):
            err = (p - b).abs().max().item()
            if not err <= 1e-5:
                fails.append(f"rank {rank}/{world} DDP on {dev} ({name}) parameter {i} "
                             f"dtype={p.dtype} count={p.numel()}: max err {err:.3g} vs gloo")
    if torch.equal(ours[0], _ddp_model(dev)[0].weight.detach()):
        fails.append(f"rank {rank}/{world} DDP on {dev}: parameters never changed")
    dist.destroy_process_group(gloo)
    _sync(dev)
    return fails


@pytest.mark.cuda
def test_cuda_ddp_matches_gloo() -> None:
    fails = [f for r in run_ranks(_ddp, 2, timeout=180, args=("cuda",)) for f in r]
    assert not fails, _report(fails)

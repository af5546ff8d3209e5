"""Every collective x dtype x world size x count against a float64/int64 reference.

Inputs are a deterministic function of (rank, index), so a wrong element identifies where
it came from. One spawn per world size runs the whole sweep and returns its failures.
"""

from __future__ import annotations

import re

import pytest
import torch
import torch.distributed as dist

from torchdist_ext.testing import run_ranks

WORLD_SIZES = [1, 2, 3, 4, 5, 6, 7, 8]
COUNTS = [0, 1, 7, 1000, 12345]
FLOATS = [torch.float32, torch.float64, torch.float16, torch.bfloat16]
INTS = [torch.int8, torch.uint8, torch.int16, torch.int32, torch.int64]
DTYPES = FLOATS + INTS + [torch.bool]
R = dist.ReduceOp


def value(rank: int, count: int, dtype: torch.dtype, op: str = "SUM") -> torch.Tensor:
    """Rank `rank`'s input: small values chosen so no signed dtype overflows at 8 ranks.
    Negative values (wrapped, in unsigned dtypes) and bit patterns across the whole width
    catch kernels that compare as unsigned, drop the sign or narrow; only floating AVG
    and PREMUL_SUM, which round, keep positive values so their tolerance is relative."""
    i = torch.arange(count, dtype=torch.int64)
    if dtype == torch.bool:
        return ((i + rank) % 3 == 0)
    if op == "PRODUCT":
        v = torch.where((i + rank) % 7 == 0, 2, torch.where((i + rank) % 5 == 0, -1, 1))
    elif op in ("BAND", "BOR", "BXOR"):
        # 16 random-looking bits and their sign: in int64 the sign fills the high bits.
        v = (rank * 40503 + i * 34283 + 12345) % 65536 - 32768
    elif op in ("MIN", "MAX"):
        v = (rank * 7 + i * 3) % 11 - 5
    elif dtype.is_floating_point and op in ("AVG", "PREMUL_SUM"):
        v = (i + rank) % 5 + 1
    else:
        v = (i + rank) % 5 - 2
    if dtype.is_floating_point:
        return (v.double() * 0.25).to(dtype) if op not in ("PRODUCT",) else v.to(dtype)
    return v.to(dtype)  # wraps into the narrow and unsigned types, as a cast does


def reference(inputs: list[torch.Tensor], op: str, n: int, dtype: torch.dtype,
              factor: float = 0.5) -> torch.Tensor:
    if dtype == torch.bool:
        stack = torch.stack(inputs)
        if op in ("SUM", "MAX", "BOR"):
            return stack.any(0)
        if op in ("PRODUCT", "MIN", "BAND"):
            return stack.all(0)
        return (stack.to(torch.int64).sum(0) % 2).bool()  # BXOR
    wide = torch.float64 if dtype.is_floating_point else torch.int64
    stack = torch.stack([t.to(wide) for t in inputs])
    if op == "SUM":
        out = stack.sum(0)
    elif op == "AVG":
        s = stack.sum(0)
        if dtype.is_floating_point:
            out = s / n
        else:  # the sum wraps in the dtype first; then it divides, truncating toward zero
            out = torch.div(s.to(dtype).to(wide), n, rounding_mode="trunc")
    elif op == "PREMUL_SUM":
        if dtype.is_floating_point:
            out = (stack * factor).sum(0)
        else:  # each share scaled, truncated toward zero, then summed, wrapping in the dtype
            out = torch.trunc(stack.double() * factor).to(torch.int64).sum(0)
    elif op == "PRODUCT":
        out = stack.prod(0)
    elif op == "MIN":
        out = stack.min(0).values
    elif op == "MAX":
        out = stack.max(0).values
    else:
        out = stack[0].clone()
        for t in stack[1:]:
            out = {"BAND": torch.bitwise_and, "BOR": torch.bitwise_or,
                   "BXOR": torch.bitwise_xor}[op](out, t)
    return out.to(dtype)


def close(got: torch.Tensor, want: torch.Tensor, avg_world: int = 0) -> bool:
    """Exact, except a float16 AVG over ``avg_world`` ranks: the inputs are multiples of
    0.25 small enough that every sum, product, min and max (and every partial sum, in any
    order) is exact in every float dtype, and AVG divides the exact sum once, so the
    averages are the correctly rounded mean, as gloo's are (a bfloat16 quotient passes
    through float on its way, which cannot change it: 24 >= 2 * 8 + 2 bits). float16
    AVG scales each share by 1/world first (its sum could overflow), which rounds once
    per share and once per addition: at most world half-ulps of the (positive) result,
    within (world + 2) / 2 ulps, the bench's allowance. Dividing by world ± 1 would be
    off by over 10% at 8 ranks."""
    if got.shape != want.shape or got.dtype != want.dtype:
        return False
    if got.dtype != torch.float16 or avg_world == 0:
        return torch.equal(got, want)
    rtol = (avg_world + 2) / 2 * torch.finfo(got.dtype).eps
    return bool(((got.double() - want.double()).abs() <= rtol * want.double().abs()).all())


def sentinel(count: int, dtype: torch.dtype) -> torch.Tensor:
    """An output buffer an op must overwrite: a stale result left in a reused allocation
    must not pass for a written one."""
    if dtype == torch.bool:
        return torch.ones(count, dtype=dtype)
    if dtype.is_floating_point:
        return torch.full((count,), float("nan"), dtype=dtype)
    return torch.full((count,), torch.iinfo(dtype).max, dtype=dtype)


def ops_for(dtype: torch.dtype) -> list[str]:
    if dtype == torch.bool:
        return ["SUM", "PRODUCT", "MIN", "MAX", "BAND", "BOR", "BXOR"]
    ops = ["SUM", "AVG", "PRODUCT", "MIN", "MAX", "PREMUL_SUM"]
    if not dtype.is_floating_point:
        ops += ["BAND", "BOR", "BXOR"]
    return ops


def redop(op: str, factor: float = 0.5):
    if op == "PREMUL_SUM":
        return dist._make_nccl_premul_sum(factor)
    return getattr(R, op)


def _sweep(rank: int, n: int) -> list[str]:
    fails: list[str] = []

    def expect(what: str, got: torch.Tensor, want: torch.Tensor) -> None:
        if not close(got, want, n if " AVG " in f" {what} " else 0):
            bad = (got.double() - want.double()).abs().argmax().item() if got.numel() else 0
            fails.append(f"r{rank}/{n} {what}: got {got.flatten()[bad:bad + 3].tolist()} "
                         f"want {want.flatten()[bad:bad + 3].tolist()} at {bad}")

    for dtype in DTYPES:
        for count in COUNTS:
            # all_reduce with every op that fits the dtype (PREMUL_SUM on integers scales
            # each share, truncating toward zero, before the sum).
            for op in ops_for(dtype):
                t = value(rank, count, dtype, op)
                dist.all_reduce(t, op=redop(op))
                want = reference([value(r, count, dtype, op) for r in range(n)], op, n, dtype)
                expect(f"all_reduce {op} {dtype} n={count}", t, want)
            # broadcast from every root
            for root in range(n):
                t = value(rank, count, dtype) if rank == root else torch.zeros(count, dtype=dtype)
                dist.broadcast(t, src=root)
                expect(f"broadcast root={root} {dtype} n={count}", t, value(root, count, dtype))
            # reduce: SUM and MAX to every root, every other op to the last rank
            for op in ops_for(dtype):
                for root in (range(n) if op in ("SUM", "MAX") else [n - 1]):
                    t = value(rank, count, dtype, op)
                    before = t.clone()
                    dist.reduce(t, dst=root, op=redop(op))
                    if rank == root:
                        want = reference([value(r, count, dtype, op) for r in range(n)], op, n, dtype)
                        expect(f"reduce {op} root={root} {dtype} n={count}", t, want)
                    else:
                        expect(f"reduce leaves non-root input {dtype}", t, before)
            # all_gather (list) and all_gather_into_tensor, out of place and in place
            outs = [sentinel(count, dtype) for _ in range(n)]
            dist.all_gather(outs, value(rank, count, dtype))
            for r in range(n):
                expect(f"all_gather [{r}] {dtype} n={count}", outs[r], value(r, count, dtype))
            flat = sentinel(n * count, dtype)
            dist.all_gather_into_tensor(flat, value(rank, count, dtype))
            want = torch.cat([value(r, count, dtype) for r in range(n)])
            expect(f"all_gather_into_tensor {dtype} n={count}", flat, want)
            flat = torch.zeros(n * count, dtype=dtype)
            flat[rank * count:(rank + 1) * count] = value(rank, count, dtype)
            dist.all_gather_into_tensor(flat, flat[rank * count:(rank + 1) * count])
            expect(f"all_gather_into_tensor in-place {dtype} n={count}", flat, want)
            # reduce_scatter (list) and reduce_scatter_tensor (also in place)
            for op in ops_for(dtype):
                full = [torch.cat([value(r * n + j, count, dtype, op) for j in range(n)])
                        for r in range(n)]
                want = reference([f[rank * count:(rank + 1) * count] for f in full], op, n, dtype)
                out = sentinel(count, dtype)
                dist.reduce_scatter_tensor(out, full[rank].clone(), op=redop(op))
                expect(f"reduce_scatter_tensor {op} {dtype} n={count}", out, want)
                inp = full[rank].clone()
                dist.reduce_scatter_tensor(inp[rank * count:(rank + 1) * count], inp, op=redop(op))
                expect(f"reduce_scatter_tensor in-place {op} {dtype} n={count}",
                       inp[rank * count:(rank + 1) * count], want)
                out = sentinel(count, dtype)
                dist.reduce_scatter(out, list(full[rank].clone().chunk(n)) if count else
                                    [torch.empty(0, dtype=dtype) for _ in range(n)], op=redop(op))
                expect(f"reduce_scatter {op} {dtype} n={count}", out, want)
        # all_to_all_single even + uneven (zero-size splits included), all_to_all lists
        for count in (0, 1, 7):
            even_in = torch.cat([value(rank * n + j, count, dtype) for j in range(n)])
            out = sentinel(n * count, dtype)
            dist.all_to_all_single(out, even_in)
            want = torch.cat([value(j * n + rank, count, dtype) for j in range(n)])
            expect(f"all_to_all_single even {dtype} n={count}", out, want)
            send_sizes = [(rank + j + count) % 3 for j in range(n)]
            recv_sizes = [(j + rank + count) % 3 for j in range(n)]
            inp = torch.cat([value(rank * n + j, send_sizes[j], dtype) for j in range(n)])
            out = sentinel(sum(recv_sizes), dtype)
            dist.all_to_all_single(out, inp, recv_sizes, send_sizes)
            want = torch.cat([value(j * n + rank, recv_sizes[j], dtype) for j in range(n)])
            expect(f"all_to_all_single uneven {dtype} n={count}", out, want)
            outs = [sentinel(count + j, dtype) for j in range(n)]
            dist.all_to_all(outs, [value(rank * n + j, count + rank, dtype) for j in range(n)])
            for j in range(n):
                expect(f"all_to_all [{j}] {dtype}", outs[j], value(j * n + rank, count + j, dtype))
        # gather / scatter from every root, at counts 0, 1 and two primes
        for root in range(n):
            for count in (0, 1, 5, 10007):
                glist = [sentinel(count, dtype) for _ in range(n)] if rank == root else None
                dist.gather(value(rank, count, dtype), glist, dst=root)
                if rank == root:
                    for r in range(n):
                        expect(f"gather root={root} [{r}] {dtype} n={count}", glist[r],
                               value(r, count, dtype))
                out = sentinel(count, dtype)
                slist = ([value(root * n + j, count, dtype) for j in range(n)]
                         if rank == root else None)
                dist.scatter(out, slist, src=root)
                expect(f"scatter root={root} {dtype} n={count}", out,
                       value(root * n + rank, count, dtype))
    return fails


def _layouts(rank: int, n: int) -> list[str]:
    """Non-contiguous tensors and async works with futures."""
    fails: list[str] = []
    base = torch.arange(24, dtype=torch.float32).reshape(4, 6)
    t = (base + rank).t()  # non-contiguous view
    dist.all_reduce(t)
    want = sum(base + r for r in range(n)).t()
    if not torch.equal(t, want):
        fails.append(f"r{rank} non-contiguous all_reduce")
    strided = torch.zeros(10)[::2]
    if rank == 0:
        strided.copy_(torch.arange(5.0))
    dist.broadcast(strided, src=0)
    if not torch.equal(strided, torch.arange(5.0)):
        fails.append(f"r{rank} strided broadcast")
    outs = [torch.zeros(3, 4).t() for _ in range(n)]
    dist.all_gather(outs, (torch.ones(4, 3) * rank))
    if any(not torch.equal(outs[r], torch.ones(4, 3) * r) for r in range(n)):
        fails.append(f"r{rank} non-contiguous all_gather outputs")
    # async + futures: the value is the list of outputs
    x = torch.full((7,), float(rank))
    work = dist.all_reduce(x, async_op=True)
    fut_value = work.get_future().wait()
    work.wait()
    if not (isinstance(fut_value, list) and torch.equal(fut_value[0], torch.full((7,), float(sum(range(n)))))):
        fails.append(f"r{rank} future value {fut_value}")
    if not work.is_completed() or not work.is_success():
        fails.append(f"r{rank} work state after wait")
    chained = dist.all_reduce(torch.ones(3), async_op=True).get_future().then(lambda f: f.value()[0] * 2)
    if not torch.equal(chained.wait(), torch.full((3,), 2.0 * n)):
        fails.append(f"r{rank} future.then")
    # many async ops in flight, waited in reverse
    ts = [torch.full((100,), float(rank + i)) for i in range(8)]
    works = [dist.all_reduce(t, async_op=True) for t in ts]
    for w in reversed(works):
        w.wait()
    for i, t in enumerate(ts):
        if not torch.equal(t, torch.full((100,), float(sum(range(n)) + n * i))):
            fails.append(f"r{rank} async op {i}")
    # coalescing manager: all_reduce, all_gather_into_tensor, reduce_scatter_tensor
    for async_ops in (False, True):
        ts = [torch.full((5 + i,), float(rank)) for i in range(3)]
        with dist._coalescing_manager(async_ops=async_ops) as cm:
            for t in ts:
                dist.all_reduce(t)
        if async_ops:
            cm.wait()
        if any(not torch.equal(t, torch.full_like(t, float(sum(range(n))))) for t in ts):
            fails.append(f"r{rank} coalesced all_reduce async={async_ops}")
    outs = [torch.empty(n * 2) for _ in range(2)]
    with dist._coalescing_manager():
        for o in outs:
            dist.all_gather_into_tensor(o, torch.full((2,), float(rank)))
    for o in outs:
        if not torch.equal(o, torch.arange(n).float().repeat_interleave(2)):
            fails.append(f"r{rank} coalesced all_gather_into_tensor")
    outs = [torch.empty(2) for _ in range(2)]
    with dist._coalescing_manager():
        for o in outs:
            dist.reduce_scatter_tensor(o, torch.arange(2.0 * n) + rank)
    for o in outs:
        want = (torch.arange(2.0 * n) * n + sum(range(n)))[rank * 2:(rank + 1) * 2]
        if not torch.equal(o, want):
            fails.append(f"r{rank} coalesced reduce_scatter_tensor")
    # object collectives
    objs = [None] * n
    dist.all_gather_object(objs, {"rank": rank, "s": "x" * rank})
    if objs != [{"rank": r, "s": "x" * r} for r in range(n)]:
        fails.append(f"r{rank} all_gather_object")
    lst = [rank, "a"] if rank == 0 else [None, None]
    dist.broadcast_object_list(lst, src=0)
    if lst != [0, "a"]:
        fails.append(f"r{rank} broadcast_object_list")
    got = [None] * n if rank == 0 else None
    dist.gather_object(rank * 10, got, dst=0)
    if rank == 0 and got != [r * 10 for r in range(n)]:
        fails.append(f"r{rank} gather_object {got}")
    out = [None]
    dist.scatter_object_list(out, [f"o{r}" for r in range(n)] if rank == 0 else None, src=0)
    if out != [f"o{rank}"]:
        fails.append(f"r{rank} scatter_object_list {out}")
    dist.barrier()
    return fails


def _versus_gloo(rank: int, n: int) -> list[str]:
    """The same calls on tdx and on gloo in the same processes give the same answers."""
    fails: list[str] = []
    gloo = dist.new_group(backend="gloo")
    for dtype in (torch.float32, torch.float64, torch.int8, torch.int32, torch.int64,
                  torch.uint8, torch.bool):
        # AVG where gloo has it: floating dtypes.
        avg = ("AVG",) if dtype.is_floating_point else ()
        for count in (1, 13, 4099):
            for op in ("SUM", "PRODUCT", "MIN", "MAX") + avg if dtype != torch.bool else ():
                a = value(rank, count, dtype, op)
                b = a.clone()
                dist.all_reduce(a, op=redop(op))
                dist.all_reduce(b, op=redop(op), group=gloo)
                if not close(a, b):
                    fails.append(f"r{rank} vs gloo all_reduce {op} {dtype} n={count}")
                a, b = value(rank, count, dtype, op), value(rank, count, dtype, op)
                dist.reduce(a, dst=n - 1, op=redop(op))
                dist.reduce(b, dst=n - 1, op=redop(op), group=gloo)
                if rank == n - 1 and not close(a, b):
                    fails.append(f"r{rank} vs gloo reduce {op} {dtype} n={count}")
                full = torch.cat([value(rank * n + j, count, dtype, op) for j in range(n)])
                oa, ob = sentinel(count, dtype), sentinel(count, dtype)
                dist.reduce_scatter(oa, list(full.chunk(n)), op=redop(op))
                dist.reduce_scatter(ob, list(full.chunk(n)), op=redop(op), group=gloo)
                if not close(oa, ob):
                    fails.append(f"r{rank} vs gloo reduce_scatter {op} {dtype} n={count}")
            oa, ob = sentinel(n * count, dtype), sentinel(n * count, dtype)
            dist.all_gather_into_tensor(oa, value(rank, count, dtype))
            dist.all_gather_into_tensor(ob, value(rank, count, dtype), group=gloo)
            if not torch.equal(oa, ob):
                fails.append(f"r{rank} vs gloo all_gather_into_tensor {dtype}")
            a = value(rank, count, dtype)
            b = a.clone()
            dist.broadcast(a, src=n - 1)
            dist.broadcast(b, src=n - 1, group=gloo)
            if not torch.equal(a, b):
                fails.append(f"r{rank} vs gloo broadcast {dtype}")
            oa = [torch.empty(count, dtype=dtype) for _ in range(n)]
            ob = [torch.empty(count, dtype=dtype) for _ in range(n)]
            dist.all_gather(oa, value(rank, count, dtype))
            dist.all_gather(ob, value(rank, count, dtype), group=gloo)
            if any(not torch.equal(x, y) for x, y in zip(oa, ob)):
                fails.append(f"r{rank} vs gloo all_gather {dtype}")
            inp = torch.cat([value(rank * n + j, count, dtype) for j in range(n)])
            oa, ob = torch.empty_like(inp), torch.empty_like(inp)
            dist.all_to_all_single(oa, inp)
            dist.all_to_all_single(ob, inp, group=gloo)
            if not torch.equal(oa, ob):
                fails.append(f"r{rank} vs gloo all_to_all_single {dtype}")
    dist.destroy_process_group(gloo)
    return fails


def _aliased_coalesced(rank: int, n: int) -> list[str]:
    """Coalesced ops whose tensors share memory: every entry is computed from the values
    its input had at the call, as gloo (which copies its inputs first) computes it."""
    fails: list[str] = []
    pg = dist.distributed_c10d._get_default_group()
    gloo = dist.new_group(backend="gloo")
    orig = torch.arange(10.0) + 100 * rank
    total = sum(torch.arange(10.0) + 100 * r for r in range(n))
    # all_reduce: overlapping views, the same view twice, and a strided view across them
    for group in (None, gloo):
        flat = orig.clone()
        views = [flat[0:6], flat[2:8], flat[2:8], flat[1::3]]
        with dist._coalescing_manager(group=group):
            for v in views:
                dist.all_reduce(v, group=group)
        name = "gloo" if group is gloo else "tdx"
        if not torch.equal(flat[:8], total[:8]) or not torch.equal(flat[8:], orig[8:]):
            fails.append(f"r{rank} {name} coalesced all_reduce of views: {flat.tolist()}")
    # all_gather_into_tensor: output 0 holds input 1
    big, other = torch.full((2 * n,), float(rank)), torch.empty(2 * n)
    pg.allgather_into_tensor_coalesced([big, other],
                                       [torch.tensor([7.0, 8.0]) + rank, big[:2]]).wait()
    if not torch.equal(big, (torch.tensor([7.0, 8.0]).repeat(n)
                             + torch.arange(n).float().repeat_interleave(2))):
        fails.append(f"r{rank} coalesced all_gather_into_tensor output {big.tolist()}")
    if not torch.equal(other, torch.arange(n).float().repeat_interleave(2)):
        fails.append(f"r{rank} coalesced all_gather_into_tensor read a written input: "
                     f"{other.tolist()}")
    # reduce_scatter_tensor: output 0 lies inside input 1
    buf = torch.arange(2.0 * n) + rank
    out1 = torch.empty(2)
    pg.reduce_scatter_tensor_coalesced([buf[2:4], out1], [torch.ones(2 * n), buf],
                                       dist.ReduceScatterOptions()).wait()
    want1 = (torch.arange(2.0 * n) * n + sum(range(n)))[rank * 2:(rank + 1) * 2]
    if not torch.equal(buf[2:4], torch.full((2,), float(n))) or not torch.equal(out1, want1):
        fails.append(f"r{rank} coalesced reduce_scatter_tensor: {buf.tolist()} {out1.tolist()}")
    # outputs of two entries that share memory: refused (the writes differ)
    buf = torch.zeros(3 * n)
    try:
        pg.allgather_into_tensor_coalesced([buf[:n], buf[n - 1:2 * n - 1]],
                                           [torch.ones(1), torch.ones(1)]).wait()
        fails.append(f"r{rank} overlapping outputs of a coalesced all_gather accepted")
    except ValueError as e:
        if "entries 0 and 1 share memory" not in str(e):
            fails.append(f"r{rank} overlapping outputs: {e}")
    # all_reduce of views of one buffer as two dtypes: the writes differ, so refused
    raw = torch.zeros(4, dtype=torch.int32)
    try:
        pg.allreduce_coalesced([raw, raw.view(torch.float32)]).wait()
        fails.append(f"r{rank} all_reduce_coalesced of one buffer as two dtypes accepted")
    except ValueError as e:
        if "entries 0 and 1 share memory" not in str(e):
            fails.append(f"r{rank} two dtypes: {e}")
    # interleaved but disjoint outputs (two columns of one matrix): accepted
    m = torch.zeros(3, 2)
    pg.reduce_scatter_tensor_coalesced([m[:, 0], m[:, 1]],
                                       [torch.ones(3 * n), torch.full((3 * n,), 2.0)],
                                       dist.ReduceScatterOptions()).wait()
    if not torch.equal(m, torch.tensor([[1.0, 2.0]] * 3) * n):
        fails.append(f"r{rank} coalesced reduce_scatter into two columns: {m.tolist()}")
    # all_gather (list form): input 1 is one of input 0's outputs
    outs0 = [torch.empty(3) for _ in range(n)]
    outs1 = [torch.empty(3) for _ in range(n)]
    in1 = outs0[(rank + 1) % n]
    in1.fill_(-1.0)
    pg.allgather_coalesced([outs0, outs1], [torch.full((3,), float(rank)), in1]).wait()
    if any(not torch.equal(o, torch.full((3,), float(r))) for r, o in enumerate(outs0)):
        fails.append(f"r{rank} coalesced all_gather output 0")
    if any(not torch.equal(o, torch.full((3,), -1.0)) for o in outs1):
        fails.append(f"r{rank} coalesced all_gather read a written input: {outs1}")
    dist.destroy_process_group(gloo)
    return fails


def _random_aliased_coalesced(rank: int, n: int, trials: int) -> list[str]:
    """Random views of one buffer (overlapping, repeated, strided, empty) in one coalesced
    all_reduce or all_gather_into_tensor, on tdx and on gloo: the same answers."""
    fails: list[str] = []
    gloo = dist.new_group(backend="gloo")
    pg = dist.distributed_c10d._get_default_group()
    gen = torch.Generator().manual_seed(1234)  # the same calls on every rank

    def randint(lo: int, hi: int) -> int:
        return int(torch.randint(lo, hi, (1,), generator=gen))

    for trial in range(trials):
        size = randint(8, 64)
        base = (torch.arange(size, dtype=torch.float64) + 1) * (rank + 1)
        views = []
        for _ in range(randint(1, 6)):
            start, step = randint(0, size), randint(1, 4)
            stop = randint(start, size + 1)
            views.append((start, stop, step))
        bufs = {}
        for name, group in (("tdx", pg), ("gloo", gloo)):
            buf = base.clone()
            with dist._coalescing_manager(group=None if group is pg else group):
                for start, stop, step in views:
                    dist.all_reduce(buf[start:stop:step], group=None if group is pg else group)
            bufs[name] = buf
        if not torch.equal(bufs["tdx"], bufs["gloo"]):
            fails.append(f"r{rank} trial {trial} all_reduce views {views}: "
                         f"tdx {bufs['tdx'].tolist()} gloo {bufs['gloo'].tolist()}")
        # all_gather_into_tensor: outputs disjoint blocks of one buffer (in any order),
        # inputs anywhere in it
        chunk = randint(1, 4)
        slots = torch.randperm(4, generator=gen).tolist()[:randint(1, 4)]
        entries = [(slot * n * chunk, randint(0, 4 * n * chunk - chunk + 1)) for slot in slots]
        outs = {}
        for name, group in (("tdx", pg), ("gloo", gloo)):
            buf = torch.arange(4 * n * chunk, dtype=torch.float64) + 100 * rank
            group.allgather_into_tensor_coalesced(
                [buf[o:o + n * chunk] for o, _ in entries],
                [buf[i:i + chunk] for _, i in entries]).wait()
            outs[name] = (buf, entries)
        if not torch.equal(outs["tdx"][0], outs["gloo"][0]):
            fails.append(f"r{rank} trial {trial} all_gather_into_tensor {outs['tdx'][1]}: "
                         f"tdx {outs['tdx'][0].tolist()} gloo {outs['gloo'][0].tolist()}")
    dist.destroy_process_group(gloo)
    return fails


def _peak_growth(fn) -> int:
    """Bytes by which this process's peak resident memory rose above its resident memory
    at the call while ``fn`` ran (writing 5 to clear_refs resets the peak, VmHWM)."""
    def status(key: str) -> int:
        with open("/proc/self/status") as f:
            line = next(x for x in f if x.startswith(key + ":"))
        return int(line.split()[1]) * 1024
    with open("/proc/self/clear_refs", "w") as f:
        f.write("5")
    before = status("VmRSS")
    fn()
    return status("VmHWM") - before


def _coalesced_staging_peak(rank: int, n: int, entries: int, mib: int) -> list[str]:
    """Non-contiguous entries are staged through contiguous copies: a coalesced op must
    hold one entry's copies at a time, not every entry's until the op ends."""
    fails: list[str] = []
    pg = dist.distributed_c10d._get_default_group()
    rows = int(((mib << 20) // 4) ** 0.5)  # an entry: a square float32 matrix, transposed
    entry = rows * rows * 4

    def square(value: float) -> torch.Tensor:
        return torch.full((rows, rows), value).t()

    def tall(value: float) -> torch.Tensor:  # n squares stacked, transposed twice over
        return torch.full((rows, n * rows), value).t()

    ins = [square(100.0 * rank + i) for i in range(entries)]
    gathered = [tall(-1.0) for _ in range(entries)]
    stacked = [tall(float(rank + i)) for i in range(entries)]
    scattered = [square(-1.0) for _ in range(entries)]
    ops = {
        # name: (run it, bytes staged per entry)
        "all_gather_into_tensor_coalesced":
            (lambda: pg.allgather_into_tensor_coalesced(gathered, ins).wait(), (1 + n) * entry),
        "reduce_scatter_tensor_coalesced":
            (lambda: pg.reduce_scatter_tensor_coalesced(
                scattered, stacked, dist.ReduceScatterOptions()).wait(), (1 + n) * entry),
        "all_reduce_coalesced":
            (lambda: pg.allreduce_coalesced(ins, dist.AllreduceCoalescedOptions()).wait(),
             entry),
    }
    for name, (op, staged) in ops.items():
        op()  # the first op sets up windows and buffers that later ones reuse
        grew = _peak_growth(op)
        # One entry's copies at a time rise by `staged` (measured: exactly that); holding
        # every entry's to the end would need entries * staged bytes.
        if grew > 2 * staged:
            fails.append(f"r{rank} {name}: the peak rose {grew / 2**20:.0f} MiB over "
                         f"{entries} entries of {staged / 2**20:.0f} MiB staged each; one "
                         f"entry's copies at a time is at most {2 * staged / 2**20:.0f} MiB")
    for i in range(entries):
        want = torch.cat([torch.full((rows, rows), 100.0 * r + i) for r in range(n)])
        if not torch.equal(gathered[i], want):
            fails.append(f"r{rank} all_gather entry {i} wrong")
        if not torch.equal(scattered[i], torch.full((rows, rows), float(sum(
                r + i for r in range(n))))):
            fails.append(f"r{rank} reduce_scatter entry {i} wrong")
        # reduced twice: n times the first sum
        if not torch.equal(ins[i], torch.full((rows, rows), n * sum(
                100.0 * r + i for r in range(n)))):
            fails.append(f"r{rank} all_reduce entry {i} wrong")
    return fails


def test_coalesced_ops_stage_one_entry_at_a_time() -> None:
    # A fixed mmap threshold: glibc otherwise raises it as large blocks are freed, and
    # then keeps freed copies in its heap, where resident memory no longer shows them.
    fails = [f for r in run_ranks(_coalesced_staging_peak, 2, args=(8, 8),
                                  env={"MALLOC_MMAP_THRESHOLD_": "65536"}) for f in r]
    assert not fails, "\n".join(fails)


def _random_output_lists(rank: int, n: int, trials: int) -> list[str]:
    """all_gather into lists of slices of a few buffers, some overlapping, some the same
    tensor twice: refused exactly when two entries share a byte, naming two that do;
    otherwise every entry holds its rank's input."""
    fails: list[str] = []
    gen = torch.Generator().manual_seed(4321)  # the same lists on every rank

    def randint(lo: int, hi: int) -> int:
        return int(torch.randint(lo, hi, (1,), generator=gen))

    for trial in range(trials):
        count = randint(1, 4)
        bufs = [torch.zeros(randint(n * count, 3 * n * count)) for _ in range(2)]
        spans = []  # (buffer, start) per entry; buffer 2 is a tensor of the entry's own
        for _ in range(n):
            b = randint(0, 3)
            spans.append((b, randint(0, bufs[b].numel() - count + 1) if b < 2 else 0))
        if randint(0, 4) == 0:  # the very same tensor twice
            i, j = randint(0, n), randint(0, n)
            spans[j] = spans[i]
        outs = [bufs[b][s:s + count] if b < 2 else torch.zeros(count) for b, s in spans]
        overlapping = {(i, j) for i in range(n) for j in range(i + 1, n)
                       if spans[i][0] == spans[j][0] < 2
                       and abs(spans[i][1] - spans[j][1]) < count}
        try:
            dist.all_gather(outs, torch.full((count,), float(rank)))
            if overlapping:
                fails.append(f"r{rank} trial {trial} {spans}: overlapping entries accepted")
            elif any(not torch.equal(o, torch.full((count,), float(r)))
                     for r, o in enumerate(outs)):
                fails.append(f"r{rank} trial {trial} {spans}: {[o.tolist() for o in outs]}")
        except ValueError as e:
            named = re.search(r"entries (\d+) and (\d+) of the output list share memory",
                              str(e))
            if not overlapping or not named or \
                    (int(named[1]), int(named[2])) not in overlapping:
                fails.append(f"r{rank} trial {trial} {spans} (overlapping: "
                             f"{sorted(overlapping)}): {e}")
    return fails


def test_output_lists_refused_exactly_when_entries_overlap() -> None:
    fails = [f for r in run_ranks(_random_output_lists, 5, args=(150,)) for f in r]
    assert not fails, "\n".join(fails[:10])


def test_random_aliased_coalesced_ops_match_gloo() -> None:
    fails = [f for r in run_ranks(_random_aliased_coalesced, 3, args=(40,)) for f in r]
    assert not fails, "\n".join(fails[:10])


def test_coalesced_ops_read_inputs_as_they_were_at_the_call() -> None:
    fails = [f for r in run_ranks(_aliased_coalesced, 3) for f in r]
    assert not fails, "\n".join(fails)


@pytest.mark.parametrize("world_size", WORLD_SIZES)
def test_every_op_dtype_count(world_size: int) -> None:
    results = run_ranks(_sweep, world_size, timeout=300)
    fails = [f for r in results for f in r]
    assert not fails, "\n".join(fails[:40])


@pytest.mark.parametrize("world_size", [1, 3, 4])
def test_layouts_async_coalesced_objects(world_size: int) -> None:
    fails = [f for r in run_ranks(_layouts, world_size) for f in r]
    assert not fails, "\n".join(fails)


@pytest.mark.parametrize("world_size", [2, 3, 5])
def test_matches_gloo(world_size: int) -> None:
    fails = [f for r in run_ranks(_versus_gloo, world_size) for f in r]
    assert not fails, "\n".join(fails)


def test_reduction_kernel_edge_values() -> None:
    """The CPU kernels on values the sweeps above never reach: NaN in MIN/MAX (whichever
    operand holds it), integer sums that wrap, int64 beyond 2^53, AVG over more ranks
    than an int8 can count."""
    import torchdist_ext

    mr = torchdist_ext._C._multi_reduce

    def run(xs: list[torch.Tensor], op: str, factor: float = 1.0) -> torch.Tensor:
        out = torch.empty_like(xs[0])
        mr(xs, [out], op, factor)
        return out

    nan = float("nan")
    for dtype in FLOATS:
        a = torch.tensor([nan, 1.0, 2.0], dtype=dtype)
        b = torch.tensor([1.0, nan, 3.0], dtype=dtype)
        for op, last in (("MIN", 2.0), ("MAX", 3.0)):
            for xs in ([a, b], [b, a]):
                got = run(xs, op)
                assert got[:2].isnan().all() and got[2].item() == last, (dtype, op, got)
    # float16 AVG: each share scaled before the sum, so no overflow past 65504.
    got = run([torch.full((5,), 40000.0, dtype=torch.float16)] * 4, "AVG")
    assert torch.equal(got, torch.full((5,), 40000.0, dtype=torch.float16)), got
    # int32 SUM/PRODUCT wrap modulo 2^32, as torch's own ops do.
    big = torch.tensor([2**31 - 1, -(2**31)], dtype=torch.int32)
    one = torch.tensor([1, -1], dtype=torch.int32)
    assert torch.equal(run([big, one], "SUM"), big + one)
    assert torch.equal(run([big, big], "PRODUCT"), big * big)
    # int64 PREMUL_SUM with a whole factor is exact beyond 2^53.
    x = torch.tensor([2**53 + 1, -(2**61) - 3], dtype=torch.int64)
    assert torch.equal(run([x, x], "PREMUL_SUM", 3.0), x * 6), run([x, x], "PREMUL_SUM", 3.0)
    # int8 AVG over 128 ranks divides by 128, not by int8(128) == -128.
    got = run([torch.full((3,), -1, dtype=torch.int8)] * 128, "AVG")
    assert torch.equal(got, torch.full((3,), -1, dtype=torch.int8)), got


def test_uint8_average_over_256_ranks_does_not_divide_by_zero() -> None:
    """uint8(256) is 0: dividing by the group size in the element type raised SIGFPE.
    Run in a child so that a regression fails this test instead of killing the suite."""
    import subprocess
    import sys

    code = (
        "import torch, torchdist_ext\n"
        "xs = [torch.full((4,), 3, dtype=torch.uint8)] * 256\n"
        "out = torch.empty_like(xs[0])\n"
        "torchdist_ext._C._multi_reduce(xs, [out], 'AVG', 1.0)\n"
        "print(out.tolist())\n"
    )
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                          timeout=120)
    assert proc.returncode == 0, (proc.returncode, proc.stderr[-2000:])
    # 256 × 3 wraps to 0 in uint8 (the sum runs in the element type); 0 / 256 = 0.
    assert proc.stdout.strip() == "[0, 0, 0, 0]", proc.stdout


def _edge_values_every_algorithm(rank: int, n: int) -> list[str]:
    import torchdist_ext

    fails: list[str] = []
    nan = float("nan")
    names = torchdist_ext.algorithms("allreduce")["allreduce"]
    for name in ["auto"] + names:
        torchdist_ext.set_algorithm("allreduce", name)
        try:
            # NaN held by one rank, at positions spread over the chunks of every plan.
            for op in (R.MIN, R.MAX):
                t = torch.ones(1001)
                t[rank::n] = nan
                dist.all_reduce(t, op=op)
                if not t.isnan().all():
                    fails.append(f"r{rank} {name} {op}: {int((~t.isnan()).sum())} NaN lost")
            h = torch.full((1001,), 40000.0, dtype=torch.float16)
            dist.all_reduce(h, op=R.AVG)
            if not torch.equal(h, torch.full_like(h, 40000.0)):
                fails.append(f"r{rank} {name} float16 AVG: {h[:3].tolist()}")
            x = torch.full((1001,), 2**53 + 1, dtype=torch.int64)
            dist.all_reduce(x, op=dist._make_nccl_premul_sum(3.0))
            if not torch.equal(x, torch.full_like(x, 3 * n * (2**53 + 1))):
                fails.append(f"r{rank} {name} int64 PREMUL_SUM: {x[:2].tolist()}")
            # The same factors as integer tensors, which a double would round: 2^53 + 1,
            # and 2^64 - 1 (uint64), which is -1 modulo 2^64.
            for factor, share in ((torch.tensor([2**53 + 1]), 3 * (2**53 + 1)),
                                  (torch.tensor([2**64 - 1], dtype=torch.uint64), -3)):
                x = torch.full((1001,), 3, dtype=torch.int64)
                dist.all_reduce(x, op=dist._make_nccl_premul_sum(factor))
                if not torch.equal(x, torch.full_like(x, n * share)):
                    fails.append(f"r{rank} {name} int64 PREMUL_SUM by {factor.dtype} "
                                 f"{factor.item()}: {x[:2].tolist()}, want {n * share}")
            ran = torchdist_ext.flight_recorder()[-1]["path"]
            if name != "auto" and ran != name:
                fails.append(f"r{rank} pinned {name} but {ran} ran")
        except Exception as e:  # noqa: BLE001 - every algorithm runs on one host at any world
            fails.append(f"r{rank} {name}: {type(e).__name__}: {e}")
        finally:
            torchdist_ext.set_algorithm("allreduce", "auto")
    return fails


@pytest.mark.parametrize("world_size", [2, 3])
def test_edge_values_agree_across_algorithms(world_size: int) -> None:
    fails = [f for r in run_ranks(_edge_values_every_algorithm, world_size) for f in r]
    assert not fails, "\n".join(fails)


def _scaled_reductions_every_algorithm(rank: int, n: int) -> list[str]:
    """AVG and PREMUL_SUM scale each rank's input where the algorithm first copies it:
    every algorithm of all_reduce, reduce and reduce_scatter, in place and out of place,
    over several window chunks, must give the scaled sum and leave its inputs alone."""
    import torchdist_ext

    fails: list[str] = []
    names = torchdist_ext.algorithms()
    count = 40009  # float32: five chunks of the 32 KiB halves these windows have
    big = 2**53 + 1  # int64 beyond double's integers: a whole factor must stay exact

    def base(r: int, dtype: torch.dtype) -> torch.Tensor:
        if dtype == torch.int64:
            return torch.full((count,), big, dtype=dtype) + r
        return value(r, count, dtype, "AVG") * (r + 1)  # positive: a relative tolerance

    def check(what: str, got: torch.Tensor, want: torch.Tensor, avg: bool) -> None:
        if not close(got, want, n if avg else 0):
            bad = (got.double() - want.double()).abs().argmax().item()
            fails.append(f"r{rank} {what}: got {got[bad].item()} want {want[bad].item()} at {bad}")

    def ran(tag: str, name: str) -> None:
        path = torchdist_ext.flight_recorder()[-1]["path"]
        if path != name:
            fails.append(f"r{rank} {tag}: pinned {name} but {path} ran")

    cases = [("AVG", 1.0, torch.float32), ("AVG", 1.0, torch.bfloat16),
             ("PREMUL_SUM", 0.5, torch.float32), ("PREMUL_SUM", 3.0, torch.float32),
             ("PREMUL_SUM", 3.0, torch.int64), ("PREMUL_SUM tensor", 0.5, torch.float32)]
    for op, factor, dtype in cases:
        avg = op == "AVG"
        if avg:
            redop_ = R.AVG
        elif op == "PREMUL_SUM tensor":  # the factor read when the op runs
            redop_ = dist._make_nccl_premul_sum(torch.tensor([factor], dtype=dtype))
        else:
            redop_ = dist._make_nccl_premul_sum(factor)
        ref_op = "AVG" if avg else "PREMUL_SUM"
        want = reference([base(r, dtype) for r in range(n)], ref_op, n, dtype, factor)
        if dtype == torch.int64:  # exact: 3 * (n * big + 0 + 1 + ...), no float64 rounding
            want = torch.full((count,), 3 * (n * big + n * (n - 1) // 2), dtype=dtype)
        for name in names["allreduce"]:
            torchdist_ext.set_algorithm("allreduce", name)
            tag = f"all_reduce {op}x{factor} {dtype} {name}"
            t = base(rank, dtype)
            dist.all_reduce(t, op=redop_)
            check(tag + " in place", t, want, avg)
            ran(tag, name)
            inp, out = base(rank, dtype), sentinel(count, dtype)
            torchdist_ext.all_reduce_into(out, inp, op=redop_)
            check(tag + " out of place", out, want, avg)
            check(tag + " leaves its input", inp, base(rank, dtype), False)
            ran(tag, name)
        torchdist_ext.set_algorithm("allreduce", "auto")
        for name in names["reduce"]:
            torchdist_ext.set_algorithm("reduce", name)
            tag = f"reduce {op}x{factor} {dtype} {name}"
            t = base(rank, dtype)
            dist.reduce(t, dst=n - 1, op=redop_)
            check(tag, t, want if rank == n - 1 else base(rank, dtype), avg)
            ran(tag, name)
        torchdist_ext.set_algorithm("reduce", "auto")
        full = [torch.cat([base(r * n + j, dtype) for j in range(n)]) for r in range(n)]
        piece = reference([f.chunk(n)[rank] for f in full], ref_op, n, dtype, factor)
        if dtype == torch.int64:
            piece = torch.full((count,), 3 * (n * big + sum(r * n + rank for r in range(n))),
                               dtype=dtype)
        for name in names["reduce_scatter"]:
            if name == "rh" and n & (n - 1):
                continue  # recursive halving needs a power-of-two world
            torchdist_ext.set_algorithm("reduce_scatter", name)
            tag = f"reduce_scatter {op}x{factor} {dtype} {name}"
            inp, out = full[rank].clone(), sentinel(count, dtype)
            dist.reduce_scatter_tensor(out, inp, op=redop_)
            check(tag + " out of place", out, piece, avg)
            check(tag + " leaves its input", inp, full[rank], False)
            ran(tag, name)
            inp = full[rank].clone()
            dist.reduce_scatter_tensor(inp.chunk(n)[rank], inp, op=redop_)
            check(tag + " in place", inp.chunk(n)[rank], piece, avg)
            for j in range(n):
                if j != rank:
                    check(tag + f" in place leaves block {j}", inp.chunk(n)[j],
                          full[rank].chunk(n)[j], False)
            ins, out = [c.clone() for c in full[rank].chunk(n)], sentinel(count, dtype)
            dist.reduce_scatter(out, ins, op=redop_)
            check(tag + " list", out, piece, avg)
            check(tag + " list leaves its inputs", torch.cat(ins), full[rank], False)
            ins = [c.clone() for c in full[rank].chunk(n)]
            dist.reduce_scatter(ins[rank], ins, op=redop_)
            check(tag + " list in place", ins[rank], piece, avg)
            ran(tag, name)
        torchdist_ext.set_algorithm("reduce_scatter", "auto")
    return fails


@pytest.mark.parametrize("world_size", [2, 3])
def test_scaled_reductions_every_algorithm(world_size: int) -> None:
    fails = [f for r in run_ranks(_scaled_reductions_every_algorithm, world_size,
                                  env={"TDX_SHM_SLOT_BYTES": "65536"}) for f in r]
    assert not fails, "\n".join(fails[:20])


def _message_algorithms_every_dtype_and_op(rank: int, n: int) -> list[str]:
    """The dtype x op sweep above runs whatever auto picks, a window on one host. Here
    each message algorithm of the reducing collectives is pinned and runs every dtype and
    op, checked against the float64/int64 reference and against the algorithm named in
    the flight recorder."""
    import torchdist_ext

    fails: list[str] = []
    pow2 = n & (n - 1) == 0
    pins = [("allreduce", "ring"), ("allreduce", "rhd"), ("allreduce", "direct"),
            ("reduce", "tree"), ("reduce_scatter", "ring")] + \
        ([("reduce_scatter", "rh")] if pow2 else [])
    for coll, name in pins:
        torchdist_ext.set_algorithm(coll, name)
        try:
            for dtype in DTYPES:
                for count in (7, 1000):
                    for op in ops_for(dtype):
                        what = f"{coll}:{name} {op} {dtype} n={count}"
                        if coll == "reduce_scatter":
                            full = torch.cat([value(rank * n + j, count, dtype, op)
                                              for j in range(n)])
                            want = reference([value(r * n + rank, count, dtype, op)
                                              for r in range(n)], op, n, dtype)
                            got = sentinel(count, dtype)
                            dist.reduce_scatter_tensor(got, full, op=redop(op))
                        else:
                            got = value(rank, count, dtype, op)
                            want = reference([value(r, count, dtype, op) for r in range(n)],
                                             op, n, dtype)
                            if coll == "reduce":
                                dist.reduce(got, dst=n - 1, op=redop(op))
                                if rank != n - 1:
                                    continue
                            else:
                                dist.all_reduce(got, op=redop(op))
                        if not close(got, want, n if op == "AVG" else 0):
                            fails.append(f"r{rank} {what}: got {got[:4].tolist()} "
                                         f"want {want[:4].tolist()}")
                        ran = torchdist_ext.flight_recorder()[-1]["path"]
                        if ran != name:
                            fails.append(f"r{rank} {what}: {ran} ran")
        finally:
            torchdist_ext.set_algorithm(coll, "auto")
    return fails


@pytest.mark.parametrize("world_size", [3, 4])
def test_message_algorithms_every_dtype_and_op(world_size: int) -> None:
    fails = [f for per_rank in run_ranks(_message_algorithms_every_dtype_and_op, world_size,
                                         timeout=300) for f in per_rank]
    assert not fails, "\n".join(fails[:20])

"""torchdist_ext.all_reduce_into: the out-of-place all_reduce.

Every allreduce algorithm (pinned) x dtype x reduce op x count, against the float64/int64
reference and against the in-place all_reduce of the same algorithm, with the input
checked unchanged afterwards. Small shared-memory slots make the shared-memory
algorithms run many chunks. Then layouts (non-contiguous, the same tensor, async), a
gloo group (copy + all_reduce), ranks mixing the two forms, and bad arguments.
"""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist

import torchdist_ext
from torchdist_ext.testing import run_ranks
from test_collectives import DTYPES, close, ops_for, redop, reference, value

COUNTS = [0, 1, 7, 1000, 12345]
SMALL_SLOTS = {"TDX_SHM_SLOT_BYTES": "8192"}  # halves of 4 KiB: 12345 floats = 13 chunks


def _sweep(rank: int, n: int, names: list[str] | None = None) -> list[str]:
    fails: list[str] = []
    names = names or torchdist_ext.algorithms("allreduce")["allreduce"] + ["auto"]
    for name in names:
        torchdist_ext.set_algorithm("allreduce", name)
        for dtype in DTYPES:
            for count in COUNTS:
                for op in ops_for(dtype):
                    label = f"r{rank}/{n} {name} {op} {dtype} n={count}"
                    x = value(rank, count, dtype, op)
                    keep = x.clone()
                    out = torch.full_like(x, 3) if dtype != torch.bool else torch.ones_like(x)
                    try:
                        torchdist_ext.all_reduce_into(out, x, op=redop(op))
                    except RuntimeError as e:
                        if name == "cma" and "cross-memory" in str(e).lower():
                            break  # this machine forbids cross-memory attach
                        raise
                    want = reference([value(r, count, dtype, op) for r in range(n)], op, n, dtype)
                    if not close(out, want, n if op == "AVG" else 0):
                        fails.append(f"{label}: got {out[:4].tolist()} want {want[:4].tolist()}")
                    if not torch.equal(x, keep):
                        fails.append(f"{label}: the input changed")
                    # The same algorithm in place gives the same bits.
                    dist.all_reduce(x, op=redop(op))
                    if not torch.equal(x, out):
                        fails.append(f"{label}: differs from the in-place all_reduce")
    torchdist_ext.set_algorithm("allreduce", "auto")
    return fails


@pytest.mark.parametrize("world_size", [1, 2, 3, 5])
def test_every_algorithm_dtype_op_count(world_size: int) -> None:
    fails = run_ranks(_sweep, world_size, env=SMALL_SLOTS, timeout=300)
    assert not [f for r in fails for f in r], [f for r in fails for f in r][:20]


def test_over_the_network_algorithms() -> None:
    """TDX_SHM=0: no window, so the plan algorithms (ring, rhd, direct) run the op on a
    copy in the output."""
    fails = run_ranks(_sweep, 3, env={"TDX_SHM": "0"}, timeout=300,
                      args=(["ring", "rhd", "direct", "auto"],))
    assert not [f for r in fails for f in r], [f for r in fails for f in r][:20]


def _layouts(rank: int, n: int) -> list[str]:
    fails: list[str] = []
    want = sum(torch.arange(24, dtype=torch.float32).reshape(4, 6) + r for r in range(n))
    base = torch.arange(24, dtype=torch.float32).reshape(4, 6) + rank
    for name in ("shm", "shm_direct", "ring"):
        torchdist_ext.set_algorithm("allreduce", name)
        # non-contiguous input, and a non-contiguous output
        x = base.t()
        out = torch.zeros(6, 4)
        torchdist_ext.all_reduce_into(out, x)
        if not torch.equal(out, want.t()) or not torch.equal(x, base.t()):
            fails.append(f"r{rank} {name}: non-contiguous input")
        big = torch.zeros(6, 8)
        out = big[:, ::2]
        torchdist_ext.all_reduce_into(out, base.t().contiguous())
        if not torch.equal(out, want.t()) or big[:, 1::2].any():
            fails.append(f"r{rank} {name}: non-contiguous output")
        # output is the input: in place
        x = base.clone()
        torchdist_ext.all_reduce_into(x, x)
        if not torch.equal(x, want):
            fails.append(f"r{rank} {name}: output is input")
        # a different shape with the same number of elements
        out = torch.empty(24)
        torchdist_ext.all_reduce_into(out, base)
        if not torch.equal(out, want.flatten()):
            fails.append(f"r{rank} {name}: reshaped output")
        # async: a work handle, the result after wait()
        out = torch.empty(4, 6)
        work = torchdist_ext.all_reduce_into(out, base, async_op=True)
        work.wait()
        if not torch.equal(out, want):
            fails.append(f"r{rank} {name}: async")
    # One rank calls the out-of-place form while the others call dist.all_reduce.
    torchdist_ext.set_algorithm("allreduce", "auto")
    x = base.clone()
    if rank == 0:
        out = torch.empty(4, 6)
        torchdist_ext.all_reduce_into(out, x)
    else:
        dist.all_reduce(x)
        out = x
    if not torch.equal(out, want):
        fails.append(f"r{rank}: all_reduce_into mixed with all_reduce")
    # A subgroup, and a rank outside it.
    sub = dist.new_group([0, n - 1])
    out = torch.zeros(4, 6)
    torchdist_ext.all_reduce_into(out, base, group=sub)
    if rank in (0, n - 1):
        if not torch.equal(out, 2 * torch.arange(24.0).reshape(4, 6) + (n - 1)):
            fails.append(f"r{rank}: subgroup got {out[0].tolist()}")
    elif out.any():
        fails.append(f"r{rank}: a rank outside the subgroup had its output written")
    dist.destroy_process_group(sub)
    return fails


@pytest.mark.parametrize("backend", ["tdx", "gloo"])
def test_layouts_async_groups(backend: str) -> None:
    fails = run_ranks(_layouts, 3, backend=backend) if backend == "tdx" else \
        run_ranks(_gloo, 3, backend="gloo")
    assert not [f for r in fails for f in r], fails


def _gloo(rank: int, n: int) -> list[str]:
    """On another backend: exactly a copy then dist.all_reduce."""
    x = torch.arange(10, dtype=torch.float64) * (rank + 1)
    out = torch.empty(10, dtype=torch.float64)
    torchdist_ext.all_reduce_into(out, x, op=dist.ReduceOp.MAX)
    want = torch.arange(10, dtype=torch.float64) * n
    ok = torch.equal(out, want) and torch.equal(x, torch.arange(10, dtype=torch.float64) * (rank + 1))
    fails = [] if ok else [f"r{rank}: gloo got {out.tolist()}"]
    # The forms the backend's own path takes work here too: an output of another shape
    # (copy_ alone would refuse it), a view of all of the input (in place); a partial
    # overlap is refused by name.
    out = torch.empty(2, 5, dtype=torch.float64)
    torchdist_ext.all_reduce_into(out, x, op=dist.ReduceOp.MAX)
    if not torch.equal(out.flatten(), want):
        fails.append(f"r{rank}: gloo, output shaped (2, 5): {out.tolist()}")
    y = x.clone().reshape(2, 5)
    torchdist_ext.all_reduce_into(y.view(-1), y, op=dist.ReduceOp.MAX)
    if not torch.equal(y.flatten(), want):
        fails.append(f"r{rank}: gloo, y.view(-1) from y: {y.tolist()}")
    z = torch.zeros(20, dtype=torch.float64)
    try:
        torchdist_ext.all_reduce_into(z[5:15], z[0:10])
        fails.append(f"r{rank}: gloo, a partly overlapping output accepted")
    except ValueError as e:
        if f"[tdx rank {rank}] all_reduce_into" not in str(e) or "overlaps part" not in str(e):
            fails.append(f"r{rank}: gloo, partial overlap: {e}")
    return fails


def _torch_detail(rank: int, n: int) -> list[str]:
    """Under TORCH_DISTRIBUTED_DEBUG=DETAIL torch wraps the backend in a checking wrapper:
    the queries still find tdx behind it, and all_reduce_into still meets the other
    ranks' all_reduce (it goes through the wrapper, whose check every rank runs)."""
    fails = []
    x = torch.arange(6.0) + rank
    want = n * torch.arange(6.0) + sum(range(n))
    # (torch's own check compares shapes, so the output keeps the input's here.)
    if rank == 0:
        got = torch.empty(6)
        torchdist_ext.all_reduce_into(got, x)
    else:
        dist.all_reduce(x)
        got = x
    if not torch.equal(got, want):
        fails.append(f"r{rank}: {got.tolist()}")
    try:
        record = torchdist_ext.flight_recorder()
        if not record or record[-1]["op"] != "all_reduce":
            fails.append(f"r{rank}: flight record {record[-1:]}")
        torchdist_ext.placement()
        torchdist_ext.predict("all_reduce", 1 << 20, group=dist.group.WORLD)
    except ValueError as e:
        fails.append(f"r{rank}: a query under DETAIL: {e}")
    return fails


def test_queries_and_all_reduce_into_under_torch_detail() -> None:
    fails = run_ranks(_torch_detail, 2, env={"TORCH_DISTRIBUTED_DEBUG": "DETAIL"})
    assert fails == [[], []], fails


def _bad(rank: int, n: int) -> list[str]:
    msgs = []
    x = torch.ones(10)
    cases = [
        (lambda: torchdist_ext.all_reduce_into(torch.empty(9), x), ValueError),
        (lambda: torchdist_ext.all_reduce_into(torch.empty(10, dtype=torch.int32), x),
         ValueError),
        (lambda: torchdist_ext.all_reduce_into(x[1:], x[:-1]), ValueError),  # partial overlap
        (lambda: torchdist_ext.all_reduce_into([x], x), TypeError),
        (lambda: torchdist_ext.all_reduce_into(torch.empty(10, dtype=torch.complex64),
                                               torch.ones(10, dtype=torch.complex64),
                                               op=dist.ReduceOp.MAX),
         TypeError),
        (lambda: torchdist_ext.all_reduce_into(torch.empty(10, dtype=torch.uint32),
                                               torch.ones(10, dtype=torch.uint32)),
         TypeError),
    ]
    for call, kind in cases:
        try:
            call()
        except kind as e:
            msgs.append(str(e))
        else:
            msgs.append(f"no {kind.__name__}")
    # The group still works afterwards.
    out = torch.empty(10)
    torchdist_ext.all_reduce_into(out, x)
    msgs.append("ok" if torch.equal(out, torch.full((10,), float(n))) else "broken")
    return msgs


def test_bad_arguments_raise_clearly() -> None:
    msgs = run_ranks(_bad, 2)
    for rank, m in enumerate(msgs):
        assert m[-1] == "ok", m
        for text in m[:-1]:
            assert "all_reduce_into" in text and (f"r{rank}/" in text or f"rank {rank}" in text), text
        assert "number of elements" in m[0] and "dtype" in m[1], m
        assert "share part of their memory" in m[2], m[2]
        assert "tensors" in m[3], m[3]
        assert "is complex" in m[4] and "MAX" in m[4], m[4]
        assert "cannot reduce" in m[5], m[5]


def _shapes_apart(rank: int, n: int) -> list[str]:
    fails = []
    base = torch.arange(24.0).reshape(4, 6) + rank
    want = n * torch.arange(24.0).reshape(4, 6) + sum(range(n))
    # Under fingerprint checks, an output shaped apart from its input still meets the
    # other ranks' in-place all_reduce of the same count.
    x = base.clone()
    if rank == 0:
        out = torch.empty(24)
        torchdist_ext.all_reduce_into(out, x)
        got = out.view(4, 6)
    else:
        dist.all_reduce(x)
        got = x
    if not torch.equal(got, want):
        fails.append(f"r{rank}: reshaped output got {got.flatten()[:4].tolist()}")
    # A view of the input's whole memory is the in-place op, not a partial overlap.
    y = base.clone()
    torchdist_ext.all_reduce_into(y.view(-1), y)
    if not torch.equal(y, want):
        fails.append(f"r{rank}: y.view(-1) from y got {y.flatten()[:4].tolist()}")
    return fails


def test_outputs_shaped_apart_and_whole_views() -> None:
    fails = run_ranks(_shapes_apart, 3, env={"TDX_DEBUG": "DETAIL"}, timeout=120)
    assert fails == [[], [], []], fails

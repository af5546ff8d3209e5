"""Calls that are right but unusual: outputs written back under the caller's no_grad or
inference mode, the single-tensor gather, and aliased tensor lists, which are refused
at the call where an algorithm would otherwise pick the answer."""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist

from torchdist_ext.testing import run_ranks


def _grad_modes(rank: int, n: int) -> list[str]:
    """Staged outputs (non-contiguous) are written back on the backend's threads, which
    have none of the caller's autograd state; gloo accepts each of these calls."""
    fails: list[str] = []

    def attempt(what: str, fn) -> None:
        try:
            fn()
        except Exception as e:  # noqa: BLE001 - reported
            fails.append(f"{what}: {type(e).__name__}: {str(e)[:300]}")

    # A parameter in channels_last (not contiguous), broadcast from rank 0 under no_grad:
    # how a model's weights are synchronised before training.
    conv = torch.nn.Conv2d(3, 4, 3).to(memory_format=torch.channels_last)
    with torch.no_grad():
        conv.weight.fill_(float(rank))
        attempt("broadcast into a leaf that requires grad",
                lambda: dist.broadcast(conv.weight, 0))
    if not torch.equal(conv.weight.detach(), torch.zeros_like(conv.weight)):
        fails.append(f"broadcast: {conv.weight.flatten()[:4]}")
    # A received parameter, the same way.
    with torch.no_grad():
        if rank == 0:
            attempt("send", lambda: dist.send(torch.full_like(conv.weight, 7.0), 1))
        elif rank == 1:
            attempt("recv into a leaf that requires grad", lambda: dist.recv(conv.weight, 0))
            if not torch.equal(conv.weight.detach(), torch.full_like(conv.weight, 7.0)):
                fails.append(f"recv: {conv.weight.flatten()[:4]}")
    # A column of an inference tensor, reduced inside inference mode.
    with torch.inference_mode():
        x = torch.full((5, 3), float(rank + 1))
        attempt("all_reduce of an inference tensor's column",
                lambda: dist.all_reduce(x[:, 1]))
        want = float(sum(range(1, n + 1)))
        if not (torch.all(x[:, 1] == want) and torch.all(x[:, 0] == rank + 1)):
            fails.append(f"inference all_reduce: {x}")
    # The group is still usable on every rank.
    attempt("all_reduce afterwards", lambda: dist.all_reduce(torch.ones(2)))
    return fails


@pytest.mark.parametrize("world_size", [2, 3])
def test_outputs_are_written_whatever_the_callers_grad_mode(world_size: int) -> None:
    for rank, fails in enumerate(run_ranks(_grad_modes, world_size, timeout=60)):
        assert not fails, (rank, fails)


def _gather_single(rank: int, n: int) -> list[str]:
    fails: list[str] = []
    for root in sorted({0, n - 1}):
        for count in (0, 1, 7):
            for dtype in (torch.float32, torch.int64, torch.bfloat16):
                x = (torch.arange(count) + 100 * rank).to(dtype)
                want = torch.cat([(torch.arange(count) + 100 * r).to(dtype) for r in range(n)])
                out = torch.full((n * count,), -1).to(dtype) if rank == root else None
                dist.gather_single(x, out, dst=root)
                if rank == root and not torch.equal(out, want):
                    fails.append(f"root {root} count {count} {dtype}: {out} != {want}")
        # In place: the root's input is its own block of the output.
        out = torch.full((n, 5), -1.0)
        mine = out[root] if rank == root else torch.empty(5)
        mine.copy_(torch.full((5,), float(rank)))
        dist.gather_single(mine, out if rank == root else None, dst=root)
        want = torch.arange(n, dtype=torch.float32).repeat_interleave(5).view(n, 5)
        if rank == root and not torch.equal(out, want):
            fails.append(f"in place, root {root}: {out}")
        # A non-contiguous output of the right size, shaped as the root likes.
        out = torch.full((5, n), -1.0).t() if rank == root else None
        dist.gather_single(torch.full((5,), float(rank)), out, dst=root)
        if rank == root and not torch.equal(out, want):
            fails.append(f"non-contiguous output, root {root}: {out}")
    if rank == 0:
        bad = [("short output",
                lambda: dist.gather_single(torch.ones(3), torch.empty(3 * n - 1)),
                "must have input.numel() * world_size")]
        if n > 1:  # with one rank, an input inside the output is the root's block
            bad.append(("input inside the output, not the root's block",
                        lambda: (lambda o: dist.gather_single(o[1:4], o))(torch.zeros(3 * n)),
                        "not the root's block"))
        for what, fn, needle in bad:
            try:
                fn()
                fails.append(f"{what}: no error")
            except ValueError as e:
                if needle not in str(e) or "gather_single" not in str(e):
                    fails.append(f"{what}: {e}")
    dist.barrier()
    return fails


@pytest.mark.parametrize("world_size", [1, 2, 3])
def test_gather_single(world_size: int) -> None:
    if not hasattr(dist, "gather_single"):
        pytest.skip("this torch has no dist.gather_single")
    for rank, fails in enumerate(run_ranks(_gather_single, world_size, timeout=60)):
        assert not fails, (rank, fails)


def _aliased_lists(rank: int, n: int) -> list[str]:
    fails: list[str] = []

    def refused(what: str, fn, needle: str) -> None:
        try:
            fn()
            fails.append(f"{what}: no error")
        except ValueError as e:
            if needle not in str(e):
                fails.append(f"{what}: {e}")

    x = torch.full((4,), float(rank))
    shared = torch.zeros(4)
    refused("all_gather into one tensor twice",
            lambda: dist.all_gather([shared] * (n - 1) + [shared], x),
            "share memory")
    # Strided entries: the same view twice is refused; views that interleave without
    # sharing an element are gathered exactly.
    strided = torch.zeros(4 * n)
    refused("all_gather into one strided view twice",
            lambda: dist.all_gather([strided[0::n]] * n, x), "share memory")
    views = [strided[r::n] for r in range(n)]
    dist.all_gather(views, x)
    if any(not torch.equal(v, torch.full((4,), float(r))) for r, v in enumerate(views)):
        fails.append(f"interleaved strided entries: {strided.tolist()}")
    buf = torch.zeros(4 * n)
    refused("all_gather_coalesced into overlapping slices",
            lambda: dist.distributed_c10d._get_default_group().allgather_coalesced(
                [[buf[i:i + 4] for i in range(n)]], [x]).wait(),
            "entries 0 and 1 of output list 0 share memory")
    refused("all_to_all into overlapping slices",
            lambda: dist.all_to_all([buf[i:i + 4] for i in range(n)],
                                    [x.clone() for _ in range(n)]),
            "entries 0 and 1 of the output list share memory")
    if rank == 0:
        # The root's input as another rank's gather_list entry.
        refused("gather with the input as rank 1's entry",
                lambda: dist.gather(x, [torch.zeros(4), x] + [torch.zeros(4)] * (n - 2), dst=0),
                "gather_list[1] (Float[4] on cpu) shares memory with the input")
        refused("gather into one tensor twice",
                lambda: dist.gather(x, [x] + [shared] * (n - 1), dst=0), "share memory")
        # The root's output as another rank's scatter_list entry.
        out = torch.zeros(4)
        refused("scatter with the output as rank 1's entry",
                lambda: dist.scatter(out, [torch.ones(4), out] + [torch.ones(4)] * (n - 2), src=0),
                "scatter_list[1]")
    # In place at the root is right and still allowed: its own entry is its tensor.
    lst = [torch.zeros(4) for _ in range(n)] if rank == 0 else None
    if rank == 0:
        lst[0] = x
    dist.gather(x, lst, dst=0)
    if rank == 0 and not all(torch.equal(lst[r], torch.full((4,), float(r))) for r in range(n)):
        fails.append(f"in-place gather: {lst}")
    out = torch.zeros(4)
    src = [torch.full((4,), 10.0 + r) for r in range(n)] if rank == 0 else None
    if rank == 0:
        out = src[0]
    dist.scatter(out, src, src=0)
    if not torch.equal(out, torch.full((4,), 10.0 + rank)):
        fails.append(f"in-place scatter: {out}")
    return fails


@pytest.mark.parametrize("algo", ["", "gather:direct,scatter:direct"], ids=["auto", "direct"])
def test_aliased_lists_are_refused_at_the_call(algo: str) -> None:
    env = {"TDX_ALGO": algo} if algo else {}
    for rank, fails in enumerate(run_ranks(_aliased_lists, 3, timeout=60, env=env)):
        assert not fails, (rank, fails)


def _huge_splits(rank: int, n: int) -> str:
    out, inp = torch.zeros(3, 2), torch.zeros(3, 2)
    try:
        dist.all_to_all_single(out, inp, [1, 1], [2**63 - 1, 2**63 - 1])
        result = "no error"
    except ValueError as e:
        result = str(e)
    dist.all_reduce(torch.ones(1))  # the group goes on
    return result


def test_split_sizes_that_overflow_int64_are_refused() -> None:
    for rank, msg in enumerate(run_ranks(_huge_splits, 2, timeout=60,
                                         env={"TDX_ALGO": "alltoall:pairwise"})):
        assert "input split sizes sum to more than the 3 rows" in msg, (rank, msg)


def _profiled(rank: int, n: int) -> list[str]:
    t = torch.ones(4)
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU]) as prof:
        dist.all_reduce(t)
        dist.all_gather_into_tensor(torch.empty(4 * n), t)
        if rank == 0:
            dist.send(t, 1)
        else:
            dist.recv(t, 0)
    return sorted({e.name for e in prof.events() if e.name.startswith("tdx:")})


def test_profiler_events_carry_the_backend_name() -> None:
    """Named as gloo names its own ("gloo:all_reduce"), so a trace tells backends apart."""
    got = run_ranks(_profiled, 2, timeout=60)
    assert got[0] == ["tdx:all_gather_into_tensor", "tdx:all_reduce", "tdx:send"], got
    assert got[1] == ["tdx:all_gather_into_tensor", "tdx:all_reduce", "tdx:recv"], got

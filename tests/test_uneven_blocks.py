"""all_gather and reduce_scatter over lists whose blocks differ in size by rank (as gloo
and NCCL accept): rank r's output (all_gather's input) has the size of entry r, and every
rank passes the same list. Checked against a float64 reference and against gloo, for
every algorithm, on the message path and through shared memory."""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist

from torchdist_ext.testing import run_ranks

OPS = {"sum": dist.ReduceOp.SUM, "max": dist.ReduceOp.MAX, "avg": dist.ReduceOp.AVG,
       "product": dist.ReduceOp.PRODUCT}


def _sizes(n: int) -> list[int]:
    """Block sizes by rank: empty, one, primes and a large one, never all equal."""
    base = [0, 1, 7, 13, 1031, 5, 2, 11]
    sizes = base[:n]
    if n > 1 and len(set(sizes)) == 1:
        sizes[-1] += 1
    return sizes


def _block(origin: int, owner: int, numel: int, dtype: torch.dtype) -> torch.Tensor:
    """Rank `origin`'s contribution to rank `owner`'s block: values 1 to 4 that depend
    on both (a product over 8 ranks wraps in uint8 and rounds in bfloat16; _close
    allows for each)."""
    v = (torch.arange(numel, dtype=torch.float64) % 3) + 1 + ((origin + 2 * owner) % 2)
    return v.to(dtype)


def _reference(op: str, owner: int, numel: int, n: int) -> torch.Tensor:
    parts = torch.stack([_block(o, owner, numel, torch.float64) for o in range(n)]) \
        if numel else torch.zeros(n, 0, dtype=torch.float64)
    if op == "sum":
        return parts.sum(0)
    if op == "max":
        return parts.max(0).values if numel else torch.zeros(0, dtype=torch.float64)
    if op == "avg":
        return parts.mean(0)
    return parts.prod(0)


def _close(got: torch.Tensor, want: torch.Tensor) -> bool:
    """Integers exactly, wrapped as the dtype wraps; floats to their precision (bfloat16
    rounds at each of up to 7 products)."""
    if got.shape != want.shape:
        return False
    if not got.dtype.is_floating_point:
        return torch.equal(got, want.to(torch.int64).to(got.dtype))
    tol = 3e-2 if got.dtype == torch.bfloat16 else 1e-6
    return torch.allclose(got.double(), want, rtol=tol)


def _uneven(rank: int, n: int, dtypes: list[str], ops: list[str]) -> list[str]:
    fails: list[str] = []
    sizes = _sizes(n)
    for name in dtypes:
        dtype = getattr(torch, name)
        # all_gather: rank r contributes sizes[r] elements, shaped (1, k) to check shapes.
        mine = _block(rank, rank, sizes[rank], dtype).view(1, -1)
        outs = [torch.full((1, k), -9, dtype=dtype) for k in sizes]
        dist.all_gather(outs, mine)
        for r, k in enumerate(sizes):
            want = _block(r, r, k, dtype).view(1, -1)
            if not torch.equal(outs[r], want):
                fails.append(f"all_gather {name} block {r}: {outs[r].tolist()} != {want.tolist()}")
        for op in ops:
            if op == "avg" and not dtype.is_floating_point:
                continue
            ins = [_block(rank, r, k, dtype) for r, k in enumerate(sizes)]
            out = torch.full((sizes[rank],), -9, dtype=dtype)
            dist.reduce_scatter(out, ins, op=OPS[op])
            want = _reference(op, rank, sizes[rank], n)
            if not _close(out, want):
                fails.append(f"reduce_scatter {name} {op}: {out.tolist()} != {want.tolist()}")
            # In place: the output is this rank's own entry of the input list.
            ins = [_block(rank, r, k, dtype) for r, k in enumerate(sizes)]
            dist.reduce_scatter(ins[rank], ins, op=OPS[op])
            if not _close(ins[rank], want):
                fails.append(f"in-place reduce_scatter {name} {op}: {ins[rank].tolist()}")
    # Even blocks right after uneven ones: nothing of the padding is left behind.
    t = torch.ones(5)
    dist.all_reduce(t)
    if t.tolist() != [float(n)] * 5:
        fails.append(f"all_reduce after: {t.tolist()}")
    return fails


@pytest.mark.parametrize("world", [1, 2, 3, 5, 8])
def test_uneven_blocks_match_a_float64_reference(world: int) -> None:
    dtypes = ["float32", "float64", "int32", "bfloat16", "uint8"]
    fails = [f for r in run_ranks(_uneven, world, timeout=120,
                                  args=(dtypes, list(OPS))) for f in r]
    assert not fails, "\n".join(fails)


@pytest.mark.parametrize("algo", ["ring", "rd/rh", "shm"])
@pytest.mark.parametrize("world", [2, 4])
def test_uneven_blocks_on_every_algorithm(algo: str, world: int) -> None:
    gather, scatter = (algo.split("/") * 2)[:2]
    env = {"TDX_ALGO": f"allgather:{gather},reduce_scatter:{scatter}",
           "TDX_SHM": "1" if algo == "shm" else "0"}
    fails = [f for r in run_ranks(_uneven, world, timeout=120, env=env,
                                  args=(["float32", "int32"], ["sum", "max"])) for f in r]
    assert not fails, "\n".join(fails)


def _against(rank: int, n: int) -> list[list[float]]:
    sizes = _sizes(n)
    got = []
    for op in ("sum", "max", "product"):
        out = torch.zeros(sizes[rank])
        dist.reduce_scatter(out, [_block(rank, r, k, torch.float32) for r, k in enumerate(sizes)],
                            op=OPS[op])
        got.append(out.tolist())
    return got


def test_uneven_reduce_scatter_agrees_with_gloo() -> None:
    """gloo takes uneven reduce_scatter blocks (not uneven all_gather ones, which it
    refuses; NCCL takes both)."""
    assert run_ranks(_against, 3, timeout=120) == run_ranks(_against, 3, backend="gloo",
                                                            timeout=120)


def _disagree(rank: int, n: int) -> list[str]:
    """The ranks pass different lists: rank 0 believes rank 1's block has 4 elements,
    rank 1 that it has 6."""
    msgs = []
    own = 4 if rank == 0 else 6
    sizes = [3, own]
    try:
        dist.reduce_scatter(torch.zeros(sizes[rank]), [torch.ones(k) for k in sizes])
        msgs.append("reduce_scatter ok")
    except dist.DistBackendError as e:
        msgs.append(str(e))
    return msgs


@pytest.mark.parametrize("debug", ["DETAIL", "OFF"])
def test_ranks_that_disagree_on_the_blocks_fail_naming_the_other(debug: str) -> None:
    """With TDX_DEBUG=DETAIL the fingerprints (the input list's shapes) differ and both
    calls are named; without it the padded block sizes differ on the wire and the ranks
    fail at once on the size, never with a wrong result."""
    env = {"TDX_DEBUG": debug, "TDX_SHM": "0"}
    for rank, msgs in enumerate(run_ranks(_disagree, 2, timeout=60, env=env)):
        assert msgs[0] != "reduce_scatter ok", (rank, msgs)
        assert "reduce_scatter" in msgs[0] and f"rank {1 - rank}" in msgs[0], (rank, msgs)


def _own_entry_wrong(rank: int, n: int) -> list[str]:
    msgs = []
    outs = [torch.zeros(3) for _ in range(n)]
    outs[rank] = torch.zeros(4)
    try:
        dist.all_gather(outs, torch.ones(3))
    except ValueError as e:
        msgs.append(str(e))
    ins = [torch.ones(3) for _ in range(n)]
    ins[rank] = torch.ones(4)
    try:
        dist.reduce_scatter(torch.zeros(3), ins)
    except ValueError as e:
        msgs.append(str(e))
    t = torch.ones(2)
    dist.all_reduce(t)
    msgs.append(str(t.tolist()))
    return msgs


def test_an_own_entry_of_another_size_is_refused_at_the_call() -> None:
    """Blocks may differ by rank, but a rank's own entry is its input (all_gather) or its
    output (reduce_scatter): a different size there is an error on that rank, at the call."""
    for rank, msgs in enumerate(run_ranks(_own_entry_wrong, 3, timeout=60)):
        assert len(msgs) == 3, (rank, msgs)
        assert "all_gather" in msgs[0] and f"output tensor {rank} (this rank's own entry) " \
            "has 4 elements but the input has 3" in msgs[0], (rank, msgs)
        assert "reduce_scatter" in msgs[1] and f"input_list[{rank}] (this rank's own entry) " \
            "has 4 elements but the output has 3" in msgs[1], (rank, msgs)
        assert msgs[2] == "[3.0, 3.0]", (rank, msgs)


def _cuda_uneven(rank: int, n: int) -> list[str]:
    torch.cuda.set_device(rank % torch.cuda.device_count())
    sizes = _sizes(n)
    fails = []
    outs = [torch.zeros(k, device="cuda") for k in sizes]
    dist.all_gather(outs, _block(rank, rank, sizes[rank], torch.float32).cuda())
    for r, k in enumerate(sizes):
        if not torch.equal(outs[r].cpu(), _block(r, r, k, torch.float32)):
            fails.append(f"all_gather block {r}")
    out = torch.zeros(sizes[rank], device="cuda")
    dist.reduce_scatter(out, [_block(rank, r, k, torch.float32).cuda()
                              for r, k in enumerate(sizes)])
    if not torch.allclose(out.cpu().double(), _reference("sum", rank, sizes[rank], n)):
        fails.append(f"reduce_scatter {out.tolist()}")
    return fails


@pytest.mark.cuda
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a GPU")
def test_cuda_uneven_blocks() -> None:
    fails = [f for r in run_ranks(_cuda_uneven, 2, timeout=120) for f in r]
    assert not fails, "\n".join(fails)

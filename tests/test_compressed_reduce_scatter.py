"""torchdist_ext.compression.reduce_scatter on spawned ranks: TopK(1.0) is exact; every
method's outputs over several calls with error feedback add up to the exact sums less
the residuals every rank keeps (an identity, checked in float64); tdx and gloo give the
same bits; AVG is SUM over the world; async; and refusals that name the rank and the fix.
"""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist

from torchdist_ext import compression as tc
from torchdist_ext.testing import expect_refusal, run_ranks

_METHODS = {"int8": tc.Int8(block=8), "sign": tc.Sign(block=8), "topk": tc.TopK(0.25)}
_CHUNKS = (0, 1, 7, 37)  # per rank: empty, one, prime, not a multiple of the block


def _input(rank: int, world: int, chunk: int, call: int, dtype: torch.dtype) -> torch.Tensor:
    g = torch.Generator().manual_seed(1000 * rank + 10 * call + chunk)
    # Values that name their origin: rank and position shift the scale.
    x = torch.randn(world * chunk, generator=g, dtype=torch.float64)
    return (x * (1 + rank) + torch.arange(world * chunk) / 100).to(dtype)


def _exact(world: int, chunk: int, call: int, rank: int) -> torch.Tensor:
    total = torch.zeros(chunk, dtype=torch.float64)
    for r in range(world):
        total += _input(r, world, chunk, call, torch.float64)[rank * chunk:(rank + 1) * chunk]
    return total


def _identity(rank: int, world: int) -> list[str]:
    fails = []
    gloo = dist.new_group(backend="gloo")
    calls = 4
    for name, method in _METHODS.items():
        for chunk in _CHUNKS:
            state = tc.ErrorFeedback()
            key = (name, chunk)
            got = torch.zeros(chunk, dtype=torch.float64)
            exact = torch.zeros(chunk, dtype=torch.float64)
            for call in range(calls):
                x = _input(rank, world, chunk, call, torch.float64)
                out = torch.full((chunk,), float("nan"), dtype=torch.float64)
                tc.reduce_scatter(out, x, method, state=state, key=key)
                # The same call on gloo, without feedback: the same bits as tdx's would be.
                if call == 0:
                    other = torch.empty_like(out)
                    tc.reduce_scatter(other, x, method, group=gloo)
                    if not torch.equal(out, other):
                        fails.append(f"{name} {chunk}: tdx and gloo differ")
                got += out
                exact += _exact(world, chunk, call, rank)
            # Sum of outputs = sum of exact sums - every rank's residual of this chunk.
            res = state.residual(key)[0]
            res = torch.zeros(world * chunk, dtype=torch.float64) if res is None else res
            every = [torch.empty_like(res) for _ in range(world)]
            dist.all_gather(every, res.contiguous(), group=gloo)
            lost = sum(e[rank * chunk:(rank + 1) * chunk] for e in every)
            if not torch.allclose(got + lost, exact, rtol=1e-12, atol=1e-9):
                fails.append(f"{name} chunk {chunk}: identity off by "
                             f"{(got + lost - exact).abs().max()}")
            if chunk and name == "int8" and (got - exact).abs().max() > 0.5 * calls:
                fails.append(f"int8 chunk {chunk}: error {(got - exact).abs().max()}")
    # TopK(1.0) sends everything: exact, in every dtype, SUM and AVG.
    for dtype in (torch.float32, torch.float64, torch.bfloat16, torch.float16):
        for chunk in _CHUNKS:
            x = _input(rank, world, chunk, 0, dtype)
            mine = torch.zeros(chunk, dtype=torch.float64)  # the float64 sum of the inputs
            for r in range(world):
                mine += _input(r, world, chunk, 0, dtype).double()[
                    rank * chunk:(rank + 1) * chunk]
            for op, scale in ((dist.ReduceOp.SUM, 1.0), (dist.ReduceOp.AVG, 1.0 / world)):
                out = torch.empty(chunk, dtype=dtype)
                tc.reduce_scatter(out, x, tc.TopK(1.0), op=op)
                # Summed in the working precision (float32 below float64), then cast.
                tol = {torch.float64: 1e-12, torch.float32: 1e-6}.get(dtype, 1e-2)
                if not torch.allclose(out.double(), mine * scale, rtol=tol, atol=tol):
                    fails.append(f"topk(1) {dtype} {chunk} {op}: "
                                 f"{(out.double() - mine * scale).abs().max()}")
    # async_op: a future whose value is the output.
    x = _input(rank, world, 5, 0, torch.float32)
    out = torch.empty(5)
    fut = tc.reduce_scatter(out, x, tc.Int8(block=8), op=dist.ReduceOp.AVG, async_op=True)
    if fut.wait() is not out or not torch.isfinite(out).all():
        fails.append("async_op did not give the output")
    return fails


@pytest.mark.parametrize("world", [1, 2, 3, 4])
def test_reduce_scatter_outputs_add_up_to_exact_sums_less_the_residuals(world: int) -> None:
    assert run_ranks(_identity, world, timeout=120) == [[] for _ in range(world)]


def _bad(rank: int, world: int) -> list[str]:
    fails = []
    x = torch.randn(4 * world)

    def refused(fn, *words, errors=(ValueError, TypeError)) -> None:
        expect_refusal(fails, fn, *words, errors=errors)

    refused(lambda: tc.reduce_scatter(torch.empty(3), x, tc.Int8()),
            f"rank {rank}", f"{world} * 3")
    refused(lambda: tc.reduce_scatter(torch.empty(4, dtype=torch.float64), x, tc.Int8()),
            "output must be a tensor of input's dtype")
    refused(lambda: tc.reduce_scatter(torch.empty(4, dtype=torch.int32),
                                      torch.zeros(4 * world, dtype=torch.int32), tc.Int8()),
            "reduce_scatter", "cannot compress")
    refused(lambda: tc.reduce_scatter(torch.empty(4), x, tc.Int8(), op=dist.ReduceOp.MAX),
            "ReduceOp.SUM or ReduceOp.AVG")
    refused(lambda: tc.reduce_scatter(torch.empty(4), x, "int8"), "Int8(...)")
    refused(lambda: tc.reduce_scatter(torch.empty(4), x, tc.Int8(), state={}), "ErrorFeedback")
    # Ranks that pass other methods raise on every rank, naming the other's (these two
    # send as many bytes; payloads of other sizes are the backend's size mismatch).
    method = tc.TopK(0.2) if rank == 0 else tc.TopK(0.25)
    refused(lambda: tc.reduce_scatter(torch.empty(4), x, method), "received its selections",
            "every rank must pass the same method", errors=(RuntimeError,))
    # The group still works.
    out = torch.empty(4)
    tc.reduce_scatter(out, torch.ones(4 * world), tc.TopK(1.0))
    if not torch.equal(out, torch.full((4,), float(world))):
        fails.append(f"after refusals: {out}")
    return fails


def test_reduce_scatter_refuses_bad_input_naming_the_rank_and_the_fix() -> None:
    assert run_ranks(_bad, 2, timeout=60) == [[], []]

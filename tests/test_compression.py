"""Compressed all_reduce (torchdist_ext.compression): the codecs' error bounds, the op
against a float64 reference at worlds 1 to 8 and against gloo bit for bit, error
feedback's bookkeeping, mismatched calls, bad input, and DDP's hook against
single-process training."""

from __future__ import annotations

import math
from typing import Any

import pytest
import torch
import torch.distributed as dist
import torch.nn as nn

from torchdist_ext import compression as tc
from torchdist_ext.testing import new_gloo_group, run_ranks

_DTYPES = (torch.float32, torch.float64, torch.float16, torch.bfloat16)
# Half a unit in the last place, relative, of each dtype the result is cast back to.
_ROUND = {torch.float32: 2.0**-23, torch.float64: 2.0**-52, torch.float16: 2.0**-10,
          torch.bfloat16: 2.0**-7}


def _data(rank: int, count: int, dtype: torch.dtype, seed: int = 0) -> torch.Tensor:
    g = torch.Generator().manual_seed(1000 * seed + 17 * rank + count)
    scale = 1.0 + rank  # ranks differ in magnitude, so the scales differ by rank
    return (torch.randn(count, generator=g, dtype=torch.float64) * scale).to(dtype)


def _topk_reference(xs: list[torch.Tensor], ratio: float) -> torch.Tensor:
    out = torch.zeros_like(xs[0])
    for x in xs:
        k = min(x.numel(), max(1, math.ceil(ratio * x.numel()))) if x.numel() else 0
        idx = x.abs().topk(k).indices
        out[idx] += x[idx]
    return out


# ---- codecs, one process -------------------------------------------------------------

@pytest.mark.parametrize("wdtype", [torch.float32, torch.float64])
@pytest.mark.parametrize("block", [1, 3, 8, 256])
def test_int8_decodes_within_half_a_step_of_each_block(wdtype: torch.dtype,
                                                        block: int) -> None:
    codec = tc.Int8(block=block)
    length = codec.unit * 5
    rows = torch.randn(3, length, dtype=wdtype) * torch.tensor([[1.0], [1e-3], [1e4]],
                                                                dtype=wdtype)
    rows[1, :block] = 0
    payload, decoded = codec.encode(rows, [rows.shape[1]] * rows.shape[0])
    assert payload.dtype == torch.uint8
    assert payload.shape == (3, codec.nbytes(length, wdtype))
    assert payload.shape[1] == length + length // block * rows.element_size()
    assert torch.equal(codec.decode(payload, length, wdtype), decoded)
    blocks, dec = rows.reshape(-1, block), decoded.reshape(-1, block)
    step = blocks.abs().amax(1, keepdim=True) / 127
    assert ((blocks - dec).abs() <= step / 2 * (1 + 1e-5)).all()
    assert (decoded[1, :block] == 0).all()  # an all-zero block stays zero


@pytest.mark.parametrize("block", [1, 5, 64, 256])
def test_sign_decodes_to_the_mean_magnitude_with_each_sign(block: int) -> None:
    codec = tc.Sign(block=block)
    length = codec.unit * 3
    rows = torch.randn(2, length)
    payload, decoded = codec.encode(rows, [rows.shape[1]] * rows.shape[0])
    assert payload.shape == (2, length // 8 + length // block * 4)
    assert torch.equal(codec.decode(payload, length, torch.float32), decoded)
    blocks, dec = rows.reshape(-1, block), decoded.reshape(-1, block)
    mean = blocks.abs().mean(1, keepdim=True)
    assert torch.allclose(dec.abs(), mean.expand_as(dec))
    assert torch.equal(dec >= 0, blocks >= 0)
    # A row the tensor fills only in part: the mean is over the tensor's elements.
    if block >= 2:
        rows[:, block + 2:] = 0
        _, decoded = codec.encode(rows, [block + 2, length])
        assert torch.allclose(decoded[0, block:block + 2].abs(),
                              rows[0, block:block + 2].abs().sum() / 2)


@pytest.mark.parametrize("codec", [tc.Int8(block=4), tc.Sign(block=8)])
def test_a_block_with_inf_or_nan_decodes_to_nan_and_spares_the_others(codec) -> None:
    rows = torch.randn(1, codec.unit * 4)
    b = codec.block
    rows[0, 1] = math.inf
    rows[0, b + 2] = math.nan
    payload, decoded = codec.encode(rows, [rows.shape[1]] * rows.shape[0])
    got = codec.decode(payload, rows.shape[1], torch.float32)
    assert got[0, :2 * b].isnan().all()
    assert torch.isfinite(got[0, 2 * b:]).all()


@pytest.mark.parametrize("wdtype", [torch.float32, torch.float64])
@pytest.mark.parametrize("codec", [tc.Int8(block=1), tc.Int8(block=7), tc.Int8(block=256),
                                   tc.Sign(block=1), tc.Sign(block=5), tc.Sign(block=64)])
def test_the_cpu_kernels_encode_and_decode_as_the_torch_codec_does(codec,
                                                                    wdtype: torch.dtype):
    """The one-pass CPU kernels against the torch-op codec (the CUDA path): the same
    payload (Sign's scales to rounding: their sums add in another order), the same
    residuals and the same decoded values, written into rows spaced apart as the
    header leaves them."""
    length = codec.unit * 6
    g = torch.Generator().manual_seed(codec.block)
    rows = torch.randn(4, length, generator=g, dtype=wdtype)
    rows[1] *= 1e-30 if wdtype == torch.float32 else 1e-300  # tiny scales
    rows[2, :codec.block] = 0
    rows[2, codec.block + 1] = math.inf
    rows[2, -1] = math.nan
    if codec.block >= 7:  # ties: a block whose scale is 1, holding halves
        rows[3, :7] = torch.tensor([127.0, 2.5, -3.5, 0.5, -0.5, 1.5, 126.5])
    valid = [length, length - 3, length, 2]
    nbytes = codec.nbytes(length, wdtype)
    out = torch.full((4, nbytes + 5), 7, dtype=torch.uint8)[:, 5:]
    lost = torch.full_like(rows, 5.0)
    codec.encode_into(rows, valid, out, lost)
    payload, decoded = codec.encode(rows, valid)
    want_lost = (rows - decoded).masked_fill(~torch.isfinite(rows - decoded), 0)
    if isinstance(codec, tc.Int8):
        assert torch.equal(out, payload)
        assert torch.equal(lost, want_lost)
        if codec.block >= 7:
            assert out[3, :7].view(torch.int8).tolist() == [127, 2, -4, 0, 0, 2, 126]
    else:
        nbits = length // 8
        assert torch.equal(out[:, :nbits], payload[:, :nbits])
        got_scale = tc.codecs.as_dtype(out[:, nbits:], wdtype)
        want_scale = tc.codecs.as_dtype(payload[:, nbits:], wdtype)
        assert torch.equal(got_scale.isnan(), want_scale.isnan())
        assert torch.allclose(got_scale.nan_to_num(), want_scale.nan_to_num(), rtol=1e-6,
                              atol=0)
        biggest = rows[torch.isfinite(rows)].abs().max()
        assert torch.allclose(lost, want_lost, rtol=1e-5, atol=1e-6 * biggest)
    back = codec.decode_rows(out, length, wdtype)
    ref = codec.decode(out, length, wdtype)  # the torch decoder, on the kernel's bytes
    assert torch.equal(back.isnan(), ref.isnan())
    assert torch.equal(back.nan_to_num(), ref.nan_to_num())
    total = codec.decode_sum(out[[0, 1, 3]], length, wdtype)
    assert torch.allclose(total, ref[0] + ref[1] + ref[3], rtol=1e-6, atol=0)


def test_bad_method_parameters_are_refused_naming_the_fix() -> None:
    for make, text in [(lambda: tc.Int8(block=0), "block must be an int"),
                       (lambda: tc.Sign(block=2.5), "block must be an int"),
                       (lambda: tc.Int8(block=True), "block must be an int"),
                       (lambda: tc.TopK(ratio=0), "ratio must be a number in (0, 1]"),
                       (lambda: tc.TopK(ratio=1.5), "ratio must be a number in (0, 1]"),
                       (lambda: tc.CompressionState("int8"), "method must be Int8"),
                       (lambda: tc.CompressionState(tc.Int8(), warmup_steps=-1),
                        "warmup_steps must be an int >= 0")]:
        with pytest.raises((ValueError, TypeError), match=None) as info:
            make()
        assert text in str(info.value), str(info.value)


# ---- the op across ranks -------------------------------------------------------------

_METHODS = (tc.Int8(), tc.Int8(block=7), tc.Sign(block=64), tc.TopK(0.1), tc.TopK(1.0))


def _counts(n: int) -> tuple[int, ...]:
    return (0, 1, 1009, 4 * n * 256 + 3)


def _bound(method, xs: list[torch.Tensor], ref: torch.Tensor, n: int, average: bool,
           dtype: torch.dtype) -> torch.Tensor | None:
    """The largest error the method may make on each element, or None where the test
    checks another way. Int8's bound uses each rank's largest element, which bounds
    every block's scale."""
    if ref.numel() == 0:
        return ref.clone()
    out = ref / n if average else ref
    cast = out.abs() * _ROUND[dtype] + 1e-6 * (out.abs().max() if out.numel() else 0)
    if isinstance(method, tc.Int8):
        first = sum(x.abs().max() for x in xs) / 254
        second = (ref.abs().max() + first) / 254
        return (first + second) / (n if average else 1) + cast + 1e-5 * first
    if isinstance(method, tc.TopK) and method.ratio == 1.0:
        return cast + 1e-6 * sum(x.abs() for x in xs) / (n if average else 1)
    return None


def _sweep(rank: int, n: int) -> list[str]:
    gloo = new_gloo_group()
    fails = []
    for method in _METHODS:
        for dtype in _DTYPES:
            for count in _counts(n):
                for op in (dist.ReduceOp.SUM, dist.ReduceOp.AVG):
                    average = op == dist.ReduceOp.AVG
                    t = _data(rank, count, dtype)
                    t2 = t.clone()
                    tc.all_reduce(t, method, op=op)
                    tc.all_reduce(t2, method, op=op, group=gloo)
                    where = f"{method} {dtype} count={count} {op}"
                    if not torch.equal(t, t2):
                        fails.append(f"{where}: tdx and gloo differ")
                    # Every rank holds the same result, bit for bit.
                    everyone = [torch.empty_like(t) for _ in range(n)]
                    dist.all_gather(everyone, t)
                    if any(not torch.equal(e, t) for e in everyone):
                        fails.append(f"{where}: ranks differ")
                    xs = [_data(r, count, dtype).double() for r in range(n)]
                    ref = sum(xs) if xs else None
                    bound = _bound(method, xs, ref, n, average, dtype)
                    want = ref / n if average else ref
                    if bound is not None:
                        err = (t.double() - want).abs()
                        if (err > bound).any():
                            fails.append(f"{where}: error {err.max():.3g} past the bound")
                    elif isinstance(method, tc.TopK):
                        want = _topk_reference(xs, method.ratio) / (n if average else 1)
                        if not torch.allclose(t.double(), want, rtol=_ROUND[dtype] * 4,
                                              atol=1e-6):
                            fails.append(f"{where}: not the sum of each rank's top k")
    return fails


@pytest.mark.parametrize("world", [1, 2, 3, 4, 5, 6, 7, 8])
def test_compressed_all_reduce_is_within_bounds_same_everywhere_and_equal_to_gloos(
        world: int) -> None:
    got = run_ranks(_sweep, world, timeout=300)
    assert got == [[]] * world, got


def _sign_exact(rank: int, n: int) -> list[str]:
    # Where every block's elements share one magnitude, one bit and a scale lose nothing:
    # the sum's blocks do too, so the result is exact.
    fails = []
    for count in (1, 63, 64 * n * 3 + 5):
        pattern = torch.where(torch.arange(count) % 3 == 0, -1.0, 1.0).double()
        t = (pattern * (rank + 1)).float()
        tc.all_reduce(t, tc.Sign(block=64))
        want = pattern * (n * (n + 1) / 2)
        if not torch.equal(t.double(), want):
            fails.append(f"count={count}: {(t.double() - want).abs().max()}")
    # A non-contiguous tensor is reduced where it lies.
    base = torch.ones(8, 6) * (rank + 1)
    view = base.t()[:, ::2]
    tc.all_reduce(view, tc.Sign(block=4))
    if not (base[::2].eq(n * (n + 1) / 2).all() and base[1::2].eq(rank + 1).all()):
        fails.append(f"non-contiguous: {base.tolist()}")
    return fails


def test_sign_is_exact_where_every_block_has_one_magnitude() -> None:
    assert run_ranks(_sign_exact, 3) == [[]] * 3


def _feedback_identity(rank: int, n: int) -> list[str]:
    """Error feedback delays what compression loses and never drops it: over T calls,
    the results plus the residuals left at the end add up to T times the exact sum."""
    fails = []
    steps = 160
    for method in (tc.Int8(block=32), tc.Sign(block=32), tc.TopK(0.05)):
        for average in (False, True):
            state = tc.ErrorFeedback()
            g = _data(rank, 1000, torch.float64, seed=5)
            total = torch.zeros(1000, dtype=torch.float64)
            op = dist.ReduceOp.AVG if average else dist.ReduceOp.SUM
            for _ in range(steps):
                t = g.clone()
                tc.all_reduce(t, method, op=op, state=state, key="g")
                total += t
            assert len(state) == 1
            sent, owned = state.residual("g")
            lost = sent.clone()
            dist.all_reduce(lost)
            if average:
                lost /= n
            if owned is not None:
                pieces = [torch.empty_like(owned) for _ in range(n)]
                dist.all_gather(pieces, owned)
                lost += torch.cat(pieces)[:1000]
            exact = sum(_data(r, 1000, torch.float64, seed=5) for r in range(n))
            exact = exact / n if average else exact
            gap = (total + lost - steps * exact).abs().max()
            if gap > 1e-9 * steps * exact.abs().max():
                fails.append(f"{method} average={average}: off by {gap:.3g}")
            # ... and the mean result converges: far closer than one call's error. (Not
            # TopK's: an element may wait longer than these steps for its turn.)
            if isinstance(method, tc.TopK):
                continue
            one = g.clone()
            tc.all_reduce(one, method, op=op)
            mean_err = (total / steps - exact).abs().max()
            one_err = (one - exact).abs().max()
            if mean_err > one_err / 5:
                fails.append(f"{method} average={average}: the mean's error {mean_err:.3g} "
                             f"against one call's {one_err:.3g}")
    return fails


def test_error_feedback_delays_what_compression_loses_and_never_drops_it() -> None:
    assert run_ranks(_feedback_identity, 3) == [[]] * 3


def _mismatched(rank: int, n: int, case: str) -> str:
    t = torch.ones(1000)
    try:
        if case == "method":  # same payload size, another ratio
            tc.all_reduce(t, tc.TopK(0.1 if rank != 2 else 0.0995))
        elif case == "count":  # same padded length, another element count
            tc.all_reduce(torch.ones(1000 if rank != 2 else 1001), tc.Int8())
        else:  # payloads of different sizes: the backend's size check
            tc.all_reduce(t, tc.Int8() if rank != 2 else tc.Sign())
    except Exception as e:  # noqa: BLE001 - the test reads the message
        return f"{type(e).__name__}: {e}"
    return "no error"


@pytest.mark.parametrize("case", ["method", "count", "size"])
def test_ranks_that_pass_different_methods_or_sizes_all_raise(case: str) -> None:
    got = run_ranks(_mismatched, 3, timeout=60, args=(case,))
    for rank, msg in enumerate(got):
        assert msg != "no error", (rank, got)
        if case == "method":
            assert "TopK(ratio=0.1)" in msg and "TopK(ratio=0.0995)" in msg, msg
            assert f"group rank {2 if rank != 2 else 0}" in msg, msg
        if case == "count":
            assert "1000 elements" in msg or "compresses 1000" in msg, msg
            assert "1001" in msg, msg
        if case == "size":  # the backend's own error, as it raised it
            assert msg.startswith("DistBackendError") and "rank" in msg, msg


def _bad_input(rank: int, n: int) -> list[str]:
    cases = [
        (lambda: tc.all_reduce(torch.ones(4, dtype=torch.int32), tc.Int8()),
         "cannot compress a tensor of dtype torch.int32"),
        (lambda: tc.all_reduce(torch.ones(4, dtype=torch.complex64), tc.Int8()),
         "cannot compress a tensor of dtype torch.complex64"),
        (lambda: tc.all_reduce(torch.ones(4).to_sparse(), tc.Int8()), "layout"),
        (lambda: tc.all_reduce(torch.ones(4), tc.Int8(), op=dist.ReduceOp.MAX),
         "op must be ReduceOp.SUM or ReduceOp.AVG"),
        (lambda: tc.all_reduce(torch.ones(4), "int8"), "method must be Int8"),
        (lambda: tc.all_reduce([1.0], tc.Int8()), "tensor must be a torch.Tensor"),
        (lambda: tc.all_reduce(torch.ones(4), tc.Int8(), state={}),
         "state must be an ErrorFeedback"),
    ]
    fails = []
    for call, text in cases:
        try:
            call()
            fails.append(f"no error for {text!r}")
        except (TypeError, ValueError) as e:
            if text not in str(e) or f"rank {rank}" not in str(e):
                fails.append(f"{text!r} not in {e}")
    state = tc.ErrorFeedback()
    tc.all_reduce(torch.ones(10), tc.Int8(), state=state, key="w")
    try:
        tc.all_reduce(torch.ones(11), tc.Int8(), state=state, key="w")
        fails.append("a key reused at another size was taken")
    except ValueError as e:
        if "key 'w' holds 10 elements" not in str(e):
            fails.append(str(e))
    # The group still works after refusals at the call: nothing was sent.
    t = torch.ones(5)
    tc.all_reduce(t, tc.Int8())
    if not torch.equal(t, torch.full((5,), float(n))):
        fails.append(f"after the refusals: {t.tolist()}")
    return fails


def test_bad_input_is_refused_at_the_call_naming_the_rank() -> None:
    assert run_ranks(_bad_input, 2) == [[], []]


def _async_and_nan(rank: int, n: int) -> list[str]:
    fails = []
    t = torch.full((300,), float(rank + 1))
    fut = tc.all_reduce(t, tc.Int8(), async_op=True)
    if fut.wait() is not t or not torch.allclose(t, torch.full((300,), n * (n + 1) / 2)):
        fails.append(f"async: {t[:4].tolist()}")
    state = tc.ErrorFeedback()
    t = torch.ones(512)
    if rank == 1:
        t[3] = math.inf
    tc.all_reduce(t, tc.Int8(block=256), state=state)
    if not (t[:256].isnan().all() and torch.equal(t[256:], torch.full((256,), float(n)))):
        fails.append(f"inf: {t[:4].tolist()} {t[256:260].tolist()}")
    sent, owned = state.residual("default")
    if not (torch.isfinite(sent).all() and torch.isfinite(owned).all()):
        fails.append("a non-finite residual was kept")
    t = torch.ones(512)
    tc.all_reduce(t, tc.Int8(block=256), state=state)
    if not torch.equal(t, torch.full((512,), float(n))):
        fails.append(f"the step after the overflow: {t[:4].tolist()}")
    return fails


def _layout_change(rank: int, n: int) -> list[str]:
    # One state and key on the world, then on a subgroup of two: the chunk this rank
    # encodes for the others is another one now (512 elements, then 768), so its
    # residual is dropped, not raised on after the first collective (which would leave
    # the other rank waiting).
    state = tc.ErrorFeedback()
    t = _data(rank, 1200, torch.float32)
    tc.all_reduce(t, tc.Int8(), state=state, key="w")
    sub = dist.new_group([0, 1])
    fails = []
    if rank < 2:
        t = torch.full((1200,), float(rank + 1))
        tc.all_reduce(t, tc.Int8(), group=sub, state=state, key="w")
        # What the first call left in the residual comes in too: within its bound.
        first = sum(_data(r, 1200, torch.float64).abs().max() for r in range(n)) / 254
        if (t.double() - 3.0).abs().max() > 2 * first + 3.0 / 127:
            fails.append(f"{(t.double() - 3.0).abs().max()}")
    return fails


def test_a_key_used_on_another_group_starts_its_chunk_afresh() -> None:
    assert run_ranks(_layout_change, 3) == [[], [], []]


def test_async_future_and_a_block_that_overflows() -> None:
    assert run_ranks(_async_and_nan, 2) == [[], []]


def _in_flight(rank: int, n: int) -> list[str]:
    """Twelve async all_reduces in flight at once, half of them of one size: each must
    equal the same all_reduce made alone. Int8's and Sign's second collective is issued
    as the first one ends, which is in another order on each rank; issued in that order
    they met other ops' (a mismatch error, or, for ops of one size, sums of other ops'
    data)."""
    fails = []
    for method in (tc.Int8(), tc.Sign(), tc.TopK(0.3)):
        gen = torch.Generator().manual_seed(rank)
        sizes = [700] * 6 + [1000 + 37 * i for i in range(6)]
        xs = [torch.randn(size, generator=gen) + 10 * i for i, size in enumerate(sizes)]
        ts = [x.clone() for x in xs]
        futs = [tc.all_reduce(t, method, async_op=True) for t in ts]
        for fut in futs:
            fut.wait()
        for i, (x, t) in enumerate(zip(xs, ts)):
            alone = x.clone()
            tc.all_reduce(alone, method)
            if not torch.equal(alone, t):
                fails.append(f"{method} op {i}: {(alone - t).abs().max().item()}")
    return fails


@pytest.mark.parametrize("backend", ["tdx", "gloo"])
def test_async_ops_in_flight_together_each_get_their_own_sum(backend: str) -> None:
    assert run_ranks(_in_flight, 3, backend=backend, timeout=90) == [[], [], []]


# ---- DDP -----------------------------------------------------------------------------

def _model() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(12, 32), nn.Tanh(), nn.Linear(32, 1))


def _batches(steps: int, world: int) -> list[tuple[torch.Tensor, torch.Tensor]]:
    g = torch.Generator().manual_seed(7)
    return [(torch.randn(8 * world, 12, generator=g), torch.randn(8 * world, 1, generator=g))
            for _ in range(steps)]


def _train(model: nn.Module, batches, rank: int, world: int) -> list[float]:
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    losses = []
    for x, y in batches:
        x, y = x.chunk(world)[rank], y.chunk(world)[rank]
        opt.zero_grad()
        loss = nn.functional.mse_loss(model(x), y)
        loss.backward()
        opt.step()
        losses.append(loss.item())
    return losses


def _ddp(rank: int, n: int, method, warmup: int) -> dict:
    model = nn.parallel.DistributedDataParallel(_model(), bucket_cap_mb=0.001)
    state = tc.CompressionState(method, warmup_steps=warmup)
    model.register_comm_hook(state, tc.ddp_comm_hook)
    losses = _train(model, _batches(10, n), rank, n)
    return {"losses": losses, "steps": state.steps,
            "params": [p.detach().tolist() for p in model.module.parameters()]}


# (method, exact steps first, parameters' tolerance, losses' relative tolerance): TopK
# with ratio 1 sends every element, so it must match to rounding; one bit per element
# (Sign) drifts furthest from the exact run within ten steps.
@pytest.mark.parametrize("method,warmup,tol,loss_tol", [(tc.TopK(1.0), 0, 1e-5, 1e-5),
                                                        (tc.Int8(), 0, 2e-3, 0.02),
                                                        (tc.Sign(), 3, 0.1, 0.25)])
def test_ddp_hook_trains_as_one_process_does(method, warmup: int, tol: float,
                                             loss_tol: float) -> None:
    world = 3
    single = _model()
    single_losses = _train(single, _batches(10, world), 0, 1)
    got = run_ranks(_ddp, world, timeout=180, args=(method, warmup))
    for rank, r in enumerate(got):
        assert r["steps"] == 10
        assert r["params"] == got[0]["params"], rank  # replicas agree, bit for bit
        for p, q in zip(r["params"], single.parameters()):
            diff = (torch.tensor(p) - q.detach()).abs().max().item()
            assert diff <= tol, (rank, diff)
    means = [sum(r["losses"][s] for r in got) / world for s in range(10)]
    for step, (mean, want) in enumerate(zip(means, single_losses)):
        assert abs(mean - want) <= loss_tol * max(want, 1.0), (step, mean, want)
    if warmup:  # the exact steps first are exact
        assert abs(means[0] - single_losses[0]) <= 1e-5
        assert abs(means[warmup] - single_losses[warmup]) <= 1e-5


class _SumInBackward(torch.autograd.Function):
    """Identity forward; backward averages the gradient across the default group on the
    thread running backward, as a tensor-parallel layer or a SyncBatchNorm does: a
    collective on DDP's group while DDP's buckets reduce."""

    @staticmethod
    def forward(ctx: Any, x: torch.Tensor) -> torch.Tensor:
        return x.view_as(x)

    @staticmethod
    def backward(ctx: Any, g: torch.Tensor) -> torch.Tensor:
        g = g.clone()
        dist.all_reduce(g)
        return g / dist.get_world_size()


class _Mixed(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.a = nn.Linear(12, 32)
        self.b = nn.Linear(32, 16)
        self.c = nn.Linear(16, 1)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        # Backward reaches the collective after c's and b's gradients: their buckets are
        # with the overlap thread by then.
        return self.c(torch.tanh(self.b(_SumInBackward.apply(torch.tanh(self.a(x))))))


def _ddp_overlap(rank: int, n: int, method_name: str, subgroup: bool) -> dict:
    method = {"int8": tc.Int8(), "sign": tc.Sign()}[method_name]
    out: dict[str, Any] = {"fails": []}
    # DDP on a group of its own (every rank), whose overlap group the ranks make.
    group = dist.new_group() if subgroup else None
    for overlap in (False, True):
        model = nn.parallel.DistributedDataParallel(_Mixed(), bucket_cap_mb=0.001,
                                                    process_group=group)
        own = dist.new_group() if overlap and subgroup else None
        state = tc.CompressionState(method, group=group, overlap=overlap, overlap_group=own)
        model.register_comm_hook(state, tc.ddp_comm_hook)
        out[f"losses {overlap}"] = _train(model, _batches(6, n), rank, n)
        out[f"params {overlap}"] = [p.detach().tolist() for p in model.module.parameters()]
        if state.steps != 6:
            out["fails"].append(f"overlap {overlap}: {state.steps} steps")
        if overlap:
            reduced = 0 if state._worker is None else state._worker.reduced
            if reduced < 6:  # at least a bucket per step
                out["fails"].append(f"the overlap thread reduced {reduced} buckets")
            state.close()
            x = torch.randn(4, 12)
            try:
                model(x).sum().backward()
                out["fails"].append("a closed state reduced")
            except RuntimeError as e:
                if "was closed" not in str(e):
                    out["fails"].append(str(e))
    return out


@pytest.mark.parametrize("backend,method,subgroup", [("tdx", "int8", False),
                                                     ("gloo", "int8", True),
                                                     ("tdx", "sign", True)])
def test_ddp_hook_overlapping_on_its_own_thread_trains_as_inline(backend: str, method: str,
                                                                 subgroup: bool) -> None:
    """overlap=True reduces Int8's and Sign's buckets on a thread and group of their own
    while backward goes on, and collectives on DDP's group run during that backward:
    the same losses and parameters as reducing inline, bit for bit."""
    got = run_ranks(_ddp_overlap, 3, backend=backend, timeout=120,
                    args=(method, subgroup))
    for rank, r in enumerate(got):
        assert r["fails"] == [], (rank, r["fails"])
        assert r["params True"] == r["params False"], rank
        assert r["losses True"] == r["losses False"], rank
        assert r["params True"] == got[0]["params True"], rank


def _overlap_refusals(rank: int, n: int) -> list[str]:
    fails: list[str] = []
    sub = dist.new_group()

    def refused(fn: Any, *words: str) -> None:
        try:
            fn()
            fails.append(f"accepted: {words}")
        except ValueError as e:
            if not all(w in str(e) for w in words):
                fails.append(str(e))
    refused(lambda: tc.CompressionState(tc.Int8(), group=sub, overlap=True),
            "overlap_group=dist.new_group", "every rank of the default group")
    refused(lambda: tc.CompressionState(tc.Int8(), group=sub, overlap=True,
                                        overlap_group=sub), "not DDP's")
    refused(lambda: tc.CompressionState(tc.Int8(), overlap_group=sub), "for overlap=True")
    refused(lambda: tc.CompressionState(tc.Int8(), group=dist.group.WORLD, overlap=True,
                                        overlap_group=dist.group.WORLD), "not DDP's")
    # The default group named as such is the default: the state makes the group itself.
    tc.CompressionState(tc.Int8(), group=dist.group.WORLD, overlap=True).close()
    # A bucket that fails on the thread fails every later one at once, without a
    # collective: on one rank, the first reduction is made to fail.
    model = nn.parallel.DistributedDataParallel(_Mixed(), bucket_cap_mb=0.001)
    state = tc.CompressionState(tc.Int8(), overlap=True)
    model.register_comm_hook(state, tc.ddp_comm_hook)
    worker = state._worker

    def boom(*args: Any) -> None:
        raise RuntimeError("injected failure")
    worker._reduce = boom
    for want in ("injected failure", "an earlier bucket's reduction failed"):
        try:
            model(torch.randn(4, 12)).sum().backward()
            fails.append(f"backward passed; expected {want!r}")
        except RuntimeError as e:
            if want not in str(e):
                fails.append(f"expected {want!r}: {e}")
    state.close()
    if worker._thread.is_alive():
        fails.append("close() left the thread running")
    return fails


def test_overlap_refusals_and_a_failed_bucket_failing_the_rest() -> None:
    assert run_ranks(_overlap_refusals, 1, timeout=60) == [[]]


# ---- CUDA ----------------------------------------------------------------------------

def _cuda(rank: int, n: int) -> list[str]:
    torch.cuda.set_device(rank % torch.cuda.device_count())
    fails = []
    for method in _METHODS:
        t = _data(rank, 4099, torch.float32).cuda()
        cpu = _data(rank, 4099, torch.float32)
        tc.all_reduce(t, method)
        tc.all_reduce(cpu, method)
        if not t.is_cuda or not torch.allclose(t.cpu(), cpu, rtol=1e-5, atol=1e-5):
            fails.append(f"{method}: {(t.cpu() - cpu).abs().max()}")
    return fails


@pytest.mark.cuda
def test_cuda_tensors_give_the_cpu_result() -> None:
    if not torch.cuda.is_available():
        pytest.skip("needs a CUDA GPU")
    assert run_ranks(_cuda, 2, timeout=180) == [[], []]


# ---- the example -----------------------------------------------------------------------

def test_the_ddp_example_trains_with_compressed_gradients() -> None:
    """examples/ddp.py --compress int8 under torchrun (standalone, 2 ranks): exit 0 and a
    test accuracy above 90% after three epochs (the exact run's is above 99%)."""
    import os
    import re
    import subprocess
    import sys
    from pathlib import Path

    example = Path(__file__).resolve().parents[1] / "examples" / "ddp.py"
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone",
           "--nproc-per-node", "2", str(example), "--compress", "int8", "--epochs", "3"]
    done = subprocess.run(cmd, capture_output=True, text=True, timeout=150,
                          env=dict(os.environ, OMP_NUM_THREADS="1"))
    out = done.stdout + done.stderr
    assert done.returncode == 0, out[-4000:]
    assert "gradients compressed: int8" in out, out[-4000:]
    accuracy = [float(a) for a in re.findall(r"test accuracy\s+([0-9.]+)%", out)]
    assert len(accuracy) == 3 and accuracy[-1] > 90, out[-4000:]

"""ZeRO with mixed precision (ZeroConfig.param_dtype, reduce_dtype): the model computes in
a lower dtype while each rank's shard keeps the parameters' own, at stages 1, 2 and 3.

Each run is checked against one process doing by hand what the ranks should: the same
lowered copy of the float64 weights, each rank's part of the batch through it, the
gradients cast to the reduce dtype, divided by the world size and summed, then a plain
float64 optimizer step. The gathered parameters must be the shards' values lowered, the
shards must keep float64 precision, and saving and loading in full precision must be exact.
"""

from __future__ import annotations

import copy
from typing import Any, Optional

import pytest
import torch
import torch.distributed as dist
import torch.nn as nn
import torch.nn.functional as F

from torchdist_ext import compression as tc
from torchdist_ext.parallel import ZeroConfig, ZeroOptimizer
from torchdist_ext.testing import expect_refusal, run_ranks

# The models, data and step counts of the stage 1, 2 and 3 tests (the tests' folder is on
# the path, as pytest puts it there for files outside a package).
from test_zero_optimizer import MICRO, STEPS, _OPTIMIZERS  # isort: skip
import test_zero_optimizer as flat_case  # isort: skip
import test_zero3 as unit_case  # isort: skip

_DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float64": torch.float64,
           None: None}


def _case(stage: int) -> Any:
    return unit_case if stage == 3 else flat_case


def _model(stage: int, seed: int) -> nn.Module:
    return _case(stage)._net(seed=seed)


def _config(stage: int, low: torch.dtype, reduce: Optional[torch.dtype]) -> ZeroConfig:
    return ZeroConfig(stage=stage, bucket_bytes=256, param_dtype=low, reduce_dtype=reduce,
                      units=(unit_case._Block,) if stage == 3 else ())


def _reference(world: int, stage: int, low: torch.dtype, reduce: Optional[torch.dtype],
               opt_name: str) -> dict:
    """One process, by hand: per step, a lowered copy of the float64 weights; each rank's
    part of each microbatch through it (stage 1 sums a rank's microbatches in the low
    dtype, as autograd does in param.grad, before reducing; stages 2 and 3 reduce each
    one); the rank gradients cast to the reduce dtype, divided by the world size and summed;
    a plain optimizer step in float64."""
    reduce = reduce or low
    master = _model(stage, 0)
    cls, kw = _OPTIMIZERS[opt_name]
    opt = cls(_case(stage)._groups(master), **kw)
    norms = []
    trainable = [(n, p) for n, p in master.named_parameters() if p.requires_grad]
    losses = []
    threads = torch.get_num_threads()
    torch.set_num_threads(1)  # as the ranks compute
    try:
        for micro in _case(stage)._data(world):
            lowered = copy.deepcopy(master).to(low)
            lows = dict(lowered.named_parameters())
            total = {n: torch.zeros_like(p) for n, p in trainable}
            pending: list[dict[str, torch.Tensor]] = [{} for _ in range(world)]
            for x, y in micro:
                for r in range(world):
                    lowered.zero_grad()
                    xr, yr = x.chunk(world)[r].to(low), y.chunk(world)[r].to(low)
                    loss = F.mse_loss(lowered(xr), yr) / MICRO
                    loss.backward()
                    losses.append((r, loss.item()))
                    for n, _ in trainable:
                        g = lows[n].grad
                        g = torch.zeros_like(lows[n]) if g is None else g
                        if stage == 1:
                            pending[r][n] = pending[r].get(n, torch.zeros_like(g)) + g
                        else:
                            pending[r][n] = g
                if stage != 1:
                    _reduce_into(total, pending, world, reduce)
            if stage == 1:
                _reduce_into(total, pending, world, reduce)
            opt.zero_grad()
            for n, p in trainable:
                p.grad = total[n]
            norms.append(float(torch.stack([g.norm() for g in total.values()]).norm()))
            opt.step()
    finally:
        torch.set_num_threads(threads)
    per_step = [sum(v for _, v in losses[i * world:(i + 1) * world]) / world
                for i in range(len(losses) // world)]
    return {"params": {n: p.detach().clone() for n, p in trainable},
            "losses": per_step, "norms": norms}


def _reduce_into(total: dict[str, torch.Tensor], pending: list[dict[str, torch.Tensor]],
                 world: int, reduce: torch.dtype) -> None:
    for n in total:
        parts = [pending[r][n].to(reduce) for r in range(world)]
        if reduce != torch.float64:
            s = sum(p / world for p in parts)
            total[n] += s.to(torch.float64)
        else:
            total[n] += sum(parts) / world


def _train(rank: int, world: int, stage: int, low_name: str, reduce_name: Optional[str],
           gloo: bool, opt_name: str, device: str = "cpu") -> dict:
    low, reduce = _DTYPES[low_name], _DTYPES[reduce_name]
    group = dist.new_group(backend="gloo") if gloo else None
    if device == "cuda":
        torch.cuda.set_device(rank % torch.cuda.device_count())
    model = _model(stage, rank).to(device)  # the broadcast from rank 0 makes them equal
    cls, kw = _OPTIMIZERS[opt_name]
    opt = ZeroOptimizer(_case(stage)._groups(model), cls, group=group,
                        config=_config(stage, low, reduce), module=model, **kw)
    norms = []
    fails: list[str] = []
    losses = []
    for micro in _case(stage)._data(world):
        opt.zero_grad()
        for x, y in micro:
            x, y = x.chunk(world)[rank].to(device), y.chunk(world)[rank].to(device)
            out = model(x)  # float64 inputs: the optimizer's hook casts them
            if out.dtype != low:
                fails.append(f"the model computed in {out.dtype}")
            loss = F.mse_loss(out, y.to(low)) / MICRO
            loss.backward()
            losses.append(loss.item())
        norms.append(float(opt.clip_grad_norm_(1e30)))  # the averaged gradient's norm
        opt.step()
    with opt.gathered():
        lowered = {n: p.detach().clone() for n, p in model.named_parameters()}
    with opt.gathered(full_precision=True):
        masters = {n: p.detach().clone() for n, p in model.named_parameters()}
    trainable = {n for n, p in model.named_parameters() if p.requires_grad}
    for n, p in lowered.items():
        want = masters[n].to(low) if n in trainable else masters[n]
        if p.dtype != low or not torch.equal(p, want):
            fails.append(f"{n}: gathered {p.dtype} is not the shard's value lowered")
        if n in trainable and masters[n].dtype != torch.float64:
            fails.append(f"{n}: the shard is {masters[n].dtype}")
    # The shards keep what the low dtype cannot hold.
    kept = sum(int((m != m.to(low).double()).sum()) for n, m in masters.items()
               if n in trainable)
    if kept == 0:
        fails.append("every shard value fits the low dtype: the shards lost their precision")
    return {"params": {n: masters[n].double().tolist() for n in masters},
            "losses": losses, "norms": norms, "fails": fails}


# SGD with momentum, unlike Adam, moves by how large the gradients are: a reduction off
# by a factor shows in the parameters.
@pytest.mark.parametrize("stage,world,low,reduce,gloo,opt_name", [
    (1, 2, "float32", None, False, "sgd"),
    (2, 3, "float32", None, False, "sgd"),
    (3, 2, "float32", "float64", False, "sgd"),
    (2, 2, "bfloat16", "float32", True, "adamw"),
    (3, 3, "bfloat16", None, False, "adamw"),
])
def test_mixed_precision_trains_as_one_process_reducing_by_hand(
        stage: int, world: int, low: str, reduce: Optional[str], gloo: bool,
        opt_name: str) -> None:
    got = run_ranks(_train, world, timeout=180, args=(stage, low, reduce, gloo, opt_name))
    ref = _reference(world, stage, _DTYPES[low], _DTYPES[reduce], opt_name)
    # A reduction in float32 or float64 agrees to float32 rounding; a bfloat16 sum of three
    # ranks differs by an ulp here and there (the ranks' order), which Adam carries further.
    _compare(got, ref, world, tight=(reduce or low) != "bfloat16")


@pytest.mark.cuda
@pytest.mark.parametrize("stage", [2, 3])
def test_cuda_mixed_precision_trains_as_one_process_reducing_by_hand(stage: int) -> None:
    if not torch.cuda.is_available():
        pytest.skip("needs a CUDA GPU")
    got = run_ranks(_train, 2, timeout=180,
                    args=(stage, "bfloat16", None, False, "adamw", "cuda"))
    # The GPU's bfloat16 kernels round otherwise than the CPU's reference.
    _compare(got, _reference(2, stage, torch.bfloat16, None, "adamw"), 2, tight=False)


def _compare(got: list[dict], ref: dict, world: int, tight: bool) -> None:
    tol = dict(rtol=1e-6, atol=1e-7) if tight else dict(rtol=1e-2, atol=2e-3)
    close = 1e-6 if tight else 1e-2  # relative, for losses and norms
    for rank, r in enumerate(got):
        assert r["fails"] == [], (rank, r["fails"])
        assert r["params"] == got[0]["params"], rank
        assert set(ref["params"]) < set(r["params"])  # the frozen ones are not compared
        for name, want in ref["params"].items():
            mine = torch.tensor(r["params"][name], dtype=torch.float64)
            assert torch.allclose(mine, want, **tol), (rank, name, (mine - want).abs().max())
    per_step = [sum(r["losses"][s] for r in got) / world for s in range(STEPS * MICRO)]
    assert per_step == pytest.approx(ref["losses"], rel=close)
    for r in got:
        assert r["norms"] == pytest.approx(ref["norms"], rel=close)


def _round_trip(rank: int, world: int, stage: int) -> list[str]:
    fails: list[str] = []
    model = _model(stage, 0)
    opt = ZeroOptimizer(_case(stage)._groups(model), torch.optim.SGD, module=model,
                        config=_config(stage, torch.float32, None), lr=0.1)
    x = torch.randn(4, 7, dtype=torch.float64, generator=torch.Generator().manual_seed(rank))
    model(x).sum().backward()
    opt.step()
    with opt.gathered(full_precision=True):
        saved = {k: v.clone() for k, v in model.state_dict().items()}
    # A fresh optimizer over other weights loads them exactly.
    other = _model(stage, 5)
    opt2 = ZeroOptimizer(_case(stage)._groups(other), torch.optim.SGD, module=other,
                         config=_config(stage, torch.float32, None), lr=0.1)
    with opt2.gathered(writeback=True, full_precision=True):
        other.load_state_dict(saved)
    with opt2.gathered(full_precision=True):
        for k, v in other.state_dict().items():
            if not torch.equal(v, saved[k]):
                fails.append(f"{k}: loaded in full precision, read back otherwise")
    with opt2.gathered():
        for k, v in other.state_dict().items():
            if not torch.equal(v, saved[k].to(torch.float32)):
                fails.append(f"{k}: the parameters are not the loaded values lowered")
    # The optimizer's state carries the masters: loaded into an optimizer over other
    # weights, they become its parameters (a collective gathers them).
    third = _model(stage, 7)
    opt3 = ZeroOptimizer(_case(stage)._groups(third), torch.optim.SGD, module=third,
                         config=_config(stage, torch.float32, None), lr=0.1)
    opt3.load_state_dict(opt.state_dict())
    with opt3.gathered(full_precision=True):
        for n, p in third.named_parameters():
            if p.requires_grad and not torch.equal(p, saved[n]):
                fails.append(f"{n}: not the master loaded from the optimizer's state")
    # A write through the lowered parameters changes only what it wrote in the shard.
    name = "a.bias" if stage != 3 else "embed.bias"
    with opt2.gathered(writeback=True):
        dict(other.named_parameters())[name].data[0] = 0.5
    with opt2.gathered(full_precision=True):
        now = dict(other.named_parameters())[name]
        if now[0].item() != 0.5 or not torch.equal(now[1:], saved[name][1:]):
            fails.append(f"{name}: a write of one element left {now.tolist()}, "
                         f"{saved[name].tolist()} before")
    # The same step runs on: the lowered copy follows the shards.
    other(x).sum().backward()
    opt2.step()
    with opt2.gathered():
        lowered = {k: v.clone() for k, v in other.state_dict().items()}
    with opt2.gathered(full_precision=True):
        for k, v in other.state_dict().items():
            if not torch.equal(lowered[k], v.to(torch.float32)):
                fails.append(f"{k}: after a step the parameters are not the shards lowered")
    # Blocks of the other precision, and a step inside a full-precision one, are refused.

    def nested(outer: bool) -> None:
        with opt2.gathered(full_precision=outer):
            with opt2.gathered(full_precision=not outer):
                pass
    expect_refusal(fails, lambda: nested(True), f"rank {rank} of {world}", "other precision",
                   errors=(RuntimeError,))
    expect_refusal(fails, lambda: nested(False), "other precision",
                   errors=(RuntimeError,))

    def step_inside() -> None:
        with opt2.gathered(full_precision=True):
            opt2.step()
    expect_refusal(fails, step_inside, "step()", "after the block",
                   errors=(RuntimeError,))
    if stage == 3 and other.embed.weight.numel():
        fails.append("a refused block left the parameters whole")
    # Ranks whose precision differs raise together, naming each other.
    expect_refusal(fails, lambda: ZeroOptimizer(
        _model(1, 0).parameters(), torch.optim.SGD, lr=1,
        config=ZeroConfig(stage=min(stage, 2), param_dtype=torch.float32 if rank else None)),
        f"ranks [{1 - rank}] lay their parameters out otherwise", errors=(ValueError,))
    return fails


@pytest.mark.parametrize("stage", [1, 2, 3])
def test_full_precision_blocks_save_and_load_the_shards_exactly(stage: int) -> None:
    assert run_ranks(_round_trip, 2, timeout=120, args=(stage,)) == [[], []]


class _Normed(nn.Module):
    """A batch norm (floating buffers), a frozen layer the optimizer is not given, and a
    keyword input."""

    def __init__(self) -> None:
        super().__init__()
        self.a = nn.Linear(4, 6)
        self.norm = nn.BatchNorm1d(6)
        self.frozen = nn.Linear(6, 6)
        self.frozen.requires_grad_(False)
        self.b = nn.Linear(6, 2)

    def forward(self, x: torch.Tensor, *, shift: torch.Tensor) -> torch.Tensor:
        return self.b(self.frozen(torch.tanh(self.norm(self.a(x)) + shift)))


def _normed(seed: int) -> _Normed:
    torch.manual_seed(seed)
    model = _Normed().double()
    shared = torch.ones(3, dtype=torch.float64)  # a buffer two modules share
    model.a.register_buffer("shared", shared)
    model.b.register_buffer("shared", shared)
    return model


def _edges(rank: int, world: int) -> list[str]:
    fails: list[str] = []
    bf16 = torch.bfloat16

    # A float16 reduction of gradients whose sum overflows float16 (but not their average).
    for reduce in (torch.float16, bf16):
        one = nn.Linear(1, 1, bias=False).double()
        opt = ZeroOptimizer(one.parameters(), torch.optim.SGD, lr=0.0,
                            config=ZeroConfig(reduce_dtype=reduce))
        (one(torch.ones(1, 1, dtype=torch.float64)) * 4e4).sum().backward()
        norm = float(opt.clip_grad_norm_(1e30))
        if not abs(norm - 4e4) <= 4e4 * 2e-3:
            fails.append(f"{reduce} reduction: averaged gradient {norm}, not 4e4")

    # Buffers, frozen parameters not passed and keyword inputs compute in param_dtype.
    model = _normed(0)
    trainable = [p for p in model.parameters() if p.requires_grad]
    opt = ZeroOptimizer(trainable, torch.optim.AdamW, module=model, lr=0.01,
                        config=ZeroConfig(param_dtype=bf16))
    x = torch.randn(8, 4, dtype=torch.float64, generator=torch.Generator().manual_seed(rank))
    shift = torch.full((6,), 0.5, dtype=torch.float64)
    for _ in range(2):
        opt.zero_grad()
        out = model(x, shift=shift)
        out.square().mean().backward()
        opt.step()
    kinds = {out.dtype, model.norm.running_mean.dtype, model.frozen.weight.dtype}
    if kinds != {bf16}:
        fails.append(f"batch norm model computed in {kinds}")
    if model.a.shared is not model.b.shared or model.a.shared.dtype != bf16:
        fails.append("a shared buffer was not lowered in place")
    # memory() counts a full-precision block's copies; a forward pass there is refused.
    before = opt.memory()["params"]
    with opt.gathered(full_precision=True):
        grown = opt.memory()["params"] - before
        expect_refusal(fails, lambda: model(x, shift=shift), "forward pass", "full_precision",
                       errors=(RuntimeError,))
    want = sum(f.flat.numel() * 8 for f in opt._flats)
    if grown != want:
        fails.append(f"a full-precision block holds {grown} more bytes, not {want}")
    # The optimizer's state_dict keeps the master weights: the lowered model's weights
    # and it, loaded in either order, restore them exactly.
    with opt.gathered():
        lowered = {k: v.clone() for k, v in model.state_dict().items()}
    with opt.gathered(full_precision=True):
        masters = {n: p.detach().clone() for n, p in model.named_parameters()}
    saved = opt.state_dict()
    saved = {**saved, "masters": [m.clone() for m in saved["masters"]]}
    for model_first in (True, False):
        again = _normed(1)
        opt2 = ZeroOptimizer([p for p in again.parameters() if p.requires_grad],
                             torch.optim.AdamW, module=again, lr=0.01,
                             config=ZeroConfig(param_dtype=bf16))
        if not model_first:
            opt2.load_state_dict(saved)
        with opt2.gathered(writeback=True):
            again.load_state_dict(lowered)
        if model_first:
            opt2.load_state_dict(saved)
        with opt2.gathered(full_precision=True):
            for n, p in again.named_parameters():
                if p.requires_grad and not torch.equal(p, masters[n]):
                    fails.append(f"model first {model_first}: {n} is not the saved master")
        with opt2.gathered():
            for k, v in again.state_dict().items():
                if not torch.equal(v, lowered[k]):
                    fails.append(f"model first {model_first}: {k} is not the lowered master")
    # A plain optimizer's state over the lowered parameters (bfloat16 moments) loads in
    # the shards' dtype, and steps.
    plain_model = copy.deepcopy(model)
    with opt.gathered():
        plain_model.load_state_dict(model.state_dict())
    plain = torch.optim.AdamW([p for p in plain_model.parameters() if p.requires_grad],
                              lr=0.01)
    plain_model(x.to(bf16), shift=shift.to(bf16)).square().mean().backward()
    plain.step()
    opt.load_consolidated_state_dict(plain.state_dict())
    moments = {v.dtype for st in opt._inner.state.values() for k, v in st.items()
               if k != "step"}
    if moments != {torch.float64}:
        fails.append(f"loaded moments are {moments}")
    model(x, shift=shift).square().mean().backward()
    opt.step()
    # Another optimizer over the lowered model, which would take bfloat16 for masters.
    expect_refusal(fails, lambda: ZeroOptimizer(trainable, torch.optim.SGD, lr=0.1),
                   f"rank {rank} of {world}", "lowered to torch.bfloat16", "afresh")
    # A param_dtype the parameters already have lowers nothing: another optimizer may
    # take them over.
    same = flat_case._net()
    ZeroOptimizer(same.parameters(), torch.optim.SGD, lr=0.1,
                  config=ZeroConfig(param_dtype=torch.float64))
    try:
        ZeroOptimizer(same.parameters(), torch.optim.SGD, lr=0.1)
    except ValueError as e:
        fails.append(f"refused after lowering nothing: {e}")
    # Compression: TopK(1.0) keeps every element, so it trains as the exact reduction.
    runs = []
    for compression in (None, tc.TopK(1.0)):
        net = flat_case._net()
        zo = ZeroOptimizer(flat_case._groups(net), torch.optim.SGD, module=net, lr=0.05,
                           config=ZeroConfig(param_dtype=bf16, compression=compression))
        for micro in flat_case._data(world):
            zo.zero_grad()
            for xb, yb in micro:
                xb, yb = xb.chunk(world)[rank], yb.chunk(world)[rank]
                F.mse_loss(net(xb), yb.to(bf16)).backward()
            zo.step()
        with zo.gathered(full_precision=True):
            runs.append(torch.cat([p.detach().reshape(-1).double()
                                   for p in net.parameters()]))
    if not torch.allclose(runs[0], runs[1], rtol=1e-2, atol=1e-3):
        fails.append(f"TopK(1.0) in bfloat16 moved {float((runs[0] - runs[1]).abs().max())} "
                     "from the exact reduction")
    return fails


def test_mixed_precision_with_overflow_buffers_state_dicts_and_compression() -> None:
    assert run_ranks(_edges, 2, timeout=120) == [[], []]


def test_config_refuses_dtypes_that_are_not_floating_point() -> None:
    for bad in (torch.int8, "bfloat16", torch.complex64, torch.float8_e4m3fn):
        with pytest.raises(TypeError, match="param_dtype must be None, torch.bfloat16"):
            ZeroConfig(param_dtype=bad)
        with pytest.raises(TypeError, match="reduce_dtype"):
            ZeroConfig(reduce_dtype=bad)

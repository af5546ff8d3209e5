"""ZeRO stage 3 (ZeroOptimizer with ZeroConfig(stage=3)): parameters sharded between
uses, gathered unit by unit. Training on spawned ranks against one process training the
same model on the whole batch with the plain optimizer (parameters, optimizer state and
losses within float64 rounding), with what each rank holds checked as it runs; the
units' plan in one process; resuming, activation checkpointing and refusals.
"""

from __future__ import annotations

import copy
import dataclasses
import random
from typing import Any

import pytest
import torch
import torch.distributed as dist
import torch.nn as nn
import torch.nn.functional as F
from torch.utils.checkpoint import checkpoint

from torchdist_ext import compression as tc
from torchdist_ext.parallel import ZeroConfig, ZeroOptimizer
from torchdist_ext.parallel.zero_units import plan_units
from torchdist_ext.testing import expect_refusal, run_ranks

# The optimizers, step counts and comparison of the stage 1 and 2 tests (the tests'
# folder is on the path, as pytest puts it there for files outside a package).
from test_zero_optimizer import MICRO, STEPS, _OPTIMIZERS  # isort: skip
from test_zero_optimizer import _compare as compare_with_one_process  # isort: skip


class _Block(nn.Module):
    def __init__(self, d: int) -> None:
        super().__init__()
        self.norm = nn.LayerNorm(d)
        self.lin = nn.Linear(d, d)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x + torch.tanh(self.lin(self.norm(x)))


class _Net(nn.Module):
    """Three blocks (units when asked), the last two sharing a weight (but under
    reentrant checkpointing, which would accumulate its gradient twice); an input layer
    whose weight the output reuses; a frozen layer, a parameter the loss never reaches, a
    0-dim one, and sizes that divide by no world size."""

    def __init__(self, ckpt: str = "", tie: bool = True) -> None:
        super().__init__()
        self.embed = nn.Linear(7, 11)
        self.blocks = nn.ModuleList([_Block(11) for _ in range(3)])
        if tie:
            self.blocks[2].lin.weight = self.blocks[1].lin.weight
        self.frozen = nn.Linear(11, 11)
        self.frozen.requires_grad_(False)
        self.unused = nn.Parameter(torch.randn(3))
        self.scale = nn.Parameter(torch.tensor(1.5))
        self.ckpt = ckpt

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.embed(x)
        for b in self.blocks:
            if self.ckpt:
                h = checkpoint(b, h, use_reentrant=self.ckpt == "reentrant")
            else:
                h = b(h)
        h = self.frozen(h)
        return F.linear(h, self.embed.weight.t()) * self.scale


def _net(seed: int = 0, ckpt: str = "", tie: bool = True) -> _Net:
    torch.manual_seed(seed)
    return _Net(ckpt, tie and ckpt != "reentrant").double()


def _groups(model: nn.Module) -> list[dict]:
    named = list(model.named_parameters())  # the frozen ones too: broadcast from rank 0
    decay = [p for n, p in named if n.endswith("weight") or n == "scale"]
    rest = [p for n, p in named if not (n.endswith("weight") or n == "scale")]
    return [{"params": decay, "weight_decay": 0.01}, {"params": rest, "weight_decay": 0.0}]


def _data(world: int) -> list[list[tuple[torch.Tensor, torch.Tensor]]]:
    g = torch.Generator().manual_seed(11)
    return [[(torch.randn(3 * world, 7, generator=g, dtype=torch.float64),
              torch.randn(3 * world, 7, generator=g, dtype=torch.float64))
             for _ in range(MICRO)] for _ in range(STEPS)]


def _reference(world: int, opt_name: str, clip: float | None, ckpt: str = "") -> dict:
    model = _net(ckpt=ckpt)
    cls, kw = _OPTIMIZERS[opt_name]
    opt = cls(_groups(model), **kw)
    sched = torch.optim.lr_scheduler.StepLR(opt, step_size=2, gamma=0.5)
    losses = []
    for micro in _data(world):
        opt.zero_grad()
        for x, y in micro:
            loss = F.mse_loss(model(x), y) / MICRO
            loss.backward()
            losses.append(loss.item())
        for p in model.parameters():  # ZeroOptimizer steps these with a zero gradient
            if p.requires_grad and p.grad is None:
                p.grad = torch.zeros_like(p)
        if clip is not None:
            nn.utils.clip_grad_norm_(model.parameters(), clip)
        opt.step()
        sched.step()
    return {"params": {n: p.detach().clone() for n, p in model.named_parameters()},
            "state": opt.state_dict(), "losses": losses}


def _held(model: _Net) -> list[bool]:
    """Whether each block's own parameters have storage now."""
    return [b.norm.weight.untyped_storage().nbytes() > 0 for b in model.blocks]


def _train(rank: int, world: int, opt_name: str, clip: float | None, units: bool,
           reshard: bool, gloo: bool, ckpt: str, prefetch: bool = True,
           compression: Any = None) -> dict:
    group = dist.new_group(backend="gloo") if gloo else None
    model = _net(seed=rank, ckpt=ckpt)  # the broadcast from rank 0 must make them equal
    cls, kw = _OPTIMIZERS[opt_name]
    config = ZeroConfig(stage=3, bucket_bytes=256, units=(_Block,) if units else (),
                        reshard_after_forward=reshard, prefetch=prefetch,
                        compression=compression)
    opt = ZeroOptimizer(_groups(model), cls, group=group, config=config, module=model, **kw)
    sched = torch.optim.lr_scheduler.StepLR(opt, step_size=2, gamma=0.5)
    seen: list[list[bool]] = []  # which blocks were whole as each block ran forward
    # Which blocks' flat buffers, or a prefetch's own, were allocated meanwhile.
    block_units = [u for b in model.blocks for u in opt._units if u.module is b]
    allocated: list[list[bool]] = []

    def record(m: nn.Module, a: Any) -> None:
        seen.append(_held(model))
        allocated.append([u.flats[0].flat.untyped_storage().nbytes() > 0
                          or u.staging is not None for u in block_units])

    for b in model.blocks:  # after the optimizer's hook, which gathers the block
        b.register_forward_pre_hook(record)
    losses, norms, fails = [], [], []
    for micro in _data(world):
        opt.zero_grad()
        for x, y in micro:
            x, y = x.chunk(world)[rank], y.chunk(world)[rank]
            loss = F.mse_loss(model(x), y) / MICRO
            loss.backward()
            losses.append(loss.item())
            if any(p.grad is not None for p in model.parameters()):
                fails.append("a parameter kept its gradient")
            if any(_held(model)):
                fails.append(f"blocks still whole after backward: {_held(model)}")
        if clip is not None:
            norms.append(float(opt.clip_grad_norm_(clip)))
        opt.step()
        sched.step()
    mem = opt.memory()
    shard_bytes = sum(f.shard.numel() * f.shard.element_size() for f in opt._flats)
    if mem["params"] != shard_bytes:
        fails.append(f"after step the parameters take {mem['params']} bytes, the shards "
                     f"{shard_bytes}")
    with torch.no_grad():  # an evaluation pass gathers and frees as it goes
        before = len(seen)
        model(torch.ones(2, 7, dtype=torch.float64))
        if any(_held(model)) or len(seen) != before + 3:
            fails.append(f"evaluation left {_held(model)}")
    # Between uses a parameter is an empty tensor: a stray read finds no elements.
    if model.blocks[0].lin.weight.shape != (0,) or model.embed.bias.shape != (0,):
        fails.append(f"freed parameters are {model.blocks[0].lin.weight.shape}")
    with opt.gathered():
        params = {n: p.detach().tolist() for n, p in model.named_parameters()}
        if model.blocks[0].lin.weight.shape != (11, 11):
            fails.append(f"gathered parameters are {model.blocks[0].lin.weight.shape}")
    if any(_held(model)) or model.blocks[0].lin.weight.numel():
        fails.append("gathered() left blocks whole")
    state = opt.consolidated_state_dict()
    state["state"] = {i: {k: torch.as_tensor(v).tolist() for k, v in st.items()}
                      for i, st in state["state"].items()}
    if units and reshard and not ckpt:
        # Block i alone is whole as it runs; with prefetch, from the second pass on, the
        # next one is being gathered meanwhile.
        for i, (s, a) in enumerate(zip(seen[:3 * MICRO * STEPS], allocated)):
            block = i % 3
            ahead = prefetch and i >= 3 and block < 2
            if s != [b == block for b in range(3)] \
                    or a != [b == block or (ahead and b == block + 1) for b in range(3)]:
                fails.append(f"forward pass {i // 3}, block {block}: whole {s}, "
                             f"allocated {a}")
                break
    if units and not reshard and seen[2] != [True, True, True]:
        fails.append(f"without resharding, blocks whole at the third: {seen[2]}")
    return {"params": params, "state": state, "losses": losses, "norms": norms,
            "fails": fails}


def _compare(got: list[dict], ref: dict, world: int) -> None:
    for rank, r in enumerate(got):
        assert r["fails"] == [], (rank, r["fails"])
    compare_with_one_process(got, ref, world)


@pytest.mark.parametrize("world", [1, 2, 3, 4])
def test_stage_3_trains_as_one_process_does(world: int) -> None:
    """AdamW, StepLR, two micro-batches per step: each block a unit, freed after its
    forward pass, so one alone is whole at a time; tied and frozen weights, an unused
    parameter; the parameters (gathered), the consolidated state and the losses equal one
    process's within float64 rounding."""
    ref = _reference(world, "adamw", None)
    got = run_ranks(_train, world, timeout=120,
                    args=("adamw", None, True, True, False, ""))
    _compare(got, ref, world)


@pytest.mark.parametrize("units,reshard,prefetch",
                         [(False, True, True), (True, False, True), (True, True, False)])
def test_stage_3_as_one_unit_without_resharding_and_without_prefetch(
        units: bool, reshard: bool, prefetch: bool) -> None:
    world = 3
    ref = _reference(world, "adamw", None)
    got = run_ranks(_train, world, timeout=120,
                    args=("adamw", None, units, reshard, False, "", prefetch))
    _compare(got, ref, world)


def test_stage_3_sgd_with_clipping_on_a_gloo_group() -> None:
    world = 2
    ref = _reference(world, "sgd", 0.05)
    got = run_ranks(_train, world, timeout=120, args=("sgd", 0.05, True, True, True, ""))
    _compare(got, ref, world)
    assert got[0]["norms"][0] > 0.05 and all(r["norms"] == got[0]["norms"] for r in got)


def test_stage_3_with_compressed_gradients() -> None:
    """TopK(1.0) sends every element, so the compressed reduce_scatter is exact."""
    world = 2
    ref = _reference(world, "adamw", None)
    got = run_ranks(_train, world, timeout=120,
                    args=("adamw", None, True, True, False, "", True, tc.TopK(1.0)))
    _compare(got, ref, world)


@pytest.mark.parametrize("ckpt", ["reentrant", "non-reentrant"])
def test_stage_3_with_activation_checkpointing(ckpt: str) -> None:
    """Blocks recomputed during backward are gathered again for it, and not freed in
    between."""
    world = 2
    ref = _reference(world, "adamw", None, ckpt)
    got = run_ranks(_train, world, timeout=120, args=("adamw", None, True, True, False, ckpt))
    _compare(got, ref, world)


def _differences(opt: ZeroOptimizer, model: nn.Module, ref: nn.Module) -> list[str]:
    """The parameters of ``model`` (gathered) that differ from ``ref``'s."""
    out = []
    with opt.gathered():
        for (n, p), q in zip(model.named_parameters(), ref.parameters()):
            if not torch.allclose(p, q, rtol=1e-10, atol=1e-12):
                out.append(f"{n}: {(p - q).abs().max()}")
    return out


class _Nested(nn.Module):
    """Every gradient but the model's own arrives inside a reentrant checkpoint's backward
    pass, the first of them before the model's; the model's gain is read after them."""

    def __init__(self) -> None:
        super().__init__()
        self.embed = nn.Linear(7, 11)
        self.gain = nn.Parameter(torch.linspace(0.5, 1.5, 11))
        self.blocks = nn.ModuleList([_Block(11) for _ in range(2)])

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.embed(x) * self.gain
        for b in self.blocks:
            h = checkpoint(b, h, use_reentrant=True)
        return h


def _nested(rank: int, world: int, stage: int) -> list[str]:
    fails = []
    torch.manual_seed(0)
    model = _Nested().double()
    ref = _Nested().double()
    ref.load_state_dict(model.state_dict())
    config = ZeroConfig(stage=3, units=(_Block,), bucket_bytes=128) if stage == 3 \
        else ZeroConfig(stage=stage, bucket_bytes=128)
    opt = ZeroOptimizer(model.parameters(), torch.optim.SGD, config=config, module=model,
                        lr=0.1, momentum=0.9)
    plain = torch.optim.SGD(ref.parameters(), lr=0.1, momentum=0.9)
    launches = []
    launch = opt._launch
    opt._launch = lambda *a, **k: (launches.append(1), launch(*a, **k))[1]
    g = torch.Generator().manual_seed(3)
    for _ in range(2):
        x = torch.randn(2 * world, 7, generator=g, dtype=torch.float64)
        y = torch.randn(2 * world, 11, generator=g, dtype=torch.float64)
        opt.zero_grad()
        launches.clear()
        F.mse_loss(model(x.chunk(world)[rank]), y.chunk(world)[rank]).backward()
        if len(launches) != len(opt._order):  # one reduce_scatter per bucket per pass
            fails.append(f"{len(launches)} reduce_scatters for {len(opt._order)} buckets")
        opt.step()
        plain.zero_grad()
        F.mse_loss(ref(x), y).backward()
        plain.step()
    fails += _differences(opt, model, ref)
    return fails


@pytest.mark.parametrize("stage", [2, 3])
def test_reentrant_checkpointing_makes_one_pass_of_reductions(stage: int) -> None:
    """A backward pass that ends inside another (a reentrant checkpoint's) is not the end
    of the step's: its buckets are reduced once, and stage 3 keeps the model's own unit
    whole until the outer pass is done with it."""
    assert run_ranks(_nested, 2, timeout=60, args=(stage,)) == [[], []]


@dataclasses.dataclass
class _Out:
    """Not a pytree node: the hooks cannot see the tensor inside."""

    h: torch.Tensor


class _Hidden(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.lin = nn.Linear(11, 11)

    def forward(self, x: torch.Tensor) -> _Out:
        return _Out(torch.tanh(self.lin(x)))


class _Boom(torch.autograd.Function):
    """Raises in backward while armed."""

    armed = False

    @staticmethod
    def forward(ctx: Any, x: torch.Tensor) -> torch.Tensor:
        return x.clone()

    @staticmethod
    def backward(ctx: Any, g: torch.Tensor) -> torch.Tensor:
        if _Boom.armed:
            raise RuntimeError("boom")
        return g


class _Odd(nn.Module):
    """A unit with a forward pre-hook of its own (weight_norm's), one whose output hides
    its tensor, and a failure in backward between two units."""

    def __init__(self) -> None:
        super().__init__()
        self.inp = nn.utils.weight_norm(nn.Linear(7, 11))
        self.hidden = _Hidden()
        self.out = nn.Linear(11, 7)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.out(_Boom.apply(self.hidden(torch.tanh(self.inp(x))).h))


def _odd_uses(rank: int, world: int) -> list[str]:
    fails = []
    torch.manual_seed(0)
    model, ref = _Odd().double(), _Odd().double()
    ref.load_state_dict(model.state_dict())
    opt = ZeroOptimizer(model.parameters(), torch.optim.AdamW, module=model, lr=0.01,
                        config=ZeroConfig(stage=3, units=(nn.Linear, _Hidden),
                                          bucket_bytes=64))
    plain = torch.optim.AdamW(ref.parameters(), lr=0.01)
    shards = sum(f.shard.numel() * 8 for f in opt._flats)
    g = torch.Generator().manual_seed(4)

    def batch() -> tuple[torch.Tensor, torch.Tensor]:
        return (torch.randn(2 * world, 7, generator=g, dtype=torch.float64),
                torch.randn(2 * world, 7, generator=g, dtype=torch.float64))

    for step in range(3):
        x, y = batch()
        if step == 1:  # fails in backward after the last unit's gradients went out
            _Boom.armed = True
            try:
                F.mse_loss(model(x.chunk(world)[rank]), y.chunk(world)[rank]).backward()
                fails.append("the armed backward did not raise")
            except RuntimeError as e:
                if "boom" not in str(e):
                    fails.append(f"raised {e}")
            _Boom.armed = False
        opt.zero_grad()
        F.mse_loss(model(x.chunk(world)[rank]), y.chunk(world)[rank]).backward()
        opt.step()
        plain.zero_grad()
        F.mse_loss(ref(x), y).backward()
        plain.step()
    # torch.autograd.grad accumulates no gradient, but its pass still ends by freeing.
    x = torch.randn(2, 7, dtype=torch.float64, requires_grad=True)
    torch.autograd.grad(model(x).sum(), [x])
    if opt.memory()["params"] != shards:
        fails.append(f"after autograd.grad the parameters take {opt.memory()['params']}")
    fails += _differences(opt, model, ref)
    # A writeback block that raises between a forward pass and its backward pass leaves
    # the unit held for that backward pass whole.
    out = model(torch.randn(2, 7, dtype=torch.float64))
    try:
        with opt.gathered(writeback=True):
            raise KeyError("in the block")
    except KeyError:
        pass
    try:
        out.sum().backward()
    except RuntimeError as e:
        fails.append(f"backward after a raised writeback block: {str(e)[:120]}")
    return fails


def test_stage_3_with_hooks_hidden_outputs_failed_backward_and_autograd_grad() -> None:
    """weight_norm's pre-hook sees whole weights; a unit whose output hides its tensor
    stays whole until its backward pass; a backward pass that raised is dropped by
    zero_grad(); torch.autograd.grad frees what it gathered: training equals one
    process's."""
    assert run_ranks(_odd_uses, 2, timeout=60) == [[], []]


class _Aux(_Block):
    """A block that also leaves a side loss the hooks cannot see: backward reaches its
    weights through it before through its output."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        out = super().forward(x)
        self.aux = self.lin(x * 0.5).pow(2).mean()  # newer than the output: runs first
        return out


class _Uses(nn.Module):
    def __init__(self, block: type = _Block) -> None:
        super().__init__()
        self.embed = nn.Linear(7, 11)
        self.blocks = nn.ModuleList([block(11) for _ in range(3)])
        self.head = nn.Linear(11, 7)
        self.inner = False

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.embed(x)
        if self.inner:  # a gradient taken inside the forward pass, through a unit
            h2 = h.detach().requires_grad_()
            g, = torch.autograd.grad(self.blocks[0](h2).sum(), h2)
            h = h + 0.1 * g
        for b in self.blocks:
            h = b(h)
        return self.head(h)


def _loss(case: str, model: nn.Module, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
    if case == "penalty":  # a gradient penalty: backward through a gradient
        x = x.clone().requires_grad_()
        out = model(x)
        g, = torch.autograd.grad(out.sum(), x, create_graph=True)
        return F.mse_loss(out, y) + g.pow(2).mean()
    if case == "aux":
        return F.mse_loss(model(x), y) + sum(b.aux for b in model.blocks)
    if case == "eval_between":  # an evaluation pass between forward and backward
        out = model(x)
        with torch.no_grad():
            t = model(x * 2)
        return F.mse_loss(out, y + 0.1 * t)
    return F.mse_loss(model(x), y)


def _uses(rank: int, world: int, case: str, reshard: bool) -> list[str]:
    fails = []
    torch.manual_seed(0)
    make = {"aux": lambda: _Uses(_Aux), "eval_between": _Odd}.get(case, _Uses)
    model, ref = make().double(), make().double()
    ref.load_state_dict(model.state_dict())
    if case == "inner":
        model.inner = ref.inner = True
    units = (_Block, nn.Linear, _Hidden)
    opt = ZeroOptimizer(model.parameters(), torch.optim.SGD, module=model, lr=0.05,
                        momentum=0.9, config=ZeroConfig(stage=3, units=units,
                                                        reshard_after_forward=reshard))
    plain = torch.optim.SGD(ref.parameters(), lr=0.05, momentum=0.9)
    g = torch.Generator().manual_seed(2)
    for _ in range(3):
        x = torch.randn(2 * world, 7, generator=g, dtype=torch.float64)
        y = torch.randn(2 * world, 7, generator=g, dtype=torch.float64)
        opt.zero_grad()
        try:
            _loss(case, model, x.chunk(world)[rank], y.chunk(world)[rank]).backward()
        except RuntimeError as e:
            return [f"raised: {str(e)[:200]}"]
        opt.step()
        plain.zero_grad()
        _loss(case, ref, x, y).backward()
        plain.step()
    fails += _differences(opt, model, ref)
    return fails


@pytest.mark.parametrize("case", ["penalty", "inner", "eval_between"])
def test_stage_3_with_gradients_of_gradients_and_passes_inside_passes(case: str) -> None:
    """A gradient penalty (autograd.grad with create_graph, then backward through it);
    autograd.grad inside the model's forward pass; an evaluation pass between a forward
    pass whose unit hides its output and its backward pass: each trains as one process
    does."""
    assert run_ranks(_uses, 2, timeout=60, args=(case, True)) == [[], []]


def test_weights_reached_around_a_units_output_need_it_kept_whole() -> None:
    """A side loss reaches a unit's weights in backward before its output's hook gathers
    it: freed after forward, that raises (rather than read a prefetch half done); kept
    whole (reshard_after_forward=False), it trains as one process does."""
    got = run_ranks(_uses, 2, timeout=60, args=("aux", True))
    assert all(len(r) == 1 and r[0].startswith("raised") for r in got), got
    assert run_ranks(_uses, 2, timeout=60, args=("aux", False)) == [[], []]


def _pinned(rank: int, world: int) -> list[str]:
    fails = []
    model = _net()
    opt = ZeroOptimizer(_groups(model), torch.optim.SGD, module=model, lr=0.1,
                        config=ZeroConfig(stage=3, units=(_Block,)))
    x = torch.randn(2, 7, dtype=torch.float64)
    for name, fn in [("state_dict", model.state_dict),
                     ("load", lambda: model.load_state_dict({}, strict=False))]:
        try:
            fn()
            fails.append(f"{name} accepted outside gathered()")
        except RuntimeError as e:
            if "gathered(" not in str(e):
                fails.append(f"{name}: {e}")
    with opt.gathered():
        with torch.no_grad():
            model(x)  # an evaluation pass inside frees nothing
        model(x).sum().backward()
        if not all(_held(model)) or model.state_dict()["blocks.0.lin.weight"].shape != (11, 11):
            fails.append(f"gathered() let passes inside free blocks: {_held(model)}")
        opt.step()  # the parameters follow the step inside the block
        whole = {n: p.clone() for n, p in model.named_parameters()}
    with opt.gathered():
        for n, p in model.named_parameters():
            if not torch.equal(p, whole[n]):
                fails.append(f"{n} changed between two gathered() blocks")
    if any(_held(model)):
        fails.append("blocks whole after gathered()")
    return fails


def test_gathered_holds_parameters_whole_through_passes_and_guards_state_dicts() -> None:
    assert run_ranks(_pinned, 2, timeout=60) == [[], []]


class _Random(nn.Module):
    """Layers drawn at random: linear, layer norms, residual blocks, a tanh; maybe two
    linear layers sharing a weight."""

    def __init__(self, rng: random.Random, d: int) -> None:
        super().__init__()
        kinds = [rng.choice(["linear", "norm", "block", "tanh"]) for _ in range(rng.randint(1, 6))]
        make = {"linear": lambda: nn.Linear(d, d), "norm": lambda: nn.LayerNorm(d),
                "block": lambda: _Block(d), "tanh": nn.Tanh}
        self.layers = nn.ModuleList([make[k]() for k in kinds])
        linear = [m for m in self.layers if type(m) is nn.Linear]
        if len(linear) >= 2 and rng.random() < 0.5:
            linear[-1].weight = linear[0].weight
        self.out = nn.Linear(d, 3)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for m in self.layers:
            x = m(x)
        return self.out(x)


def _random_models(rank: int, world: int, trials: int) -> list[str]:
    """Stage 3, under random units, resharding, prefetch and bucket sizes, against stage
    2 on a copy of the same model: the same parameters after three steps."""
    fails = []
    rng = random.Random(7)  # the same draws on every rank
    for trial in range(trials):
        d = rng.choice([3, 5, 8])
        torch.manual_seed(trial)
        first = _Random(rng, d).double()
        models = [first, copy.deepcopy(first)]
        units = rng.choice([(), (nn.Linear,), (_Block,), (nn.Linear, nn.LayerNorm)])
        if units and not any(isinstance(m, units) for m in models[0].modules()
                             if m is not models[0]):
            units = ()
        three = ZeroConfig(stage=3, units=units, bucket_bytes=rng.choice([64, 256, 1 << 20]),
                           reshard_after_forward=rng.random() < 0.7,
                           prefetch=rng.random() < 0.7)
        opts = [ZeroOptimizer(models[0].parameters(), torch.optim.Adam, config=three,
                              module=models[0], lr=0.01),
                ZeroOptimizer(models[1].parameters(), torch.optim.Adam,
                              config=ZeroConfig(stage=2), lr=0.01)]
        g = torch.Generator().manual_seed(trial)
        for _ in range(3):
            for m, opt in zip(models, opts):
                opt.zero_grad()
            for _ in range(2):
                x = torch.randn(2 * world, d, generator=g, dtype=torch.float64)
                for m in models:
                    m(x.chunk(world)[rank]).square().mean().backward()
            for opt in opts:
                opt.step()
        fails += [f"trial {trial} ({three}): {e}"
                  for e in _differences(opts[0], models[0], models[1])]
    return fails


def test_stage_3_matches_stage_2_on_random_models() -> None:
    assert run_ranks(_random_models, 3, timeout=120, args=(24,)) == [[], [], []]


def _owners(rank: int, world: int) -> list[str]:
    """A deepcopy of a model (an EMA copy, say) is not the optimizer's: its state dicts
    and gradients are its own. A second ZeroOptimizer over a model takes it over from the
    first; at stage 3, whose parameters are sharded then, it is refused. A rank whose
    stage 3 set-up is refused does not leave the others waiting."""
    fails = []
    x = torch.ones(2, 7, dtype=torch.float64)
    model = _net()
    first = ZeroOptimizer(_groups(model), torch.optim.SGD, module=model, lr=0.1)
    model(x).sum().backward()
    first.step()
    ema = copy.deepcopy(model)
    weights = ema.state_dict()
    ema.load_state_dict(weights)
    ema(x).sum().backward()
    if ema.embed.weight.grad is None:
        fails.append("the copy's gradient was taken by the optimizer")
    second = ZeroOptimizer(_groups(model), torch.optim.SGD, module=model, lr=0.1)
    with second.gathered(writeback=True):
        model.load_state_dict(weights)
    expect_refusal(fails, lambda: model.load_state_dict(weights), "writeback=True",
                   errors=(RuntimeError,))
    second.zero_grad()
    model(x).sum().backward()
    second.step()
    if any(p.grad is not None for p in model.parameters()):
        fails.append("the second optimizer left gradients")
    sharded = _net()
    three = ZeroConfig(stage=3)
    ZeroOptimizer(_groups(sharded), torch.optim.SGD, module=sharded, config=three, lr=0.1)
    expect_refusal(fails, lambda: ZeroOptimizer(_groups(sharded), torch.optim.SGD,
                                                module=sharded, config=three, lr=0.1),
                   "sharded already")
    expect_refusal(fails, lambda: ZeroOptimizer(_groups(model), torch.optim.SGD, config=three,
                                                module=model if rank else None, lr=0.1),
                   "module=model" if rank == 0 else "lay their parameters out otherwise")
    return fails


def test_copies_second_optimizers_and_one_rank_refused() -> None:
    assert run_ranks(_owners, 2, timeout=60) == [[], []]


def _resume(rank: int, world: int, stage: int) -> list[str]:
    """A model and optimizer state taken out through gathered() and
    consolidated_state_dict() go into another model's optimizer through
    gathered(writeback=True): both train on alike."""
    fails = []
    models = [_net(seed=0), _net(seed=5)]
    config = ZeroConfig(stage=3, units=(_Block,), bucket_bytes=128) if stage == 3 \
        else ZeroConfig(stage=stage, bucket_bytes=128)
    a = ZeroOptimizer(_groups(models[0]), torch.optim.AdamW, config=config, module=models[0],
                      lr=0.01)
    data = _data(world)

    def train(model: nn.Module, opt: ZeroOptimizer, steps: list) -> None:
        for micro in steps:
            opt.zero_grad()
            for x, y in micro:
                F.mse_loss(model(x.chunk(world)[rank]), y.chunk(world)[rank]).backward()
            opt.step()

    train(models[0], a, data[:2])
    with a.gathered():
        weights = {k: v.clone() for k, v in models[0].state_dict().items()}
    state = a.consolidated_state_dict()
    b = ZeroOptimizer(_groups(models[1]), torch.optim.AdamW, config=config, module=models[1],
                      lr=0.5)
    with b.gathered(writeback=True):
        models[1].load_state_dict(weights)
    b.load_consolidated_state_dict(state)
    train(models[0], a, data[2:])
    train(models[1], b, data[2:])
    with a.gathered(), b.gathered():
        for (n, p), q in zip(models[0].named_parameters(), models[1].parameters()):
            if not torch.equal(p, q):
                fails.append(f"{n}: {(p - q).abs().max()}")
    return fails


@pytest.mark.parametrize("stage", [2, 3])
def test_resuming_through_gathered_writeback(stage: int) -> None:
    """At stage 2 as well: there the parameters are always whole, but a write to them
    reaches the optimizer's shard only through writeback."""
    assert run_ranks(_resume, 2, timeout=60, args=(stage,)) == [[], []]


def test_units_are_the_outermost_modules_of_the_types_and_tied_weights_go_to_the_model() -> None:
    model = _net()
    units, owner = plan_units(model, (_Block,))
    assert [u.name for u in units] == ["", "blocks.0", "blocks.1", "blocks.2"]
    assert owner[id(model.blocks[0].lin.weight)] == 1
    assert owner[id(model.blocks[1].lin.weight)] == 0  # tied with blocks.2
    assert owner[id(model.blocks[2].lin.bias)] == 3
    assert owner[id(model.embed.weight)] == 0
    outer = nn.Sequential(nn.Sequential(_Block(3), _Block(3)), _Block(3))
    units, _ = plan_units(outer, (nn.Sequential, _Block))
    assert [u.name for u in units] == ["", "0", "1"]
    units, owner = plan_units(model, ())
    assert len(units) == 1 and set(owner.values()) == {0}


def test_config_refuses_what_stage_3_alone_takes() -> None:
    with pytest.raises(ValueError, match="stage 3 only"):
        ZeroConfig(stage=2, units=(_Block,))
    with pytest.raises(ValueError, match="stage 3 only"):
        ZeroConfig(stage=1, reshard_after_forward=False)
    with pytest.raises(ValueError, match="prefetch apply at stage 3 only"):
        ZeroConfig(stage=2, prefetch=False)
    with pytest.raises(TypeError, match="nn.Module subclasses"):
        ZeroConfig(stage=3, units=[_Block])
    with pytest.raises(ValueError, match="1, 2 or 3"):
        ZeroConfig(stage=4)
    with pytest.raises(TypeError, match="Int8"):
        ZeroConfig(compression="int8")


def _bad(rank: int, world: int) -> list[str]:
    fails = []
    model = _net()

    def refused(fn, *words, errors=(ValueError, TypeError)) -> None:
        expect_refusal(fails, fn, *words, errors=errors)

    three = ZeroConfig(stage=3)
    refused(lambda: ZeroOptimizer(model.parameters(), torch.optim.SGD, config=three, lr=1),
            f"rank {rank} of {world}", "module=model")
    stray = nn.Parameter(torch.zeros(2, dtype=torch.float64))
    refused(lambda: ZeroOptimizer([stray], torch.optim.SGD, config=three, module=model, lr=1),
            "parameter 0 of group 0", "not a parameter of the module")
    refused(lambda: ZeroOptimizer(_groups(model), torch.optim.SGD, module=model, lr=1,
                                  config=ZeroConfig(stage=3, units=(nn.Conv2d,))),
            "no module of the types", "Conv2d")
    # Ranks that would gather at other times all raise, naming the others.
    refused(lambda: ZeroOptimizer(_groups(model), torch.optim.SGD, module=model, lr=1,
                                  config=ZeroConfig(stage=3, reshard_after_forward=rank == 0)),
            f"ranks [{1 - rank}] lay their parameters out otherwise")
    refused(lambda: ZeroOptimizer(_groups(model), torch.optim.SGD, module=model, lr=1,
                                  config=ZeroConfig(stage=3,
                                                    units=(_Block,) if rank else ())),
            f"ranks [{1 - rank}] lay their parameters out otherwise")
    # A weight in two reentrant checkpointed regions: its gradient arrives twice.
    tied = _net(ckpt="non-reentrant")
    tied.ckpt = "reentrant"
    opt = ZeroOptimizer(_groups(tied), torch.optim.SGD, config=three, module=tied, lr=1)
    refused(lambda: tied(torch.randn(2, 7, dtype=torch.float64)).sum().backward(),
            "arrived twice", "use_reentrant=False", errors=(RuntimeError,))
    # The group still works afterwards: a whole step.
    opt = ZeroOptimizer(_groups(model), torch.optim.SGD, config=three, module=model, lr=0.1)
    model(torch.randn(2, 7, dtype=torch.float64)).sum().backward()
    opt.step()
    if "ZeroOptimizer(stage 3, SGD" not in repr(opt) or "unit 0 (the model)" not in repr(opt):
        fails.append(repr(opt))
    return fails


def test_stage_3_bad_input_is_refused_naming_the_rank_and_the_fix() -> None:
    assert run_ranks(_bad, 2, timeout=60) == [[], []]


def _cuda_train(rank: int, world: int) -> list[str]:
    torch.cuda.set_device(rank % torch.cuda.device_count())
    fails = []
    models = [_net(), _net().cuda()]
    config = ZeroConfig(stage=3, units=(_Block,), bucket_bytes=256)
    opts = [ZeroOptimizer(_groups(m), torch.optim.AdamW, config=config, module=m, lr=0.01)
            for m in models]
    for micro in _data(world):
        for m, opt in zip(models, opts):
            opt.zero_grad()
            dev = next(m.parameters()).device
            for x, y in micro:
                x, y = x.chunk(world)[rank].to(dev), y.chunk(world)[rank].to(dev)
                (F.mse_loss(m(x), y) / MICRO).backward()
            opt.step()
    with opts[0].gathered(), opts[1].gathered():
        for (n, p), q in zip(models[0].named_parameters(), models[1].parameters()):
            if not q.is_cuda or not torch.allclose(p, q.cpu(), rtol=1e-9, atol=1e-11):
                fails.append(f"{n}: {(p - q.cpu()).abs().max()}")
    if opts[1].memory()["params"] != sum(f.shard.numel() * 8 for f in opts[1]._flats):
        fails.append(f"CUDA parameters held after step: {opts[1].memory()}")
    return fails


@pytest.mark.cuda
def test_stage_3_cuda_parameters_train_as_cpu_ones_do() -> None:
    if not torch.cuda.is_available():
        pytest.skip("needs a CUDA GPU")
    assert run_ranks(_cuda_train, 2, timeout=180) == [[], []]

"""ZeRO stages 1 and 2 (torchdist_ext.parallel.ZeroOptimizer): the flat layout and bucket
release order of the C++ core, exhaustively in one process; then training on spawned
ranks against one process training the same model on the whole batch with the plain
optimizer (same parameters and optimizer state within float64 rounding), on tdx and gloo.
"""

from __future__ import annotations

import copy
import random
from typing import Any

import pytest
import torch
import torch.distributed as dist
import torch.nn as nn

from torchdist_ext import _C
from torchdist_ext import compression as tc
from torchdist_ext.parallel import ZeroConfig, ZeroOptimizer
from torchdist_ext.testing import expect_refusal, run_ranks

# ---- the layout, in one process ----------------------------------------------------------


def _check_layout(numels: list[int], world: int, cap: int, align: int) -> None:
    lay = _C._FlatLayout(numels, world, cap, align)
    params, buckets = lay.params, lay.buckets
    assert len(params) == len(numels)
    # Buckets tile the flat buffer and the shard buffer in order, each a multiple of
    # world * align, and together hold every parameter once, in order.
    at = shard_at = 0
    covered = []
    for n, b in enumerate(buckets):
        assert b.offset == at and b.shard_offset == shard_at, (n, numels, world, cap)
        assert b.numel % (world * align) == 0 and b.shard_numel * world == b.numel
        assert b.first_param < b.last_param or (b.first_param == b.last_param == 0 and not numels)
        covered += range(b.first_param, b.last_param)
        used = 0
        for i in range(b.first_param, b.last_param):
            p = params[i]
            assert p.bucket == n and p.numel == numels[i]
            assert p.offset % align == 0 and p.offset >= b.offset + used
            used = p.offset - b.offset + p.numel
        assert used <= b.numel and b.numel - used < world * align + align
        # A bucket goes past the cap only when it holds one parameter.
        if b.last_param - b.first_param > 1:
            assert used <= cap, (numels, cap, used)
        at += b.numel
        shard_at += b.shard_numel
    assert covered == list(range(len(numels)))
    assert lay.numel == at and lay.shard_numel == shard_at
    # Every element of every parameter is owned by exactly one rank.
    assert sum(lay.owned_numel(r) for r in range(world)) == sum(numels)
    # Parameters do not overlap.
    spans = sorted((p.offset, p.offset + p.numel) for p in params if p.numel)
    assert all(a[1] <= b[0] for a, b in zip(spans, spans[1:]))


def test_layouts_tile_shard_and_own_every_element_once() -> None:
    rng = random.Random(3)
    cases = 0
    for world in range(1, 17):
        for align in (1, 2, 4, 8):
            for _ in range(12):
                numels = [rng.choice([0, 1, 2, 7, 31, 64, 97, 1000])
                          for _ in range(rng.randint(0, 9))]
                for cap in (1, 5, 64, 257, 10 ** 6):
                    _check_layout(numels, world, cap, align)
                    cases += 1
    assert cases == 16 * 4 * 12 * 5


def test_bad_layouts_are_refused_naming_the_argument() -> None:
    for args, word in [(([3], 0, 8, 1), "world size"), (([3], 2, 0, 1), "bucket size"),
                       (([3], 2, 8, 0), "alignment"), (([3, -1], 2, 8, 1), "parameter 1")]:
        with pytest.raises(ValueError, match=word):
            _C._FlatLayout(*args)
    with pytest.raises(ValueError, match="rank 3"):
        _C._FlatLayout([3], 3, 8, 1).owned_numel(3)


def test_buckets_are_released_in_order_whatever_order_gradients_arrive_in() -> None:
    rng = random.Random(5)
    for _ in range(200):
        nbuckets = rng.randint(1, 6)
        owner = list(range(nbuckets)) + [rng.randrange(nbuckets) for _ in range(rng.randint(0, 8))]
        rng.shuffle(owner)
        tracker = _C._BucketTracker(owner)
        for _ in range(2):  # the tracker is reusable after finish()
            order = list(range(len(owner)))
            rng.shuffle(order)
            arrive = order[:rng.randint(0, len(order))]
            released = []
            for i in arrive:
                got = tracker.mark(i)
                released += got
                # A bucket is released only once it and every bucket before it are full.
                for b in got:
                    assert all(owner[j] > b or j in arrive[:arrive.index(i) + 1]
                               for j in range(len(owner)) if owner[j] <= b)
            assert released == list(range(len(released)))
            assert tracker.missing() == sorted(set(range(len(owner))) - set(arrive))
            assert tracker.started == bool(arrive)
            assert released + tracker.finish() == list(range(nbuckets))
            assert tracker.missing() == list(range(len(owner))) and not tracker.started


def test_tracker_refuses_a_second_gradient_and_bad_buckets() -> None:
    tracker = _C._BucketTracker([0, 1])
    tracker.mark(0)
    with pytest.raises(RuntimeError, match="second gradient"):
        tracker.mark(0)
    with pytest.raises(IndexError, match="parameter 5"):
        tracker.mark(5)
    with pytest.raises(ValueError, match="bucket 1 holds no parameter"):
        _C._BucketTracker([0, 2])
    with pytest.raises(ValueError, match="negative"):
        _C._BucketTracker([-1])


def test_config_refuses_what_it_cannot_do() -> None:
    with pytest.raises(ValueError, match="stage must be 1, 2 or 3"):
        ZeroConfig(stage=0)
    with pytest.raises(ValueError, match="bucket_bytes"):
        ZeroConfig(bucket_bytes=0)


# ---- training against one process --------------------------------------------------------


class _Net(nn.Module):
    """Weights and biases in two optimizer groups, a frozen layer, a parameter the loss
    never reaches, and sizes that divide by no world size."""

    def __init__(self) -> None:
        super().__init__()
        self.a = nn.Linear(7, 13)
        self.frozen = nn.Linear(13, 13)
        self.frozen.requires_grad_(False)
        self.b = nn.Linear(13, 5)
        self.unused = nn.Parameter(torch.randn(3))
        self.scale = nn.Parameter(torch.tensor(1.5))  # 0-dim

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.b(torch.tanh(self.frozen(torch.tanh(self.a(x))))) * self.scale


def _net(seed: int = 0) -> _Net:
    torch.manual_seed(seed)
    return _Net().double()


def _groups(model: _Net) -> list[dict]:
    decay = [p for n, p in model.named_parameters() if n.endswith("weight") or n == "scale"]
    rest = [p for n, p in model.named_parameters() if not (n.endswith("weight") or n == "scale")]
    return [{"params": decay, "weight_decay": 0.01}, {"params": rest, "weight_decay": 0.0}]


_OPTIMIZERS = {
    "adamw": (torch.optim.AdamW, {"lr": 0.01}),
    "sgd": (torch.optim.SGD, {"lr": 0.05, "momentum": 0.9}),
}
STEPS, MICRO = 4, 2


def _data(world: int) -> list[list[tuple[torch.Tensor, torch.Tensor]]]:
    g = torch.Generator().manual_seed(11)
    return [[(torch.randn(3 * world, 7, generator=g, dtype=torch.float64),
              torch.randn(3 * world, 5, generator=g, dtype=torch.float64))
             for _ in range(MICRO)] for _ in range(STEPS)]


def _reference(world: int, opt_name: str, clip: float | None) -> dict:
    """One process, the whole batch, the plain optimizer and a StepLR schedule."""
    model = _net()
    cls, kw = _OPTIMIZERS[opt_name]
    opt = cls(_groups(model), **kw)
    sched = torch.optim.lr_scheduler.StepLR(opt, step_size=2, gamma=0.5)
    losses = []
    for micro in _data(world):
        opt.zero_grad()
        for x, y in micro:
            loss = nn.functional.mse_loss(model(x), y) / MICRO
            loss.backward()
            losses.append(loss.item())
        # ZeroOptimizer steps every trainable parameter: one no rank's loss reached has a
        # zero gradient, where torch's optimizers would skip it.
        for p in model.parameters():
            if p.requires_grad and p.grad is None:
                p.grad = torch.zeros_like(p)
        if clip is not None:
            nn.utils.clip_grad_norm_(model.parameters(), clip)
        opt.step()
        sched.step()
    return {"params": {n: p.detach().clone() for n, p in model.named_parameters()},
            "state": opt.state_dict(), "losses": losses}


def _zero_train(rank: int, world: int, stage: int, opt_name: str, clip: float | None,
                bucket_bytes: int, gloo: bool, compression: Any = None) -> dict:
    group = dist.new_group(backend="gloo") if gloo else None
    # Every rank starts from other values: the broadcast from rank 0 must make them equal.
    model = _net(seed=rank)
    cls, kw = _OPTIMIZERS[opt_name]
    opt = ZeroOptimizer(_groups(model), cls, group=group,
                        config=ZeroConfig(stage=stage, bucket_bytes=bucket_bytes,
                                          compression=compression), **kw)
    sched = torch.optim.lr_scheduler.StepLR(opt, step_size=2, gamma=0.5)
    losses = []
    norms = []
    for micro in _data(world):
        opt.zero_grad()
        for x, y in micro:
            x, y = x.chunk(world)[rank], y.chunk(world)[rank]
            loss = nn.functional.mse_loss(model(x), y) / MICRO
            loss.backward()
            losses.append(loss.item())
            if stage == 2:  # gradients leave with their bucket
                assert all(p.grad is None for p in model.parameters()), "stage 2 kept a grad"
        if clip is not None:
            norms.append(float(opt.clip_grad_norm_(clip)))
        opt.step()
        sched.step()
    inner_numel = sum(s.numel() for st in opt._inner.state.values()
                      for s in st.values() if isinstance(s, torch.Tensor) and s.dim())
    # Plain lists: tensors sent back from a rank would outlive the process that shares them.
    state = opt.consolidated_state_dict()
    state["state"] = {i: {k: torch.as_tensor(v).tolist() for k, v in st.items()}
                      for i, st in state["state"].items()}
    return {"params": {n: p.detach().tolist() for n, p in model.named_parameters()},
            "state": state, "losses": losses, "norms": norms,
            "inner_numel": inner_numel,
            "owned": sum(f.layout.owned_numel(rank) for f in opt._flats),
            "feedback": None if opt._feedback is None else len(opt._feedback),
            "buckets": len(opt._order),
            "trainable": sum(p.numel() for p in model.parameters() if p.requires_grad)}


def _compare(got: list[dict], ref: dict, world: int) -> None:
    for rank, r in enumerate(got):
        for name, want in ref["params"].items():
            mine = torch.tensor(r["params"][name], dtype=torch.float64)
            assert torch.allclose(mine, want, rtol=1e-10, atol=1e-12), \
                (rank, name, (mine - want).abs().max())
            assert r["params"][name] == got[0]["params"][name], (rank, name)
        assert r["state"]["param_groups"] == ref["state"]["param_groups"]
        assert sorted(r["state"]["state"]) == sorted(ref["state"]["state"])
        for i, st in ref["state"]["state"].items():
            for k, v in st.items():
                mine = r["state"]["state"][i][k]
                assert torch.allclose(torch.as_tensor(mine, dtype=torch.float64),
                                      torch.as_tensor(v, dtype=torch.float64),
                                      rtol=1e-9, atol=1e-12), (rank, i, k)
    per_step = [sum(r["losses"][s] for r in got) / world for s in range(STEPS * MICRO)]
    assert per_step == pytest.approx(ref["losses"], rel=1e-10)


@pytest.mark.parametrize("world", [1, 2, 3, 4, 5])
@pytest.mark.parametrize("stage", [1, 2])
def test_zero_trains_as_one_process_does(world: int, stage: int) -> None:
    """AdamW with a StepLR schedule, two micro-batches per step, 4 steps: the parameters,
    every rank's, and the consolidated optimizer state equal one process's within float64
    rounding; the buckets are small, so each step runs several."""
    ref = _reference(world, "adamw", None)
    got = run_ranks(_zero_train, world, timeout=120,
                    args=(stage, "adamw", None, 256, False))
    _compare(got, ref, world)
    for rank, r in enumerate(got):
        # The state each rank keeps is its share: two tensors (exp_avg, exp_avg_sq) per
        # element it owns, padding included, about 1/world of the whole.
        assert r["inner_numel"] >= 2 * r["owned"]
        assert r["inner_numel"] <= 2 * (r["trainable"] // world + 64), (rank, r)


@pytest.mark.parametrize("stage", [1, 2])
def test_sgd_with_clipping_on_a_gloo_group(stage: int) -> None:
    """SGD with momentum, the gradient clipped to a norm it exceeds, reduced over a gloo
    group: ZeroOptimizer runs on any backend, and clips by the norm of the whole gradient."""
    world = 3
    ref = _reference(world, "sgd", 0.05)
    got = run_ranks(_zero_train, world, timeout=120, args=(stage, "sgd", 0.05, 64, True))
    _compare(got, ref, world)
    assert got[0]["norms"][0] > 0.05  # the clip did something
    assert all(r["norms"] == got[0]["norms"] for r in got)


@pytest.mark.parametrize("stage", [1, 2])
def test_compressed_gradients_train_as_one_process_does(stage: int) -> None:
    """TopK(1.0) sends every element: the compressed reduce_scatter is then exact, and
    training equals one process's within float64 rounding. Int8 comes close, with one
    error-feedback residual per bucket."""
    world = 3
    ref = _reference(world, "adamw", None)
    got = run_ranks(_zero_train, world, timeout=120,
                    args=(stage, "adamw", None, 256, False, tc.TopK(1.0)))
    _compare(got, ref, world)
    got = run_ranks(_zero_train, world, timeout=120,
                    args=(stage, "adamw", None, 256, False, tc.Int8(block=16)))
    for r in got:
        assert r["feedback"] == r["buckets"] > 1
        for name, want in ref["params"].items():
            mine = torch.tensor(r["params"][name], dtype=torch.float64)
            assert torch.allclose(mine, want, rtol=0.02, atol=0.02), (name, mine - want)


def _resume(rank: int, world: int) -> list[str]:
    """A consolidated state saved at 3 ranks, loaded by ranks of a group of 2 (and by a
    plain optimizer): training goes on as it would have."""
    fails = []
    model = _net()
    opt = ZeroOptimizer(_groups(model), torch.optim.AdamW, lr=0.01)
    data = _data(world)
    for micro in data[:2]:
        opt.zero_grad()
        for x, y in micro:
            nn.functional.mse_loss(model(x.chunk(world)[rank]), y.chunk(world)[rank]).backward()
        opt.step()
    full = opt.consolidated_state_dict()
    params = {n: p.detach().clone() for n, p in model.named_parameters()}

    # The same training in one process, continued for two more steps from the saved state.
    plain_model = _net()
    plain_model.load_state_dict(model.state_dict())
    plain = torch.optim.AdamW(_groups(plain_model), lr=0.01)
    plain.load_state_dict(copy.deepcopy(full))  # torch keeps the tensors it is given
    for micro in data[2:]:
        plain.zero_grad()
        for x, y in micro:
            nn.functional.mse_loss(plain_model(x[:3 * 2]), y[:3 * 2]).backward()
        plain.step()

    # Ranks 0 and 1 as a group of 2 take up the consolidated state.
    sub = dist.new_group([0, 1])
    if rank < 2:
        m2 = _net(seed=5)
        with torch.no_grad():
            for n, p in m2.named_parameters():
                p.copy_(params[n])
        opt2 = ZeroOptimizer(_groups(m2), torch.optim.AdamW, group=sub, lr=0.5)
        opt2.load_consolidated_state_dict(full)
        if opt2.param_groups[0]["lr"] != 0.01:
            fails.append(f"lr {opt2.param_groups[0]['lr']}")
        for micro in data[2:]:
            opt2.zero_grad()
            for x, y in micro:
                x, y = x[:3 * 2].chunk(2)[rank], y[:3 * 2].chunk(2)[rank]
                nn.functional.mse_loss(m2(x), y).backward()
            opt2.step()
        for n, p in m2.named_parameters():
            want = dict(plain_model.named_parameters())[n]
            if not torch.allclose(p, want, rtol=1e-10, atol=1e-12):
                fails.append(f"{n}: {(p - want).abs().max()}")
        # A shard's own state_dict reloads at the same place and is refused elsewhere.
        opt2.load_state_dict(opt2.state_dict())
    mine = opt.state_dict()
    if rank == 1:
        mine["zero"]["rank"] = 0
        try:
            opt.load_state_dict(mine)
            fails.append("a shard saved by rank 0 loaded at rank 1")
        except ValueError as e:
            if "consolidated_state_dict" not in str(e):
                fails.append(str(e))
    return fails


def test_consolidated_state_moves_between_world_sizes_and_plain_optimizers() -> None:
    assert run_ranks(_resume, 3, timeout=120) == [[], [], []]


def _no_zero_grad(rank: int, world: int) -> list[str]:
    """Steps with no zero_grad between them see the gradients summed since the last one,
    as with torch's optimizers, at both stages."""
    fails = []
    data = _data(world)
    plain_model = _net()
    plain = torch.optim.SGD(_groups(plain_model), lr=0.05, momentum=0.9)
    for micro in data[:3]:
        for x, y in micro[:1]:
            nn.functional.mse_loss(plain_model(x), y).backward()
        plain.step()
    for stage in (1, 2):
        model = _net()
        opt = ZeroOptimizer(_groups(model), torch.optim.SGD, lr=0.05, momentum=0.9,
                            config=ZeroConfig(stage=stage))
        for micro in data[:3]:
            for x, y in micro[:1]:
                nn.functional.mse_loss(model(x.chunk(world)[rank]),
                                       y.chunk(world)[rank]).backward()
            opt.step()
        for (n, p), q in zip(model.named_parameters(), plain_model.parameters()):
            if n != "unused" and not torch.allclose(p, q, rtol=1e-10, atol=1e-12):
                fails.append(f"stage {stage} {n}: {(p - q).abs().max()}")
        try:
            opt.add_param_group({"params": [nn.Parameter(torch.zeros(2))]})
            fails.append("add_param_group accepted")
        except NotImplementedError as e:
            if f"rank {rank} of {world}" not in str(e) or "new ZeroOptimizer" not in str(e):
                fails.append(str(e))
    return fails


def test_steps_without_zero_grad_between_them_accumulate_as_torch_does() -> None:
    assert run_ranks(_no_zero_grad, 2, timeout=60) == [[], []]


def _checkpointed(rank: int, world: int) -> list[str]:
    """Activation checkpointing, reentrant or not, of the first or the last layers: the
    stage 2 gradients equal one process's without checkpointing."""
    from torch.utils.checkpoint import checkpoint

    fails = []
    x, y = _data(world)[0][0]
    for reentrant in (False, True):
        for cut in ("first", "last"):
            model, ref = _net(), _net()
            opt = ZeroOptimizer(_groups(model), torch.optim.SGD, lr=0.1,
                                config=ZeroConfig(stage=2, bucket_bytes=64))
            plain = torch.optim.SGD(_groups(ref), lr=0.1)

            def forward(m: _Net, inp: torch.Tensor) -> torch.Tensor:
                def head(t: torch.Tensor) -> torch.Tensor:
                    return torch.tanh(m.frozen(torch.tanh(m.a(t))))

                def tail(t: torch.Tensor) -> torch.Tensor:
                    return m.b(t) * m.scale

                if cut == "first":
                    return tail(checkpoint(head, inp.requires_grad_(reentrant),
                                           use_reentrant=reentrant))
                return checkpoint(tail, head(inp), use_reentrant=reentrant)

            xr, yr = x.chunk(world)[rank].clone(), y.chunk(world)[rank]
            nn.functional.mse_loss(forward(model, xr), yr).backward()
            opt.step()
            nn.functional.mse_loss(ref(x), y).backward()
            for p in ref.parameters():
                if p.requires_grad and p.grad is None:
                    p.grad = torch.zeros_like(p)
            plain.step()
            for (n, p), q in zip(model.named_parameters(), ref.parameters()):
                if not torch.allclose(p, q, rtol=1e-10, atol=1e-12):
                    fails.append(f"reentrant={reentrant} {cut} {n}: {(p - q).abs().max()}")
    return fails


def test_stage_2_with_activation_checkpointing() -> None:
    assert run_ranks(_checkpointed, 2, timeout=60) == [[], []]


def _bad(rank: int, world: int) -> list[str]:
    fails = []
    model = _net()

    def refused(fn, *words) -> None:
        expect_refusal(fails, fn, *words)

    refused(lambda: ZeroOptimizer(model.parameters(), torch.optim.SGD(model.parameters(), lr=1)),
            "optimizer_class", "torch.optim.AdamW")
    refused(lambda: ZeroOptimizer(model.parameters(), torch.optim.SGD, config={"stage": 1}, lr=1),
            "ZeroConfig")
    p = next(model.parameters())
    refused(lambda: ZeroOptimizer([p, p], torch.optim.SGD, lr=1), f"rank {rank} of {world}",
            "appears twice")
    refused(lambda: ZeroOptimizer([nn.Parameter(torch.zeros(2, dtype=torch.complex64))],
                                  torch.optim.SGD, lr=1), "complex", "view_as_real")
    # Ranks that lay out other parameters, or run another stage, all raise, naming the
    # others, before any bucket is reduced.
    extra = [nn.Parameter(torch.zeros(3 + rank, dtype=torch.float64))]
    refused(lambda: ZeroOptimizer(list(model.parameters()) + extra, torch.optim.SGD, lr=1),
            f"ranks [{1 - rank}] lay their parameters out otherwise", "same ZeroConfig")
    refused(lambda: ZeroOptimizer(model.parameters(), torch.optim.SGD,
                                  config=ZeroConfig(stage=1 + rank), lr=1),
            f"ranks [{1 - rank}] lay their parameters out otherwise", f"stage {1 + rank}")
    # The group still works afterwards: a whole step.
    opt = ZeroOptimizer(model.parameters(), torch.optim.SGD, lr=0.1)
    model(torch.randn(2, 7, dtype=torch.float64)).sum().backward()
    opt.step()
    if "ZeroOptimizer(stage 2, SGD" not in repr(opt):
        fails.append(repr(opt))
    return fails


def test_bad_input_is_refused_naming_the_rank_and_the_fix() -> None:
    assert run_ranks(_bad, 2, timeout=60) == [[], []]


def test_zero_needs_an_initialized_group() -> None:
    with pytest.raises(RuntimeError, match="init_process_group"):
        ZeroOptimizer(_net().parameters(), torch.optim.SGD, lr=1)


# ---- CUDA ----------------------------------------------------------------------------


def _cuda_train(rank: int, world: int, stage: int) -> list[str]:
    torch.cuda.set_device(rank % torch.cuda.device_count())
    fails = []
    cpu_model, gpu_model = _net(), _net().cuda()
    opts = [ZeroOptimizer(_groups(m), torch.optim.AdamW, config=ZeroConfig(stage=stage),
                          lr=0.01) for m in (cpu_model, gpu_model)]
    for micro in _data(world):
        for m, opt in zip((cpu_model, gpu_model), opts):
            opt.zero_grad()
            for x, y in micro:
                x, y = x.chunk(world)[rank], y.chunk(world)[rank]
                dev = next(m.parameters()).device
                (nn.functional.mse_loss(m(x.to(dev)), y.to(dev)) / MICRO).backward()
            opt.step()
    for (n, p), q in zip(cpu_model.named_parameters(), gpu_model.parameters()):
        if not q.is_cuda or not torch.allclose(p, q.cpu(), rtol=1e-9, atol=1e-11):
            fails.append(f"{n}: {(p - q.cpu()).abs().max()}")
    return fails


@pytest.mark.cuda
@pytest.mark.parametrize("stage", [1, 2])
def test_cuda_parameters_train_as_cpu_ones_do(stage: int) -> None:
    if not torch.cuda.is_available():
        pytest.skip("needs a CUDA GPU")
    assert run_ranks(_cuda_train, 2, timeout=180, args=(stage,)) == [[], []]


# ---- the example -----------------------------------------------------------------------


@pytest.mark.parametrize("stage,dtype", [(1, "float32"), (2, "float32"), (3, "float32"),
                                         (3, "bfloat16")])
def test_the_zero_example_trains_under_torchrun(stage: int, dtype: str) -> None:
    """examples/zero.py under torchrun (standalone, 2 ranks): exit 0, half the parameters'
    state per rank, and a test accuracy above 95% after two epochs (in bfloat16 too)."""
    import os
    import re
    import subprocess
    import sys
    from pathlib import Path

    example = Path(__file__).resolve().parents[1] / "examples" / "zero.py"
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone",
           "--nproc-per-node", "2", str(example), "--stage", str(stage), "--epochs", "2",
           "--param-dtype", dtype]
    done = subprocess.run(cmd, capture_output=True, text=True, timeout=150,
                          env=dict(os.environ, OMP_NUM_THREADS="1"))
    out = done.stdout + done.stderr
    assert done.returncode == 0, out[-4000:]
    m = re.search(r"ZeRO stage (\d) on 2 ranks.*parameters in (\w+), .* (\d+) parameters, "
                  r"Adam state for (\d+) of them per rank", out)
    assert m and int(m.group(1)) == stage and m.group(2) == dtype, out[-4000:]
    assert int(m.group(3)) // 2 <= int(m.group(4)) <= int(m.group(3)) // 2 + 64
    accuracy = [float(a) for a in re.findall(r"test accuracy\s+([\d.]+)%", out)]
    assert len(accuracy) == 2 and accuracy[-1] > 95.0, out[-4000:]

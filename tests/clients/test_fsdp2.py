"""FSDP2 (torch.distributed.fsdp.fully_shard), unmodified, on tdx: a float64 model sharded
over a 1-D CPU DeviceMesh of 4 ranks, with reshard_after_forward True and False, trained
with gradient accumulation (set_requires_gradient_sync) and Adam. init_device_mesh uses the
default group's backend, so the same function runs once on tdx and once on gloo; the
final full parameters must agree within 1e-5, must match single-process training on the
whole batch, and must have moved. With a MixedPrecisionPolicy (float32 or bfloat16
parameters gathered over the float64 shards, gradients reduce-scattered in float32) the
same holds within the lower precision's rounding.
"""

from __future__ import annotations

import io

import pytest
import torch
import torch.nn as nn
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard

from torchdist_ext.testing import run_ranks

from . import compare_training

WORLD = 4
STEPS = 4
MICRO = 2   # micro-batches per step; only the last one reduce-scatters
BATCH = 3   # samples per micro-batch per rank
TOL = 1e-5


def _model() -> nn.Sequential:
    # Odd sizes: the dim-0 shards are uneven over 4 ranks and FSDP2 pads them.
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(5, 13), nn.Tanh(), nn.Linear(13, 7), nn.Tanh(),
                         nn.Linear(7, 3)).double()


def _data(world: int) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(5)
    x = torch.randn(STEPS, MICRO, world * BATCH, 5, generator=g, dtype=torch.float64)
    y = torch.randint(0, 3, (STEPS, MICRO, world * BATCH), generator=g)
    return x, y


def _fsdp(rank: int, world: int, low: str = "") -> bytes:
    mesh = init_device_mesh("cpu", (world,))
    x, y = _data(world)
    mine = slice(rank * BATCH, (rank + 1) * BATCH)
    out = {}
    policy = MixedPrecisionPolicy(param_dtype=getattr(torch, low),
                                  reduce_dtype=torch.float32) if low else MixedPrecisionPolicy()
    for reshard in (True, False):
        model = _model()  # the same on every rank: FSDP2 shards it without a broadcast
        for layer in model:
            if isinstance(layer, nn.Linear):
                fully_shard(layer, mesh=mesh, reshard_after_forward=reshard, mp_policy=policy)
        fully_shard(model, mesh=mesh, reshard_after_forward=reshard, mp_policy=policy)
        opt = torch.optim.Adam(model.parameters(), lr=0.01)
        losses = []
        for s in range(STEPS):
            opt.zero_grad()
            for m in range(MICRO):
                model.set_requires_gradient_sync(m == MICRO - 1)
                loss = nn.functional.cross_entropy(model(x[s, m, mine]), y[s, m, mine]) / MICRO
                loss.backward()
                losses.append(loss.item())
            opt.step()
        out[reshard] = ({n: p.full_tensor() for n, p in model.named_parameters()}, losses)
    buf = io.BytesIO()  # tensors go back serialised: queued shared memory dies with the rank
    torch.save(out, buf)
    return buf.getvalue()


def _single_process(world: int) -> dict[str, torch.Tensor]:
    """What FSDP must reproduce: one process, the whole batch of every micro-batch."""
    x, y = _data(world)
    model = _model()
    opt = torch.optim.Adam(model.parameters(), lr=0.01)
    for s in range(STEPS):
        opt.zero_grad()
        for m in range(MICRO):
            (nn.functional.cross_entropy(model(x[s, m]), y[s, m]) / MICRO).backward()
        opt.step()
    return {n: p.detach() for n, p in model.named_parameters()}


@pytest.mark.parametrize("low,tol", [("", TOL), ("float32", 1e-6), ("bfloat16", 5e-3)])
def test_fsdp2_matches_gloo(low: str, tol: float) -> None:
    ours = [torch.load(io.BytesIO(b))
            for b in run_ranks(_fsdp, WORLD, backend="tdx", args=(low,))]
    gloo = [torch.load(io.BytesIO(b))
            for b in run_ranks(_fsdp, WORLD, backend="gloo", args=(low,))]
    reference = _single_process(WORLD)
    init = {n: p.detach() for n, p in _model().named_parameters()}
    fails = []
    for reshard in (True, False):
        for rank in range(WORLD):
            (a, a_losses), (b, b_losses) = ours[rank][reshard], gloo[rank][reshard]
            fails += compare_training(f"reshard_after_forward={reshard}, rank {rank}", a, b,
                                      reference, init, a_losses, b_losses, tol)
    assert not fails, "\n".join(fails)

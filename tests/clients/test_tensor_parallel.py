"""DTensor tensor parallelism, unmodified, on tdx: 4 ranks as a 2 x 2 (dp, tp) CPU
DeviceMesh. parallelize_module splits a float64 MLP's wide pair of layers over tp
(ColwiseParallel then RowwiseParallel), and FSDP2 (fully_shard on the dp dimension)
shards it and averages gradients over dp, the 2-D recipe of the PyTorch docs.
init_device_mesh uses the default group's backend, so the same function runs once on tdx
and once on gloo. The final full parameters (full_tensor over both dimensions) must agree
with gloo within 1e-5, must match single-process training on the whole batch, and must
have moved; the layers must really be split over tp.
"""

from __future__ import annotations

import io

import torch
import torch.nn as nn
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.fsdp import fully_shard
from torch.distributed.tensor import DTensor, Shard
from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel, parallelize_module

from torchdist_ext.testing import run_ranks

from . import compare_training

DP, TP = 2, 2
STEPS = 4
BATCH = 4   # per dp rank
TOL = 1e-5


class MLP(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.inp = nn.Linear(5, 8)
        self.up = nn.Linear(8, 32)     # split column-wise over tp
        self.down = nn.Linear(32, 8)   # split row-wise over tp
        self.out = nn.Linear(8, 3)
        self.double()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = torch.tanh(self.inp(x))
        h = h + self.down(torch.tanh(self.up(h)))
        return self.out(h)


def _data() -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(9)
    x = torch.randn(STEPS, DP * BATCH, 5, generator=g, dtype=torch.float64)
    y = torch.randint(0, 3, (STEPS, DP * BATCH), generator=g)
    return x, y


def _tp(rank: int, world: int) -> bytes:
    mesh = init_device_mesh("cpu", (DP, TP), mesh_dim_names=("dp", "tp"))
    dp_rank = mesh["dp"].get_local_rank()
    model = MLP()
    parallelize_module(model, mesh["tp"], {"up": ColwiseParallel(), "down": RowwiseParallel()})
    layout = {
        "up.weight": tuple(model.up.weight.placements),
        "down.weight": tuple(model.down.weight.placements),
        "up.local": tuple(model.up.weight.to_local().shape),
    }
    fully_shard(model, mesh=mesh["dp"])
    opt = torch.optim.Adam(model.parameters(), lr=0.01)
    x, y = _data()
    mine = slice(dp_rank * BATCH, (dp_rank + 1) * BATCH)  # the tp ranks of a dp group share it
    losses = []
    for s in range(STEPS):
        opt.zero_grad()
        loss = nn.functional.cross_entropy(model(x[s, mine]), y[s, mine])
        loss.backward()
        opt.step()
        losses.append(loss.item())
    params = {n: p.full_tensor() if isinstance(p, DTensor) else p.detach().clone()
              for n, p in model.named_parameters()}
    buf = io.BytesIO()  # tensors go back serialised: queued shared memory dies with the rank
    torch.save((params, losses, layout), buf)
    return buf.getvalue()


def _single_process() -> dict[str, torch.Tensor]:
    x, y = _data()
    model = MLP()
    opt = torch.optim.Adam(model.parameters(), lr=0.01)
    for s in range(STEPS):
        opt.zero_grad()
        nn.functional.cross_entropy(model(x[s]), y[s]).backward()
        opt.step()
    return {n: p.detach() for n, p in model.named_parameters()}


def test_tensor_parallel_2d_matches_gloo() -> None:
    ours = [torch.load(io.BytesIO(b)) for b in run_ranks(_tp, DP * TP, backend="tdx")]
    gloo = [torch.load(io.BytesIO(b)) for b in run_ranks(_tp, DP * TP, backend="gloo")]
    reference = _single_process()
    init = {n: p.detach() for n, p in MLP().named_parameters()}
    fails = []
    for rank in range(DP * TP):
        (a, a_losses, layout), (b, b_losses, _) = ours[rank], gloo[rank]
        assert layout == {"up.weight": (Shard(0),), "down.weight": (Shard(1),), "up.local": (16, 8)}
        fails += compare_training(f"rank {rank}", a, b, reference, init, a_losses, b_losses,
                                  TOL)
    assert not fails, "\n".join(fails)

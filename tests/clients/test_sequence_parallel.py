"""Sequence parallelism and hybrid-sharded data parallelism, unmodified, on tdx: 4 ranks.

- Tensor and sequence parallel on a 2 x 2 (dp, tp) CPU DeviceMesh: a float64 transformer-
  style block whose LayerNorms run on sequence shards (SequenceParallel), whose MLP is
  split over tp (ColwiseParallel taking sequence shards, RowwiseParallel giving them
  back), and whose head gathers the whole output; FSDP2 shards it over dp. Each tp rank
  feeds its shard of the sequence.
- HSDP: FSDP2's fully_shard on a 2-D (replicate, shard) mesh, which shards parameters
  within each pair of ranks and replicates them across the pairs.

init_device_mesh uses the default group's backend, so the same function runs once on
tdx and once on gloo. The final full parameters must agree with gloo within 1e-5, match
single-process training on the whole batch, and have moved.
"""

from __future__ import annotations

import io

import torch
import torch.nn as nn
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.fsdp import fully_shard
from torch.distributed.tensor import DTensor, Replicate, Shard
from torch.distributed.tensor.parallel import (
    ColwiseParallel, RowwiseParallel, SequenceParallel, parallelize_module,
)

from torchdist_ext.testing import run_ranks

from . import compare_training

DP, TP = 2, 2
STEPS = 3
BATCH = 2   # sequences per dp rank
SEQ = 6     # tokens per sequence, split over tp
TOL = 1e-5


class Block(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.norm1 = nn.LayerNorm(8)
        self.up = nn.Linear(8, 32)
        self.down = nn.Linear(32, 8)
        self.norm2 = nn.LayerNorm(8)
        self.head = nn.Linear(8, 4)
        with torch.no_grad():  # LayerNorm starts at ones and zeros: make them matter
            for norm in (self.norm1, self.norm2):
                norm.weight.uniform_(0.5, 1.5)
                norm.bias.uniform_(-0.2, 0.2)
        self.double()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = x + self.down(torch.tanh(self.up(self.norm1(x))))
        return self.head(self.norm2(h))


def _data() -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(13)
    x = torch.randn(STEPS, DP * BATCH, SEQ, 8, generator=g, dtype=torch.float64)
    y = torch.randn(STEPS, DP * BATCH, SEQ, 4, generator=g, dtype=torch.float64)
    return x, y


def _full(model: nn.Module) -> dict[str, torch.Tensor]:
    return {n: p.full_tensor() if isinstance(p, DTensor) else p.detach().clone()
            for n, p in model.named_parameters()}


def _pack(value) -> bytes:
    buf = io.BytesIO()  # tensors go back serialised: queued shared memory dies with the rank
    torch.save(value, buf)
    return buf.getvalue()


def _sequence_parallel(rank: int, world: int) -> bytes:
    mesh = init_device_mesh("cpu", (DP, TP), mesh_dim_names=("dp", "tp"))
    dp_rank, tp_rank = mesh["dp"].get_local_rank(), mesh["tp"].get_local_rank()
    model = Block()
    parallelize_module(model, mesh["tp"], {
        "norm1": SequenceParallel(),
        "up": ColwiseParallel(input_layouts=Shard(1)),
        "down": RowwiseParallel(output_layouts=Shard(1)),
        "norm2": SequenceParallel(),
        "head": ColwiseParallel(input_layouts=Shard(1), output_layouts=Replicate()),
    })
    layout = (tuple(model.norm1.weight.placements), tuple(model.up.weight.placements),
              tuple(model.down.weight.to_local().shape))
    fully_shard(model, mesh=mesh["dp"])
    opt = torch.optim.Adam(model.parameters(), lr=0.01)
    x, y = _data()
    rows = slice(dp_rank * BATCH, (dp_rank + 1) * BATCH)
    tokens = slice(tp_rank * SEQ // TP, (tp_rank + 1) * SEQ // TP)
    losses = []
    for s in range(STEPS):
        opt.zero_grad()
        out = model(x[s, rows, tokens])  # this rank's shard of the sequence
        loss = nn.functional.mse_loss(out, y[s, rows])
        loss.backward()
        opt.step()
        losses.append(loss.item())
    return _pack((_full(model), losses, layout))


def _hsdp(rank: int, world: int) -> bytes:
    mesh = init_device_mesh("cpu", (2, 2), mesh_dim_names=("replicate", "shard"))
    model = Block()
    for name in ("up", "down"):
        fully_shard(getattr(model, name), mesh=mesh)
    fully_shard(model, mesh=mesh)
    opt = torch.optim.Adam(model.parameters(), lr=0.01)
    x, y = _data()
    per = DP * BATCH // world  # every rank a different part of the batch
    mine = slice(rank * per, (rank + 1) * per)
    losses = []
    for s in range(STEPS):
        opt.zero_grad()
        loss = nn.functional.mse_loss(model(x[s, mine]), y[s, mine])
        loss.backward()
        opt.step()
        losses.append(loss.item())
    placements = tuple(model.up.weight.placements)
    return _pack((_full(model), losses, placements))


def _single_process() -> dict[str, torch.Tensor]:
    x, y = _data()
    model = Block()
    opt = torch.optim.Adam(model.parameters(), lr=0.01)
    for s in range(STEPS):
        opt.zero_grad()
        nn.functional.mse_loss(model(x[s]), y[s]).backward()
        opt.step()
    return {n: p.detach() for n, p in model.named_parameters()}


def _compare(fn, check_layout) -> None:
    ours = [torch.load(io.BytesIO(b)) for b in run_ranks(fn, DP * TP, backend="tdx")]
    gloo = [torch.load(io.BytesIO(b)) for b in run_ranks(fn, DP * TP, backend="gloo")]
    reference = _single_process()
    init = {n: p.detach() for n, p in Block().named_parameters()}
    fails = []
    for rank in range(DP * TP):
        (a, a_losses, layout), (b, b_losses, _) = ours[rank], gloo[rank]
        check_layout(layout)
        fails += compare_training(f"rank {rank}", a, b, reference, init, a_losses, b_losses,
                                  TOL)
    assert not fails, "\n".join(fails)


def test_sequence_parallel_with_fsdp_matches_gloo_and_one_process() -> None:
    def layout(got) -> None:
        norm, up, down_local = got
        assert norm == (Replicate(),) and up == (Shard(0),) and down_local == (8, 16), got

    _compare(_sequence_parallel, layout)


def test_hsdp_on_a_2d_mesh_matches_gloo_and_one_process() -> None:
    def layout(got) -> None:
        assert got == (Replicate(), Shard(0)), got

    _compare(_hsdp, layout)

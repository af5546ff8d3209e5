"""torch DDP, unmodified, on tdx: the same training on a gloo group in the same processes
must end with the same parameters, and both must match single-process training."""

from __future__ import annotations

import torch
import torch.distributed as dist
import torch.nn as nn
from torch.nn.parallel import DistributedDataParallel as DDP

from torchdist_ext.testing import new_gloo_group, run_ranks

STEPS = 6
BATCH = 8  # per rank


def _model() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(5, 16), nn.Tanh(), nn.Linear(16, 3)).double()


def _data(world: int) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(7)
    x = torch.randn(STEPS, world * BATCH, 5, generator=g, dtype=torch.float64)
    y = torch.randint(0, 3, (STEPS, world * BATCH), generator=g)
    return x, y


def _train(model: nn.Module, x: torch.Tensor, y: torch.Tensor, rank: int, world: int,
           hook: bool = False) -> list[torch.Tensor]:
    opt = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    if hook:
        # A comm hook that awaits the bucket's future: DDP's hooks depend on get_future().
        def allreduce_hook(state, bucket):
            t = bucket.buffer().div_(world)
            fut = dist.all_reduce(t, group=state, async_op=True).get_future()
            return fut.then(lambda f: f.value()[0])

        model.register_comm_hook(model.process_group, allreduce_hook)
    for s in range(STEPS):
        mine = slice(rank * BATCH, (rank + 1) * BATCH)
        opt.zero_grad()
        nn.functional.cross_entropy(model(x[s, mine]), y[s, mine]).backward()
        opt.step()
    return [p.detach().clone() for p in model.parameters()]


def _ddp_vs_gloo(rank: int, world: int) -> list[str]:
    gloo = new_gloo_group()
    x, y = _data(world)
    ours = _train(DDP(_model(), bucket_cap_mb=0.0001), x, y, rank, world)
    hooked = _train(DDP(_model()), x, y, rank, world, hook=True)
    theirs = _train(DDP(_model(), process_group=gloo, bucket_cap_mb=0.0001), x, y, rank, world)
    # Single process on the whole batch: what data parallelism must reproduce.
    single = _model()
    opt = torch.optim.SGD(single.parameters(), lr=0.1, momentum=0.9)
    for s in range(STEPS):
        opt.zero_grad()
        nn.functional.cross_entropy(single(x[s]), y[s]).backward()
        opt.step()
    fails = []
    for i, (a, h, b, c) in enumerate(zip(ours, hooked, theirs, single.parameters())):
        if (a - b).abs().max() > 1e-6:
            fails.append(f"rank {rank}: parameter {i} differs from gloo by {(a - b).abs().max():.3g}")
        if (h - b).abs().max() > 1e-6:
            fails.append(f"rank {rank}: parameter {i} (comm hook) differs from gloo by {(h - b).abs().max():.3g}")
        if (a - c.detach()).abs().max() > 1e-6:
            fails.append(f"rank {rank}: parameter {i} differs from single-process training")
    if torch.equal(ours[0], _model()[0].weight.detach()):
        fails.append(f"rank {rank}: parameters never changed")
    return fails


def test_ddp_matches_gloo_and_single_process() -> None:
    for world in (2, 3):
        fails = [f for r in run_ranks(_ddp_vs_gloo, world) for f in r]
        assert not fails, "\n".join(fails)

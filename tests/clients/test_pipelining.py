"""torch.distributed.pipelining, unmodified, on tdx: a float64 MLP cut into 2 stages
(PipelineStage, one per rank) trained with ScheduleGPipe and Schedule1F1B, 4 micro-batches
per step. Each schedule runs on the default (tdx) group and, in the same processes, on a
gloo group (PipelineStage's ``group``). The final stage parameters and the per-micro-batch
losses must agree with gloo within 1e-5, must match single-process training, and the
parameters must have moved.
"""

from __future__ import annotations

import io

import torch
import torch.distributed as dist
import torch.nn as nn
from torch.distributed.pipelining import PipelineStage, Schedule1F1B, ScheduleGPipe

from torchdist_ext.testing import new_gloo_group, run_ranks

WORLD = 2
STEPS = 3
BATCH = 16
MICRO = 4
TOL = 1e-5
SCHEDULES = {"GPipe": ScheduleGPipe, "1F1B": Schedule1F1B}


def _model() -> nn.Sequential:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(5, 16), nn.Tanh(), nn.Linear(16, 16), nn.Tanh(),
                         nn.Linear(16, 12), nn.Tanh(), nn.Linear(12, 3)).double()


def _stage(model: nn.Sequential, index: int) -> nn.Sequential:
    return model[:4] if index == 0 else model[4:]


def _data() -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(3)
    x = torch.randn(STEPS, BATCH, 5, generator=g, dtype=torch.float64)
    y = torch.randint(0, 3, (STEPS, BATCH), generator=g)
    return x, y


def _train(schedule_cls, group: dist.ProcessGroup | None, rank: int, world: int):
    x, y = _data()
    module = _stage(_model(), rank)
    stage = PipelineStage(module, rank, world, torch.device("cpu"), group=group)
    schedule = schedule_cls(stage, n_microbatches=MICRO, loss_fn=nn.functional.cross_entropy)
    opt = torch.optim.SGD(module.parameters(), lr=0.1, momentum=0.9)
    losses: list[float] = []
    for s in range(STEPS):
        opt.zero_grad()
        if rank == 0:
            schedule.step(x[s])
        else:
            step_losses: list[torch.Tensor] = []
            schedule.step(target=y[s], losses=step_losses)
            losses += [loss.item() for loss in step_losses]
        opt.step()
    return {n: p.detach().clone() for n, p in module.named_parameters()}, losses


def _pipelines(rank: int, world: int) -> bytes:
    gloo = new_gloo_group()
    out = {name: (_train(cls, None, rank, world), _train(cls, gloo, rank, world))
           for name, cls in SCHEDULES.items()}
    buf = io.BytesIO()  # tensors go back serialised: queued shared memory dies with the rank
    torch.save(out, buf)
    return buf.getvalue()


def _single_process() -> tuple[list[dict[str, torch.Tensor]], list[float]]:
    """The same training in one process: mean loss over micro-batches = full-batch loss."""
    x, y = _data()
    model = _model()
    opt = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    losses = []
    for s in range(STEPS):
        opt.zero_grad()
        for xm, ym in zip(x[s].chunk(MICRO), y[s].chunk(MICRO)):
            loss = nn.functional.cross_entropy(model(xm), ym)
            losses.append(loss.item())
            (loss / MICRO).backward()
        opt.step()
    stages = [{n: p.detach() for n, p in _stage(model, i).named_parameters()} for i in range(WORLD)]
    return stages, losses


def test_pipeline_schedules_match_gloo() -> None:
    results = [torch.load(io.BytesIO(b)) for b in run_ranks(_pipelines, WORLD)]
    ref_stages, ref_losses = _single_process()
    init = [{n: p.detach() for n, p in _stage(_model(), i).named_parameters()} for i in range(WORLD)]
    fails = []
    for name in SCHEDULES:
        for rank in range(WORLD):
            (ours, ours_losses), (gloo, gloo_losses) = results[rank][name]
            assert ours.keys() == gloo.keys() == ref_stages[rank].keys()
            for p in ours:
                diff = (ours[p] - gloo[p]).abs().max().item()
                if not diff <= TOL:
                    fails.append(f"{name}, stage {rank}: {p} differs from gloo by {diff:.3g}")
                ref = (ours[p] - ref_stages[rank][p]).abs().max().item()
                if not ref <= TOL:
                    fails.append(f"{name}, stage {rank}: {p} differs from single-process "
                                 f"training by {ref:.3g}")
                if torch.equal(ours[p], init[rank][p]):
                    fails.append(f"{name}, stage {rank}: {p} never moved")
            if rank == WORLD - 1:
                assert len(ours_losses) == len(gloo_losses) == STEPS * MICRO
                for i, (a, b, c) in enumerate(zip(ours_losses, gloo_losses, ref_losses)):
                    if not (abs(a - b) <= TOL and abs(a - c) <= TOL):
                        fails.append(f"{name}: micro-batch loss {i} is {a}, gloo {b}, "
                                     f"single process {c}")
    assert not fails, "\n".join(fails)

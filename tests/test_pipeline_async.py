"""Pipelines whose weights change during a step: PipeDream (weight stashing, an update per
microbatch) and PipeDream-2BW (an update per batch of microbatches, each with a gradient
one update old). The C++ weight plan against a model of the executor's rules, in one
process; then training on spawned ranks against a replay in one process of what each
stage ran each microbatch on.
"""

from __future__ import annotations

import pytest
import torch
import torch.nn as nn

from torchdist_ext import _C
from torchdist_ext.parallel import PipelineConfig, PipelineStage
from torchdist_ext.testing import expect_refusal, run_ranks

# ---- the plan, in one process ------------------------------------------------------------


def _model_of_rules(actions, m: int, mode: str, every: int, start: int) -> tuple:
    """The executor's rules (csrc/parallel/weight_versions.h) written out again:
    (versions, stashed, peak copies, end version)."""
    live, backs = start, {}
    version, stashed, updates = [None] * m, [False] * m, {}
    for i, (verb, mb) in enumerate(actions):
        if verb == "F":
            version[mb] = live if mode == "pipedream" else max(start + mb // every - 1, 0)
        elif verb == "B":
            b = mb // every
            backs[b] = backs.get(b, 0) + 1
            if mode == "pipedream" or backs[b] == every:
                live += 1
                updates[i] = live
    end = live
    live = start
    at_f = {}
    for i, (verb, mb) in enumerate(actions):
        if verb == "F":
            at_f[mb] = live
        elif verb == "B":
            if mb in at_f:
                stashed[mb] = at_f[mb] != version[mb] or any(
                    j in updates for j in range(actions.index(("F", mb)), i))
            if i in updates:
                live = updates[i]
    copies = {start - 1} if mode == "2bw" and start >= 1 else set()
    flying: list[int] = []
    peak, live = 0, start
    for i, (verb, mb) in enumerate(actions):
        if verb == "F" and stashed[mb]:
            copies.add(version[mb])
            flying.append(version[mb])
        elif verb == "B":
            if stashed[mb]:
                flying.remove(version[mb])
            if i in updates:
                if mode == "2bw":
                    copies.add(live)
                peak = max(peak, len(copies))
                live = updates[i]
            copies = {v for v in copies if v in flying or (mode == "2bw" and v == live - 1)}
        peak = max(peak, len(copies))
    return version, stashed, peak, end


def test_pipedream_versions_follow_the_stage_depth() -> None:
    """Stage s of S, 1F1B: microbatch m runs on the weights of max(0, m - w) updates,
    w = min(S - 1 - s, M) being the stage's warm-up forwards; the last stage never keeps
    a copy; everything else as the model of the rules says."""
    cases = 0
    for stages in range(1, 9):
        for m in range(1, 17):
            sched = _C._PipelineSchedule.one_f_one_b(stages, m)
            for s in range(stages):
                w = min(stages - 1 - s, m)
                for start in (0, 3):
                    plan = _C._plan_weights(sched.actions(s), s, m, "pipedream", 1, start)
                    assert list(plan.version) == [start + max(0, k - w) for k in range(m)]
                    version, stashed, peak, end = _model_of_rules(
                        sched.actions(s), m, "pipedream", 1, start)
                    assert list(plan.stashed) == stashed, (stages, m, s)
                    assert plan.peak_copies == peak and plan.end_version == end == start + m
                    assert plan.end_copies == 0
                    if s == stages - 1:
                        assert plan.peak_copies == 0
                    assert plan.peak_copies <= w + 1
                    cases += 1
    assert cases == 2 * 16 * 36


def test_2bw_runs_batch_b_on_update_b_minus_1_and_keeps_two_copies() -> None:
    cases = refused = 0
    for stages in range(1, 9):
        for every in range(1, 9):
            m = 3 * every  # three batches: the third needs the first's update
            sched = _C._PipelineSchedule.one_f_one_b(stages, m)
            for s in range(stages):
                for start in (0, 1, 4):
                    try:
                        plan = _C._plan_weights(sched.actions(s), s, m, "2bw", every, start)
                    except ValueError as e:
                        assert every < max(1, stages - 1), e
                        assert f"stage {s}" in str(e) and f"batches of {every}" in str(e)
                        refused += 1
                        continue
                    want = [max(start + k // every - 1, 0) for k in range(m)]
                    assert list(plan.version) == want
                    version, stashed, peak, end = _model_of_rules(
                        sched.actions(s), m, "2bw", every, start)
                    assert list(plan.stashed) == stashed and plan.peak_copies == peak
                    assert plan.end_version == end == start + 3
                    assert plan.peak_copies <= 2 and plan.end_copies == 1
                    cases += 1
            # Batches of at least S - 1 microbatches always fit a 1F1B pipeline.
            if every >= max(1, stages - 1):
                for s in range(stages):
                    _C._plan_weights(sched.actions(s), s, m, "2bw", every, 1)
    assert cases > 0 and refused > 0


def test_bad_plans_and_configs_are_refused() -> None:
    acts = _C._PipelineSchedule.one_f_one_b(2, 4).actions(0)
    for args, word in [((acts, 0, 4, "2bw", 3, 0), "does not divide"),
                       ((acts, 0, 4, "2bw", 0, 0), "at least 1"),
                       ((acts, 0, 4, "pipedream", 1, -1), "negative start"),
                       ((acts, 0, 4, "sgd", 1, 0), "pipedream or 2bw")]:
        with pytest.raises(ValueError, match=word):
            _C._plan_weights(*args)
    for kwargs, word in [({"schedule": "pipedream", "update_every": 2}, "after every microbatch"),
                         ({"schedule": "1f1b", "update_every": 2}, "when you step"),
                         ({"schedule": "2bw", "microbatches": 6, "update_every": 4}, "divides"),
                         ({"schedule": "2bw", "update_every": 0}, "positive int")]:
        with pytest.raises(ValueError, match=word):
            PipelineConfig(**kwargs)
    assert PipelineConfig(schedule="2bw", microbatches=6).every == 6
    assert PipelineConfig(schedule="2bw", microbatches=6, update_every=3).every == 3
    assert PipelineConfig(schedule="pipedream").every == 1


# ---- training against a replay -------------------------------------------------------------

LR = 0.05


def _model() -> nn.Sequential:
    torch.manual_seed(0)
    layers: list[nn.Module] = [nn.Linear(5, 8)]
    for _ in range(4):
        layers += [nn.Tanh(), nn.Linear(8, 8)]
    layers += [nn.Tanh(), nn.Linear(8, 3)]
    return nn.Sequential(*layers).double()


def _cut(model: nn.Sequential, stages: int, stage: int) -> nn.Sequential:
    mods = list(model)
    bounds = [round(i * len(mods) / stages) for i in range(stages + 1)]
    return nn.Sequential(*mods[bounds[stage]:bounds[stage + 1]])


def _batches(steps: int, rows: int) -> list[tuple[torch.Tensor, torch.Tensor]]:
    g = torch.Generator().manual_seed(11)
    return [(torch.randn(rows, 5, generator=g, dtype=torch.float64),
             torch.randn(rows, 3, generator=g, dtype=torch.float64)) for _ in range(steps)]


def _optimizer(params) -> torch.optim.Optimizer:
    return torch.optim.SGD(params, lr=LR, momentum=0.9)


def _train_rank(rank: int, world: int, mode: str, m: int, every, steps: int,
                rows: int) -> dict:
    stage = _cut(_model(), world, rank)
    opt = _optimizer(stage.parameters())
    last = rank == world - 1
    runner = PipelineStage(stage, optimizer=opt, loss_fn=nn.functional.mse_loss if last else None,
                           config=PipelineConfig(schedule=mode, microbatches=m,
                                                 update_every=every))
    losses = []
    for x, y in _batches(steps, rows):
        loss = runner.step(inputs=x if rank == 0 else None, targets=y if last else None)
        losses.append(None if loss is None else loss.item())
    peaks = []
    for start in range(steps):  # the plan of each step, as the stage ran it
        peaks.append(_C._plan_weights(runner.schedule.actions(rank), rank, m, mode,
                                      runner.update_every,
                                      start * (m // runner.update_every)).peak_copies)
    return {"params": [p.detach().flatten().tolist() for p in stage.parameters()],
            "version": runner.version, "copies": runner.max_copies, "peak": max(peaks),
            "losses": losses}


def _replay_pipedream(world: int, m: int, steps: int, rows: int) -> tuple[list, list]:
    """Per microbatch, in order: a forward through every stage, each on the version of
    its weights the plan gives, and each stage's update with its gradient."""
    model = _model()
    stages = [_cut(model, world, s) for s in range(world)]
    opts = [_optimizer(st.parameters()) for st in stages]
    history = [[[p.detach().clone() for p in st.parameters()]] for st in stages]
    losses = []
    for step, (x, y) in enumerate(_batches(steps, rows)):
        xs, ys = torch.tensor_split(x, m), torch.tensor_split(y, m)
        plans = [_C._plan_weights(_C._PipelineSchedule.one_f_one_b(world, m).actions(s), s, m,
                                  "pipedream", 1, step * m) for s in range(world)]
        total = 0.0
        for mb in range(m):
            used = []
            h = xs[mb]
            for s, st in enumerate(stages):
                ws = [w.clone().requires_grad_() for w in history[s][plans[s].version[mb]]]
                names = [n for n, _ in st.named_parameters()]
                used.append(ws)
                h = torch.func.functional_call(st, dict(zip(names, ws)), (h,))
            loss = nn.functional.mse_loss(h, ys[mb])
            total += loss.item() * len(ys[mb]) / rows
            flat = [w for ws in used for w in ws]
            grads = torch.autograd.grad(loss, flat)
            at = 0
            for s, st in enumerate(stages):
                for p in st.parameters():
                    p.grad = grads[at]
                    at += 1
                opts[s].step()
                history[s].append([p.detach().clone() for p in st.parameters()])
        losses.append(total)
    return [p.detach().flatten().tolist() for p in model.parameters()], losses


def _replay_2bw(m: int, every: int, steps: int, rows: int) -> tuple[list, list]:
    """One process: update k + 1 applies batch k's gradient taken on update max(k - 1, 0)."""
    model = _model()
    opt = _optimizer(model.parameters())
    names = [n for n, _ in model.named_parameters()]
    versions = [[p.detach().clone() for p in model.parameters()]]
    losses = []
    k = 0
    for x, y in _batches(steps, rows):
        xs, ys = torch.tensor_split(x, m), torch.tensor_split(y, m)
        total = 0.0
        for b0 in range(0, m, every):
            ws = [w.clone().requires_grad_() for w in versions[max(k - 1, 0)]]
            batch_rows = sum(len(t) for t in ys[b0:b0 + every])
            loss = 0.0
            for mb in range(b0, b0 + every):
                part = nn.functional.mse_loss(
                    torch.func.functional_call(model, dict(zip(names, ws)), (xs[mb],)), ys[mb])
                total += part.item() * len(ys[mb]) / rows
                loss = loss + part * (len(ys[mb]) / batch_rows)
            for p, g in zip(model.parameters(), torch.autograd.grad(loss, ws)):
                p.grad = g
            opt.step()
            versions.append([p.detach().clone() for p in model.parameters()])
            k += 1
        losses.append(total)
    return [p.detach().flatten().tolist() for p in model.parameters()], losses


def _check(runs: list, want_params: list, want_losses: list, versions: int) -> None:
    params = [p for r in runs for p in r["params"]]
    assert len(params) == len(want_params)
    for i, (mine, want) in enumerate(zip(params, want_params)):
        assert torch.allclose(torch.tensor(mine), torch.tensor(want), rtol=1e-12,
                              atol=1e-13), i
    assert runs[-1]["losses"] == pytest.approx(want_losses, rel=1e-12)
    for r in runs:
        assert r["version"] == versions and r["copies"] == r["peak"], r


@pytest.mark.parametrize("world", [1, 2, 4])
def test_pipedream_trains_as_its_replay(world: int) -> None:
    """SGD with momentum, 3 steps of 6 microbatches (uneven: a batch of 14): every stage's
    parameters equal a one-process replay in which each microbatch runs on each stage's
    weights of the version the plan gives; each rank kept the plan's copies."""
    m, steps, rows = 6, 3, 14
    runs = run_ranks(_train_rank, world, timeout=120, args=("pipedream", m, None, steps, rows))
    _check(runs, *_replay_pipedream(world, m, steps, rows), versions=m * steps)


@pytest.mark.parametrize("world,every", [(1, 1), (2, 1), (3, 2), (4, 3)])
def test_2bw_trains_as_delayed_gradient_descent(world: int, every: int) -> None:
    """2BW, 3 steps of 2 batches each: the parameters equal one process's training in which
    each update applies a gradient taken one update earlier (the first two on the start)."""
    m, steps, rows = 2 * every, 3, 3 * every + 1
    runs = run_ranks(_train_rank, world, timeout=120, args=("2bw", m, every, steps, rows))
    _check(runs, *_replay_2bw(m, every, steps, rows), versions=2 * steps)


def _refusals(rank: int, world: int) -> list[str]:
    fails: list[str] = []
    stage = _cut(_model(), world, rank)
    last = rank == world - 1
    loss = nn.functional.mse_loss if last else None
    opt = _optimizer(stage.parameters())
    expect_refusal(fails, lambda: PipelineStage(stage, loss_fn=loss,
                                                config=PipelineConfig(schedule="pipedream")),
                   f"stage {rank} of {world}", "pass optimizer=")
    expect_refusal(fails, lambda: PipelineStage(stage, loss_fn=loss, optimizer=opt,
                                                config=PipelineConfig(schedule="1f1b")),
                   "param.grad", "pipedream and 2bw")
    # Batches too small for a pipeline of 4 stages: every rank raises, naming the stage.
    expect_refusal(fails, lambda: PipelineStage(
        stage, loss_fn=loss, optimizer=opt,
        config=PipelineConfig(schedule="2bw", microbatches=4, update_every=1)),
        "2BW: stage", "needs at least 3")
    return fails


def test_mistakes_are_refused_on_every_stage() -> None:
    assert run_ranks(_refusals, 4, timeout=60) == [[]] * 4


def _cuda_rank(rank: int, world: int) -> dict:
    torch.cuda.set_device(rank % torch.cuda.device_count())
    stage = _cut(_model(), world, rank).cuda()
    last = rank == world - 1
    runner = PipelineStage(stage, optimizer=_optimizer(stage.parameters()),
                           loss_fn=nn.functional.mse_loss if last else None,
                           config=PipelineConfig(schedule="pipedream", microbatches=4))
    for x, y in _batches(2, 8):
        runner.step(inputs=x.cuda() if rank == 0 else None, targets=y.cuda() if last else None)
    return {"params": [p.detach().cpu().flatten().tolist() for p in stage.parameters()]}


@pytest.mark.cuda
def test_pipedream_on_cuda_matches_its_cpu_replay() -> None:
    if not torch.cuda.is_available():
        pytest.skip("needs a GPU")
    runs = run_ranks(_cuda_rank, 2, timeout=120)
    want, _ = _replay_pipedream(2, 4, 2, 8)
    got = [p for r in runs for p in r["params"]]
    for mine, ref in zip(got, want):
        assert torch.allclose(torch.tensor(mine), torch.tensor(ref), rtol=1e-10, atol=1e-12)


def test_the_pipeline_example_trains_with_pipedream() -> None:
    """examples/pipeline.py --runner tdx --schedule pipedream under torchrun (standalone,
    3 stages): exit 0, and a test accuracy above 95% after two epochs."""
    import os
    import re
    import subprocess
    import sys
    from pathlib import Path

    example = Path(__file__).resolve().parents[1] / "examples" / "pipeline.py"
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone",
           "--nproc-per-node", "3", str(example), "--runner", "tdx", "--schedule",
           "pipedream", "--epochs", "2"]
    done = subprocess.run(cmd, capture_output=True, text=True, timeout=150,
                          env=dict(os.environ, OMP_NUM_THREADS="1"))
    out = done.stdout + done.stderr
    assert done.returncode == 0, out[-4000:]
    assert "(pipedream, 4 microbatches, tdx)" in out, out[-4000:]
    accuracy = [float(a) for a in re.findall(r"test accuracy\s+([\d.]+)%", out)]
    assert len(accuracy) == 2 and accuracy[-1] > 95.0, out[-4000:]

"""Pipeline parallelism (torchdist_ext.parallel.PipelineStage): the schedules of the C++
core checked exhaustively in one process; then training on spawned ranks, one stage per
rank, against one process training the whole model on the whole batch (float64, the
same parameters within rounding), at 1 to 4 stages, GPipe and 1F1B, microbatches that do
and do not divide the batch."""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist
import torch.nn as nn

from torchdist_ext.parallel import PipelineConfig, PipelineStage, Schedule
from torchdist_ext.testing import expect_refusal, run_ranks

# ---- schedules, in one process ------------------------------------------------------------


@pytest.mark.parametrize("name", ["gpipe", "1f1b"])
def test_schedules_are_complete_and_keep_what_they_promise(name: str) -> None:
    for stages in range(1, 9):
        for m in range(1, 17):
            s = Schedule.named(name, stages, m)  # the core's check ran: no deadlock
            for st in range(stages):
                acts = s.actions(st)
                # A forward and a backward per microbatch, and a message each way per
                # microbatch across every boundary this stage has.
                want = 2 + (st > 0) * 2 + (st < stages - 1) * 2
                assert len(acts) == want * m, (name, stages, m, st)
                for verb in ("F", "B"):
                    assert sorted(mb for v, mb in acts if v == verb) == list(range(m))
            # What each keeps: GPipe every microbatch, 1F1B at most stages - s.
            if name == "gpipe":
                assert s.peak_in_flight == [m] * stages
            else:
                assert s.peak_in_flight == [min(stages - st, m) for st in range(stages)]
            # Both fill and drain the pipeline once: (stages - 1) forward and backward units
            # of idling per stage, around 3 m units of work.
            assert s.makespan == 3 * m + 3 * (stages - 1), (name, stages, m)
            assert s.bubble == pytest.approx((stages - 1) / (m + stages - 1))


def test_the_grid_draws_the_timeline() -> None:
    g = Schedule.one_f_one_b(2, 3).grid().splitlines()
    # Stage 0 waits two units for microbatch 0's gradient from stage 1's backward.
    assert g[0].split("|")[1].split() == ["F0", "F1", ".", ".", "B0", "B0", "F2", "B1", "B1",
                                          ".", "B2", "B2"]
    assert g[1].split("|")[1].split() == [".", "F0", "B0", "B0", "F1", "B1", "B1", "F2", "B2",
                                          "B2", ".", "."]
    assert "bubble 25%" in repr(Schedule.gpipe(2, 3))


@pytest.mark.parametrize("actions, m, words", [
    # Each stage waits for the other's message first.
    ([[("F", 0), ("RG", 0), ("SA", 0), ("B", 0)], [("RA", 0), ("F", 0), ("B", 0), ("SG", 0)]],
     1, ["stage 0, step 1 (RG0)", "wait for one another forever",
         "stage 1, step 0 (RA0) waits for stage 0 to send microbatch 0's activation"]),
    # Messages between two stages arrive in the order they were sent.
    ([[("F", 0), ("SA", 0), ("F", 1), ("SA", 1), ("RG", 0), ("B", 0), ("RG", 1), ("B", 1)],
      [("RA", 1), ("F", 1), ("RA", 0), ("F", 0), ("B", 0), ("SG", 0), ("B", 1), ("SG", 1)]],
     2, ["stage 1, step 0 (RA1)", "stage 0 sent microbatch 0's first"]),
    ([[("B", 0), ("F", 0)]], 1, ["stage 0, step 0 (B0)", "forward has not run"]),
    ([[("F", 0), ("B", 0), ("F", 0), ("B", 0)]], 1, ["step 2 (F0)", "forward runs twice"]),
    ([[("F", 0), ("SA", 0), ("B", 0)]], 1, ["the last stage has no next stage"]),
    ([[("F", 0)]], 1, ["microbatch 0's backward never runs"]),
    ([[("F", 0), ("B", 0)]], 2, ["microbatch 1's forward never runs"]),
    ([[("F", 3), ("B", 3)]], 1, ["microbatch 3 is not in [0, 1)"]),
])
def test_bad_schedules_are_refused_naming_the_stage_and_step(actions, m: int, words) -> None:
    with pytest.raises(ValueError) as err:
        Schedule(actions, m)
    text = str(err.value)
    assert all(w in text for w in words), text
    assert "stage 0 |" in text  # the grid of what ran


def test_a_schedule_of_ones_own_runs_when_it_is_sound() -> None:
    """Backwards in reverse order, a schedule neither generator makes."""
    s = Schedule([[("F", 0), ("SA", 0), ("F", 1), ("SA", 1), ("RG", 1), ("B", 1), ("RG", 0),
                   ("B", 0)],
                  [("RA", 0), ("F", 0), ("RA", 1), ("F", 1), ("B", 1), ("SG", 1), ("B", 0),
                   ("SG", 0)]], 2)
    assert s.peak_in_flight == [2, 2] and s.actions(1)[4] == ("B", 1)


def test_bad_shapes_and_names_are_refused() -> None:
    with pytest.raises(ValueError, match="at least 1 stage"):
        Schedule.gpipe(0, 2)
    with pytest.raises(ValueError, match="at least 1 microbatch"):
        Schedule.one_f_one_b(2, 0)
    with pytest.raises(ValueError, match="unknown pipeline action 'X'"):
        Schedule([[("X", 0)]], 1)
    with pytest.raises(ValueError, match="unknown pipeline schedule 'zb'"):
        Schedule.named("zb", 2, 2)
    with pytest.raises(ValueError, match="microbatches must be an int of at least 1"):
        PipelineConfig(microbatches=0)
    with pytest.raises(ValueError, match="schedule must be one of gpipe, 1f1b"):
        PipelineConfig(schedule="interleaved")


# ---- training against one process ------------------------------------------------------

LAYERS = 8
BATCH = 10
STEPS = 3


def _model() -> nn.Sequential:
    torch.manual_seed(0)
    layers: list[nn.Module] = [nn.Linear(6, 9)]
    for _ in range(LAYERS - 2):
        layers += [nn.Tanh(), nn.Linear(9, 9)]
    layers += [nn.Tanh(), nn.Linear(9, 4)]
    return nn.Sequential(*layers).double()


def _cut(model: nn.Sequential, stages: int, stage: int) -> nn.Sequential:
    """Stage ``stage`` of ``stages``: a contiguous run of the model's modules."""
    mods = list(model)
    bounds = [round(i * len(mods) / stages) for i in range(stages + 1)]
    return nn.Sequential(*mods[bounds[stage]:bounds[stage + 1]])


def _data() -> list[tuple[torch.Tensor, torch.Tensor]]:
    g = torch.Generator().manual_seed(3)
    return [(torch.randn(BATCH, 6, generator=g, dtype=torch.float64),
             torch.randn(BATCH, 4, generator=g, dtype=torch.float64)) for _ in range(STEPS)]


def _reference() -> tuple[list[list[float]], list[float]]:
    model = _model()
    opt = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    losses = []
    for x, y in _data():
        opt.zero_grad()
        loss = nn.functional.mse_loss(model(x), y)
        loss.backward()
        opt.step()
        losses.append(loss.item())
    return [p.detach().flatten().tolist() for p in model.parameters()], losses


def _pipeline(rank: int, world: int, name: str) -> dict:
    out = {}
    for m in (1, 3, 4):
        stage = _cut(_model(), world, rank)
        runner = PipelineStage(stage, config=PipelineConfig(schedule=name, microbatches=m),
                               loss_fn=nn.functional.mse_loss if rank == world - 1 else None)
        opt = torch.optim.SGD(stage.parameters(), lr=0.1, momentum=0.9)
        losses = []
        for x, y in _data():
            opt.zero_grad()
            loss = runner.step(inputs=x if rank == 0 else None,
                               targets=y if rank == world - 1 else None)
            opt.step()
            losses.append(None if loss is None else loss.item())
        out[m] = {"params": [p.detach().flatten().tolist() for p in stage.parameters()],
                  "losses": losses, "kept": runner.max_kept,
                  "peak": runner.schedule.peak_in_flight[rank]}
    return out


@pytest.mark.parametrize("world", [1, 2, 3, 4])
@pytest.mark.parametrize("name", ["gpipe", "1f1b"])
def test_pipeline_trains_as_one_process_does(world: int, name: str) -> None:
    """SGD with momentum, 3 steps of a batch of 10 in 1, 3 (uneven) and 4 microbatches:
    each stage's parameters equal the same layers' in one process within 1e-12, the last
    stage's loss is the batch's, and each rank kept no more activations than the schedule
    says."""
    ref_params, ref_losses = _reference()
    runs = run_ranks(_pipeline, world, timeout=120, args=(name,))
    for m in (1, 3, 4):
        got = [r[m] for r in runs]
        params = [p for r in got for p in r["params"]]
        assert len(params) == len(ref_params)
        for i, (mine, want) in enumerate(zip(params, ref_params)):
            assert torch.allclose(torch.tensor(mine), torch.tensor(want), rtol=1e-12,
                                  atol=1e-13), (m, i)
        assert got[-1]["losses"] == pytest.approx(ref_losses, rel=1e-12), m
        assert all(r["kept"] == r["peak"] for r in got), (m, got)


def _mistakes(rank: int, world: int) -> list[str]:
    """Each mistake on one stage, in a pipeline of its own: that stage refuses naming it,
    the other stops at once naming the stage that failed, and both refuse later calls.
    A pipeline on a new group then trains."""
    import time

    fails = []

    def refused(fn, *words) -> None:
        expect_refusal(fails, fn, *words)

    stage = _cut(_model(), world, rank)
    last = rank == world - 1
    loss = nn.functional.mse_loss if last else None
    refused(lambda: PipelineStage(stage, schedule=Schedule.gpipe(world + 1, 2),
                                  loss_fn=nn.functional.mse_loss),
            f"stage {rank} of {world}", f"{world + 1} stages", "one stage per rank")
    if last:
        refused(lambda: PipelineStage(stage), "pass loss_fn")
    x, y = _data()[0]
    good = {"inputs": x if rank == 0 else None, "targets": y if last else None}
    for culprit, bad, words in [
            (0, {"inputs": None}, ("stage 0 of 2", "pass inputs")),
            (1, {"targets": None}, ("pass targets",)),
            (1, {"targets": y[:3]}, ("a batch of 3 cannot split into 4",)),
            (0, {"inputs": x[:3]}, ("a batch of 3 cannot split into 4",))]:
        group = dist.new_group()
        runner = PipelineStage(stage, group=group, config=PipelineConfig(microbatches=4),
                               loss_fn=loss)
        started = time.monotonic()
        if rank == culprit:
            refused(lambda: runner.step(**{**good, **bad}), *words)
        else:
            expect_refusal(fails, lambda: runner.step(**good), "step() stopped",
                           f"stage {culprit} failed this call", errors=(RuntimeError,))
        if time.monotonic() - started > 10:
            fails.append(f"stage {rank} waited {time.monotonic() - started:.0f} s for {words}")
        expect_refusal(fails, lambda: runner.step(**good), "after a failed call",
                       "make a new group", errors=(RuntimeError,))
        dist.destroy_process_group(group)
    # A pipeline on a new group trains.
    runner = PipelineStage(stage, group=dist.new_group(), config=PipelineConfig(microbatches=4),
                           loss_fn=loss)
    runner.step(**good)
    return fails


def test_mistakes_are_refused_naming_the_stage() -> None:
    assert run_ranks(_mistakes, 2, timeout=60) == [[], []]


class _Faulty(nn.Module):
    """Raises in the forward of its ``at``-th call."""

    def __init__(self, inner: nn.Module, at: int) -> None:
        super().__init__()
        self.inner, self.at, self.calls = inner, at, 0

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        self.calls += 1
        if self.calls == self.at:
            raise ArithmeticError("the module failed on purpose")
        return self.inner(x)


class _FailingBackward(torch.autograd.Function):
    """The identity, whose backward raises at its ``at``-th call (counted in ``box``)."""

    @staticmethod
    def forward(ctx, x, box):  # type: ignore[override]
        ctx.box = box
        return x.view_as(x)

    @staticmethod
    def backward(ctx, g):  # type: ignore[override]
        ctx.box[0] += 1
        if ctx.box[0] == ctx.box[1]:
            raise ArithmeticError("the backward failed on purpose")
        return g, None


class _LateFault(nn.Module):
    """Raises in the backward of the ``at``-th microbatch: on the first stage of 1F1B, the
    last action of the step, when the other stages have nothing left to receive."""

    def __init__(self, inner: nn.Module, at: int) -> None:
        super().__init__()
        self.inner, self.box = inner, [0, at]

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.inner(_FailingBackward.apply(x.requires_grad_(), self.box))


def _failure_spreads(rank: int, world: int, schedule: str, late: bool) -> list[str]:
    """A stage's module raises (the middle one in its second forward, or the first one in
    its last backward): that stage raises the error, the others stop at once naming it,
    and a pipeline made later on the same group finds the failed call's messages instead
    of taking them for its own."""
    import time

    fails: list[str] = []
    module = _cut(_model(), world, rank)
    last = rank == world - 1
    culprit = 0 if late else 1
    faulty = _LateFault(module, 4) if late else _Faulty(module, 2)
    opt = torch.optim.SGD(module.parameters(), lr=0.1) if schedule == "pipedream" else None
    runner = PipelineStage(faulty if rank == culprit else module, optimizer=opt,
                           config=PipelineConfig(schedule=schedule, microbatches=4),
                           loss_fn=nn.functional.mse_loss if last else None)
    x, y = _data()[0]
    good = {"inputs": x if rank == 0 else None, "targets": y if last else None}
    started = time.monotonic()
    if rank == culprit:
        expect_refusal(fails, lambda: runner.step(**good), "on purpose",
                       errors=(ArithmeticError,))
    else:
        expect_refusal(fails, lambda: runner.step(**good), f"stage {culprit} failed this call",
                       errors=(RuntimeError,))
    if time.monotonic() - started > 10:
        fails.append(f"stage {rank} took {time.monotonic() - started:.0f} s to stop")
    # A new pipeline on the same group must not take the failed call's messages for its
    # own. After the late failure every message had been taken (the first stage failed
    # last), so the new pipeline runs; after the early one, messages are left and it
    # refuses them.
    again = PipelineStage(module, config=PipelineConfig(microbatches=4),
                          loss_fn=nn.functional.mse_loss if last else None)
    try:
        again.step(**good)
        if not late:
            fails.append("a pipeline on the failed group ran a step")
    except RuntimeError as e:
        if late or not any(w in str(e) for w in ("left over", "failed this call")):
            fails.append(f"unexpected: {e}")
    return fails


@pytest.mark.parametrize("schedule,late", [("1f1b", False), ("pipedream", False),
                                           ("1f1b", True)])
def test_a_stage_that_fails_stops_every_stage_at_once(schedule: str, late: bool) -> None:
    assert run_ranks(_failure_spreads, 3, timeout=60, args=(schedule, late)) == [[], [], []]


class _Head(nn.Module):
    """Stage 0 of the tuple pipeline: a hidden state, an integer flag and a float gate."""

    def __init__(self) -> None:
        super().__init__()
        self.lin, self.gate = nn.Linear(6, 9), nn.Linear(6, 1)

    def forward(self, x: torch.Tensor):
        return torch.tanh(self.lin(x)), (x[:, 0] > 0).long(), torch.sigmoid(self.gate(x))


class _Mid(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.lin, self.emb = nn.Linear(9, 9), nn.Embedding(2, 9)

    def forward(self, h: torch.Tensor, flag: torch.Tensor, gate: torch.Tensor):
        return torch.tanh(self.lin(h) * gate + self.emb(flag)), flag


class _Tail(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.lin, self.emb = nn.Linear(9, 4), nn.Embedding(2, 4)

    def forward(self, h: torch.Tensor, flag: torch.Tensor) -> torch.Tensor:
        return self.lin(h) + self.emb(flag)


def _tuple_stages() -> list[nn.Module]:
    torch.manual_seed(4)
    return [m.double() for m in (_Head(), _Mid(), _Tail())]


def _tuple_reference(optimizer) -> list[list[float]]:
    stages = _tuple_stages()
    opt = optimizer([p for st in stages for p in st.parameters()])
    for x, y in _data():
        opt.zero_grad()
        out = x
        for st in stages:
            out = st(*out) if isinstance(out, tuple) else st(out)
        nn.functional.mse_loss(out, y).backward()
        opt.step()
    return [p.detach().flatten().tolist() for st in stages for p in st.parameters()]


def _sgd(params):
    return torch.optim.SGD(params, lr=0.1, momentum=0.9)


def _tuple_pipedream_replay(m: int) -> list[list[float]]:
    """PipeDream in one process: each microbatch through every stage on the weight version
    the plan gives that stage, then each stage's update with its gradient (zeros for a
    parameter without one, as the stages do)."""
    from torchdist_ext import _C

    stages = _tuple_stages()
    opts = [_sgd(st.parameters()) for st in stages]
    names = [[n for n, _ in st.named_parameters()] for st in stages]
    history = [[[p.detach().clone() for p in st.parameters()]] for st in stages]
    sched = _C._PipelineSchedule.one_f_one_b(len(stages), m)
    for step, (x, y) in enumerate(_data()):
        plans = [_C._plan_weights(sched.actions(s), s, m, "pipedream", 1, step * m)
                 for s in range(len(stages))]
        xs, ys = torch.tensor_split(x, m), torch.tensor_split(y, m)
        for mb in range(m):
            used, h = [], xs[mb]
            for s, st in enumerate(stages):
                ws = [w.clone().requires_grad_() for w in history[s][plans[s].version[mb]]]
                used.append(ws)
                h = torch.func.functional_call(st, dict(zip(names[s], ws)),
                                               h if isinstance(h, tuple) else (h,))
            loss = nn.functional.mse_loss(h, ys[mb])
            grads = iter(torch.autograd.grad(loss, [w for ws in used for w in ws],
                                             allow_unused=True))
            for s, st in enumerate(stages):
                for p in st.parameters():
                    g = next(grads)
                    p.grad = torch.zeros_like(p) if g is None else g
                opts[s].step()
                history[s].append([p.detach().clone() for p in st.parameters()])
    return [p.detach().flatten().tolist() for st in stages for p in st.parameters()]


def _tuple_pipeline(rank: int, world: int, schedule: str, m: int) -> dict:
    stage = _tuple_stages()[rank]
    last = rank == world - 1
    opt = _sgd(stage.parameters())
    runner = PipelineStage(stage, loss_fn=nn.functional.mse_loss if last else None,
                           optimizer=opt if schedule == "pipedream" else None,
                           config=PipelineConfig(schedule=schedule, microbatches=m))
    for x, y in _data():
        opt.zero_grad()
        runner.step(inputs=x if rank == 0 else None, targets=y if last else None)
        if schedule != "pipedream":
            opt.step()
    out = runner.evaluate(inputs=_data()[0][0] if rank == 0 else None)
    return {"params": [p.detach().flatten().tolist() for p in stage.parameters()],
            "eval": None if out is None else out.tolist()}


@pytest.mark.parametrize("schedule,m", [("gpipe", 3), ("1f1b", 4), ("pipedream", 1),
                                        ("pipedream", 3)])
def test_stages_pass_tuples_with_integer_and_float_members(schedule: str, m: int) -> None:
    """Stage 0 passes (hidden, integer flag, float gate), stage 1 uses all three and passes
    (hidden, flag): the parameters equal one process's within 1e-12 (pipedream with one
    microbatch is 1F1B with an update per step; with three, stashed weight copies run the
    tuples, against a replay of the plan's versions), and evaluate() gives the model's
    output."""
    runs = run_ranks(_tuple_pipeline, 3, timeout=120, args=(schedule, m))
    got = [p for r in runs for p in r["params"]]
    want = (_tuple_pipedream_replay(m) if schedule == "pipedream" and m > 1
            else _tuple_reference(_sgd))
    assert len(got) == len(want)
    for mine, ref in zip(got, want):
        assert torch.allclose(torch.tensor(mine), torch.tensor(ref), rtol=1e-12, atol=1e-13)
    # The trained stages' output on the first batch, from one process.
    stages = _tuple_stages()
    with torch.no_grad():
        for st, r in zip(stages, runs):
            for p, values in zip(st.parameters(), r["params"]):
                p.copy_(torch.tensor(values, dtype=torch.float64).view_as(p))
        out = _data()[0][0]
        for st in stages:
            out = st(*out) if isinstance(out, tuple) else st(out)
    assert torch.allclose(torch.tensor(runs[-1]["eval"], dtype=torch.float64), out,
                          rtol=1e-12, atol=1e-13)


def _over_a_subgroup(rank: int, world: int) -> list[str]:
    """Two pipelines of 2 stages side by side (ranks 0-1 and 2-3), each on its own
    group and its own data, as a (data, pipe) mesh would run them."""
    groups = [dist.new_group([0, 1]), dist.new_group([2, 3])]
    group = groups[rank // 2]
    stage = _cut(_model(), 2, rank % 2)
    runner = PipelineStage(stage, group=group, config=PipelineConfig(microbatches=3),
                           loss_fn=nn.functional.mse_loss if rank % 2 else None)
    x, y = _data()[rank // 2]
    fails = []
    out = runner.evaluate(inputs=x if rank % 2 == 0 else None)  # forward only
    if rank % 2 and not torch.allclose(out, _model()(x), rtol=1e-12, atol=1e-13):
        fails.append(f"evaluate: {(out - _model()(x)).abs().max()}")
    if rank % 2 == 0 and out is not None:
        fails.append("evaluate returned on the first stage")
    if any(p.grad is not None for p in stage.parameters()):
        fails.append("evaluate left gradients")
    loss = runner.step(inputs=x if rank % 2 == 0 else None,
                       targets=y if rank % 2 else None)
    if rank % 2:
        want = nn.functional.mse_loss(_model()(x), y).item()
        if abs(loss.item() - want) > 1e-12:
            fails.append(f"loss {loss.item()} against {want}")
    return fails


def test_pipelines_run_on_subgroups_and_evaluate_forward_only() -> None:
    assert run_ranks(_over_a_subgroup, 4, timeout=60) == [[]] * 4


# ---- CUDA ----------------------------------------------------------------------------


def _cuda(rank: int, world: int) -> list[str]:
    torch.cuda.set_device(rank % torch.cuda.device_count())
    fails = []
    for name in ("gpipe", "1f1b"):
        cpu, gpu = _cut(_model(), world, rank), _cut(_model(), world, rank).cuda()
        last = rank == world - 1
        losses = []
        for stage in (cpu, gpu):
            dev = "cuda" if stage is gpu else "cpu"
            runner = PipelineStage(stage, config=PipelineConfig(schedule=name, microbatches=3),
                                   loss_fn=nn.functional.mse_loss if last else None)
            x, y = (t.to(dev) for t in _data()[0])
            losses.append(runner.step(inputs=x if rank == 0 else None,
                                      targets=y if last else None))
        for p, q in zip(cpu.parameters(), gpu.parameters()):
            if not torch.allclose(p.grad, q.grad.cpu(), rtol=1e-9, atol=1e-12):
                fails.append(f"{name}: {(p.grad - q.grad.cpu()).abs().max()}")
        if last and not (losses[1].is_cuda and abs(losses[0].item() - losses[1].item()) < 1e-9):
            fails.append(f"{name} loss {losses}")
    return fails


@pytest.mark.cuda
def test_cuda_stages_compute_the_cpu_gradients() -> None:
    if not torch.cuda.is_available():
        pytest.skip("needs a CUDA GPU")
    assert run_ranks(_cuda, 2, timeout=180) == [[], []]


# ---- the example -----------------------------------------------------------------------


def test_the_pipeline_example_trains_with_the_tdx_runner() -> None:
    """examples/pipeline.py --runner tdx under torchrun (standalone, 3 stages, 1F1B): exit
    0, the schedule's grid printed, and a test accuracy above 95% after two epochs."""
    import os
    import re
    import subprocess
    import sys
    from pathlib import Path

    example = Path(__file__).resolve().parents[1] / "examples" / "pipeline.py"
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone",
           "--nproc-per-node", "3", str(example), "--runner", "tdx", "--schedule", "1f1b",
           "--epochs", "2"]
    done = subprocess.run(cmd, capture_output=True, text=True, timeout=150,
                          env=dict(os.environ, OMP_NUM_THREADS="1"))
    out = done.stdout + done.stderr
    assert done.returncode == 0, out[-4000:]
    assert "stage 2 |  .  . F0 B0 B0 F1" in out, out[-4000:]
    accuracy = [float(a) for a in re.findall(r"test accuracy\s+([\d.]+)%", out)]
    assert len(accuracy) == 2 and accuracy[-1] > 95.0, out[-4000:]

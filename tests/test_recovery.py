"""Checkpoints and recovery: torchdist_ext.checkpoint at 1 to 3 ranks (what a save
keeps, an interrupted save never loaded, a failed save named on every rank, another
world size refused), a ZeRO run resumed in new processes equal to one that never
stopped, and examples/train.py under torchrun --max-restarts, one of its ranks killed
mid-training, ending on the same weights as the run that was not interrupted.
"""

from __future__ import annotations

import glob
import os
import random
import re
import subprocess
import sys
import threading
from collections import OrderedDict
from pathlib import Path

import pytest
import torch
import torch.distributed as dist
import torch.nn as nn

from torchdist_ext.checkpoint import Checkpointer, CheckpointError, rng_state, set_rng_state
from torchdist_ext.testing import expect_refusal, run_ranks

ROOT = Path(__file__).resolve().parents[1]


def _state(rank: int, step: int) -> dict:
    model = OrderedDict(w=torch.full((3, 2), rank * 100.0 + step, dtype=torch.float64),
                        b=torch.arange(5, dtype=torch.int32) + step)
    model._metadata = {"": {"version": step}}  # what load_state_dict reads
    return {"model": model, "opt": {"state": {0: {"step": torch.tensor(float(step))}},
                                    "param_groups": [{"lr": 0.1, "params": [0]}]},
            "rank": rank, "step": step, "list": [torch.ones(4) * rank, "text", (1, 2.5)]}


def _same(a, b) -> bool:
    if isinstance(a, torch.Tensor):
        return isinstance(b, torch.Tensor) and a.dtype == b.dtype and torch.equal(a, b)
    if isinstance(a, dict):
        return (type(a) is type(b) and a.keys() == b.keys()
                and all(_same(a[k], b[k]) for k in a)
                and getattr(a, "_metadata", None) == getattr(b, "_metadata", None))
    if isinstance(a, (list, tuple)):
        return type(a) is type(b) and len(a) == len(b) and all(map(_same, a, b))
    return a == b


def _mine(directory: str, rank: int, step: int) -> list[str]:
    return glob.glob(os.path.join(directory, f"step-{step:012d}", f"rank-{rank:05d}-*"))


def _checkpointer_cases(rank: int, world: int, directory: str) -> list[str]:
    fails: list[str] = []
    last = world - 1

    def loaded(expect_step: int, expect_state: dict, **kw) -> None:
        got = ck.load(**kw)
        if got is None or got[0] != expect_step or not _same(got[1], expect_state):
            fails.append(f"load({kw}): step {None if got is None else got[0]}, wanted "
                         f"{expect_step} and its state")

    ck = Checkpointer(directory, keep=2)
    if ck.load() is not None or ck.steps() != []:
        fails.append("an empty directory has a checkpoint")
    for step in range(6):
        ck.save(step, _state(rank, step))
    kept = sorted(int(p.split("step-")[1][:12]) for p in
                  glob.glob(os.path.join(directory, "step-*", f"rank-{rank:05d}-*")))
    if kept != [4, 5] or ck.steps() != [4, 5]:
        fails.append(f"keep=2 kept {kept}, steps() {ck.steps()}")
    loaded(5, _state(rank, 5))
    loaded(4, _state(rank, 4), step=4)
    expect_refusal(fails, lambda: ck.load(step=3), "step 3 is not a complete checkpoint",
                   "complete steps: [4, 5]", errors=(CheckpointError,))

    # A save that does not block takes its copy at the call, not when it writes.
    live = {"t": torch.zeros(1000, dtype=torch.float64), "n": [1]}
    ck.save(6, live, blocking=False)
    live["t"].add_(1)
    live["n"].append(2)
    ck.wait()
    loaded(6, {"t": torch.zeros(1000, dtype=torch.float64), "n": [1]})

    # A crash cut the last rank's write of step 6 short: the step is not complete, and
    # the one before is loaded.
    dist.barrier()
    if rank == last:
        for path in _mine(directory, rank, 6):
            os.remove(path)
    dist.barrier()
    loaded(5, _state(rank, 5))
    # Saved again (as a restarted job does), it is complete again, and whole.
    ck.save(6, _state(rank, 6))
    loaded(6, _state(rank, 6))
    files = glob.glob(os.path.join(directory, f"step-{6:012d}", "*"))
    if len(files) != world:
        fails.append(f"step 6 holds {len(files)} files for {world} ranks: {files}")

    # A save that fails on the last rank (an object torch.save cannot pickle) raises on
    # every rank, naming it; the step is skipped.
    def failing(step: int) -> dict:
        state = _state(rank, step)
        if rank == last:
            state["oops"] = lambda: None
        return state

    expect_refusal(fails, lambda: ck.save(7, failing(7)), f"rank {last} of {world} could not "
                   "write its file", "checkpoint step 7", errors=(CheckpointError,))
    loaded(6, _state(rank, 6))
    # Step 7 saved whole, then saved again (other values) and cut short on the last
    # rank: the first save stays whole and is loaded; the second one's files on the
    # other ranks are not mixed with it.
    ck.save(7, _state(rank, 7))
    expect_refusal(fails, lambda: ck.save(7, failing(70)), f"rank {last} of {world}",
                   errors=(CheckpointError,))
    loaded(7, _state(rank, 7))
    # A state that cannot be copied for a save that does not block: the rank does not
    # raise alone at the call (the others went on), every rank raises at the next wait.
    odd = {"lock": threading.Lock()} if rank == last else {"x": 1}
    ck.save(8, odd, blocking=False)
    dist.barrier()  # the others' collectives meet nothing of the failed save
    expect_refusal(fails, ck.wait, f"rank {last} of {world} could not copy its state",
                   errors=(CheckpointError,))

    # A file that cannot be read: every rank raises, naming the rank.
    dist.barrier()
    if rank == last:
        for path in _mine(directory, rank, 6):
            with open(path, "r+b") as f:
                f.truncate(40)
    dist.barrier()
    expect_refusal(fails, lambda: ck.load(step=6), f"rank {last} of {world} could not read",
                   errors=(CheckpointError,))

    # A run rewound to an earlier step: its next save removes the steps after it.
    ck = Checkpointer(directory, keep=3)
    for step in (8, 9, 10):
        ck.save(step, _state(rank, step))
    ck.load(step=8)
    ck.save(9, _state(rank, 90))
    if ck.steps() != [8, 9]:
        fails.append(f"after the rewound save of 9: steps {ck.steps()}, wanted [8, 9]")
    loaded(9, _state(rank, 90))

    expect_refusal(fails, lambda: ck.save(-1, {}), "step must be an int >= 0")
    expect_refusal(fails, lambda: ck.save(True, {}), "step must be an int >= 0")
    expect_refusal(fails, lambda: ck.save(1, [1]), "state must be a mapping")
    expect_refusal(fails, lambda: ck.load(step=-2), "step must be None or an int >= 0")
    expect_refusal(fails, lambda: Checkpointer(directory, keep=0), "keep must be an int >= 1")
    expect_refusal(fails, lambda: Checkpointer(3), "directory must be a path")
    return fails


@pytest.mark.parametrize("world", [1, 3])
def test_checkpointer_saves_keeps_and_loads_only_whole_steps(tmp_path, world: int) -> None:
    for rank, fails in enumerate(run_ranks(_checkpointer_cases, world, timeout=90,
                                           args=(str(tmp_path),))):
        assert not fails, (rank, fails)


def _save_two(rank: int, world: int, directory: str) -> None:
    ck = Checkpointer(directory)
    ck.save(3, {"x": torch.ones(2) * rank})


def _load_refused(rank: int, world: int, directory: str) -> str:
    try:
        Checkpointer(directory).load()
    except CheckpointError as e:
        return str(e)
    return "loaded"


def test_a_checkpoint_of_another_world_size_is_refused_on_every_rank(tmp_path) -> None:
    run_ranks(_save_two, 2, timeout=60, args=(str(tmp_path),))
    for world in (1, 3):
        for rank, text in enumerate(run_ranks(_load_refused, world, timeout=60,
                                              args=(str(tmp_path),))):
            assert f"step 3, was saved by 2 ranks and this group has {world}" in text, \
                (world, rank, text)
            assert "torch.distributed.checkpoint" in text, text


def test_rng_state_round_trip() -> None:
    import numpy as np

    random.seed(1)
    torch.manual_seed(2)
    np.random.seed(3)
    saved = rng_state()
    # What torch.load(weights_only=True) must read back: the form checkpoints store.
    path = os.path.join(os.environ.get("TMPDIR", "/tmp"), f"tdx-rng-{os.getpid()}.pt")
    torch.save(saved, path)
    try:
        saved = torch.load(path, weights_only=True)
    finally:
        os.remove(path)
    first = (random.random(), torch.rand(3), np.random.rand(3))
    set_rng_state(saved)
    again = (random.random(), torch.rand(3), np.random.rand(3))
    assert first[0] == again[0]
    assert torch.equal(first[1], again[1])
    assert (first[2] == again[2]).all()
    with pytest.raises(TypeError, match="what rng_state"):
        set_rng_state({"python": 1})


def _zero_run(rank: int, world: int, directory: str, stop: int, steps: int,
              mixed: bool = False) -> list:
    """ZeRO stage 2 over a float64 MLP (``mixed``: computing in float32 over the float64
    shards): resumes from the newest checkpoint in ``directory`` if any, trains to
    ``steps``, saving at ``stop``; returns the final parameters (gathered whole, in the
    shards' precision)."""
    from torchdist_ext.parallel import ZeroConfig, ZeroOptimizer

    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(5, 7), nn.Tanh(), nn.Linear(7, 3)).double()
    opt = ZeroOptimizer(model.parameters(), torch.optim.Adam, lr=0.05, module=model,
                        config=ZeroConfig(stage=2,
                                          param_dtype=torch.float32 if mixed else None))
    ck = Checkpointer(directory)
    start = 0
    found = ck.load()
    if found is not None:
        start, state = found
        with opt.gathered(writeback=True):
            model.load_state_dict(state["model"])
        opt.load_state_dict(state["opt"])
    gen = torch.Generator().manual_seed(7)
    xs = torch.randn(8, 4 * world, 5, generator=gen, dtype=torch.float64)  # whatever steps is
    for step in range(start, steps):
        opt.zero_grad()
        x = xs[step][rank::world]
        model(x).square().mean().backward()
        opt.step()
        if step + 1 == stop:
            with opt.gathered():
                model_state = {k: v.clone() for k, v in model.state_dict().items()}
            ck.save(step + 1, {"model": model_state, "opt": opt.state_dict()})
    with opt.gathered(full_precision=True):
        return [[p.dtype == torch.float64, p.detach().clone().tolist()]
                for p in model.parameters()]


@pytest.mark.parametrize("mixed", [False, True])
def test_zero_resumed_in_new_processes_ends_where_an_uninterrupted_run_does(
        tmp_path, mixed: bool) -> None:
    """Each rank's own optimizer shard goes into its own file: the resumed run (new
    processes, from step 3 of 6) ends on the parameters of the run that never stopped,
    exactly (float64). With mixed precision the model's weights are float32, and the
    optimizer's state carries the float64 masters."""
    whole = run_ranks(_zero_run, 3, timeout=90, args=(str(tmp_path / "a"), 3, 6, mixed))
    run_ranks(_zero_run, 3, timeout=90, args=(str(tmp_path / "b"), 3, 3, mixed))
    resumed = run_ranks(_zero_run, 3, timeout=90, args=(str(tmp_path / "b"), 0, 6, mixed))
    assert resumed == whole
    assert whole[0] == whole[1] == whole[2]
    assert all(is_double for is_double, _ in whole[0])


def _torchrun(tmp: Path, name: str, restarts: int, *extra: str) -> subprocess.CompletedProcess:
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone",
           "--nproc-per-node", "2", "--max-restarts", str(restarts),
           str(ROOT / "examples" / "train.py"), "--epochs", "3", "--samples", "3000",
           "--checkpoint-dir", str(tmp / name), "--checkpoint-every", "7",
           "--save-model", str(tmp / f"{name}.pt"), *extra]
    env = dict(os.environ, OMP_NUM_THREADS="1", PYTHONUNBUFFERED="1")
    return subprocess.run(cmd, capture_output=True, text=True, timeout=240, env=env,
                          cwd=ROOT)


def test_torchrun_restart_after_a_killed_rank_resumes_to_the_same_weights(tmp_path) -> None:
    """examples/train.py on 2 ranks, checkpoints every 7 steps: its last rank is killed
    (SIGKILL) at step 40 in the first attempt; torchrun --max-restarts 1 starts both
    again on its store, they resume from step 35 and end on the weights of the run
    that was never interrupted, bit for bit."""
    whole = _torchrun(tmp_path, "whole", 0)
    assert whole.returncode == 0, whole.stdout[-3000:] + whole.stderr[-3000:]
    crashed = _torchrun(tmp_path, "crashed", 1, "--crash-at-step", "40")
    report = crashed.stdout[-4000:] + crashed.stderr[-6000:]
    assert crashed.returncode == 0, report
    assert "rank 1: crashing at step 40" in crashed.stdout, report
    # From step 35 (its save written on a thread may still be unfinished at the kill,
    # 5 steps later; then from 28).
    assert re.search(r"resumed from step (35 \(epoch 2, batch 16\)|28 \(epoch 2, batch 9\)), "
                     r"attempt 1", crashed.stdout), report
    # The restarted group is made on the first attempt's store without reading its keys:
    # no warning of the backend's or UCX's (the backend logs to standard error, UCX to
    # standard output).
    assert not re.search(r"\bWARN\b", crashed.stdout + crashed.stderr), report
    a = torch.load(tmp_path / "whole.pt", weights_only=True)
    b = torch.load(tmp_path / "crashed.pt", weights_only=True)
    assert a.keys() == b.keys()
    assert all(torch.equal(a[k], b[k]) for k in a), report
    losses = [line for line in crashed.stdout.splitlines() if line.startswith("epoch  3")]
    assert losses and losses[-1].split()[3] in whole.stdout, report

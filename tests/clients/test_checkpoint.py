"""torch.distributed.checkpoint, unmodified, on tdx, with resharding: 4 ranks train a
float64 FSDP2 model for a few Adam steps and save its sharded model and optimizer state
dicts (DTensors, dim-0 shards of uneven size) with dcp.save; then 2 ranks build the same
model from a different initialisation, dcp.load the checkpoint into their own 2-way
shards and set it with set_state_dict. Every parameter and every Adam state tensor,
reassembled in the test process from the ranks' local shards (not through a backend
collective), must equal the saved values exactly.
"""

from __future__ import annotations

import io

import torch
import torch.distributed.checkpoint as dcp
import torch.nn as nn
from torch.distributed.checkpoint.state_dict import get_state_dict, set_state_dict
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.fsdp import fully_shard
from torch.distributed.tensor import DTensor, Shard

from torchdist_ext.testing import run_ranks

SAVE_WORLD, LOAD_WORLD = 4, 2
STEPS = 3


def _model(seed: int) -> nn.Sequential:
    torch.manual_seed(seed)
    return nn.Sequential(nn.Linear(5, 13), nn.Tanh(), nn.Linear(13, 7), nn.Tanh(),
                         nn.Linear(7, 3)).double()


def _sharded(world: int, seed: int) -> tuple[nn.Module, torch.optim.Optimizer]:
    mesh = init_device_mesh("cpu", (world,))
    model = _model(seed)
    for layer in model:
        if isinstance(layer, nn.Linear):
            fully_shard(layer, mesh=mesh)
    fully_shard(model, mesh=mesh)
    return model, torch.optim.Adam(model.parameters(), lr=0.01)


def _local(state: dict) -> dict[str, torch.Tensor]:
    """This rank's piece of every tensor in a (nested) state dict, by flattened key."""
    out = {}
    for key, value in state.items():
        if isinstance(value, dict):
            out.update({f"{key}.{k}": v for k, v in _local(value).items()})
        elif isinstance(value, DTensor):
            assert value.placements == (Shard(0),), (key, value.placements)
            out[key] = value.to_local().detach().clone()
        elif isinstance(value, torch.Tensor):
            out[key] = value.detach().clone()  # replicated, e.g. Adam's step
    return out


def _pack(obj) -> bytes:
    buf = io.BytesIO()  # tensors go back serialised: queued shared memory dies with the rank
    torch.save(obj, buf)
    return buf.getvalue()


def _save(rank: int, world: int, path: str) -> bytes:
    model, opt = _sharded(world, seed=0)
    g = torch.Generator().manual_seed(rank)
    for _ in range(STEPS):
        opt.zero_grad()
        x = torch.randn(6, 5, generator=g, dtype=torch.float64)
        y = torch.randint(0, 3, (6,), generator=g)
        nn.functional.cross_entropy(model(x), y).backward()
        opt.step()
    model_sd, optim_sd = get_state_dict(model, opt)
    dcp.save({"model": model_sd, "optim": optim_sd}, checkpoint_id=path)
    return _pack(_local({"model": model_sd, "optim": optim_sd}))


def _load(rank: int, world: int, path: str) -> bytes:
    model, opt = _sharded(world, seed=1)  # different values everywhere before the load
    model_sd, optim_sd = get_state_dict(model, opt)  # initialises the Adam state
    before = _local({"model": model_sd})
    state = {"model": model_sd, "optim": optim_sd}
    dcp.load(state, checkpoint_id=path)
    set_state_dict(model, opt, model_state_dict=state["model"], optim_state_dict=state["optim"])
    # Read back from the live model and optimizer, not from the dict dcp filled in.
    model_sd, optim_sd = get_state_dict(model, opt)
    return _pack((before, _local({"model": model_sd, "optim": optim_sd})))


def _full(per_rank: list[dict[str, torch.Tensor]]) -> dict[str, torch.Tensor]:
    """Reassemble dim-0 shards (rank order); replicated 0-d tensors must agree."""
    out = {}
    for key in per_rank[0]:
        parts = [r[key] for r in per_rank]
        if parts[0].dim() == 0:
            assert all(torch.equal(p, parts[0]) for p in parts), key
            out[key] = parts[0]
        else:
            out[key] = torch.cat(parts)
    return out


def test_checkpoint_save_4_ranks_load_2_ranks(tmp_path) -> None:
    path = str(tmp_path / "ckpt")
    saved = _full([torch.load(io.BytesIO(b)) for b in run_ranks(_save, SAVE_WORLD, args=(path,))])
    loaded = [torch.load(io.BytesIO(b)) for b in run_ranks(_load, LOAD_WORLD, args=(path,))]
    before = _full([b for b, _ in loaded])
    after = _full([a for _, a in loaded])

    expected_model = {f"model.{n}": p.detach() for n, p in _model(0).named_parameters()}
    assert {k for k in saved if k.startswith("model.")} == expected_model.keys()
    # Adam keeps step, exp_avg and exp_avg_sq for each of the 6 parameters.
    assert len([k for k in saved if k.startswith("optim.")]) == 3 * len(expected_model)
    assert saved.keys() == after.keys()
    fails = []
    for key in saved:
        if saved[key].shape != after[key].shape or not torch.equal(saved[key], after[key]):
            fails.append(f"{key}: loaded value differs from the saved one")
    for key, p0 in expected_model.items():
        if saved[key].shape != p0.shape:
            fails.append(f"{key}: reassembled shape {tuple(saved[key].shape)}, expected {tuple(p0.shape)}")
        elif torch.equal(saved[key], p0):
            fails.append(f"{key}: training never changed it")
        if torch.equal(before[key], saved[key]):
            fails.append(f"{key}: the 2-rank model held the saved values before loading")
    assert not fails, "\n".join(fails)

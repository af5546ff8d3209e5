"""torch.distributed.optim.ZeroRedundancyOptimizer, unmodified, on tdx: Adam state
partitioned over the ranks (with DDP for the gradients), once with per-parameter
broadcasts and once with parameters_as_bucket_view=True. Each run is repeated on a gloo
group in the same processes; the final parameters and the consolidated optimizer state
must agree within 1e-5, and the parameters must have moved.
"""

from __future__ import annotations

import io

import torch
import torch.distributed as dist
import torch.nn as nn
from torch.distributed.optim import ZeroRedundancyOptimizer
from torch.nn.parallel import DistributedDataParallel as DDP

from torchdist_ext.testing import new_gloo_group, run_ranks

WORLD = 3   # 8 parameters over 3 ranks: uneven partitions
STEPS = 5
BATCH = 4
TOL = 1e-5


def _model(seed: int) -> nn.Module:
    torch.manual_seed(seed)
    return nn.Sequential(nn.Linear(5, 16), nn.Tanh(), nn.Linear(16, 24), nn.Tanh(),
                         nn.Linear(24, 8), nn.Tanh(), nn.Linear(8, 3)).double()


def _train(group: dist.ProcessGroup | None, bucket_view: bool, rank: int, world: int):
    g = torch.Generator().manual_seed(11)
    x = torch.randn(STEPS, world * BATCH, 5, generator=g, dtype=torch.float64)
    y = torch.randint(0, 3, (STEPS, world * BATCH), generator=g)
    mine = slice(rank * BATCH, (rank + 1) * BATCH)
    model = DDP(_model(seed=100 + rank), process_group=group)  # rank 0's init wins
    opt = ZeroRedundancyOptimizer(model.parameters(), optimizer_class=torch.optim.Adam,
                                  process_group=group, parameters_as_bucket_view=bucket_view,
                                  lr=0.01)
    for s in range(STEPS):
        opt.zero_grad()
        nn.functional.cross_entropy(model(x[s, mine]), y[s, mine]).backward()
        opt.step()
    # Gather every rank's shard of the Adam state on rank 0 (object send/recv).
    opt.consolidate_state_dict(to=0)
    state = opt.state_dict() if rank == 0 else None
    params = [p.detach().clone() for p in model.module.parameters()]
    return params, state


def _zero(rank: int, world: int) -> bytes:
    gloo = new_gloo_group()
    out = {view: (_train(None, view, rank, world), _train(gloo, view, rank, world))
           for view in (False, True)}
    buf = io.BytesIO()  # tensors go back serialised: queued shared memory dies with the rank
    torch.save(out, buf)
    return buf.getvalue()


def _state_tensors(state: dict) -> list[tuple[str, torch.Tensor]]:
    """(key, tensor) for every tensor of the optimizer state, in a fixed order."""
    return [(f"{i}.{k}", v) for i, per_param in sorted(state["state"].items())
            for k, v in sorted(per_param.items()) if isinstance(v, torch.Tensor)]


def test_zero_redundancy_optimizer_matches_gloo() -> None:
    results = [torch.load(io.BytesIO(b)) for b in run_ranks(_zero, WORLD)]
    init = [p.detach() for p in _model(seed=100).parameters()]
    fails = []
    for view in (False, True):
        for rank, per_view in enumerate(results):
            (ours, ours_state), (gloo, gloo_state) = per_view[view]
            for i, (a, b, p0) in enumerate(zip(ours, gloo, init, strict=True)):
                diff = (a - b).abs().max().item()
                if not diff <= TOL:
                    fails.append(f"bucket_view={view}, rank {rank}: parameter {i} differs "
                                 f"from gloo by {diff:.3g}")
                if torch.equal(a, p0):
                    fails.append(f"bucket_view={view}, rank {rank}: parameter {i} never moved")
        (_, ours_state), (_, gloo_state) = results[0][view]
        ours_t, gloo_t = _state_tensors(ours_state), _state_tensors(gloo_state)
        # Adam keeps step, exp_avg and exp_avg_sq for each of the 8 parameters.
        assert [k for k, _ in ours_t] == [k for k, _ in gloo_t] and len(ours_t) == 3 * len(init)
        for (key, a), (_, b) in zip(ours_t, gloo_t):
            diff = (a.double() - b.double()).abs().max().item()
            if not diff <= TOL:
                fails.append(f"bucket_view={view}: optimizer state {key} differs from gloo by {diff:.3g}")
    assert not fails, "\n".join(fails)

"""torch DistributedDataParallel, unmodified, on tdx: the DDP features beyond the plain
loop of tests/test_ddp.py. Each variant trains once on the default (tdx) group and once
on a gloo group in the same processes; the final parameters must agree within 1e-5 and
must have moved from their initial values.

Variants: no_sync() gradient accumulation; comm hooks built on ``work.get_future()``
(default_hooks.allreduce_hook, and PowerSGD, whose callbacks issue further all-reduces);
find_unused_parameters=True with a branch used on every other step and a layer never
used; static_graph=True with two layers never used.
"""

from __future__ import annotations

import io

import torch
import torch.distributed as dist
import torch.nn as nn
from torch.distributed.algorithms.ddp_comm_hooks import default_hooks, powerSGD_hook
from torch.nn.parallel import DistributedDataParallel as DDP

from torchdist_ext.testing import new_gloo_group, run_ranks

WORLD = 3
STEPS = 5
MICRO = 3   # micro-batches per step in the no_sync variant
BATCH = 4   # samples per micro-batch per rank
TOL = 1e-5


class Net(nn.Module):
    """Trunk and head are used on every step; ``branch`` only when asked; ``unused`` never."""

    def __init__(self, seed: int, extra: bool) -> None:
        super().__init__()
        torch.manual_seed(seed)
        self.trunk = nn.Sequential(nn.Linear(5, 16), nn.Tanh(), nn.Linear(16, 16), nn.Tanh())
        self.head = nn.Linear(16, 3)
        if extra:
            self.branch = nn.Linear(16, 3)
            self.unused = nn.Linear(16, 3)
        self.double()

    def forward(self, x: torch.Tensor, use_branch: bool = False) -> torch.Tensor:
        h = self.trunk(x)
        out = self.head(h)
        if use_branch:
            out = out + self.branch(h)
        return out


def _data(world: int) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(7)
    x = torch.randn(STEPS, MICRO, world * BATCH, 5, generator=g, dtype=torch.float64)
    y = torch.randint(0, 3, (STEPS, MICRO, world * BATCH), generator=g)
    return x, y


def _train(variant: str, group: dist.ProcessGroup | None, rank: int, world: int) -> dict[str, torch.Tensor]:
    """One DDP run of ``variant`` over ``group`` (None: the default tdx group)."""
    x, y = _data(world)
    mine = slice(rank * BATCH, (rank + 1) * BATCH)
    extra = variant in ("find_unused", "static_graph")
    # A different seed per rank: DDP must broadcast rank 0's parameters at construction.
    net = Net(seed=100 + rank, extra=extra)
    # Several small buckets; PowerSGD keeps the default size (see its test).
    kwargs = dict(process_group=group, bucket_cap_mb=25 if variant == "powersgd_hook" else 0.001)
    if variant == "find_unused":
        kwargs["find_unused_parameters"] = True
    if variant == "static_graph":
        kwargs["static_graph"] = True
    model = DDP(net, **kwargs)
    if variant == "allreduce_hook":
        model.register_comm_hook(group, default_hooks.allreduce_hook)
    if variant == "powersgd_hook":
        state = powerSGD_hook.PowerSGDState(process_group=group, matrix_approximation_rank=1,
                                            start_powerSGD_iter=2, random_seed=0)
        model.register_comm_hook(state, powerSGD_hook.powerSGD_hook)
    opt = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    for s in range(STEPS):
        opt.zero_grad()
        if variant == "no_sync":
            # Accumulate MICRO micro-batches; only the last backward all-reduces.
            for m in range(MICRO):
                loss = nn.functional.cross_entropy(model(x[s, m, mine]), y[s, m, mine]) / MICRO
                if m < MICRO - 1:
                    with model.no_sync():
                        loss.backward()
                else:
                    loss.backward()
        else:
            use_branch = variant == "find_unused" and s % 2 == 0
            out = model(x[s, 0, mine], use_branch=use_branch)
            nn.functional.cross_entropy(out, y[s, 0, mine]).backward()
        opt.step()
    return {n: p.detach().clone() for n, p in model.module.named_parameters()}


def _ddp_variants(rank: int, world: int, variants: tuple[str, ...]) -> bytes:
    gloo = new_gloo_group()
    out = {v: (_train(v, None, rank, world), _train(v, gloo, rank, world)) for v in variants}
    # Tensors go back serialised: a queued tensor's shared memory dies with its rank.
    buf = io.BytesIO()
    torch.save(out, buf)
    return buf.getvalue()


def _check(packed: list[bytes], variants: tuple[str, ...]) -> None:
    results = [torch.load(io.BytesIO(b)) for b in packed]
    fails = []
    for variant in variants:
        init = dict(Net(seed=100, extra=variant in ("find_unused", "static_graph")).named_parameters())
        for rank, per_variant in enumerate(results):
            ours, gloo = per_variant[variant]
            assert ours.keys() == gloo.keys() == init.keys()
            for name in ours:
                diff = (ours[name] - gloo[name]).abs().max().item()
                if not diff <= TOL:
                    fails.append(f"{variant}, rank {rank}: {name} differs from gloo by {diff:.3g}")
                if not torch.equal(ours[name], results[0][variant][0][name]):
                    fails.append(f"{variant}, rank {rank}: {name} differs from rank 0's")
            moved = {n for n in ours if not torch.equal(ours[n], init[n].detach())}
            never = {"find_unused": {"unused."}, "static_graph": {"unused.", "branch."}}.get(variant, set())
            expect = {n for n in ours if not any(n.startswith(p) for p in never)}
            if moved != expect:
                fails.append(f"{variant}, rank {rank}: parameters that moved {sorted(moved)}, "
                             f"expected {sorted(expect)}")
    assert not fails, "\n".join(fails)


def test_ddp_features_match_gloo() -> None:
    variants = ("no_sync", "allreduce_hook", "find_unused", "static_graph")
    _check(run_ranks(_ddp_variants, WORLD, args=(variants,)), variants)


def test_ddp_powersgd_hook_matches_gloo() -> None:
    # One bucket (DDP's default size): with several buckets PowerSGD also hangs on plain
    # gloo, whose two worker threads then block in the callbacks.
    variants = ("powersgd_hook",)
    _check(run_ranks(_ddp_variants, 2, args=(variants,), timeout=15), variants)

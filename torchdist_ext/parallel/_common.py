"""What the strategies that wrap an optimizer share: their arguments' checks, parameter
groups read once, and the check that every rank laid its parameters out alike."""

from __future__ import annotations

import hashlib
from typing import Any

import torch
import torch.distributed as dist

# torch 2.14 renamed the flat collectives (the old names warn there); older releases lack
# the new names.
all_gather_single = getattr(dist, "all_gather_single", dist.all_gather_into_tensor)
reduce_scatter_single = getattr(dist, "reduce_scatter_single", dist.reduce_scatter_tensor)


def check_wrapper_args(owner: str, optimizer_class: Any, config: Any, config_type: type,
                       example: str) -> None:
    """The optimizer class, the config's type and an initialised torch.distributed, each
    refused with the fix."""
    if not (isinstance(optimizer_class, type)
            and issubclass(optimizer_class, torch.optim.Optimizer)):
        raise TypeError(f"{owner}: optimizer_class must be a torch.optim.Optimizer subclass "
                        f"such as {example}, not {optimizer_class!r}")
    if not isinstance(config, config_type):
        raise TypeError(f"{owner}: config must be a {config_type.__name__}, not {config!r}")
    if not dist.is_initialized():
        raise RuntimeError(f"{owner}: torch.distributed is not initialized; call "
                           "dist.init_process_group first")


def group_as_list(group: dict[str, Any]) -> dict[str, Any]:
    """A parameter group whose "params" (a tensor, list or generator) is a list, so that
    it can be read more than once."""
    ps = group.get("params", [])
    return {**group, "params": [ps] if isinstance(ps, torch.Tensor) else list(ps)}


def ranks_that_differ(text: str, group: dist.ProcessGroup, device: torch.device) -> list[int]:
    """The ranks of ``group`` whose ``text`` (a description of their layout) hashes
    otherwise than this rank's: one all_gather of 8 bytes per rank."""
    digest = int.from_bytes(hashlib.sha256(text.encode()).digest()[:8], "little", signed=True)
    mine = torch.tensor([digest], dtype=torch.int64, device=device)
    every = torch.empty(dist.get_world_size(group), dtype=torch.int64, device=device)
    all_gather_single(every, mine, group=group)
    return [r for r, d in enumerate(every.tolist()) if d != digest]

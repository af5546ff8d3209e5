"""Unmodified PyTorch clients on tdx, each against the same run on gloo."""

from __future__ import annotations

from typing import Sequence

import torch


def compare_training(where: str, ours: dict[str, torch.Tensor], gloo: dict[str, torch.Tensor],
                     reference: dict[str, torch.Tensor], init: dict[str, torch.Tensor],
                     our_losses: Sequence[float], gloo_losses: Sequence[float],
                     tol: float) -> list[str]:
    """What differs between one rank's full parameters after training on tdx and on gloo,
    and between them and one process's training (``reference``), beyond ``tol``; a
    parameter still at its ``init`` value; and losses that differ from gloo's. ``where``
    starts each line ("rank 2")."""
    fails = []
    assert ours.keys() == gloo.keys() == reference.keys()
    for name in ours:
        diff = (ours[name] - gloo[name]).abs().max().item()
        if not diff <= tol:
            fails.append(f"{where}: {name} differs from gloo by {diff:.3g}")
        ref = (ours[name] - reference[name]).abs().max().item()
        if not ref <= tol:
            fails.append(f"{where}: {name} differs from single-process training by {ref:.3g}")
        if torch.equal(ours[name], init[name]):
            fails.append(f"{where}: {name} never moved")
    loss_diff = max(abs(p - q) for p, q in zip(our_losses, gloo_losses, strict=True))
    if not loss_diff <= tol:
        fails.append(f"{where}: losses differ from gloo by {loss_diff:.3g}")
    return fails

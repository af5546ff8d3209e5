"""The bundled default data set of the examples: three interleaved spirals in 2-D.

It is generated from a fixed seed, so every rank (and every run) sees the same samples
without a download. Three classes wind around each other, so a linear model cannot
separate them and a small MLP has to learn a curved boundary: the loss falls over a few
epochs instead of in one step.
"""

from __future__ import annotations

import math

import torch

NUM_CLASSES = 3
NUM_FEATURES = 2


def spirals(samples: int = 12_000, noise: float = 0.15, seed: int = 0) -> tuple[torch.Tensor, torch.Tensor]:
    """Returns (features [samples, 2] float32, labels [samples] int64), shuffled."""
    g = torch.Generator().manual_seed(seed)
    per_class = samples // NUM_CLASSES
    xs, ys = [], []
    for c in range(NUM_CLASSES):
        r = torch.linspace(0.1, 1.0, per_class)
        theta = r * 3.0 * math.pi + c * 2.0 * math.pi / NUM_CLASSES
        theta = theta + noise * torch.randn(per_class, generator=g)
        xs.append(torch.stack([r * torch.cos(theta), r * torch.sin(theta)], dim=1))
        ys.append(torch.full((per_class,), c, dtype=torch.int64))
    x = torch.cat(xs)
    y = torch.cat(ys)
    order = torch.randperm(x.shape[0], generator=g)
    return x[order].contiguous(), y[order].contiguous()


def split(x: torch.Tensor, y: torch.Tensor, test_fraction: float = 0.2):
    """The first (1 - test_fraction) of the samples train, the rest test."""
    n_test = int(x.shape[0] * test_fraction)
    return (x[n_test:], y[n_test:]), (x[:n_test], y[:n_test])

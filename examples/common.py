"""Shared pieces of the per-client examples (ddp.py, fsdp.py, pipeline.py,
tensor_parallel.py): command-line options, process-group set-up, a small MLP and the
bundled spirals data set (examples/data.py), sharded per rank.

Every example is an unmodified PyTorch distributed program apart from ``import
torchdist_ext`` (done here), which registers the ``tdx`` backend; ``--backend gloo``
runs the same job on gloo.
"""

from __future__ import annotations

import argparse
import math
import os
import sys
import time
from collections import OrderedDict
from typing import Iterator

import torch
import torch.distributed as dist
import torch.nn as nn

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import torchdist_ext  # noqa: E402,F401  (registers "tdx")
from data import NUM_CLASSES, NUM_FEATURES, spirals, split  # noqa: E402

__all__ = [
    "NUM_CLASSES", "NUM_FEATURES", "parse_args", "check_device", "device_name",
    "positive_float", "positive_int", "setup", "make_model", "load_data",
    "shard", "batches", "mean_over_ranks", "print0", "train",
]


def parse_args(doc: str, extra=None, **defaults) -> argparse.Namespace:
    """The options every example takes; ``defaults`` overrides their default values
    (``epochs=4``), and ``extra(parser)`` may add the example's own options."""
    p = argparse.ArgumentParser(description=doc, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--backend", default=defaults.get("backend", "tdx"))
    p.add_argument("--epochs", type=positive_int, default=defaults.get("epochs", 6))
    p.add_argument("--batch-size", type=positive_int, default=defaults.get("batch_size", 64),
                   help="samples per optimizer step per data-parallel rank")
    p.add_argument("--lr", type=positive_float, default=defaults.get("lr", 0.01))
    p.add_argument("--hidden", type=positive_int, default=defaults.get("hidden", 64))
    p.add_argument("--samples", type=positive_int, default=defaults.get("samples", 12_000),
                   help="size of the generated spirals data set (train + test)")
    p.add_argument("--device", default="cpu", choices=["cpu", "cuda"])
    if extra is not None:
        extra(p)
    args = p.parse_args()
    check_device(p, args.device)
    return args


def check_device(parser: argparse.ArgumentParser, device: str) -> None:
    """Refuse ``--device cuda`` (or ``cuda:N``) where no GPU is visible, before any process
    group starts (the GPU index would otherwise divide by a device count of 0). The one
    place the examples say so."""
    if torch.device(device).type == "cuda" and not torch.cuda.is_available():
        parser.error(f"--device {device}: no CUDA device is visible to this process; "
                     "use --device cpu")


def device_name(text: str) -> str:
    """An argparse type: ``cpu``, ``cuda`` or ``cuda:N``."""
    try:
        kind = torch.device(text).type
    except RuntimeError:
        kind = None
    if kind not in ("cpu", "cuda"):
        raise argparse.ArgumentTypeError(f"{text!r}: use cpu, cuda or cuda:N")
    return text


def positive_float(text: str) -> float:
    """An argparse type: a finite number > 0 (a learning rate)."""
    try:
        value = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"not a number: {text!r}") from None
    if not math.isfinite(value) or value <= 0:
        raise argparse.ArgumentTypeError(f"must be a finite number > 0, got {text}")
    return value


def positive_int(text: str) -> int:
    """An argparse type: a whole number >= 1."""
    try:
        value = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"not a whole number: {text!r}") from None
    if value < 1:
        raise argparse.ArgumentTypeError(f"must be at least 1, got {value}")
    return value


def setup(args: argparse.Namespace) -> tuple[int, int, torch.device]:
    """Initialises the default process group (torchrun's environment) and picks the
    device: the CPU, or the GPU of this rank's LOCAL_RANK."""
    dist.init_process_group(args.backend)
    device = torch.device("cpu")
    if args.device == "cuda":
        device = torch.device("cuda", int(os.environ.get("LOCAL_RANK", 0)) % torch.cuda.device_count())
        torch.cuda.set_device(device)
    return dist.get_rank(), dist.get_world_size(), device


def make_model(hidden: int = 64, dtype: torch.dtype = torch.float32, seed: int = 0) -> nn.Sequential:
    """A small MLP with named layers: in_proj -> up (x4) -> down -> head, ReLU between.

    The names let the examples address the layers: tensor parallelism splits ``up``
    column-wise and ``down`` row-wise, the pipeline cuts the sequence into stages.
    The same seed gives the same initial weights on every rank."""
    torch.manual_seed(seed)
    return nn.Sequential(OrderedDict([
        ("in_proj", nn.Linear(NUM_FEATURES, hidden)), ("act0", nn.ReLU()),
        ("up", nn.Linear(hidden, 4 * hidden)), ("act1", nn.ReLU()),
        ("down", nn.Linear(4 * hidden, hidden)), ("act2", nn.ReLU()),
        ("head", nn.Linear(hidden, NUM_CLASSES)),
    ])).to(dtype)


def load_data(samples: int = 12_000):
    """((x_train, y_train), (x_test, y_test)) of the spirals data set; identical on
    every rank (fixed seed, no download)."""
    return split(*spirals(samples))


def shard(x: torch.Tensor, y: torch.Tensor, index: int, count: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Every ``count``-th sample from ``index`` on, cut to an equal length on all shards."""
    n = x.shape[0] // count
    return x[index::count][:n], y[index::count][:n]


def batches(n: int, batch_size: int, generator: torch.Generator) -> Iterator[torch.Tensor]:
    """Index tensors of a fresh permutation of ``range(n)``; full batches only, so every
    rank takes the same number of steps."""
    order = torch.randperm(n, generator=generator)
    for i in range(0, n - batch_size + 1, batch_size):
        yield order[i:i + batch_size]


def mean_over_ranks(total: float, count: float, device: torch.device, group=None) -> float:
    """sum(total) / sum(count) over the ranks of ``group`` (default: all)."""
    t = torch.tensor([total, count], dtype=torch.float64, device=device)
    dist.all_reduce(t, group=group)
    return (t[0] / t[1]).item()


def train(model: nn.Module, opt: torch.optim.Optimizer, data: tuple, test: tuple,
          args: argparse.Namespace, generator: torch.Generator, device: torch.device) -> None:
    """The epochs every data-parallel example runs: Adam steps over this rank's batches,
    then rank 0 prints the loss and test accuracy averaged over all ranks."""
    x, y = data
    x_test, y_test = test
    loss_fn = nn.CrossEntropyLoss()
    for epoch in range(args.epochs):
        model.train()
        start = time.perf_counter()
        total, steps = 0.0, 0
        for idx in batches(x.shape[0], args.batch_size, generator):
            idx = idx.to(device)
            opt.zero_grad(set_to_none=True)
            loss = loss_fn(model(x[idx]), y[idx])
            loss.backward()
            opt.step()
            total, steps = total + loss.item(), steps + 1
        elapsed = time.perf_counter() - start
        model.eval()
        with torch.no_grad():
            correct = (model(x_test).argmax(1) == y_test).sum().item()
        # Ranks that hold the same data (a tensor-parallel group) count the same values,
        # so the ratio is unchanged by them.
        loss_mean = mean_over_ranks(total, steps, device)
        accuracy = mean_over_ranks(correct, x_test.shape[0], device)
        print0(f"epoch {epoch + 1:2d}  loss {loss_mean:.4f}  test accuracy {accuracy:6.2%}  "
               f"{elapsed:5.2f} s")


def print0(*a) -> None:
    if dist.get_rank() == 0:
        print(*a, flush=True)

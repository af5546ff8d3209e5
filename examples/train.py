"""Data-parallel training on the tdx backend: torch DDP, unmodified.

    torchrun --standalone --nproc-per-node 4 examples/train.py [--epochs 8] [--backend tdx]

Each rank trains a small MLP on its shard of the bundled spirals data set (examples/data.py)
and DDP averages the gradients through the backend. Rank 0 prints, per epoch, the mean
training loss over all ranks, the test accuracy over all ranks and the samples per second.
Pass --backend gloo to run the same job on gloo for comparison.
"""

from __future__ import annotations

import argparse
import os
import sys
import time

import torch
import torch.distributed as dist
import torch.nn as nn
from torch.nn.parallel import DistributedDataParallel as DDP

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import torchdist_ext  # noqa: E402,F401  (registers "tdx")
from common import check_device, device_name, positive_float, positive_int  # noqa: E402
from data import NUM_CLASSES, NUM_FEATURES, spirals, split  # noqa: E402


def make_model(hidden: int = 128) -> nn.Module:
    return nn.Sequential(
        nn.Linear(NUM_FEATURES, hidden), nn.ReLU(),
        nn.Linear(hidden, hidden), nn.ReLU(),
        nn.Linear(hidden, NUM_CLASSES),
    )


def parse_args() -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--backend", default="tdx")
    p.add_argument("--epochs", type=positive_int, default=8)
    p.add_argument("--batch-size", type=positive_int, default=64, help="per rank")
    p.add_argument("--lr", type=positive_float, default=0.01)
    p.add_argument("--device", type=device_name,
                   default="cuda" if torch.cuda.is_available() else "cpu",
                   help="cpu, cuda or cuda:N (default cuda when a GPU is visible); on "
                        "cuda each rank takes the GPU of its LOCAL_RANK (modulo the GPU "
                        "count), whatever N says")
    args = p.parse_args()
    check_device(p, args.device)
    return args


def main() -> None:
    args = parse_args()
    torch.manual_seed(0)
    dist.init_process_group(args.backend)
    rank, world = dist.get_rank(), dist.get_world_size()
    device = torch.device(args.device)
    if device.type == "cuda":
        device = torch.device("cuda", int(os.environ.get("LOCAL_RANK", 0)) % torch.cuda.device_count())
        torch.cuda.set_device(device)

    (x_train, y_train), (x_test, y_test) = split(*spirals())
    # Each rank takes every world-th sample: disjoint shards of equal size.
    per_rank = x_train.shape[0] // world
    x_mine = x_train[rank::world][:per_rank].to(device)
    y_mine = y_train[rank::world][:per_rank].to(device)
    x_test_mine = x_test[rank::world].to(device)
    y_test_mine = y_test[rank::world].to(device)

    model = DDP(make_model().to(device), device_ids=[device.index] if device.type == "cuda" else None)
    opt = torch.optim.Adam(model.parameters(), lr=args.lr)
    loss_fn = nn.CrossEntropyLoss()
    g = torch.Generator().manual_seed(1234 + rank)

    if rank == 0:
        print(f"training on {world} ranks, backend {args.backend}, device {device.type}, "
              f"{x_train.shape[0]} training samples", flush=True)
    for epoch in range(args.epochs):
        model.train()
        order = torch.randperm(per_rank, generator=g).to(device)
        start = time.perf_counter()
        total = torch.zeros(2, dtype=torch.float64, device=device)  # loss sum, batches
        for i in range(0, per_rank, args.batch_size):
            idx = order[i:i + args.batch_size]
            opt.zero_grad(set_to_none=True)
            loss = loss_fn(model(x_mine[idx]), y_mine[idx])
            loss.backward()
            opt.step()
            total += torch.stack([loss.detach().double(), torch.ones((), dtype=torch.float64, device=device)])
        elapsed = time.perf_counter() - start

        model.eval()
        with torch.no_grad():
            correct = (model(x_test_mine).argmax(1) == y_test_mine).sum()
        stats = torch.stack([total[0], total[1], correct.double(),
                             torch.tensor(float(x_test_mine.shape[0]), dtype=torch.float64, device=device)])
        dist.all_reduce(stats)
        rate = torch.tensor([per_rank / elapsed], dtype=torch.float64, device=device)
        dist.all_reduce(rate)  # samples per second summed over ranks
        if rank == 0:
            print(f"epoch {epoch + 1:2d}  loss {stats[0].item() / stats[1].item():.4f}  "
                  f"test accuracy {stats[2].item() / stats[3].item():6.2%}  "
                  f"{rate.item():9.0f} samples/s", flush=True)
    dist.destroy_process_group()


if __name__ == "__main__":
    main()

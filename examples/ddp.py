"""Data parallelism with torch DistributedDataParallel, unmodified, on the tdx backend.

    torchrun --standalone --nproc-per-node 4 examples/ddp.py [--epochs 6] [--backend tdx]
        [--compress int8|topk]

Each rank trains the small MLP of examples/common.py on its shard of the spirals data;
DDP averages the gradients through the backend; with --compress, through
torchdist_ext.compression's hook (error feedback on; Int8's buckets reduce on a thread of
their own while backward goes on, ``overlap=True``). Sign is not offered here: one bit
per element and Adam do not mix (README, "Compressed all_reduce"). Rank 0 prints, per
epoch, the mean training loss and the test accuracy over all ranks. --backend gloo runs
the same job on gloo. It also runs across nodes, e.g. two torchrun processes with
``--nnodes 2 --nproc-per-node 2 --rdzv-backend c10d --rdzv-endpoint HOST:PORT``.
"""

from __future__ import annotations

import argparse
import os
import sys

import torch
import torch.distributed as dist
from torch.nn.parallel import DistributedDataParallel as DDP

from torchdist_ext import compression as tc

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from common import load_data, make_model, parse_args, print0, setup, shard, train  # noqa: E402


def _compress_option(p: argparse.ArgumentParser) -> None:
    p.add_argument("--compress", choices=["none", "int8", "topk"], default="none",
                   help="average gradients through a compressed all_reduce (default none)")


def main() -> None:
    args = parse_args(__doc__, extra=_compress_option)
    rank, world, device = setup(args)
    (x_train, y_train), (x_test, y_test) = load_data(args.samples)
    x, y = (t.to(device) for t in shard(x_train, y_train, rank, world))
    x_test, y_test = (t.to(device) for t in shard(x_test, y_test, rank, world))

    # DDP broadcasts rank 0's parameters at construction, so the seed need not match.
    model = DDP(make_model(args.hidden, seed=rank).to(device),
                device_ids=[device.index] if device.type == "cuda" else None)
    if args.compress != "none":
        method = {"int8": tc.Int8(), "topk": tc.TopK(0.1)}[args.compress]
        model.register_comm_hook(tc.CompressionState(method, overlap=True), tc.ddp_comm_hook)
    opt = torch.optim.Adam(model.parameters(), lr=args.lr)
    g = torch.Generator().manual_seed(1234 + rank)
    print0(f"DDP on {world} ranks, backend {args.backend}, device {device.type}, "
           f"{x_train.shape[0]} training samples, gradients compressed: {args.compress}")
    train(model, opt, (x, y), (x_test, y_test), args, g, device)
    dist.destroy_process_group()


if __name__ == "__main__":
    main()

"""Fully sharded data parallelism with FSDP2 (torch.distributed.fsdp.fully_shard),
unmodified, on the tdx backend.

    torchrun --standalone --nproc-per-node 4 examples/fsdp.py [--epochs 6] [--no-reshard]

Every Linear of the MLP in examples/common.py and the root module are sharded over a 1-D
DeviceMesh of all ranks: each rank keeps a quarter of each parameter and of the Adam
state, FSDP all-gathers the parameters before use and reduce-scatters the gradients.
Rank 0 prints, per epoch, the mean training loss and the test accuracy over all ranks.
--backend gloo runs the same job on gloo.
"""

from __future__ import annotations

import os
import sys

import torch
import torch.distributed as dist
import torch.nn as nn
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.fsdp import fully_shard

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from common import load_data, make_model, parse_args, print0, setup, shard, train  # noqa: E402


def main() -> None:
    args = parse_args(__doc__, extra=lambda p: p.add_argument(
        "--no-reshard", action="store_true",
        help="keep the gathered parameters from forward to backward (reshard_after_forward=False)"))
    rank, world, device = setup(args)
    (x_train, y_train), (x_test, y_test) = load_data(args.samples)
    x, y = (t.to(device) for t in shard(x_train, y_train, rank, world))
    x_test, y_test = (t.to(device) for t in shard(x_test, y_test, rank, world))

    # The mesh uses the default group's backend (tdx). Same seed on every rank: FSDP2
    # shards the parameters as they are, without a broadcast.
    mesh = init_device_mesh(device.type, (world,))
    model = make_model(args.hidden).to(device)
    for layer in model:
        if isinstance(layer, nn.Linear):
            fully_shard(layer, mesh=mesh, reshard_after_forward=not args.no_reshard)
    fully_shard(model, mesh=mesh, reshard_after_forward=not args.no_reshard)
    opt = torch.optim.Adam(model.parameters(), lr=args.lr)
    g = torch.Generator().manual_seed(1234 + rank)
    print0(f"FSDP2 on {world} ranks, backend {args.backend}, device {device.type}, "
           f"reshard_after_forward={not args.no_reshard}, {x_train.shape[0]} training samples")
    train(model, opt, (x, y), (x_test, y_test), args, g, device)
    dist.destroy_process_group()


if __name__ == "__main__":
    main()

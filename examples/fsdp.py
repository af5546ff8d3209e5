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
import time

import torch
import torch.distributed as dist
import torch.nn as nn
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.fsdp import fully_shard

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from common import batches, load_data, make_model, mean_over_ranks, parse_args, print0, setup, shard  # noqa: E402


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
    loss_fn = nn.CrossEntropyLoss()
    g = torch.Generator().manual_seed(1234 + rank)
    print0(f"FSDP2 on {world} ranks, backend {args.backend}, device {device.type}, "
           f"reshard_after_forward={not args.no_reshard}, {x_train.shape[0]} training samples")
    for epoch in range(args.epochs):
        model.train()
        start = time.perf_counter()
        total, steps = 0.0, 0
        for idx in batches(x.shape[0], args.batch_size, g):
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
        loss_mean = mean_over_ranks(total, steps, device)
        accuracy = mean_over_ranks(correct, x_test.shape[0], device)
        print0(f"epoch {epoch + 1:2d}  loss {loss_mean:.4f}  test accuracy {accuracy:6.2%}  "
               f"{elapsed:5.2f} s")
    dist.destroy_process_group()


if __name__ == "__main__":
    main()

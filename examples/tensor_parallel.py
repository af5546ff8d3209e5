"""Tensor parallelism with DTensor (parallelize_module, ColwiseParallel / RowwiseParallel),
combined with FSDP2 data parallelism on a 2-D DeviceMesh, unmodified, on the tdx backend.

    torchrun --standalone --nproc-per-node 4 examples/tensor_parallel.py [--tp 2]

The ranks form a (dp, tp) mesh, 2 x 2 for 4 ranks. Within a tp group the MLP of
examples/common.py splits its wide layer pair: ``up`` column-wise and ``down`` row-wise,
so each rank holds half of each and one all-reduce per pass joins the halves. Across the
dp groups FSDP2 (fully_shard on the dp mesh dimension) shards the parameters and averages
the gradients; each dp group trains on its own shard of the spirals data. Rank 0 prints,
per epoch, the mean training loss and the test accuracy. --backend gloo runs the same job
on gloo.
"""

from __future__ import annotations

import os
import sys

import torch
import torch.distributed as dist
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.fsdp import fully_shard
from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel, parallelize_module

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from common import (  # noqa: E402
    load_data,
    make_model,
    parse_args,
    positive_int,
    print0,
    setup,
    shard,
    train,
)


def main() -> None:
    # --tp 0 would divide by zero below; it is refused as the arguments are parsed.
    args = parse_args(__doc__, extra=lambda p: p.add_argument(
        "--tp", type=positive_int, default=2,
        help="tensor-parallel degree, at least 1; the rest of the ranks is data parallel"))
    rank, world, device = setup(args)
    if world % args.tp:
        raise SystemExit(f"--tp {args.tp} does not divide the {world} ranks")
    dp = world // args.tp
    mesh = init_device_mesh(device.type, (dp, args.tp), mesh_dim_names=("dp", "tp"))
    dp_rank = mesh["dp"].get_local_rank()

    (x_train, y_train), (x_test, y_test) = load_data(args.samples)
    x, y = (t.to(device) for t in shard(x_train, y_train, dp_rank, dp))
    x_test, y_test = (t.to(device) for t in shard(x_test, y_test, dp_rank, dp))

    model = make_model(args.hidden).to(device)
    parallelize_module(model, mesh["tp"], {"up": ColwiseParallel(), "down": RowwiseParallel()})
    if dp > 1:
        fully_shard(model, mesh=mesh["dp"])
    opt = torch.optim.Adam(model.parameters(), lr=args.lr)
    g = torch.Generator().manual_seed(1234 + dp_rank)  # the ranks of a tp group see the same batches
    print0(f"tensor parallel {args.tp} x data parallel {dp}{' (FSDP2)' if dp > 1 else ''}, backend {args.backend}, "
           f"device {device.type}, {x_train.shape[0]} training samples")
    train(model, opt, (x, y), (x_test, y_test), args, g, device)
    dist.destroy_process_group()


if __name__ == "__main__":
    main()

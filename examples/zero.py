"""ZeRO stages 1, 2 and 3 with torchdist_ext.parallel.ZeroOptimizer on the tdx backend.

    torchrun --standalone --nproc-per-node 4 examples/zero.py [--stage 2] [--epochs 6]
        [--backend tdx] [--param-dtype bfloat16]

Each rank trains the small MLP of examples/common.py on its shard of the spirals data, with
no DDP: the optimizer averages the gradients itself, by reduce_scatter (in step() at stage
1, during backward at stages 2 and 3), keeps Adam's state for 1/world of the parameters,
and all-gathers the updated parameters (at stage 3 each linear layer's, just before the
layer runs, freeing them after). Rank 0 prints, per epoch, the mean training loss and the
test accuracy over all ranks, and first how much optimizer state each rank keeps. With
``--param-dtype bfloat16`` the model computes, and the ranks communicate, in bfloat16,
while each rank's shard of the weights, which Adam updates, stays float32.
"""

from __future__ import annotations

import argparse
import os
import sys

import torch
import torch.distributed as dist
import torch.nn as nn

from torchdist_ext.parallel import ZeroConfig, ZeroOptimizer

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from common import load_data, make_model, parse_args, print0, setup, shard, train  # noqa: E402


def _stage_option(p: argparse.ArgumentParser) -> None:
    p.add_argument("--stage", type=int, choices=[1, 2, 3], default=2,
                   help="1: optimizer state sharded; 2: gradients too; 3: parameters too "
                        "(default 2)")
    p.add_argument("--param-dtype", choices=["float32", "bfloat16"], default="float32",
                   help="the dtype the model computes in; the shards Adam updates stay "
                        "float32 (default float32)")


def main() -> None:
    args = parse_args(__doc__, extra=_stage_option)
    rank, world, device = setup(args)
    (x_train, y_train), (x_test, y_test) = load_data(args.samples)
    x, y = (t.to(device) for t in shard(x_train, y_train, rank, world))
    x_test, y_test = (t.to(device) for t in shard(x_test, y_test, rank, world))

    # The optimizer broadcasts rank 0's parameters when it is made, so the seed need not
    # match.
    model = make_model(args.hidden, seed=rank).to(device)
    numel = sum(p.numel() for p in model.parameters())  # at stage 3 empty between uses
    # Stage 3 gathers each linear layer on its own, as it runs.
    low = torch.bfloat16 if args.param_dtype == "bfloat16" else None
    config = ZeroConfig(stage=args.stage, units=(nn.Linear,) if args.stage == 3 else (),
                        param_dtype=low)
    opt = ZeroOptimizer(model.parameters(), torch.optim.Adam, config=config, module=model,
                        lr=args.lr)
    print0(f"ZeRO stage {args.stage} on {world} ranks, backend {args.backend}, device "
           f"{device.type}, parameters in {args.param_dtype}, {x_train.shape[0]} training "
           f"samples, {numel} parameters, "
           f"Adam state for {opt.shard_numel} of them per rank")
    g = torch.Generator().manual_seed(1234 + rank)
    train(model, opt, (x, y), (x_test, y_test), args, g, device)
    dist.destroy_process_group()


if __name__ == "__main__":
    main()

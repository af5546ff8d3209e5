"""Pipeline parallelism with torch.distributed.pipelining, unmodified, on the tdx backend;
or with torchdist_ext.parallel.PipelineStage (--runner tdx).

    torchrun --standalone --nproc-per-node 2 examples/pipeline.py [--schedule 1f1b]
    torchrun --standalone --nproc-per-node 4 examples/pipeline.py [--microbatches 8]
    torchrun --standalone --nproc-per-node 4 examples/pipeline.py --runner tdx
    torchrun --standalone --nproc-per-node 3 examples/pipeline.py --runner tdx \
        --schedule pipedream|2bw [--update-every 2]

The MLP of examples/common.py is cut into one stage per rank (2 to 4 stages; it has four
Linear layers). Rank 0 feeds the batches, the last rank computes the loss, and the
schedule (GPipe or 1F1B) moves activations forward and gradients backward between
neighbouring stages with send/recv. With --runner tdx, the pipedream and 2bw schedules
also update the weights during the step: after every microbatch (PipeDream, weight
stashing), or after every --update-every microbatches with a gradient one update old
(PipeDream-2BW). Rank 0 prints, per epoch, the mean training loss
and the test accuracy, which the last stage measures. --backend gloo runs the same job
on gloo.
"""

from __future__ import annotations

import os
import sys
import time

import torch
import torch.distributed as dist
import torch.nn as nn
from torch.distributed.pipelining import PipelineStage, Schedule1F1B, ScheduleGPipe

from torchdist_ext import parallel as tp

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from common import (  # noqa: E402
    batches, load_data, make_model, mean_over_ranks, parse_args, positive_int, print0, setup,
)

SCHEDULES = {"gpipe": ScheduleGPipe, "1f1b": Schedule1F1B}
UPDATING = ("pipedream", "2bw")  # --runner tdx only: the optimizer steps inside the step


def stage_module(model: nn.Sequential, stage: int, stages: int) -> nn.Sequential:
    """Stage ``stage`` of ``stages``: a contiguous run of (Linear, activation) blocks."""
    blocks, current = [], []
    for name, layer in model.named_children():
        if isinstance(layer, nn.Linear) and current:
            blocks.append(current)
            current = []
        current.append(name)
    blocks.append(current)
    if not 1 < stages <= len(blocks):
        raise SystemExit(f"pipeline.py needs 2 to {len(blocks)} ranks (one stage each), got {stages}")
    mine = blocks[stage * len(blocks) // stages:(stage + 1) * len(blocks) // stages]
    names = [n for block in mine for n in block]
    return nn.Sequential(*(model.get_submodule(n) for n in names))


def main() -> None:
    def extra(p):
        p.add_argument("--schedule", choices=sorted(SCHEDULES) + list(UPDATING),
                       default="gpipe")
        p.add_argument("--update-every", type=positive_int, default=None,
                       help="2bw: microbatches per weight update (default: all of a step)")
        p.add_argument("--microbatches", type=positive_int, default=4)
        p.add_argument("--runner", choices=["torch", "tdx"], default="torch",
                       help="torch.distributed.pipelining (default) or "
                            "torchdist_ext.parallel.PipelineStage")

    args = parse_args(__doc__, extra=extra, batch_size=128, lr=0.005)
    if args.schedule in UPDATING and args.runner != "tdx":
        raise SystemExit(f"--schedule {args.schedule} needs --runner tdx")
    if args.microbatches > args.batch_size:
        raise SystemExit(f"--microbatches {args.microbatches} exceeds --batch-size "
                         f"{args.batch_size}: a microbatch needs at least one sample")
    rank, world, device = setup(args)
    (x_train, y_train), (x_test, y_test) = load_data(args.samples)
    x_train, y_train, x_test, y_test = (t.to(device) for t in (x_train, y_train, x_test, y_test))

    # Every rank builds the whole model from the same seed and keeps its own stage.
    module = stage_module(make_model(args.hidden), rank, world).to(device)
    first, last = rank == 0, rank == world - 1
    loss_fn = nn.CrossEntropyLoss()
    if args.runner == "torch":
        stage = PipelineStage(module, rank, world, device)
        schedule = SCHEDULES[args.schedule](stage, n_microbatches=args.microbatches,
                                            loss_fn=loss_fn)
    opt = torch.optim.Adam(module.parameters(), lr=args.lr)
    updating = args.schedule in UPDATING
    if args.runner == "tdx":
        runner = tp.PipelineStage(module, loss_fn=loss_fn, optimizer=opt if updating else None,
                                  config=tp.PipelineConfig(
                                      schedule=args.schedule, microbatches=args.microbatches,
                                      update_every=args.update_every))
    g = torch.Generator().manual_seed(1234)  # the same batch order on every stage
    print0(f"pipeline of {world} stages ({args.schedule}, {args.microbatches} microbatches, "
           f"{args.runner}), backend {args.backend}, device {device.type}, "
           f"{x_train.shape[0]} training samples")
    if args.runner == "tdx":
        print0(runner.schedule.grid().rstrip())
    for epoch in range(args.epochs):
        start = time.perf_counter()
        total, steps = 0.0, 0
        for idx in batches(x_train.shape[0], args.batch_size, g):
            idx = idx.to(device)
            opt.zero_grad(set_to_none=True)
            if args.runner == "tdx":
                loss = runner.step(inputs=x_train[idx] if first else None,
                                   targets=y_train[idx] if last else None)
                if last:
                    total, steps = total + loss.item(), steps + 1
            elif first:
                schedule.step(x_train[idx])
            elif last:
                losses: list[torch.Tensor] = []
                schedule.step(target=y_train[idx], losses=losses)
                total, steps = total + torch.stack(losses).mean().item(), steps + 1
            else:
                schedule.step()
            if not updating:  # pipedream and 2bw stepped it during the step
                opt.step()
        elapsed = time.perf_counter() - start
        # Test accuracy, forward only, in batches of the training shape.
        correct = seen = 0
        for i in range(0, x_test.shape[0] - args.batch_size + 1, args.batch_size):
            batch = x_test[i:i + args.batch_size] if first else None
            target = y_test[i:i + args.batch_size]
            if args.runner == "tdx":
                out = runner.evaluate(inputs=batch)
            elif first:
                out = schedule.eval(batch)
            elif last:
                out = schedule.eval(target=target)  # the schedule applies loss_fn too
            else:
                out = schedule.eval()
            if last:
                correct += (out.argmax(1) == target).sum().item()
                seen += args.batch_size
        loss_mean = mean_over_ranks(total, steps, device)  # only the last stage counts
        accuracy = mean_over_ranks(correct, seen, device)
        print0(f"epoch {epoch + 1:2d}  loss {loss_mean:.4f}  test accuracy {accuracy:6.2%}  "
               f"{elapsed:5.2f} s")
    dist.destroy_process_group()


if __name__ == "__main__":
    main()

"""Data-parallel training on the tdx backend: torch DDP, unmodified.

    torchrun --standalone --nproc-per-node 4 examples/train.py [--epochs 8] [--backend tdx]

Each rank trains a small MLP on its shard of the bundled spirals data set (examples/data.py)
and DDP averages the gradients through the backend. Rank 0 prints, per epoch, the mean
training loss over all ranks, the test accuracy over all ranks and the samples per second.
Pass --backend gloo to run the same job on gloo for comparison.

Recovery: with --checkpoint-dir, every rank saves its state every --checkpoint-every
steps (torchdist_ext.checkpoint) and a job started again (by hand, or by torchrun
--max-restarts after a rank dies) resumes from the newest complete checkpoint, exactly
where it was: the same batches, the same final weights. --crash-at-step N kills the
last rank at step N in the first attempt, to watch it happen:

    torchrun --standalone --nproc-per-node 4 --max-restarts 1 examples/train.py \
        --checkpoint-dir /tmp/ckpt --crash-at-step 150
"""

from __future__ import annotations

import argparse
import os
import signal
import sys
import time

import torch
import torch.distributed as dist
import torch.nn as nn
from torch.nn.parallel import DistributedDataParallel as DDP

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import torchdist_ext  # noqa: E402,F401  (registers "tdx")
from common import check_device, device_name, positive_float, positive_int  # noqa: E402
from torchdist_ext.checkpoint import Checkpointer, rng_state, set_rng_state  # noqa: E402
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
    p.add_argument("--samples", type=positive_int, default=12_000,
                   help="size of the generated spirals data set (train + test)")
    p.add_argument("--checkpoint-dir", default=None,
                   help="save every rank's state here and resume from the newest complete "
                        "checkpoint found there")
    p.add_argument("--checkpoint-every", type=positive_int, default=50,
                   help="optimizer steps between checkpoints (default 50)")
    p.add_argument("--crash-at-step", type=positive_int, default=None,
                   help="kill the last rank (SIGKILL) at this step in the first attempt "
                        "(TORCHELASTIC_RESTART_COUNT 0), to try recovery")
    p.add_argument("--save-model", default=None,
                   help="rank 0 writes the final model's state dict to this file")
    p.add_argument("--device", type=device_name,
                   default="cuda" if torch.cuda.is_available() else "cpu",
                   help="cpu, cuda or cuda:N (default cuda when a GPU is visible); on "
                        "cuda each rank takes the GPU of its LOCAL_RANK (modulo the GPU "
                        "count), whatever N says")
    args = p.parse_args()
    check_device(p, args.device)
    if args.crash_at_step is not None and args.checkpoint_dir is None:
        p.error("--crash-at-step needs --checkpoint-dir: without checkpoints the restarted "
                "job starts again from step 0")
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

    (x_train, y_train), (x_test, y_test) = split(*spirals(args.samples))
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

    # Where training stands, all of it in the checkpoint: the epoch, the batches of it
    # done, the generator as the epoch began (it draws the epoch's order again), the
    # epoch's loss so far.
    step, epoch, done = 0, 0, 0
    epoch_rng = g.get_state()
    total = torch.zeros(2, dtype=torch.float64, device=device)  # loss sum, batches
    ckpt = Checkpointer(args.checkpoint_dir) if args.checkpoint_dir else None
    found = ckpt.load() if ckpt is not None else None
    # What the position in the data means: a resume with other values would skip other
    # batches than the ones trained on.
    settings = {"world": world, "batch_size": args.batch_size, "samples": args.samples}
    if found is not None:
        step, state = found
        if state["settings"] != settings:
            raise SystemExit(f"{args.checkpoint_dir} holds step {step} of a run with "
                             f"{state['settings']}, this one has {settings}: resume with the "
                             "same options, or pass another --checkpoint-dir")
        model.module.load_state_dict(state["model"])
        opt.load_state_dict(state["opt"])
        epoch, done, epoch_rng = state["epoch"], state["done"], state["epoch_rng"]
        total = state["total"].to(device)
        set_rng_state(state["rng"])
    if rank == 0:
        print(f"training on {world} ranks, backend {args.backend}, device {device.type}, "
              f"{x_train.shape[0]} training samples", flush=True)
        if found is not None:
            print(f"resumed from step {step} (epoch {epoch + 1}, batch {done}), attempt "
                  f"{os.environ.get('TORCHELASTIC_RESTART_COUNT', '0')}", flush=True)
    first_attempt = os.environ.get("TORCHELASTIC_RESTART_COUNT", "0") == "0"
    for epoch in range(epoch, args.epochs):
        model.train()
        g.set_state(epoch_rng)
        order = torch.randperm(per_rank, generator=g).to(device)
        start, seen = time.perf_counter(), 0
        for b, i in enumerate(range(0, per_rank, args.batch_size)):
            if b < done:
                continue  # done before the checkpoint this run resumed from
            idx = order[i:i + args.batch_size]
            seen += idx.numel()
            opt.zero_grad(set_to_none=True)
            loss = loss_fn(model(x_mine[idx]), y_mine[idx])
            loss.backward()
            opt.step()
            total += torch.stack([loss.detach().double(), torch.ones((), dtype=torch.float64, device=device)])
            step += 1
            if first_attempt and step == args.crash_at_step and rank == world - 1:
                print(f"rank {rank}: crashing at step {step}, as --crash-at-step asks",
                      flush=True)
                os.kill(os.getpid(), signal.SIGKILL)
            if ckpt is not None and step % args.checkpoint_every == 0:
                ckpt.save(step, {"model": model.module.state_dict(), "opt": opt.state_dict(),
                                 "epoch": epoch, "done": b + 1, "epoch_rng": epoch_rng,
                                 "total": total, "rng": rng_state(), "settings": settings},
                          blocking=False)
        elapsed = time.perf_counter() - start

        model.eval()
        with torch.no_grad():
            correct = (model(x_test_mine).argmax(1) == y_test_mine).sum()
        stats = torch.stack([total[0], total[1], correct.double(),
                             torch.tensor(float(x_test_mine.shape[0]), dtype=torch.float64, device=device)])
        dist.all_reduce(stats)
        rate = torch.tensor([seen / elapsed], dtype=torch.float64, device=device)
        dist.all_reduce(rate)  # samples per second summed over ranks
        if rank == 0:
            print(f"epoch {epoch + 1:2d}  loss {stats[0].item() / stats[1].item():.4f}  "
                  f"test accuracy {stats[2].item() / stats[3].item():6.2%}  "
                  f"{rate.item():9.0f} samples/s", flush=True)
        epoch_rng, done = g.get_state(), 0
        total = torch.zeros(2, dtype=torch.float64, device=device)
    if ckpt is not None:
        ckpt.wait()
    if args.save_model and rank == 0:
        torch.save(model.module.state_dict(), args.save_model)
    dist.destroy_process_group()


if __name__ == "__main__":
    main()

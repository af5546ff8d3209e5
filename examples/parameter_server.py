"""A parameter server with torchdist_ext.parallel.ParameterServer on the tdx backend.

    torchrun --standalone --nproc-per-node 4 examples/parameter_server.py [--servers 1]
        [--mode sync|async] [--max-staleness N] [--epochs 6] [--backend tdx]

The first ``--servers`` ranks keep the parameters of the small MLP of examples/common.py
and Adam's state, each for its slice; the other ranks are workers, each training on its
shard of the spirals data. A worker pushes its gradient after every batch and takes the
parameters its servers answer with. In sync mode the servers average one push of every
worker per step; in async mode they step on each push as it arrives, and
``--max-staleness`` keeps any worker from running more than that many pushes ahead of the
slowest. The first worker prints, per epoch, the mean training loss and the test accuracy
over the workers; each server prints the steps it took and the stalest push it applied.
"""

from __future__ import annotations

import argparse
import os
import sys
import time

import torch
import torch.distributed as dist
import torch.nn as nn

from torchdist_ext.parallel import ParameterServer, ServerConfig

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from common import (batches, load_data, make_model, mean_over_ranks, parse_args,  # noqa: E402
                    positive_int, setup, shard)


def _options(p: argparse.ArgumentParser) -> None:
    p.add_argument("--servers", type=positive_int, default=1,
                   help="ranks that serve the parameters (the first ones; default 1)")
    p.add_argument("--mode", choices=["sync", "async"], default="sync")
    p.add_argument("--max-staleness", type=int, default=None,
                   help="async only: how many pushes a worker may run ahead of the slowest")


def main() -> None:
    args = parse_args(__doc__, extra=_options)
    rank, world, device = setup(args)
    if args.servers >= world:
        raise SystemExit(f"--servers {args.servers} leaves no worker among {world} ranks")
    config = ServerConfig(servers=args.servers, mode=args.mode, max_staleness=args.max_staleness)
    # Every rank makes the group of workers (new_group is collective), which averages the
    # printed figures.
    workers = dist.new_group(list(range(args.servers, world)))
    model = make_model(args.hidden).to(device)
    ps = ParameterServer(model.parameters(), torch.optim.Adam, config=config, lr=args.lr)

    if ps.is_server:
        start = time.perf_counter()
        report = ps.serve()
        print(f"server {rank}: {report.version} steps, pushes per worker {report.pushes}, "
              f"stalest push {report.stalest} step(s), widest lead {report.widest_gap} "
              f"push(es), {time.perf_counter() - start:.2f} s", flush=True)
        dist.destroy_process_group()
        return

    me, count = rank - args.servers, world - args.servers
    (x_train, y_train), (x_test, y_test) = load_data(args.samples)
    x, y = (t.to(device) for t in shard(x_train, y_train, me, count))
    x_test, y_test = (t.to(device) for t in shard(x_test, y_test, me, count))
    if me == 0:
        print(f"parameter server, {args.mode} mode, {args.servers} server(s) and {count} "
              f"worker(s), backend {args.backend}, device {device.type}, "
              f"{sum(p.numel() for p in model.parameters())} parameters", flush=True)
    loss_fn = nn.CrossEntropyLoss()
    g = torch.Generator().manual_seed(1234 + rank)
    for epoch in range(args.epochs):
        start = time.perf_counter()
        total, steps = 0.0, 0
        for idx in batches(x.shape[0], args.batch_size, g):
            idx = idx.to(device)
            ps.zero_grad()
            loss = loss_fn(model(x[idx]), y[idx])
            loss.backward()
            ps.step()
            total, steps = total + loss.item(), steps + 1
        elapsed = time.perf_counter() - start
        with torch.no_grad():
            correct = (model(x_test).argmax(1) == y_test).sum().item()
        loss_mean = mean_over_ranks(total, steps, device, group=workers)
        accuracy = mean_over_ranks(correct, x_test.shape[0], device, group=workers)
        if me == 0:
            print(f"epoch {epoch + 1:2d}  loss {loss_mean:.4f}  test accuracy {accuracy:6.2%}  "
                  f"{elapsed:5.2f} s", flush=True)
    ps.close()
    dist.destroy_process_group()


if __name__ == "__main__":
    main()

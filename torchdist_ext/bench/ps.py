"""``python -m torchdist_ext.bench ps``: a worker's training step with a parameter
server, sync and async, against DDP among the same workers.

The group's first ``--servers`` ranks serve (:class:`torchdist_ext.parallel.ParameterServer`
with Adam), the others are workers, each stepping an MLP of ``--layers`` square linear
layers on a batch of its own: forward, backward, and the push and answer (``sync``,
``async``), or torch's DistributedDataParallel over the workers alone with Adam on each
(``ddp``; the servers sit that one out). Times are the largest over the workers of the
mean over ``--iters`` steps, after ``--warmup``; ``stalest`` is the most steps of a
server that any push's gradient missed, and ``busy`` the busiest server's share of its
``serve()`` spent applying pushes (warm-up included). A push and its answer each carry the whole
model once per worker, split among the servers.

Usage::

    python -m torchdist_ext.bench ps                            # tdx and gloo, 3 ranks
    python -m torchdist_ext.bench ps --world 5 --servers 2 --params 1M,8M
"""

from __future__ import annotations

import argparse
import sys
import time
from dataclasses import dataclass
from typing import Any, Sequence

import torch
import torch.distributed as dist
import torch.nn as nn

from ..parallel import ParameterServer, ServerConfig
from . import runner
from .core import names_arg, sizes_arg
from .runner import LaunchError
from .zero import check_training_options, square_mlp, square_width

__all__ = ["PsBenchOptions", "build_parser", "main", "run", "table_lines"]

_BACKENDS = ("tdx", "gloo")
_STRATEGIES = ("ddp", "sync", "async")


@dataclass(frozen=True)
class PsBenchOptions:
    """One run: ``world`` spawned ranks (ignored under torchrun), the first ``servers`` of
    them serving; for each of ``params`` (trainable float32 parameters, about), each
    strategy on each backend."""

    world: int = 3
    servers: int = 1
    backends: tuple[str, ...] = _BACKENDS
    strategies: tuple[str, ...] = _STRATEGIES
    params: tuple[int, ...] = (1 << 20, 1 << 23)
    layers: int = 4
    batch: int = 32
    device: str = "cpu"
    iters: int = 10
    warmup: int = 2
    timeout: float = 300.0
    json_path: str | None = None

    def __post_init__(self) -> None:
        runner.check_side_options(self, _BACKENDS)
        check_training_options(self, _STRATEGIES)
        if self.servers < 1:
            raise ValueError(f"servers (--servers) must be at least 1, not {self.servers}")
        if not runner.launched():  # under torchrun, the world is known at run time
            check_world(self.world, self.servers)


def check_world(world: int, servers: int) -> None:
    if world <= servers:
        raise LaunchError(f"{servers} server(s) (--servers) leave no worker among {world} "
                          f"rank(s); run at least {servers + 1} ranks (--world)")


def _cell(name: str, opts: PsBenchOptions, params: int, group: Any, workers: Any,
          worker_ddp: Any, rank: int, device: torch.device, x: torch.Tensor) -> dict[str, Any]:
    model = square_mlp(params, opts.layers, device)
    numel = sum(p.numel() for p in model.parameters())
    serving = rank < opts.servers
    ms, stalest, busy = 0.0, 0, 0.0
    if name == "ddp":
        if not serving:
            module = nn.parallel.DistributedDataParallel(model, process_group=worker_ddp)
            opt = torch.optim.Adam(model.parameters(), lr=1e-4)
            ms = _time_worker(module, opt, x, opts, workers, device)
    else:
        ps = ParameterServer(model.parameters(), torch.optim.Adam, group=group, lr=1e-4,
                             config=ServerConfig(servers=opts.servers, mode=name))
        if ps.is_server:
            report = ps.serve()
            stalest = report.stalest
            busy = report.step_seconds / max(report.seconds, 1e-9)
        else:
            ms = _time_worker(model, ps, x, opts, workers, device)
            ps.close()
    # Over the bench's own gloo group, which every rank, server or not, is in.
    out = torch.tensor([ms, stalest, busy], dtype=torch.float64)
    dist.all_reduce(out, op=dist.ReduceOp.MAX)
    # A worker's bytes to and from its servers; DDP's depend on its all_reduce's algorithm.
    return {"params": numel, "ms": out[0].item(), "stalest": int(out[1].item()),
            "busy": out[2].item(), "bytes": None if name == "ddp" else 2 * numel * 4}


def _time_worker(module: nn.Module, opt: Any, x: torch.Tensor, opts: PsBenchOptions,
                 workers: Any, device: torch.device) -> float:
    def step() -> None:
        opt.zero_grad(set_to_none=True)
        module(x).square().mean().backward()
        opt.step()

    for _ in range(opts.warmup):
        step()
    dist.barrier(group=workers)
    if device.type == "cuda":
        torch.cuda.synchronize(device)
    start = time.perf_counter()
    for _ in range(opts.iters):
        step()
    if device.type == "cuda":
        torch.cuda.synchronize(device)
    return (time.perf_counter() - start) / opts.iters * 1e3


def _backend_rows(opts: PsBenchOptions, group: Any, world: int, rank: int,
                  device: torch.device) -> dict[str, Any]:
    check_world(world, opts.servers)  # under torchrun the world comes from there
    ranks = list(range(opts.servers, world))
    # Collective on every rank, in this order: the workers' gloo barrier group, and their
    # group on the backend measured, for DDP.
    workers = dist.new_group(ranks)
    worker_ddp = dist.new_group(ranks, backend=dist.get_backend(group))
    out: dict[str, Any] = {}
    gen = torch.Generator().manual_seed(rank)
    try:
        for params in opts.params:
            x = torch.randn(opts.batch, square_width(params, opts.layers), generator=gen)
            out[str(params)] = {name: _cell(name, opts, params, group, workers, worker_ddp,
                                            rank, device, x.to(device))
                                for name in opts.strategies}
    finally:
        dist.destroy_process_group(worker_ddp)
        dist.destroy_process_group(workers)
    return out


def _rank_main(rank: int, world: int, opts: Any,
               local_rank: int | None = None) -> dict[str, Any]:
    """One rank of a run: every backend's results."""
    return runner.side_rank("training step: ddp, parameter server sync and async",
                            _backend_rows, rank, world, opts, local_rank)


def run(opts: PsBenchOptions) -> dict[str, Any]:
    """Measure; rank 0's results (every rank's under torchrun)."""
    return runner.run_side(opts, _rank_main)


def table_lines(data: dict[str, Any]) -> list[str]:
    """The text table of a run's results."""
    o = data["options"]
    names = list(data["backends"])
    workers = data["world"] - o["servers"]
    lines = [f"# a worker's training step (forward, backward, Adam) of an MLP of {o['layers']} "
             f"square layers, batch {o['batch']} per worker, {o['servers']} server(s) and "
             f"{workers} worker(s), {o['device']}, {data['host']}, {data['date']}",
             f"# time: the largest over the workers of the mean of {o['iters']} steps, in ms; "
             "stalest: the most server steps a push missed; busy: the busiest server's "
             "share of serve() spent applying pushes; moved: bytes a worker sends to and "
             "receives from the servers per step"]
    head = f"{'params':>10} {'strategy':>9} {'moved':>10}"
    for n in names:
        head += f" {n + ' ms':>10} {n + ' stalest':>13} {n + ' busy':>10}"
    lines.append(head)
    for params in o["params"]:
        for name in o["strategies"]:
            first = data["backends"][names[0]][str(params)][name]
            moved = "-" if first["bytes"] is None else _mib(first["bytes"])
            line = f"{first['params']:>10} {name:>9} {moved:>10}"
            for n in names:
                cell = data["backends"][n][str(params)][name]
                stale = str(cell["stalest"]) if name == "async" else "-"
                busy = f"{cell['busy']:.0%}" if name != "ddp" else "-"
                line += f" {cell['ms']:>10.2f} {stale:>13} {busy:>10}"
            lines.append(line)
    return lines


def _mib(n: int) -> str:
    return f"{n / 2 ** 20:.2f} MiB"


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="python -m torchdist_ext.bench ps",
        description="Time a worker's training step with a parameter server (sync and "
                    "async) and under DDP among the workers, several backends side by side.",
        epilog="Under torchrun the ranks come from the environment and --world is ignored.")
    p.add_argument("--servers", type=int, default=1,
                   help="the first ranks, which serve (default 1)")
    p.add_argument("--backends", default="tdx,gloo", help="tdx and/or gloo (default both)")
    p.add_argument("--strategies", default="ddp,sync,async",
                   help="ddp, sync and/or async (default all)")
    p.add_argument("--params", type=sizes_arg, default=(1 << 20, 1 << 23),
                   help="comma-separated model sizes in parameters, K/M suffixes "
                        "(default 1M,8M)")
    p.add_argument("--layers", type=int, default=4, help="square linear layers (default 4)")
    p.add_argument("--batch", type=int, default=32, help="samples per worker (default 32)")
    runner.add_side_arguments(p, iters=10, warmup=2, what="steps", world=3)
    return p


def _options(a: argparse.Namespace) -> PsBenchOptions:
    return PsBenchOptions(world=a.world, servers=a.servers, backends=names_arg(a.backends),
                          strategies=names_arg(a.strategies), params=a.params,
                          layers=a.layers, batch=a.batch, device=a.device, iters=a.iters,
                          warmup=a.warmup, timeout=a.timeout, json_path=a.json_path)


def main(argv: Sequence[str] | None = None) -> int:
    """0 when every step ran (a backend that fails raises)."""
    runner.side_main(build_parser(), argv, _options, run, table_lines)
    return 0


if __name__ == "__main__":  # pragma: no cover
    sys.exit(main())

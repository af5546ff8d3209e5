"""``python -m torchdist_ext.bench compressed``: compressed all_reduce against exact.

Per size and backend, the time of an exact ``dist.all_reduce`` (SUM) of a float32 tensor
stands next to the time of ``torchdist_ext.compression.all_reduce`` of it with each
method, with error feedback on as training keeps it. Columns: the bytes each rank sends
per op (exact: a ring's ``2 (n - 1) / n`` of the tensor), the error of the first result
(the largest difference from a float64 sum of every rank's tensor, over the sum's
largest element; the same on every backend), and per backend the time per op in µs (the
largest over the ranks of the mean over ``--iters`` ops, after ``--warmup``) and the
exact op's time over it (above 1: compression pays).

Every backend under test gets its own group in the same processes. Usage::

    python -m torchdist_ext.bench compressed                        # tdx and gloo, 2 ranks
    python -m torchdist_ext.bench compressed --world 4 --sizes 1M,16M --methods int8,sign
    TDX_SHM=0 TDX_UCX_PEER_ERRORS=1 python -m torchdist_ext.bench compressed  # over TCP
"""

from __future__ import annotations

import argparse
import sys
from dataclasses import dataclass
from typing import Any, Sequence

import torch
import torch.distributed as dist

from .. import compression as tc
from . import report, runner
from .core import names_arg, sizes_arg
from .runner import time_per_call

__all__ = ["CompressedOptions", "build_parser", "main", "run", "table_lines"]

_BACKENDS = ("tdx", "gloo")
_METHODS = ("int8", "sign", "topk")


@dataclass(frozen=True)
class CompressedOptions:
    """One run: ``world`` spawned ranks (ignored under torchrun); each of ``sizes``
    (bytes of float32) reduced exactly and with each of ``methods`` on each backend."""

    world: int = 2
    backends: tuple[str, ...] = _BACKENDS
    methods: tuple[str, ...] = _METHODS
    sizes: tuple[int, ...] = (1 << 16, 1 << 20, 1 << 24)
    block: int = 256
    ratio: float = 0.01
    device: str = "cpu"
    iters: int = 10
    warmup: int = 2
    timeout: float = 300.0
    json_path: str | None = None

    def __post_init__(self) -> None:
        runner.check_side_options(self, _BACKENDS)
        if not self.methods or any(m not in _METHODS for m in self.methods) \
                or len(set(self.methods)) != len(self.methods):
            raise ValueError(f"methods (--methods) take int8, sign and/or topk, each once, "
                             f"not {','.join(self.methods)!r}")
        if not self.sizes or any(s < 4 or s % 4 for s in self.sizes):
            raise ValueError(f"sizes (--sizes) must be byte counts of float32 tensors (4 or "
                             f"more, multiples of 4), not {','.join(map(str, self.sizes))}")
        tc.Int8(block=self.block)  # their own checks name the fix
        tc.TopK(ratio=self.ratio)

    def method(self, name: str) -> tc.Method:
        return {"int8": tc.Int8(self.block), "sign": tc.Sign(self.block),
                "topk": tc.TopK(self.ratio)}[name]


def _tensor(rank: int, count: int, device: torch.device) -> torch.Tensor:
    gen = torch.Generator().manual_seed(7919 * rank + count)
    return torch.randn(count, generator=gen, dtype=torch.float64).float().to(device)


def sent_bytes(method: tc.Method | None, count: int, world: int) -> int:
    """Bytes one rank sends per op of ``count`` float32 elements: a ring's share for the
    exact op (``method`` None), the encoded rows and their headers for the methods."""
    if world == 1:
        return 0
    if method is None:
        return 2 * (world - 1) * -(-count // world) * 4
    if isinstance(method, tc.TopK):
        k = method.k(count)
        return (world - 1) * (16 + k * (4 + method.index_dtype(count).itemsize))
    length = -(-count // (world * method.unit)) * method.unit
    return 2 * (world - 1) * (16 + method.nbytes(length, torch.float32))


def _backend_rows(opts: CompressedOptions, group: Any, world: int, rank: int,
                  device: torch.device) -> dict[str, Any]:
    out: dict[str, Any] = {}
    for nbytes in opts.sizes:
        count = nbytes // 4
        row: dict[str, Any] = {}
        t = _tensor(rank, count, device)
        for _ in range(opts.warmup):
            dist.all_reduce(t, group=group)
        # The tensor's values grow by the world each op: the time does not depend on them.
        row["exact"] = {"us": time_per_call(lambda i: dist.all_reduce(t, group=group),
                                            opts.iters, device) * 1e6, "error": 0.0}
        for name in opts.methods:
            method = opts.method(name)
            first = _tensor(rank, count, device)
            state = tc.ErrorFeedback()
            tc.all_reduce(first, method, group=group, state=state)
            error = None
            if rank == 0:
                want = sum(_tensor(r, count, torch.device("cpu")).double()
                           for r in range(world))
                scale = float(want.abs().max()) or 1.0
                error = float((first.double().cpu() - want).abs().max()) / scale
            x = _tensor(rank, count, device)
            for _ in range(opts.warmup):
                tc.all_reduce(x.clone(), method, group=group, state=state)
            copies = [x.clone() for _ in range(opts.iters)]
            us = time_per_call(lambda i: tc.all_reduce(copies[i], method, group=group,
                                                       state=state),
                               opts.iters, device) * 1e6
            row[name] = {"us": us, "error": error}
        out[str(nbytes)] = row
    return out


def _rank_main(rank: int, world: int, opts: Any,
               local_rank: int | None = None) -> dict[str, Any]:
    """One rank of a run: every backend's results (errors on rank 0)."""
    return runner.side_rank("compressed all_reduce", _backend_rows, rank, world, opts, local_rank)


def run(opts: CompressedOptions) -> dict[str, Any]:
    """Measure; rank 0's results (every rank's under torchrun, errors on rank 0)."""
    return runner.run_side(opts, _rank_main)


def table_lines(data: dict[str, Any]) -> list[str]:
    """The text table of a run's results."""
    o = data["options"]
    world = data["world"]
    opts = CompressedOptions(**{**o, "backends": tuple(o["backends"]),
                                "methods": tuple(o["methods"]), "sizes": tuple(o["sizes"])})
    names = list(data["backends"])
    lines = [f"# all_reduce (SUM) of float32, exact and compressed (error feedback on), "
             f"{world} rank(s), {o['device']}, {data['host']}, {data['date']}",
             f"# time: the largest over the ranks of the mean of {o['iters']} ops, in us; "
             f"vs exact: the exact op's time over this one's (above 1: compression pays)"]
    head = f"{'size':>10} {'method':>18} {'sent/rank':>11} {'error':>9}"
    for n in names:
        head += f" {n + ' us':>13} {'vs exact':>9}"
    lines.append(head)
    for nbytes in o["sizes"]:
        count = nbytes // 4
        for name in ("exact", *o["methods"]):
            method = None if name == "exact" else opts.method(name)
            first = data["backends"][names[0]][str(nbytes)][name]
            err = first["error"]
            line = (f"{report.bytes_text(nbytes):>10} {str(method or 'exact'):>18} "
                    f"{report.bytes_text(sent_bytes(method, count, world)):>11} "
                    f"{'-' if err is None else f'{err:.2e}':>9}")
            for n in names:
                cell = data["backends"][n][str(nbytes)]
                us = cell[name]["us"]
                line += f" {us:>13.1f} {cell['exact']['us'] / us:>8.2f}x"
            lines.append(line)
    return lines


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="python -m torchdist_ext.bench compressed",
        description="Time torchdist_ext.compression.all_reduce against an exact all_reduce, "
                    "several backends side by side.",
        epilog="Under torchrun the ranks come from the environment and --world is ignored.")
    p.add_argument("--backends", default="tdx,gloo", help="tdx and/or gloo (default both)")
    p.add_argument("--methods", default="int8,sign,topk",
                   help="int8, sign and/or topk (default all)")
    p.add_argument("--sizes", type=sizes_arg, default=(1 << 16, 1 << 20, 1 << 24),
                   help="comma-separated tensor sizes in bytes, K/M suffixes "
                        "(default 64K,1M,16M)")
    p.add_argument("--block", type=int, default=256,
                   help="elements per scale for int8 and sign (default 256)")
    p.add_argument("--ratio", type=float, default=0.01,
                   help="share of elements topk sends (default 0.01)")
    runner.add_side_arguments(p, iters=10, warmup=2)
    return p


def _options(a: argparse.Namespace) -> CompressedOptions:
    return CompressedOptions(world=a.world, backends=names_arg(a.backends),
                             methods=names_arg(a.methods), sizes=a.sizes, block=a.block,
                             ratio=a.ratio, device=a.device, iters=a.iters, warmup=a.warmup,
                             timeout=a.timeout, json_path=a.json_path)


def main(argv: Sequence[str] | None = None) -> int:
    """0 when every op ran (a backend that fails raises)."""
    runner.side_main(build_parser(), argv, _options, run, table_lines)
    return 0


if __name__ == "__main__":  # pragma: no cover
    sys.exit(main())

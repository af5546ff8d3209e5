"""``python -m torchdist_ext.bench sparse``: all_reduce of sparse embedding gradients.

What a job with ``nn.Embedding(sparse=True)`` under DDP pays per step for one table: each
rank's gradient of a ``rows x dim`` table that ``lookups`` random rows touched is summed
across the ranks with ``dist.all_reduce``. The gradient is left as the embedding's
backward leaves it, uncoalesced: one row per lookup, repeated rows included. Each
backend's time stands next to its dense all_reduce of the whole table, which is what
the job pays without ``sparse=True``.

Columns per size: the lookups per rank, the bytes each rank contributes (its indices
and values), the rows of the summed result, and per backend the time per op in µs (the
largest over the ranks of the mean over ``--iters``, after ``--warmup`` untimed ops) and
``#wrong``. ``#wrong`` counts the elements of the first result's dense image that differ
from a float64 sum of every rank's input by more than the dtype's rounding allows. The
header gives each backend's dense time.

Every backend under test gets its own group in the same processes, as in the main bench;
a gloo group times and checks. Usage::

    python -m torchdist_ext.bench sparse                       # tdx and gloo, 2 ranks
    python -m torchdist_ext.bench sparse --world 4 --rows 1M --dim 128 --lookups 4K,64K
    torchrun --nproc-per-node 4 -m torchdist_ext.bench sparse --json sparse.json
"""

from __future__ import annotations

import argparse
import sys
from dataclasses import dataclass
from typing import Any, Sequence

import torch
import torch.distributed as dist

import torchdist_ext  # noqa: F401 - registers the tdx backend

from . import report, runner
from .core import dtype_name, names_arg, parse_dtype, parse_size, size_arg
from .runner import time_per_call

__all__ = ["SparseOptions", "build_parser", "main", "run", "table_lines"]

_BACKENDS = ("tdx", "gloo")
_DTYPES = (torch.float32, torch.float64, torch.float16, torch.bfloat16)


@dataclass(frozen=True)
class SparseOptions:
    """One run: ``world`` spawned ranks (ignored under torchrun), a ``rows x dim`` table
    of ``dtype``, each size in ``lookups`` timed on each backend in ``backends``."""

    world: int = 2
    backends: tuple[str, ...] = _BACKENDS
    rows: int = 1 << 18
    dim: int = 64
    lookups: tuple[int, ...] = (1 << 10, 1 << 12, 1 << 14, 1 << 16)
    dtype: torch.dtype = torch.float32
    device: str = "cpu"
    iters: int = 20
    warmup: int = 3
    dense: bool = True
    timeout: float = 300.0
    json_path: str | None = None

    def __post_init__(self) -> None:
        runner.check_side_options(self, _BACKENDS)
        if self.rows < 1 or self.dim < 1:
            raise ValueError(f"the table (--rows x --dim) needs at least one row and one "
                             f"column, not {self.rows} x {self.dim}")
        if not self.lookups or any(n < 1 for n in self.lookups):
            raise ValueError(f"lookups (--lookups) must be counts of at least 1, not "
                             f"{','.join(map(str, self.lookups)) or 'none'}")
        if self.dtype not in _DTYPES:
            raise ValueError(f"dtype (-d) must be one of "
                             f"{', '.join(dtype_name(d) for d in _DTYPES)} "
                             f"(an embedding's gradient), not {dtype_name(self.dtype)}")


def _gradient(rank: int, opts: SparseOptions, lookups: int, device: torch.device
              ) -> torch.Tensor:
    """Rank ``rank``'s gradient at ``lookups``, the same on every rank that builds it (the
    check rebuilds the others'): uncoalesced, one row per lookup."""
    gen = torch.Generator().manual_seed(1000003 * rank + lookups)
    idx = torch.randint(opts.rows, (1, lookups), generator=gen)
    val = torch.randn(lookups, opts.dim, generator=gen, dtype=torch.float64)
    return torch.sparse_coo_tensor(idx, val.to(opts.dtype), (opts.rows, opts.dim),
                                   check_invariants=False).to(device)


def _reference(world: int, opts: SparseOptions, lookups: int) -> torch.Tensor:
    """The exact sum of every rank's gradient at ``lookups`` (float64, dense), and the
    bound on how far a sum in ``opts.dtype`` may be from it: each of a row's additions
    rounds by at most eps times the sum of the magnitudes added so far, and the result
    once more. Stacked as ``[2, rows, dim]``."""
    ref = torch.zeros(2, opts.rows, opts.dim, dtype=torch.float64)
    terms = torch.zeros(opts.rows, 1, dtype=torch.float64)
    for r in range(world):
        g = _gradient(r, opts, lookups, torch.device("cpu"))
        rows, values = g._indices()[0], g._values().to(torch.float64)  # exact in float64
        ref[0].index_add_(0, rows, values)
        ref[1].index_add_(0, rows, values.abs())
        terms.index_add_(0, rows, torch.ones(len(rows), 1, dtype=torch.float64))
    ref[1] *= torch.finfo(opts.dtype).eps * (terms + 1)
    return ref


def _wrong(got: torch.Tensor, ref: torch.Tensor) -> int:
    """Elements of ``got`` (sparse) further from ``ref[0]`` than ``ref[1]`` allows
    (:func:`_reference`); every element when it is not sparse or has another shape."""
    if not got.is_sparse or got.shape != ref.shape[1:]:
        return ref[0].numel()
    dense = got.detach().cpu().to_dense().to(torch.float64)
    return int((~((dense - ref[0]).abs() <= ref[1])).sum())  # NaN counts as wrong


def _backend_rows(opts: SparseOptions, group: Any, world: int, rank: int,
                  device: torch.device) -> dict[str, Any]:
    out: dict[str, Any] = {"sizes": {}, "dense_us": None}
    for lookups in opts.lookups:
        base = _gradient(rank, opts, lookups, device)
        # all_reduce writes its result over its input: each op gets a copy of its own,
        # made before the clock starts.
        copies = [base.clone() for _ in range(opts.warmup + opts.iters + 1)]
        dist.all_reduce(copies[0], group=group)
        first = copies[0]
        for i in range(opts.warmup):
            dist.all_reduce(copies[1 + i], group=group)
        t = time_per_call(
            lambda i: dist.all_reduce(copies[1 + opts.warmup + i], group=group),
            opts.iters, device)
        wrong = None
        if rank == 0:
            wrong = _wrong(first, _reference(world, opts, lookups))
        out["sizes"][lookups] = {"us": t * 1e6, "wrong": wrong,
                                 "result_rows": int(first.coalesce()._nnz())}
        del copies, first
    if opts.dense:
        table = torch.zeros(opts.rows, opts.dim, dtype=opts.dtype, device=device)
        for _ in range(opts.warmup):
            dist.all_reduce(table, group=group)
        out["dense_us"] = time_per_call(lambda i: dist.all_reduce(table, group=group),
                                        opts.iters, device) * 1e6
    return out


def _rank_main(rank: int, world: int, opts: Any,
               local_rank: int | None = None) -> dict[str, Any]:
    """One rank of a run: every backend's results (on rank 0, with the ``#wrong`` counts)."""
    return runner.side_rank("sparse all_reduce", _backend_rows, rank, world, opts, local_rank)


def run(opts: SparseOptions) -> dict[str, Any]:
    """Measure; rank 0's results (every rank's under torchrun, ``#wrong`` on rank 0)."""
    return runner.run_side(opts, _rank_main)


def table_lines(data: dict[str, Any]) -> list[str]:
    """The text table of a run's results."""
    o = data["options"]
    dtype = parse_dtype(o["dtype"])
    elem = torch.empty(0, dtype=dtype).element_size()
    dense_bytes = o["rows"] * o["dim"] * elem
    lines = [f"# sparse all_reduce (SUM) of a {o['rows']} x {o['dim']} {dtype_name(dtype)} table's "
             f"gradient ({report.bytes_text(dense_bytes)} dense), {data['world']} rank(s), "
             f"{o['device']}, {data['host']}, {data['date']}",
             f"# time: the largest over the ranks of the mean of {o['iters']} ops, in us"]
    names = list(data["backends"])
    for name in names:
        b = data["backends"][name]
        if b["dense_us"] is not None:
            lines.append(f"# {name}: dense all_reduce of the whole table: "
                         f"{b['dense_us']:.1f} us")
    ok = names
    head = f"{'lookups':>9} {'sent/rank':>11} {'rows out':>9}"
    for n in ok:
        head += f" {n + ' us':>13} {'#wrong':>7} {'vs dense':>9}"
    if len(ok) > 1:
        head += f" {ok[0] + '/' + ok[1]:>10}"
    lines.append(head)
    for lookups in o["lookups"]:
        sizes = {n: data["backends"][n]["sizes"][lookups] for n in ok}
        rows_out = next(iter(sizes.values()))["result_rows"] if sizes else 0
        sent = lookups * (8 + o["dim"] * elem)
        line = f"{lookups:>9} {report.bytes_text(sent):>11} {rows_out:>9}"
        for n in ok:
            s = sizes[n]
            dense = data["backends"][n]["dense_us"]
            ratio = f"{dense / s['us']:.1f}x" if dense else "-"
            line += f" {s['us']:>13.1f} {'-' if s['wrong'] is None else s['wrong']:>7} " \
                    f"{ratio:>9}"
        if len(ok) > 1:
            line += f" {sizes[ok[0]]['us'] / sizes[ok[1]]['us']:>10.2f}"
        lines.append(line)
    if len(ok) > 1:
        lines.append(f"# {ok[0]}/{ok[1]}: {ok[0]}'s time over {ok[1]}'s (below 1: "
                     f"{ok[0]} faster); vs dense: the dense time over the sparse time")
    return lines


def _counts(text: str) -> tuple[int, ...]:
    try:
        values = tuple(parse_size(x.strip()) for x in text.split(",") if x.strip())
    except ValueError as exc:
        raise argparse.ArgumentTypeError(str(exc)) from None
    if not values:
        raise argparse.ArgumentTypeError("expected one or more counts, e.g. 1K,16K")
    return values


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="python -m torchdist_ext.bench sparse",
        description="Time all_reduce of sparse embedding gradients (SUM), several backends "
                    "side by side, next to each backend's dense all_reduce of the table.",
        epilog="Under torchrun the ranks come from the environment and --world is ignored.")
    p.add_argument("--backends", default="tdx,gloo", help="tdx and/or gloo (default both)")
    p.add_argument("--rows", type=size_arg, default=1 << 18,
                   help="rows of the table (num_embeddings; K/M suffixes; default 256K)")
    p.add_argument("--dim", type=int, default=64, help="columns (embedding_dim; default 64)")
    p.add_argument("--lookups", type=_counts, default=(1 << 10, 1 << 12, 1 << 14, 1 << 16),
                   help="comma-separated lookups per rank, one row each "
                        "(default 1K,4K,16K,64K)")
    p.add_argument("-d", "--dtype", default="float32",
                   help="float32, float64, float16 or bfloat16 (default float32)")
    runner.add_side_arguments(p, iters=20, warmup=3)
    p.add_argument("--no-dense", dest="dense", action="store_false",
                   help="skip the dense all_reduce of the whole table")
    return p


def _options(a: argparse.Namespace) -> SparseOptions:
    return SparseOptions(world=a.world, backends=names_arg(a.backends), rows=a.rows,
                         dim=a.dim, lookups=a.lookups, dtype=parse_dtype(a.dtype),
                         device=a.device, iters=a.iters, warmup=a.warmup, dense=a.dense,
                         timeout=a.timeout, json_path=a.json_path)


def main(argv: Sequence[str] | None = None) -> int:
    """0 when no element was wrong, 1 otherwise (a backend that fails raises)."""
    data = runner.side_main(build_parser(), argv, _options, run, table_lines)
    if data is None:  # not the lead rank, which reports
        return 0
    wrong = sum(s["wrong"] or 0 for b in data["backends"].values()
                for s in b["sizes"].values())
    return 0 if wrong == 0 else 1


if __name__ == "__main__":  # pragma: no cover
    sys.exit(main())

"""Command line: ``python -m torchdist_ext.bench --help``; ``python -m torchdist_ext.bench
calibrate --help`` for the cost-model calibration, ``... tune --help`` for measured rules,
``... sparse --help`` for sparse all_reduce, ``... compressed --help`` for compressed
all_reduce, ``... zero --help`` for a training step under DDP and ZeRO, ``... ps --help``
for one with a parameter server."""

from __future__ import annotations

import argparse
import sys
from typing import Sequence

from . import report
from .core import ALL_OPS, KNOWN_BACKENDS, OPS, REDOPS, Options, size_arg, sizes_for
from .runner import LaunchError, launch_problem, launched, planned_world, run

__all__ = ["build_parser", "main", "options_from_args"]


def build_parser() -> argparse.ArgumentParser:
    """The argparse parser behind ``python -m torchdist_ext.bench``."""
    p = argparse.ArgumentParser(
        prog="python -m torchdist_ext.bench",
        description="nccl-tests-style tables for torch.distributed collectives, several "
                    "backends side by side in one run.",
        epilog="Under torchrun (RANK and WORLD_SIZE set) the ranks come from the environment "
               "and --world is ignored. 'python -m torchdist_ext.bench calibrate --help': "
               "fit tdx's cost model to this machine; 'python -m torchdist_ext.bench tune "
               "--help': record the fastest algorithm per size where the model misjudges; "
               "'python -m torchdist_ext.bench sparse --help': all_reduce of sparse "
               "embedding gradients; 'python -m torchdist_ext.bench compressed --help': "
               "compressed all_reduce against exact; 'python -m torchdist_ext.bench zero "
               "--help': a training step under DDP, ZeRO-1 and ZeRO-2; 'python -m "
               "torchdist_ext.bench ps --help': a worker's step with a parameter server, "
               "sync and async, against DDP.",
    )
    p.add_argument("--op", default="all_reduce",
                   help=f"comma-separated ops or 'all' ({', '.join(ALL_OPS)}); "
                        "default all_reduce")
    p.add_argument("--backends", default="tdx,gloo",
                   help=f"comma-separated backends under test ({', '.join(KNOWN_BACKENDS)}; "
                        "nccl runs with --device cuda, and is skipped with a note "
                        "otherwise); tdx:ALGO pins "
                        "a tdx algorithm for each op (tdx:ring, tdx:shm, ...; "
                        "torchdist_ext.algorithms() lists them), tdx:all every algorithm of "
                        "each op; default tdx,gloo")
    p.add_argument("--world", type=int, default=2, help="ranks to spawn (default 2)")
    p.add_argument("--device", choices=("cpu", "cuda"), default="cpu",
                   help="tensor device; with cuda rank r uses cuda:(r %% device_count)")
    p.add_argument("-b", "--minbytes", type=size_arg, default=1 << 10,
                   help="smallest size, K/M/G suffixes allowed (default 1K)")
    p.add_argument("-e", "--maxbytes", type=size_arg, default=64 << 20,
                   help="largest size (default 64M)")
    p.add_argument("-f", "--stepfactor", type=int, default=2,
                   help="multiply the size by this between rows (default 2)")
    p.add_argument("-n", "--iters", type=int, default=20, help="timed iterations (default 20)")
    p.add_argument("-w", "--warmup", type=int, default=5,
                   help="untimed iterations before timing (default 5)")
    p.add_argument("--warmup-ms", type=float, default=20.0, metavar="MS",
                   help="after the -w iterations, keep running untimed ones until this many "
                        "milliseconds have passed, so a small size is not timed on idle, "
                        "slowly clocked cores (every rank runs as many; 0, or -w 0: "
                        "only -w; default 20)")
    p.add_argument("--stat", choices=("mean", "median"), default="mean",
                   help="per-op time: mean over the timed loop (default), or median of each "
                        "iteration timed alone (steadier on a busy machine)")
    p.add_argument("--rounds", type=int, default=1,
                   help="measure each size this many times, the backends taking turns, and "
                        "report the median round (default 1); fair comparisons on a noisy "
                        "host, e.g. with --check-auto")
    p.add_argument("-d", "--dtype", default="float32",
                   help="any torch dtype name (default float32)")
    p.add_argument("-o", "--redop", default="sum", help=f"{', '.join(REDOPS)} (default sum)")
    p.add_argument("--premul-factor", type=float, default=0.5, metavar="F",
                   help="-o premul_sum: each rank's input is multiplied by F before the "
                        "sum (default 0.5)")
    p.add_argument("-r", "--root", type=int, default=0, help="root of broadcast and reduce")
    p.add_argument("-c", "--check", type=int, choices=(0, 1), default=1,
                   help="count wrong result elements (default 1)")
    p.add_argument("--json", dest="json_path", metavar="PATH", help="write every row as JSON")
    p.add_argument("--plot", dest="plot_path", metavar="PNG",
                   help="plot busbw vs size, one line per backend (needs matplotlib)")
    p.add_argument("--timeout", type=float, default=300.0,
                   help="process-group timeout in seconds (default 300)")
    p.add_argument("--check-auto", nargs="?", const="report", choices=("report", "strict"),
                   help="compare tdx (auto) with the fastest pinned tdx:ALGO at every size "
                        "and print a verdict per op (adds tdx and tdx:all to --backends when "
                        "they have no plain tdx or no tdx:ALGO); =strict: exit 1 when auto "
                        "lost")
    p.add_argument("--auto-tolerance", type=float, default=10.0, metavar="PCT",
                   help="--check-auto: how much slower than the best auto may be, in "
                        "percent (default 10)")
    p.add_argument("-q", "--quiet", action="store_true", help="print no tables")
    p.add_argument("--no-progress", dest="progress", action="store_false",
                   help="no progress indicator on stderr")
    return p


def options_from_args(argv: Sequence[str] | None = None) -> Options:
    """Parse a command line into :class:`Options` (exits with usage on bad arguments)."""
    parser = build_parser()
    a = parser.parse_args(argv)
    try:
        opts = Options(ops=a.op, backends=a.backends, world=a.world, device=a.device,
                       minbytes=a.minbytes, maxbytes=a.maxbytes, stepfactor=a.stepfactor,
                       iters=a.iters, warmup=a.warmup, warmup_ms=a.warmup_ms,
                       dtype=a.dtype, redop=a.redop,
                       premul_factor=a.premul_factor, root=a.root, check=bool(a.check), json_path=a.json_path,
                       plot_path=a.plot_path, timeout=a.timeout, quiet=a.quiet,
                       progress=a.progress, stat=a.stat, rounds=a.rounds,
                       check_auto=a.check_auto,
                       auto_tolerance=a.auto_tolerance / 100.0)
    except ValueError as exc:
        parser.error(str(exc))
    # Everything that would fail a run only after its ranks start (or after it measured),
    # refused here with one line instead. Under torchrun (or in a group already
    # initialised) the ranks and the world come from there, and each rank refuses here
    # only what every rank sees alike: the output paths, which only rank 0 writes, are
    # checked once the group is up, every rank learning rank 0's answer (main() turns it
    # into this same usage error on each), so that no rank waits for one that left.
    world = planned_world(a.world)
    if world < 2 and all(op == "sendrecv" for op in opts.ops):
        parser.error(f"--op sendrecv needs at least 2 ranks (it sends to the next rank), "
                     f"and this run has {world}; use --world 2 or more")
    if why := launch_problem(opts, world, lead=not launched()):
        parser.error(why)
    return opts


def main(argv: Sequence[str] | None = None) -> int:
    """Entry point: 0 when every op ran and every checked element was right (and, with
    ``--check-auto=strict``, auto never lost), 1 otherwise: a wrong element, an op that
    failed (a skip, such as a pinned algorithm that cannot run a size, is not a failure)
    or a sweep with no rows. ``calibrate``, ``tune``, ``sparse``, ``compressed``, ``zero`` or
    ``ps`` as the first argument runs that module's ``main``
    (:mod:`torchdist_ext.bench.calibrate`, ``.tune``, ``.sparse``, ``.compressed``, ``.zero``,
    ``.ps``) on the rest."""
    argv = list(sys.argv[1:] if argv is None else argv)
    if argv and argv[0] == "tune":
        from . import tune

        return tune.main(argv[1:])
    if argv and argv[0] == "calibrate":
        from . import calibrate

        return calibrate.main(argv[1:])
    if argv and argv[0] == "sparse":
        from . import sparse

        return sparse.main(argv[1:])
    if argv and argv[0] == "compressed":
        from . import compressed

        return compressed.main(argv[1:])
    if argv and argv[0] == "zero":
        from . import zero

        return zero.main(argv[1:])
    if argv and argv[0] == "ps":
        from . import ps

        return ps.main(argv[1:])
    opts = options_from_args(argv)
    try:
        rows = run(opts)
    except LaunchError as exc:  # found by the ranks together: each exits with it alike
        build_parser().error(str(exc))
    if not rows:
        world = planned_world(opts.world)
        runnable = [op for op in opts.ops if op != "sendrecv" or world >= 2]
        if not runnable:
            print(f"# no rows: sendrecv needs at least 2 ranks, and this run has {world}",
                  file=sys.stderr)
        elif any(sizes_for(OPS[op], opts, world) for op in runnable):
            # There were sizes to run: every backend was skipped or failed to start (the
            # run's notes say why), not the sweep.
            print("# no rows: no backend under test could run (the notes above say why); "
                  "check --backends and --device", file=sys.stderr)
        else:
            print("# no rows: no size in the sweep holds a whole element per rank; "
                  "widen -b/-e", file=sys.stderr)
        return 1
    wrong = sum((r["oop_wrong"] or 0) + (r["ip_wrong"] or 0) for r in rows)
    failed = sum(1 for r in rows for key in ("oop_error", "ip_error")
                 if r.get(key) and not report.is_skipped(r[key]))
    if opts.check_auto == "strict" and any(report.auto_losses(rows, opts.auto_tolerance).values()):
        return 1
    return 0 if wrong == 0 and failed == 0 else 1


if __name__ == "__main__":  # pragma: no cover
    sys.exit(main())

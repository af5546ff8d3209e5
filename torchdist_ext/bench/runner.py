"""Running the benchmark: the per-rank loop and how ranks are started.

Every rank runs :func:`rank_main`. The default process group is gloo on CPU; it only
carries the benchmark's own bookkeeping (barriers, the MAX of the times, the sum of the
wrong counts, error agreement), so timing never depends on a backend under test. Each
backend under test gets its own group from ``dist.new_group(backend=...)`` in the same
processes, and the loop runs op -> size -> backend, so the rows of all backends for one
size are taken back to back on the same machine. ``tdx:<algorithm>`` labels share the one
tdx group: every rank pins the algorithm right before that label's row and restores the
previous choice (normally auto) right after it.
"""

from __future__ import annotations

import contextlib
import dataclasses
import datetime
import functools
import math
import os
import platform
import queue
import shutil
import socket
import statistics
import sys
import tempfile
import time
import traceback
import warnings
from dataclasses import dataclass
from datetime import timedelta
from typing import Any, Callable, Iterator, Sequence

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

import torchdist_ext
from torchdist_ext import _C

from . import report
from .core import (
    COLLECTIVES,
    OPS,
    TDX,
    Label,
    OpSpec,
    Options,
    count_wrong,
    dtype_name,
    expected_output,
    labels_for_op,
    op_input,
    parse_backend,
    poison,
    sizes_for,
    unusable,
)

__all__ = ["LaunchError", "agree_across_ranks", "is_lead", "launch_problem", "launched",
           "output_problem", "planned_world", "rank_main", "run", "torchrun_group",
           "world_source"]

_REDOPS = {
    "sum": dist.ReduceOp.SUM,
    "prod": dist.ReduceOp.PRODUCT,
    "min": dist.ReduceOp.MIN,
    "max": dist.ReduceOp.MAX,
    "avg": dist.ReduceOp.AVG,
    "band": dist.ReduceOp.BAND,
    "bor": dist.ReduceOp.BOR,
    "bxor": dist.ReduceOp.BXOR,
}


def _short(exc: BaseException) -> str:
    text = str(exc).strip().splitlines()
    first = text[0] if text else ""
    return f"{type(exc).__name__}: {first[:200]}"


def _spoil(t: torch.Tensor) -> torch.Tensor:
    """A copy of ``t`` with its first element changed (the ``_corrupt`` test hook)."""
    t = t.detach().to("cpu").clone()
    if t.numel():
        flat = t.view(-1)
        flat[0] = ~flat[0] if t.dtype == torch.bool else flat[0] + 1
    return t


# Read-only copies for checking: every backend and both forms of one size share them,
# so a large size is computed once. Buffers are always filled from fresh tensors.
_expected = functools.lru_cache(maxsize=2)(expected_output)
_input = functools.lru_cache(maxsize=2)(op_input)


@dataclass
class _Case:
    """One op on one group with its buffers: ``call`` runs it once, ``wrong`` checks it."""

    call: Callable[[], None]
    wrong: Callable[[], int]


@dataclass
class _Ctx:
    opts: Options
    rank: int
    world: int
    device: torch.device
    side: Any  # gloo group on CPU for the benchmark's own bookkeeping

    def sync(self) -> None:
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)

    def agree(self, error: str | None) -> str | None:
        """Every rank learns whether any rank failed, and the first failing rank's message."""
        return _agree(error, self.side, self.world)


def _agree(error: str | None, group: Any, world: int) -> str | None:
    """Every rank of ``group`` (a gloo group of ``world`` ranks) learns whether any rank's
    ``error`` was not None, and the first such rank's message."""
    flag = torch.tensor([1 if error else 0], dtype=torch.int64)
    dist.all_reduce(flag, group=group)
    if not int(flag):
        return None
    return _failed(error, group, world)


def _failed(error: str | None, group: Any, world: int) -> str:
    """Once every rank of ``group`` knows some rank failed: the first such rank's
    message, with its rank."""
    errors: list[Any] = [None] * world
    dist.all_gather_object(errors, error, group=group)
    for r, e in enumerate(errors):
        if e:
            return f"rank {r}: {e}"
    return "unknown error"  # pragma: no cover


def build_case(spec: OpSpec, in_place: bool, group: Any, ctx: _Ctx, count: int) -> _Case:
    """Buffers filled with known inputs and a closure that runs ``spec`` once on ``group``.

    Torch's all_reduce, broadcast and reduce only work in place. all_reduce's out-of-place
    form is torchdist_ext.all_reduce_into: on tdx (CPU) the algorithm reads the input and
    writes the output, on any other backend it is a copy plus the in-place call. The
    out-of-place broadcast and reduce copy the input into a separate output buffer and
    run the in-place call on it (what torch's functional collectives do). Either way the
    input stays intact.
    """
    o, rank, world = ctx.opts, ctx.rank, ctx.world
    dtype, redop, root, dev = o.torch_dtype, o.redop, o.root, ctx.device
    rop = (dist._make_nccl_premul_sum(o.premul_factor) if redop == "premul_sum"
           else _REDOPS[redop])
    chunk = count // world

    def inp(n: int, r: int = rank, offset: int = 0) -> torch.Tensor:
        return op_input(spec.name, r, world, n, dtype, redop, offset).to(dev)

    def empty(n: int) -> torch.Tensor:
        return poison(n, dtype, redop).to(dev)

    keep: list[tuple[torch.Tensor, Callable[[], torch.Tensor]]] = []  # inputs that must survive
    call: Callable[[], None]
    name = spec.name
    if name in ("all_reduce", "reduce", "broadcast"):
        if name == "broadcast" and rank != root:
            out = empty(count)
            src = None
        elif in_place:
            out = inp(count)
            src = None
        else:
            src, out = inp(count), empty(count)
            keep.append((src, lambda: _input(name, rank, world, count, dtype, redop)))

        def coll() -> None:
            if name == "all_reduce":
                dist.all_reduce(out, op=rop, group=group)
            elif name == "reduce":
                dist.reduce(out, dst=root, op=rop, group=group)
            else:
                dist.broadcast(out, src=root, group=group)

        if src is None:
            call = coll
        elif name == "all_reduce":
            def call() -> None:
                torchdist_ext.all_reduce_into(out, src, op=rop, group=group)
        else:
            def call() -> None:
                out.copy_(src)
                coll()
    elif name == "all_gather":
        if in_place:
            out = empty(count)
            mine = out.narrow(0, rank * chunk, chunk)
            mine.copy_(inp(chunk))
        else:
            mine, out = inp(chunk), empty(count)
            keep.append((mine, lambda: _input(name, rank, world, chunk, dtype, redop)))

        def call() -> None:
            dist.all_gather_into_tensor(out, mine, group=group)
    elif name == "reduce_scatter":
        if in_place:
            full = inp(count)
            out = full.narrow(0, rank * chunk, chunk)
        else:
            full, out = inp(count), empty(chunk)
            keep.append((full, lambda: _input(name, rank, world, count, dtype, redop)))

        def call() -> None:
            dist.reduce_scatter_tensor(out, full, op=rop, group=group)
    elif name == "all_to_all":
        if in_place:
            raise ValueError("all_to_all has no in-place form")
        src, out = inp(count), empty(count)
        keep.append((src, lambda: _input(name, rank, world, count, dtype, redop)))

        def call() -> None:
            dist.all_to_all_single(out, src, group=group)
    elif name == "sendrecv":
        if in_place:
            raise ValueError("sendrecv has no in-place form")
        if world < 2:
            raise ValueError("sendrecv needs at least 2 ranks")
        src, out = inp(count), empty(count)
        keep.append((src, lambda: _input(name, rank, world, count, dtype, redop)))
        # The bench's groups span every rank, so group ranks are global ranks.
        ops = [dist.P2POp(dist.isend, src, (rank + 1) % world, group),
               dist.P2POp(dist.irecv, out, (rank - 1) % world, group)]

        def call() -> None:
            for work in dist.batch_isend_irecv(ops):
                work.wait()
    else:  # pragma: no cover - Options validates names
        raise ValueError(f"unknown op {name!r}")

    def wrong() -> int:
        n = 0
        want = _expected(name, rank, world, count, dtype, redop, root, o.premul_factor)
        if want is not None:
            got = _spoil(out) if o._corrupt else out
            n += count_wrong(got, want, world, redop if spec.reduces else None)
        for tensor, original in keep:  # an out-of-place op must leave its input alone
            n += count_wrong(tensor, original())
        return n

    return _Case(call, wrong)


def _measure(spec: OpSpec, in_place: bool, group: Any, ctx: _Ctx,
             count: int) -> tuple[float | None, int | None, str | None]:
    """(max-over-ranks mean (or median) µs per op, wrong elements summed over ranks, error)."""
    o = ctx.opts
    error, wrong, case, per_op = None, 0, None, 0.0
    try:
        case = build_case(spec, in_place, group, ctx, count)
        case.call()  # the checked run, on freshly filled buffers
        ctx.sync()
        if o.check:
            wrong = case.wrong()
    except Exception as exc:  # noqa: BLE001 - reported in the row, the run goes on
        error = _short(exc)
    error = ctx.agree(error)
    if error or case is None:
        return None, None, error
    warmed = o.warmup and o.warmup_ms > 0
    if warmed:
        error = _warm(case, ctx)
        if error:
            return None, None, error
    try:
        for _ in range(0 if warmed else o.warmup):
            case.call()
        ctx.sync()
        dist.barrier(group=ctx.side)
        if o.stat == "median":
            times = []
            for _ in range(o.iters):
                start = time.perf_counter()
                case.call()
                ctx.sync()
                times.append(time.perf_counter() - start)
            per_op = statistics.median(times)
        else:
            start = time.perf_counter()
            for _ in range(o.iters):
                case.call()
            ctx.sync()
            per_op = (time.perf_counter() - start) / o.iters
    except Exception as exc:  # noqa: BLE001
        error = _short(exc)
    error = ctx.agree(error)
    if error:
        return None, None, error
    stats = torch.tensor([per_op * 1e6], dtype=torch.float64)
    dist.all_reduce(stats, op=dist.ReduceOp.MAX, group=ctx.side)
    total_wrong = torch.tensor([wrong], dtype=torch.int64)
    dist.all_reduce(total_wrong, group=ctx.side)
    return float(stats), (int(total_wrong) if o.check else None), None


# At most this many untimed calls beyond -w, whatever --warmup-ms asks: a call of a few
# microseconds must not turn a long floor into a minutes-long warm-up.
MAX_EXTRA_WARMUP = 100_000


def _warm(case: _Case, ctx: _Ctx) -> str | None:
    """Runs the ``warmup`` untimed calls, then batches of more until ``warmup_ms`` has
    passed on the slowest rank (or MAX_EXTRA_WARMUP more ran); None, or the first failing
    rank's error. After each batch the ranks agree on the slowest rank's time together
    with whether any failed, so every rank runs the same calls. Each batch is sized from
    the calls so far, which ran on the coldest cores and so overestimate a call: a batch
    falls short rather than overshoots, and the next one makes up the rest."""
    o = ctx.opts
    floor = o.warmup_ms * 1e-3
    batch, done, begun = o.warmup, 0, time.perf_counter()
    while True:
        error = None
        try:
            for _ in range(batch):
                case.call()
            ctx.sync()
        except Exception as exc:  # noqa: BLE001 - reported in the row, the run goes on
            error = _short(exc)
        done += batch
        seen = torch.tensor([1.0 if error else 0.0, time.perf_counter() - begun],
                            dtype=torch.float64)
        dist.all_reduce(seen, op=dist.ReduceOp.MAX, group=ctx.side)
        if seen[0] > 0:
            return _failed(error, ctx.side, ctx.world)
        took, extra = float(seen[1]), done - o.warmup
        if took >= floor or extra >= MAX_EXTRA_WARMUP:
            return None
        per_call = took / done
        want = MAX_EXTRA_WARMUP if per_call <= 0 else math.ceil((floor - took) / per_call)
        batch = max(1, min(want, MAX_EXTRA_WARMUP - extra))


def _combine(results: list[tuple[Any, Any, Any]]) -> tuple[Any, Any, Any]:
    """One figure from a label's rounds: the median time (of the two middle rounds for an
    even count), the most wrong elements any round saw, and the first error (a round that
    failed makes the figure an error, still counting what earlier rounds found wrong)."""
    errors = [e for _, _, e in results if e]
    wrongs = [w for _, w, _ in results if w is not None]
    worst = max(wrongs) if wrongs else None
    if errors:
        return None, worst, errors[0]
    times = [t for t, _, _ in results if t is not None]
    return (statistics.median(times) if times else None, worst, None)


def _label_order(asked: tuple[str, ...], ran: list[str]) -> list[str]:
    """The labels that ran, in the order they were asked for; each ``tdx:all`` stands for
    the labels it expanded into."""
    ran = list(dict.fromkeys(ran))
    out: list[str] = []
    for a in asked:
        if a in ran:
            out.append(a)
        elif parse_backend(a) == (TDX, "all"):
            out += [r for r in ran if r.startswith(f"{TDX}:") and r not in asked]
    out += ran
    return list(dict.fromkeys(out))


def _ran_algorithm(group: Any, collective: str) -> str | None:
    """The algorithm of the group's latest op as its flight recorder names it
    (``cuda-peer`` for the same-host GPU path), or None where the recorder does not say."""
    try:
        entries = torchdist_ext.flight_recorder(group)
    except (RuntimeError, ValueError):
        return None
    if not entries:
        return None
    name = str(entries[-1].get("path", "")).removeprefix("staged ").strip()
    if name == "cuda-peer" or name in torchdist_ext.algorithms(collective)[collective]:
        return name
    return None


def _algo_fields(lb: Label, collective: str | None, nbytes: int, world: int, same_host: bool,
                 one_host: bool, crowded: bool, group: Any = None,
                 pass_threads: int = 1) -> dict[str, Any]:
    """For tdx rows: ``algo``, the algorithm that ran (the flight recorder's, when ``group``
    is given and names one; else the pinned one, or what auto picks as
    ``torchdist_ext.predict`` says), ``algo_from`` (``flight recorder``, ``pinned`` or
    ``predict``), ``pinned``, and ``predicted_us`` (the cost model's time for ``algo``).
    All None for other backends."""
    out: dict[str, Any] = {"algo": None, "algo_from": None, "pinned": None,
                           "predicted_us": None}
    if lb.backend != TDX or collective is None:  # another backend, or point-to-point
        return out
    out["pinned"] = lb.algo is not None
    source = "flight recorder"
    name = _ran_algorithm(group, collective) if group is not None else None
    if name is None:
        name, source = lb.algo, "pinned"
    if name is None:
        source = "predict"
        # The backend chooses all_to_all's algorithm for an empty message: splits may be
        # uneven, and every rank must choose alike.
        chosen_for = 0 if collective == "alltoall" else nbytes
        try:  # predict() answers for a pin set outside the bench (TDX_ALGO) too
            name = torchdist_ext.predict(collective, chosen_for, world, same_host, one_host,
                                         crowded, pass_threads=pass_threads)[0]
        except (RuntimeError, ValueError):  # a pin that cannot run this op
            return out
    out["algo"], out["algo_from"] = name, source
    if name in torchdist_ext.algorithms(collective)[collective]:
        cost = _C._algorithm_cost(collective, name, float(nbytes), world, one_host, crowded,
                                  pass_threads)
        out["predicted_us"] = float(cost["seconds"]) * 1e6
    return out


def _runs_at(op: str, world: int) -> bool:
    """Whether ``op`` can run at ``world`` ranks: point-to-point needs a peer."""
    return world >= 2 or op != "sendrecv"


def _skip_reason(backend: str, device: str, local_world: int) -> str | None:
    if backend == "nccl":
        if not dist.is_nccl_available():
            return "nccl skipped: this torch has no NCCL"
        if device != "cuda":
            return "nccl skipped: it needs --device cuda"
        ndev = torch.cuda.device_count()
        if local_world > ndev:
            return (f"nccl skipped: {local_world} ranks on this host share {ndev} GPU(s), "
                    "and NCCL refuses two ranks on one GPU")
    return None


def _meta(ctx: _Ctx, backends: list[str]) -> tuple[dict[str, Any], list[str]]:
    """Rank 0's machine description (same on every rank) and one line per rank.

    ``one_host``: every rank on one host, so tdx prices its messages as same-host ones;
    ``same_host``: that and ``TDX_SHM`` not 0, so its shared-memory algorithms can run;
    ``crowded``: one host whose CPUs the ranks outnumber, so tdx adds a wake-up to each
    message step. All from host names and rank 0's CPU count here; the caller replaces
    them with the tdx group's own placement when there is one."""
    gpu = torch.cuda.get_device_name(ctx.device) if ctx.device.type == "cuda" else None
    mine = {"rank": ctx.rank, "pid": os.getpid(), "host": socket.gethostname(),
            "device": str(ctx.device), "gpu": gpu}
    ranks: list[Any] = [None] * ctx.world
    dist.all_gather_object(ranks, mine, group=ctx.side)
    meta = {
        "host": socket.gethostname(),
        "cpu_count": os.cpu_count(),
        "gpu": gpu,
        "torch_version": torch.__version__,
        "tdx_version": torchdist_ext.__version__,
        "ucx_version": torchdist_ext.ucx_version(),
        "python_version": platform.python_version(),
        "date": datetime.datetime.now().astimezone().isoformat(timespec="seconds"),
        "world": ctx.world,
        "device": ctx.opts.device,
        "backends": backends,
        "one_host": len({r["host"] for r in ranks}) == 1,
        "same_host": (len({r["host"] for r in ranks}) == 1
                      and os.environ.get("TDX_SHM", "1").strip() != "0"),
        "crowded": (len({r["host"] for r in ranks}) == 1
                    and ctx.world > _C._usable_cpus()),
    }
    box = [meta]
    dist.broadcast_object_list(box, src=0, group=ctx.side)
    lines = [
        f"Rank {r['rank']:2d} Pid {r['pid']:7d} on {r['host']:>12} device {r['device']}"
        + (f" [{r['gpu']}]" if r["gpu"] else "")
        for r in ranks
    ]
    return box[0], lines


def rank_main(rank: int, world: int, opts: Options, local_rank: int | None = None,
              local_world: int | None = None) -> list[dict[str, Any]]:
    """Run the whole benchmark on this rank of an initialised default group; every rank
    returns the same rows. Rank 0 prints the tables and writes --json / --plot."""
    # torch 2.14 flags all_gather_into_tensor / reduce_scatter_tensor as deprecated (in
    # favour of *_single); the benchmark calls them on purpose, once per iteration.
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message=r".*is deprecated\. Please use",
                                category=FutureWarning)
        return _rank_main(rank, world, opts, local_rank, local_world)


class LaunchError(ValueError):
    """Arguments that cannot work, found before anything is measured. Every rank of a run
    raises it with the same message (the command line turns it into a usage error on
    every rank), so no rank is left waiting for another."""


def _torchrun() -> bool:
    return "RANK" in os.environ and "WORLD_SIZE" in os.environ


def launched() -> bool:
    """Whether :func:`run` measures with ranks it does not spawn: a default group already
    initialised, or torchrun's (``RANK`` and ``WORLD_SIZE`` set). Then a problem that only
    one rank can see must be agreed on (:func:`agree_across_ranks`) before any rank stops,
    or the others would wait for it until the group timeout."""
    return dist.is_initialized() or _torchrun()


def is_lead() -> bool:
    """Whether this process prints and writes the outputs: rank 0 of an initialised
    default group, torchrun's rank 0, or the one process that spawns the ranks."""
    if dist.is_initialized():
        return dist.get_rank() == 0
    return os.environ.get("RANK", "0") == "0" if _torchrun() else True


def _planned(asked: int) -> tuple[int, str | None]:
    if dist.is_initialized():
        n = dist.get_world_size()
        return n, f"the initialised process group has {n} rank(s)"
    if _torchrun():
        try:
            return int(os.environ["WORLD_SIZE"]), f"WORLD_SIZE={os.environ['WORLD_SIZE']}"
        except ValueError:
            pass
    return asked, None


def planned_world(asked: int) -> int:
    """The ranks :func:`run` will measure with: an initialised default group's, torchrun's
    ``WORLD_SIZE`` under torchrun, else ``asked`` (``--world``, the ranks it spawns)."""
    return _planned(asked)[0]


def world_source(asked: str) -> str:
    """Where :func:`planned_world` takes the world size from, for a message: the
    initialised group, torchrun's ``WORLD_SIZE``, or else ``asked``, the caller's own
    words for the size it asked for (``"--world 1"``, ``"world=1"``)."""
    return _planned(0)[1] or asked


@contextlib.contextmanager
def torchrun_group(timeout: float) -> Iterator[None]:
    """Under torchrun with no default group yet: the gloo group that :func:`run` measures
    with (from the environment, with ``timeout`` seconds), initialised for the body and
    destroyed after it. A check inside can then agree across the ranks before anything is
    measured, and :func:`run` inside uses the group as it finds it. Otherwise nothing."""
    if dist.is_initialized() or not _torchrun():
        yield
        return
    dist.init_process_group("gloo", timeout=timedelta(seconds=timeout))
    try:
        yield
    finally:
        dist.destroy_process_group()


def agree_across_ranks(problem: str | None) -> str | None:
    """With a default group initialised: every rank learns whether any rank's ``problem``
    was not None, and the first such rank's message (a collective: every rank must call
    it). Without one: ``problem`` itself."""
    if not dist.is_initialized():
        return problem
    own_side = dist.get_backend() != "gloo"
    side = dist.new_group(backend="gloo") if own_side else dist.group.WORLD
    try:
        return _agree(problem, side, dist.get_world_size())
    finally:
        if own_side:
            dist.destroy_process_group(side)


def launch_problem(opts: Options, world: int, lead: bool = True) -> str | None:
    """Why a run of ``opts`` at ``world`` ranks cannot go well, found before any rank
    measures anything (None when nothing is wrong): a root that is not a rank for an op
    that takes one, ``--device cuda`` where no GPU is visible, and on the ``lead`` rank
    (which writes them) an output path that cannot be written. The first two are the
    same on every rank; the paths, seen by one rank, must be agreed on when there are
    several (:func:`rank_main` does)."""
    rooted = [op for op in opts.ops if OPS[op].rooted]
    if rooted and opts.root >= world:
        return (f"root {opts.root} (-r) is not a rank of a world of {world}, and "
                f"{', '.join(rooted)} take(s) a root; use -r 0 to {world - 1}")
    if opts.device == "cuda" and not torch.cuda.is_available():
        return "--device cuda: no CUDA device is visible to this process; use --device cpu"
    if lead:
        return output_problem(opts)
    return None


def output_problem(opts: Options) -> str | None:
    """Why ``--json`` or ``--plot`` cannot be written (None when both can, or neither is
    asked for)."""
    if opts.json_path and (why := report.unwritable(opts.json_path, "--json")):
        return why
    if opts.plot_path and (why := report.plot_unwritable(opts.plot_path)):
        return why
    return None


def _rank_main(rank: int, world: int, opts: Options, local_rank: int | None,
               local_world: int | None) -> list[dict[str, Any]]:
    # The same on every rank, so every rank raises alike and none waits for the others.
    # (A missing GPU is among them: the device count below is then not 0.)
    if why := launch_problem(opts, world, lead=False):
        raise LaunchError(why)
    local_rank = rank if local_rank is None else local_rank
    local_world = world if local_world is None else local_world
    if opts.device == "cuda":
        device = torch.device("cuda", local_rank % torch.cuda.device_count())
        torch.cuda.set_device(device)
    else:
        device = torch.device("cpu")
    own_side = dist.get_backend() != "gloo"
    side = dist.new_group(backend="gloo") if own_side else dist.group.WORLD
    ctx = _Ctx(opts, rank, world, device, side)
    lead = rank == 0
    # Only rank 0 writes --json and --plot, but every rank must learn that it cannot
    # before anything is measured, or the others would wait for it.
    why = ctx.agree(output_problem(opts) if lead else None)
    if why:
        if own_side:
            dist.destroy_process_group(side)
        raise LaunchError(why)

    # Which backends run: every rank must agree, so reasons are gathered.
    reasons: dict[str, str | None] = {}
    for b in opts.groups:
        gathered: list[Any] = [None] * world
        dist.all_gather_object(gathered, _skip_reason(b, opts.device, local_world), group=side)
        reasons[b] = next((g for g in gathered if g), None)
    groups: dict[str, Any] = {}
    notes = [r for r in reasons.values() if r]
    for b in (b for b in opts.groups if not reasons[b]):
        error = None
        try:
            groups[b] = dist.new_group(backend=b, timeout=timedelta(seconds=opts.timeout))
        except Exception as exc:  # noqa: BLE001
            error = _short(exc)
        error = ctx.agree(error)
        if error:
            groups.pop(b, None)
            notes.append(f"{b} skipped: could not create its group: {error}")
    meta, rank_lines = _meta(ctx, list(groups))
    if TDX in groups:
        # The group's own answer (boot id and namespaces, TDX_SHM on every rank), which
        # host names only approximate: containers may share one.
        placed = torchdist_ext.placement(groups[TDX])
        meta["one_host"], meta["same_host"] = placed["one_host"], placed["windows"]
        meta["crowded"] = placed["crowded"]
        meta["pass_threads"] = placed["pass_threads"]
    same_host = bool(meta["same_host"])
    pass_threads = int(meta.get("pass_threads", 1))
    one_host = bool(meta["one_host"])
    crowded = bool(meta["crowded"])

    # Labels per op: a backend, or tdx with an algorithm pinned. tdx:<algo> labels share
    # the one tdx group; the algorithm is pinned around each of their rows.
    labelled = tuple(lb for lb in opts.backends if parse_backend(lb)[0] in groups)
    plan: list[tuple[OpSpec, list[tuple[int, int]], list[Label]]] = []
    for op in opts.ops:
        if not _runs_at(op, world):
            # One rank has no peer to send to: nothing to measure, and nothing failed.
            notes.append(f"{op} skipped: it needs at least 2 ranks, and this run has {world}")
            continue
        op_labels, op_notes = labels_for_op(op, labelled, world, same_host)
        notes += op_notes
        plan.append((OPS[op], sizes_for(OPS[op], opts, world), op_labels))
    backends = _label_order(opts.backends, [lb.label for _, _, labels in plan for lb in labels])
    if lead and opts.quiet and not backends:
        # Nothing will run, and -q hides the header that says why: say it anyway.
        for note in notes:
            print(f"# note: {note}", file=sys.stderr)
    if opts.device == "cuda" and any(b.startswith(f"{TDX}:") for b in backends):
        notes.append("with --device cuda, tdx's GPU path among ranks of one host (algo "
                     "cuda-peer) does not use the algorithm registry: tdx:<algo> pins only "
                     "change staged ops")
    meta["backends"] = backends
    meta["groups"] = list(groups)
    meta["notes"] = notes
    original = {c: torchdist_ext.get_algorithm(c) for c in set(COLLECTIVES.values())}

    total = sum(len(sizes) * len(labels) for _, sizes, labels in plan) * opts.rounds
    progress = report.Progress(total, enabled=lead and opts.progress)
    show = lead and not opts.quiet

    def emit(line: str) -> None:
        if show:
            progress.print(line)

    for line in report.header_lines(meta, rank_lines, opts, notes):
        emit(line)
    rows: list[dict[str, Any]] = []
    broken: dict[tuple[str, str, bool], str] = {}
    told: set[tuple[str, str, str]] = set()
    try:
        for spec, sizes, labels in plan:
            progress.note(f"{spec.name}: {len(sizes)} sizes x {len(labels)} backends")
            lead_cols = report.lead_columns(lb.label for lb in labels)
            for line in report.table_header(spec, lead_cols):
                emit(line)
            factor = spec.bus_factor(world)
            collective = COLLECTIVES.get(spec.name)
            for nbytes, count in sizes:
                whys = {lb.label: unusable(spec.name, lb.algo, nbytes, world, same_host)
                        if lb.algo else "" for lb in labels}

                def measure_label(lb: Label) -> dict[str, tuple[Any, Any, Any]]:
                    """prefix -> (time, wrong, error) of one round of ``lb``."""
                    why = whys[lb.label]
                    out: dict[str, tuple[Any, Any, Any]] = {}
                    if lb.algo and not why:
                        torchdist_ext.set_algorithm(collective, lb.algo)
                    try:
                        for prefix, in_place in (("oop_", False), ("ip_", True)):
                            t = wrong = error = None
                            key = (spec.name, lb.label, in_place)
                            if in_place and not spec.in_place:
                                pass
                            elif why:
                                error = f"{report.UNUSABLE}: {why}"
                            elif key in broken:
                                error = f"{report.SKIPPED}: {broken[key]}"
                            else:
                                t, wrong, error = _measure(spec, in_place, groups[lb.backend],
                                                           ctx, count)
                                if error:
                                    broken[key] = error
                            out[prefix] = (t, wrong, error)
                    finally:
                        if lb.algo and not why:
                            torchdist_ext.set_algorithm(collective, original[collective])
                    return out

                # prefix -> per-round results of each label; rounds interleave the labels
                # so that slow spells of a shared host hit all of them.
                taken: dict[str, dict[str, list[tuple[Any, Any, Any]]]] = {
                    lb.label: {"oop_": [], "ip_": []} for lb in labels}
                ran: dict[str, dict[str, Any]] = {}
                for _ in range(opts.rounds):
                    for lb in labels:
                        progress.step(f"{spec.name} {lb.label} {nbytes} B")
                        this_round = measure_label(lb)
                        for prefix, result in this_round.items():
                            taken[lb.label][prefix].append(result)
                        if lb.backend == TDX and any(t for t, _, _ in this_round.values()):
                            # what this label's last timed op really ran
                            ran[lb.label] = _algo_fields(lb, collective, nbytes, world,
                                                         same_host, one_host, crowded,
                                                         groups[lb.backend], pass_threads)
                        progress.advance()
                for lb in labels:
                    why = whys[lb.label]
                    row: dict[str, Any] = {
                        "op": spec.name, "backend": lb.label, "world": world,
                        "device": opts.device, "size": nbytes, "count": count,
                        "dtype": dtype_name(opts.torch_dtype),
                        "redop": opts.redop if spec.reduces else "none",
                        "root": opts.root if spec.rooted else None,
                    }
                    row.update(_algo_fields(lb, collective, nbytes, world, same_host,
                                            one_host, crowded, pass_threads=pass_threads))
                    for prefix, results in taken[lb.label].items():
                        t, wrong, error = _combine(results)
                        algbw = nbytes / (t * 1e-6) / 1e9 if t else None
                        row[f"{prefix}time_us"] = t
                        row[f"{prefix}algbw_gb_s"] = algbw
                        row[f"{prefix}busbw_gb_s"] = algbw * factor if algbw else None
                        row[f"{prefix}wrong"] = wrong
                        row[f"{prefix}error"] = error
                    row.update(ran.get(lb.label, {}))
                    row.update(iters=opts.iters, warmup=opts.warmup,
                               warmup_ms=opts.warmup_ms, stat=opts.stat,
                               rounds=opts.rounds, host=meta["host"],
                               one_host=one_host, windows=same_host, crowded=crowded,
                               pass_threads=pass_threads,
                               torch_version=meta["torch_version"],
                               tdx_version=meta["tdx_version"],
                               ucx_version=meta["ucx_version"], date=meta["date"])
                    rows.append(row)
                    emit(report.format_row(row, lead_cols))
                    for line in report.error_lines(row):
                        emit(line)
                    if why and (spec.name, lb.label, why) not in told:
                        told.add((spec.name, lb.label, why))
                        emit(f"#   {lb.label} {spec.name} skipped from {nbytes} B: "
                             f"{lb.algo} {why}")
            for line in report.avg_busbw_lines(rows, spec.name, [lb.label for lb in labels]):
                emit(line)
    finally:
        progress.close()
        _expected.cache_clear()
        _input.cache_clear()

    bad = sum((r["oop_wrong"] or 0) + (r["ip_wrong"] or 0) for r in rows)
    for line in report.ratio_lines(rows, backends):
        emit(line)
    emit("#")
    if opts.check:
        emit(f"# Wrong elements : {bad} {'OK' if bad == 0 else 'FAILED'}")
    else:
        emit("# Wrong elements : not checked (-c 0)")
    failed = sum(1 for r in rows for p in ("oop_", "ip_")
                 if r[f"{p}error"] and not report.is_skipped(r[f"{p}error"]))
    if failed:
        emit(f"# Failed ops     : {failed} (an op, form and backend each; reasons above)")
    if opts.check_auto:
        for line in report.check_auto_lines(rows, opts.auto_tolerance):
            emit(line)
    if lead and opts.json_path:
        report.write_json(opts.json_path, {"meta": meta, "rows": rows})
    if lead and opts.plot_path:
        report.write_plot(opts.plot_path, rows, backends,
                          f"busbw, world {world}, {opts.device}, {meta['host']}")
    for g in groups.values():
        dist.destroy_process_group(g)
    if own_side:
        dist.destroy_process_group(side)
    return rows


# ---------------------------------------------------------------------------------------
# Launch
# ---------------------------------------------------------------------------------------

def side_device(device: str, rank: int, local_rank: int | None) -> torch.device:
    """The device of a side bench's rank (``sparse``, ``compressed``): the CPU, or the GPU
    that ``local_rank`` picks (the rank itself when not given, as for ranks the bench
    spawns on one host), made current."""
    if device != "cuda":
        return torch.device("cpu")
    local = rank if local_rank is None else local_rank
    dev = torch.device("cuda", local % torch.cuda.device_count())
    torch.cuda.set_device(dev)
    return dev


def side_report(bench: str, world: int, opts: Any) -> dict[str, Any]:
    """A side bench's report header, once every rank agrees that ``opts.json_path`` can
    be written (the lead checks; all raise alike)."""
    problem = None
    if is_lead() and opts.json_path:
        problem = report.unwritable(opts.json_path, "--json")
    if why := agree_across_ranks(problem):
        raise LaunchError(why)
    return {
        "bench": bench, "world": world,
        "date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
        "host": socket.gethostname(), "cpus": os.cpu_count(), "torch": torch.__version__,
        "options": {k: (str(v) if isinstance(v, torch.dtype) else v)
                    for k, v in dataclasses.asdict(opts).items()},
        "backends": {},
    }


def per_backend(backends: Sequence[str], measure: Callable[[Any], Any]) -> dict[str, Any]:
    """``measure(group)`` on a group of its own for each backend, by name. A failure stops
    the run on every rank alike (each raises from the same op), with the rank's
    traceback: a backend that cannot do this is the answer."""
    out: dict[str, Any] = {}
    for backend in backends:
        group = dist.new_group(backend=backend)
        try:
            out[backend] = measure(group)
        finally:
            dist.destroy_process_group(group)
    return out


def side_rank(bench: str, backend_rows: Callable[..., Any], rank: int, world: int,
              opts: Any, local_rank: int | None = None) -> dict[str, Any]:
    """One rank of a side bench inside an initialised default gloo group: the report,
    with ``backend_rows(opts, group, world, rank, device)`` for each backend (pass it
    bound with functools.partial, so that spawned ranks can unpickle it)."""
    device = side_device(opts.device, rank, local_rank)
    data = side_report(bench, world, opts)
    data["backends"] = per_backend(
        opts.backends, lambda group: backend_rows(opts, group, world, rank, device))
    return data


def run_side(opts: Any, rank_main: Callable[..., Any]) -> Any:
    """A side bench's run: under torchrun, this process's rank; otherwise ``opts.world``
    spawned ranks. Rank 0's results (every rank's under torchrun)."""
    if opts.device == "cuda" and not torch.cuda.is_available():
        raise LaunchError("--device cuda: no CUDA device is visible to this process; use "
                          "--device cpu")
    if launched():
        with torchrun_group(opts.timeout):
            rank, world = dist.get_rank(), dist.get_world_size()
            return rank_main(rank, world, opts, int(os.environ.get("LOCAL_RANK", rank)))
    if opts.json_path and (why := report.unwritable(opts.json_path, "--json")):
        raise LaunchError(why)
    return _spawn(opts, functools.partial(_spawn_child, main=rank_main))


def add_side_arguments(p: Any, iters: int, warmup: int, what: str = "ops",
                       world: int = 2) -> None:
    """The flags every side bench takes: --world, --device, -n/--iters, -w/--warmup,
    --timeout and --json (``what`` names what is timed in the help text)."""
    p.add_argument("--world", type=int, default=world, help=f"ranks to spawn (default {world})")
    p.add_argument("--device", choices=("cpu", "cuda"), default="cpu")
    p.add_argument("-n", "--iters", type=int, default=iters,
                   help=f"timed {what} (default {iters})")
    p.add_argument("-w", "--warmup", type=int, default=warmup,
                   help=f"untimed {what} (default {warmup})")
    p.add_argument("--timeout", type=float, default=300.0,
                   help="process-group timeout in seconds (default 300)")
    p.add_argument("--json", dest="json_path", metavar="PATH", help="write the results as JSON")


def check_side_options(opts: Any, backends: Sequence[str]) -> None:
    """The checks every side bench's options share (``backends``, ``world``, ``device``,
    ``iters``, ``warmup``, ``timeout``), each naming its command-line flag."""
    if not opts.backends or any(b not in backends for b in opts.backends):
        raise ValueError(f"backends (--backends) take {' and/or '.join(backends)}, not "
                         f"{','.join(opts.backends)!r}")
    if len(set(opts.backends)) != len(opts.backends):
        raise ValueError(f"a backend is named twice in {','.join(opts.backends)!r} "
                         f"(--backends)")
    if opts.world < 1:
        raise ValueError(f"world (--world) must be at least 1, not {opts.world}")
    if opts.device not in ("cpu", "cuda"):
        raise ValueError(f"device (--device) must be cpu or cuda, not {opts.device!r}")
    if opts.iters < 1 or opts.warmup < 0:
        raise ValueError(f"iters (-n) must be at least 1 and warmup (-w) at least 0, "
                         f"not {opts.iters} and {opts.warmup}")
    if not (math.isfinite(opts.timeout) and opts.timeout > 0):
        raise ValueError(f"timeout (--timeout) must be a number of seconds > 0, not "
                         f"{opts.timeout}")


def side_main(parser: Any, argv: Any, options: Callable[[Any], Any],
              run: Callable[[Any], Any], table_lines: Callable[[Any], list[str]]) -> Any:
    """A side bench's command line: the options from the parsed arguments (a ValueError
    is a usage error), the run (so is a LaunchError), then on the lead rank the table
    and the JSON file. The run's data on the lead rank, None elsewhere."""
    args = parser.parse_args(argv)
    try:
        opts = options(args)
    except ValueError as exc:
        parser.error(str(exc))
    try:
        data = run(opts)
    except LaunchError as exc:
        parser.error(str(exc))
    if not is_lead():
        return None
    for line in table_lines(data):
        print(line)
    if opts.json_path:
        report.write_json(opts.json_path, data)
    return data


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def time_per_call(call: Callable[[int], Any], n: int, device: torch.device) -> float:
    """Seconds per call of ``call(i)`` for i < n, the largest over the ranks of the default
    group (the benchmarks' gloo side channel), after a barrier there."""
    dist.barrier()
    _sync(device)
    start = time.perf_counter()
    for i in range(n):
        call(i)
    _sync(device)
    took = torch.tensor([(time.perf_counter() - start) / n], dtype=torch.float64)
    dist.all_reduce(took, op=dist.ReduceOp.MAX)
    return float(took.item())


def _spawn_child(rank: int, world: int, store_path: str, opts: Any, results: Any,
                 main: Callable[[int, int, Any], Any] = rank_main) -> None:
    """One spawned rank: a gloo default group on the run's FileStore (the bench's own
    side channel), then ``main(rank, world, opts)``, whose result rank 0 reports.
    Other benchmarks pass their ``main`` with functools.partial."""
    try:
        torch.set_num_threads(max(1, (os.cpu_count() or 1) // world))
        store = dist.FileStore(store_path, world)
        dist.init_process_group("gloo", store=store, rank=rank, world_size=world,
                                timeout=timedelta(seconds=opts.timeout))
        try:
            value = main(rank, world, opts)
        finally:
            dist.destroy_process_group()
        results.put((rank, True, value if rank == 0 else None))
    except BaseException:  # report everything, KeyboardInterrupt included
        results.put((rank, False, traceback.format_exc()))


# Slack after the group timeout for the ranks still running when one has finished, and
# more for rank 0, which writes the report after the ops.
_TEARDOWN_SLACK_S = 30.0
_LEAD_SLACK_S = 300.0


def _spawn(opts: Any, child: Callable[..., None] = _spawn_child) -> Any:
    ctx = mp.get_context("spawn")
    tmp = tempfile.mkdtemp(prefix="tdx-bench-")
    results = ctx.Queue()
    procs = [ctx.Process(target=child,
                         args=(r, opts.world, os.path.join(tmp, "store"), opts, results),
                         daemon=True)
             for r in range(opts.world)]
    done: dict[int, Any] = {}
    # Every op is bounded by the group timeout, but the code around the ops (set-up,
    # teardown, the report) is not: once a rank has finished, the others get one group
    # timeout plus the slack below to finish too, and a rank stuck past it fails the run
    # instead of hanging it.
    finish_by: float | None = None
    try:
        for p in procs:
            p.start()
        while len(done) < opts.world:
            try:
                rank, ok, value = results.get(timeout=1.0)
            except queue.Empty:
                dead = [r for r, p in enumerate(procs) if r not in done and p.exitcode is not None]
                if finish_by is not None and time.monotonic() > finish_by and not dead:
                    late = [r for r in range(opts.world) if r not in done]
                    slack = _TEARDOWN_SLACK_S + (0 if 0 in done else _LEAD_SLACK_S)
                    raise RuntimeError(
                        f"bench rank(s) {late} did not finish within "
                        f"{opts.timeout + slack:.0f} s of rank(s) {sorted(done)} "
                        f"(the group timeout plus {slack:.0f} s); they were "
                        "stopped") from None
                if dead:
                    try:  # a dying rank may still deliver its traceback
                        rank, ok, value = results.get(timeout=2.0)
                    except queue.Empty:
                        codes = {r: procs[r].exitcode for r in dead}
                        raise RuntimeError(
                            f"bench rank(s) {dead} exited with codes {codes} without "
                            "reporting (crash?)") from None
                else:
                    continue
            if not ok:
                raise RuntimeError(f"bench rank {rank}/{opts.world} failed:\n{value}")
            done[rank] = value
            # Rank 0 finishes last as a rule: after the ops it still writes the tables,
            # --json and --plot, which no group timeout bounds. Waiting for rank 0, the
            # deadline allows for that; waiting for the others, only for teardown.
            if rank == 0:
                finish_by = time.monotonic() + opts.timeout + _TEARDOWN_SLACK_S
            elif finish_by is None:
                finish_by = time.monotonic() + opts.timeout + _TEARDOWN_SLACK_S + _LEAD_SLACK_S
        return done[0]
    finally:
        started = [p for p in procs if p.pid is not None]
        for p in started:
            p.join(timeout=10.0 if len(done) == opts.world else 0.5)
        for p in started:
            if p.is_alive():
                p.kill()
                p.join(timeout=5.0)
        shutil.rmtree(tmp, ignore_errors=True)


def run(options: Options) -> list[dict[str, Any]]:
    """Run the benchmark and return one dict per (op, backend, size).

    Under torchrun (``RANK`` and ``WORLD_SIZE`` set) this process is one rank: the default
    group is initialised from the environment (gloo) and destroyed afterwards. With a
    default group already initialised, that group's ranks are used as they are. Otherwise
    ``options.world`` ranks are spawned with a FileStore in a temporary directory, and the
    rows come back from rank 0.
    """
    if launched():
        # This process is one of the ranks. The root and the device look the same from
        # every rank, so each refuses them alike before the group starts. The output
        # paths only rank 0 writes: rank_main checks them there and tells every rank,
        # which then raise the same LaunchError.
        if why := launch_problem(options, planned_world(options.world), lead=False):
            raise LaunchError(why)
        with torchrun_group(options.timeout):
            rank, world = dist.get_rank(), dist.get_world_size()
            return rank_main(rank, world, options,
                             int(os.environ.get("LOCAL_RANK", rank)),
                             int(os.environ.get("LOCAL_WORLD_SIZE", world)))
    # Before any rank starts: a bad root, device or output path fails in a second, not
    # after the measurements.
    if why := launch_problem(options, options.world):
        raise LaunchError(why)
    return _spawn(options)

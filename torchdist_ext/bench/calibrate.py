"""``python -m torchdist_ext.bench calibrate``: fit tdx's cost model to this machine.

tdx picks an algorithm per op from a model of its time on each link (``net``: messages
between hosts, ``local``: messages between ranks of one host, which UCX carries through
shared memory, ``shm``: a shared-memory window, ``cma``: in-place reads of peers' memory)::

    t = alpha * steps + beta * bytes_moved + gamma * bytes_reduced

where each algorithm states its own steps and bytes (``torchdist_ext._C._algorithm_cost``).
Calibration spawns ranks with the benchmark's runner, times every algorithm of the ops in
``DEFAULT_OPS`` (all_reduce, all_gather, broadcast, reduce_scatter, all_to_all and reduce,
or those of ``--ops``) pinned in turn (``tdx:<algorithm>``) at a few sizes, and fits
alpha, beta, gamma per link by non-negative least squares on the relative error (each
point weighted by 1 / its measured time, so small sizes count as much as large ones),
with ``TDX_SHM_THREADS=1``: the model scales the window all_reduce by its threads itself,
a pass over T threads running T**p times faster. The shm all_reduce is then timed again
from ``THREAD_FIT_MIN_BYTES`` with the threads the ranks get (``TDX_SHM_THREADS`` as
this process has it, auto by default), and where that is several each, p is fitted
(:func:`fit_thread_exponent`). The time of a point is the in-place one (the op alone),
the median of its iterations timed one by one, so a stall of a busy machine does not
move it. The result goes to
:func:`torchdist_ext.calibration.save` (``calibration_path()``, read by every later
``import torchdist_ext``) unless ``--dry-run``.

Usage::

    python -m torchdist_ext.bench calibrate                      # world 2, 4K .. 16M
    python -m torchdist_ext.bench calibrate --world 4 --sizes 1K,64K,4M --dry-run
    python -m torchdist_ext.bench calibrate --out /tmp/cal.json --json fit.json

A term that no point depends on (say gamma when only all_gather ran) keeps its current
value. Ranks that outnumber their host's CPUs measure the scheduler as much as the links,
so such runs fit nothing (``--world`` above the CPU count is refused); the model prices
crowded hosts with ``TDX_CROWDED_STEP_US`` instead. Spawned ranks share this host, so
their message algorithms fit ``local``; ``net`` is fitted by a run under torchrun whose
ranks span hosts (which has no shared-memory points). Saving keeps the links of the
existing file that this run did not fit, so the two runs add up.
"""

from __future__ import annotations

import argparse
import contextlib
import dataclasses
import datetime
import itertools
import math
import os
import socket
import sys
from pathlib import Path
from typing import Any, Iterable, Iterator, Sequence

import numpy as np

import torchdist_ext
from torchdist_ext import _C, calibration

from . import report
from .core import COLLECTIVES, OPS, Options, canonical_op, parse_size, timeout_problem
from .runner import (
    agree_across_ranks,
    is_lead,
    planned_world,
    run,
    torchrun_group,
    world_source,
)

__all__ = ["DEFAULT_OPS", "DEFAULT_SIZES", "TERMS", "UNCALIBRATABLE", "build_parser",
           "calibrate", "fit_link", "fit_thread_exponent", "main", "nnls", "pick_ops",
           "points_from_rows", "report_lines"]

TERMS = ("alpha", "beta", "gamma")
_COLUMNS = ("steps", "bytes_moved", "bytes_reduced")  # what each term multiplies
LINKS = calibration.LINKS
DEFAULT_OPS = ("all_reduce", "all_gather", "broadcast", "reduce_scatter", "all_to_all",
               "reduce")
DEFAULT_SIZES = tuple(4096 * 4**k for k in range(7))  # 4K, 16K, ..., 16M
# Point-to-point has no algorithm to pin, so no point to fit: --ops refuses it by name.
UNCALIBRATABLE = {"sendrecv": "point-to-point has no algorithms to pin, so there is nothing "
                              "to calibrate"}


def _too_few_ranks(world: int, asked: str) -> str | None:
    """None when a run asked for ``world`` ranks measures with 2 or more; else why it
    cannot be calibrated, worded by where its size comes from: an initialised group,
    torchrun's WORLD_SIZE, or else ``asked``, the caller's words (``--world 1``)."""
    n = planned_world(world)
    if n >= 2:
        return None
    ranks = "one rank sends" if n == 1 else f"{n} ranks send"
    return (f"{world_source(asked)}: {ranks} no messages, so there is nothing to fit; "
            "calibrate needs 2 ranks or more")


def pick_ops(names: str | Sequence[str], allowed: Sequence[str],
             refused: dict[str, str]) -> list[str]:
    """Canonical op names from ``names`` (a comma-separated string or a sequence); ``all``
    stands for every op of ``allowed``. An op of ``refused`` is a ValueError with its
    reason, an unknown one a ValueError listing exactly what is accepted."""
    if isinstance(names, str):
        names = names.split(",")
    accepted = f"use all or any of {', '.join(allowed)}"
    out: list[str] = []
    for name in (n.strip() for n in names if n.strip()):
        if name.lower() == "all":
            out += allowed
            continue
        try:
            op = canonical_op(name)
        except ValueError:
            raise ValueError(f"unknown op {name!r} in --ops; {accepted}") from None
        if op in refused:
            raise ValueError(f"--ops {op}: {refused[op]}; {accepted}")
        if op not in allowed:  # pragma: no cover - allowed and refused cover every op
            raise ValueError(f"--ops {op} cannot be measured here; {accepted}")
        out.append(op)
    if not out:
        raise ValueError(f"--ops names no op; {accepted}")
    return list(dict.fromkeys(out))


# ---------------------------------------------------------------------------------------
# Fitting
# ---------------------------------------------------------------------------------------

def nnls(a: Any, b: Any) -> tuple[np.ndarray, float]:
    """Non-negative least squares: ``x >= 0`` minimising ``|a x - b|^2``, and that residual.

    With three unknowns, every subset of the columns is solved unconstrained (columns scaled
    to unit norm first; steps and bytes differ by orders of magnitude) and the best
    solution with no negative entry wins. The NNLS optimum is among them: it is the
    unconstrained optimum of the columns it leaves positive. Smaller subsets are tried
    first and a larger one must fit strictly better, so a term the points do not need
    stays 0.
    """
    a = np.asarray(a, dtype=np.float64)
    b = np.asarray(b, dtype=np.float64)
    if a.ndim != 2 or b.shape != (a.shape[0],):
        raise ValueError(f"nnls: need a (m, n) matrix and m values, got {a.shape}, {b.shape}")
    n = a.shape[1]
    scale = np.linalg.norm(a, axis=0)
    scale[scale == 0] = 1.0
    an = a / scale
    best_x, best_r = np.zeros(n), float(b @ b)
    for k in range(1, n + 1):
        for cols in itertools.combinations(range(n), k):
            sub = an[:, cols]
            sol = np.linalg.lstsq(sub, b, rcond=None)[0]
            if np.any(sol < 0):
                continue
            r = float(np.sum((sub @ sol - b) ** 2))
            if r < best_r * (1 - 1e-9) - 1e-300:
                best_x = np.zeros(n)
                best_x[list(cols)] = sol
                best_r = r
    return best_x / scale, best_r


def fit_link(points: Sequence[dict[str, Any]],
             current: dict[str, float] | None = None) -> tuple[dict[str, float], list[str]]:
    """alpha, beta, gamma for one link from its points (each with steps, bytes_moved,
    bytes_reduced and measured_s), minimising the relative error. Terms that no point
    depends on keep ``current``'s value (0 without one); their names come back second."""
    if not points:
        raise ValueError("no points to fit")
    a = np.array([[p[c] for c in _COLUMNS] for p in points], dtype=np.float64)
    t = np.array([p["measured_s"] for p in points], dtype=np.float64)
    if np.any(t <= 0) or not np.all(np.isfinite(t)):
        raise ValueError("measured times must be positive")
    used = [i for i in range(len(_COLUMNS)) if np.any(a[:, i] != 0)]
    x, _ = nnls(a[:, used] / t[:, None], np.ones(len(t)))
    terms = {name: float((current or {}).get(name, 0.0)) for name in TERMS}
    for i, value in zip(used, x, strict=True):
        terms[TERMS[i]] = float(value)
    kept = [TERMS[i] for i in range(len(TERMS)) if i not in used]
    return terms, kept


def predict(terms: dict[str, float], point: dict[str, Any]) -> float:
    """Seconds the model ``terms`` gives a point."""
    return sum(terms[t] * point[c] for t, c in zip(TERMS, _COLUMNS, strict=True))


# ---------------------------------------------------------------------------------------
# Measuring
# ---------------------------------------------------------------------------------------

def points_from_rows(rows: Iterable[dict[str, Any]],
                     links: Sequence[str] = LINKS) -> list[dict[str, Any]]:
    """One point per benchmark row of a pinned tdx algorithm that ran: the model's terms
    for the algorithm that ran (``_C._algorithm_cost``; the row's ``algo``, normally the
    pinned one), the link that prices it (``local`` for messages when the row's ranks
    shared a host) and its measured seconds (in-place time where the op has that form).
    Rows whose ranks outnumbered their host's CPUs (``crowded``) give no point."""
    out = []
    for r in rows:
        algo = r.get("algo")  # what ran, as the flight recorder says
        if not r.get("pinned") or r.get("predicted_us") is None:
            continue
        prefix = "ip_" if OPS[r["op"]].in_place else "oop_"
        t = r.get(f"{prefix}time_us")
        if r.get(f"{prefix}error") or not t:
            continue
        if r.get("crowded"):
            # Ranks that took turns on the cores: the time is the scheduler's as much as
            # the link's (the model prices that apart, with TDX_CROWDED_STEP_US).
            continue
        cost = _C._algorithm_cost(COLLECTIVES[r["op"]], algo, float(r["size"]), r["world"],
                                  bool(r.get("one_host", True)))
        if cost["priced_on"] not in links:
            continue
        out.append({
            "link": cost["priced_on"], "op": r["op"], "algo": algo, "size": r["size"],
            "world": r["world"], "steps": cost["steps"], "bytes_moved": cost["bytes_moved"],
            "bytes_reduced": cost["bytes_reduced"], "measured_s": t * 1e-6,
        })
    return out


# The thread exponent is fitted from window all_reduce sizes whose passes split over
# several threads (parts of at least 64 KiB): from this size up.
THREAD_FIT_MIN_BYTES = 256 << 10


def fit_thread_exponent(one_thread: Sequence[dict[str, Any]],
                        threaded_rows: Iterable[dict[str, Any]],
                        shm: dict[str, float]) -> tuple[float | None, list[dict[str, Any]]]:
    """The exponent p with which a window all_reduce pass over T threads runs T**p times
    faster, from the one-thread points of the shm all_reduce (``one_thread``, measured
    with ``TDX_SHM_THREADS=1``) and rows of the same algorithm with the ranks' own thread
    count (``threaded_rows``). Per size, each time less the model's steps (``shm``'s
    alpha times the steps) is its byte part, t1 and tT; p = ln(t1 / tT) / ln(ways), ways
    being the threads a pass of that size really splits over. Returns the median over
    sizes, kept within 0 to 1 (threads that slow a pass, on a host without cores to
    spare, give 0), or None when no size had a pass over several threads; and the
    per-size points."""
    base = {(p["size"], p["world"]): p for p in one_thread
            if p["op"] == "all_reduce" and p["algo"] == "shm"}
    points = []
    for r in threaded_rows:
        t = r.get("ip_time_us")
        mine = base.get((r["size"], r["world"]))
        if (r.get("algo") != "shm" or r.get("ip_error") or not t or mine is None
                or r.get("crowded")):
            continue
        threads = int(r.get("pass_threads", 1))
        cost = _C._algorithm_cost("allreduce", "shm", float(r["size"]), r["world"], True,
                                  False, threads)
        steps = shm["alpha"] * cost["steps"]
        alone, split = mine["measured_s"] - steps, t * 1e-6 - steps
        if cost["ways"] <= 1 or alone <= 0 or split <= 0:
            continue
        points.append({"size": r["size"], "world": r["world"], "threads": threads,
                       "ways": cost["ways"], "one_thread_s": mine["measured_s"],
                       "threaded_s": t * 1e-6,
                       "exponent": math.log(alone / split) / math.log(cost["ways"])})
    if not points:
        return None, points
    fitted = float(np.median([p["exponent"] for p in points]))
    return min(1.0, max(0.0, fitted)), points


def _labels(ops: Sequence[str], links: Sequence[str]) -> list[str]:
    """``tdx:<name>`` for every algorithm of these ops on these links (message algorithms
    for ``net`` or ``local``, whichever the ranks turn out to be on)."""
    names: dict[str, None] = {}
    wanted = {"net" if link == "local" else link for link in links}
    for a in _C._algorithms():
        if a["link"] in wanted and a["collective"] in {COLLECTIVES[o] for o in ops}:
            names.setdefault(a["name"])
    return [f"tdx:{n}" for n in names]


@contextlib.contextmanager
def _env(**values: str) -> Iterator[None]:
    """Sets environment variables for the ranks this process starts, then restores them."""
    before = {k: os.environ.get(k) for k in values}
    os.environ.update(values)
    try:
        yield
    finally:
        for k, v in before.items():
            if v is None:
                os.environ.pop(k, None)
            else:
                os.environ[k] = v


def calibrate(world: int = 2, sizes: Sequence[int] = DEFAULT_SIZES,
              ops: Sequence[str] = DEFAULT_OPS, links: Sequence[str] = LINKS,
              iters: int = 20, warmup: int = 3, stat: str = "median", timeout: float = 300.0,
              progress: bool = True, rounds: int = 1,
              warmup_ms: float = 20.0) -> dict[str, Any]:
    """Measure and fit; returns the calibration (what :func:`calibration.save` takes):
    ``links`` (the fitted terms), ``previous`` (the model before), ``kept`` (terms per link
    that no point determined), ``points`` (with ``model_s`` and ``rel_error`` under the fit),
    ``host``, ``date``, ``world``, sizes, ops, iters, rounds and versions. ``rounds`` > 1
    times every size that many times with the algorithms taking turns and keeps each
    one's median round, so a slow spell of a shared machine lands on all of them.

    Under torchrun every rank measures; all return the same result."""
    ops = pick_ops(ops, DEFAULT_OPS, UNCALIBRATABLE)
    if why := _too_few_ranks(world, f"world={world}"):
        raise ValueError(why)
    opts = Options(ops=tuple(ops), backends=tuple(_labels(ops, links)), world=world,
                   sizes=tuple(sizes), iters=iters, warmup=warmup, warmup_ms=warmup_ms,
                   stat=stat, timeout=timeout, quiet=True, progress=progress, rounds=rounds)
    # The shm link's terms are one thread's: the model divides the window all_reduce's
    # byte terms by its threads' speedup itself (TDX_SHM_THREADS), which a fit of
    # threaded points would count a second time. Rooted ops send plainly: the round trip
    # of their check (TDX_ROOT_CHECK) is not the link's and would raise every op's alpha.
    with _env(TDX_SHM_THREADS="1", TDX_ROOT_CHECK="0"):
        rows = run(opts)
    points = points_from_rows(rows, links)
    previous = torchdist_ext.cost_model()
    fitted: dict[str, dict[str, float]] = {}
    kept: dict[str, list[str]] = {}
    for link in links:
        mine = [p for p in points if p["link"] == link]
        if mine:
            fitted[link], kept[link] = fit_link(mine, previous.get(link))
    for p in points:
        terms = fitted.get(p["link"])
        if terms:
            p["model_s"] = predict(terms, p)
            p["rel_error"] = p["model_s"] / p["measured_s"] - 1.0
    world_run = rows[0]["world"] if rows else world
    why = {"net": "messages between hosts need ranks on several hosts (torchrun)",
           "local": "messages between ranks of one host need every rank on one host",
           "shm": "shared memory needs every rank on one host and TDX_SHM not 0",
           "cma": "cross-memory reads need every rank on one host, TDX_SHM not 0 and a "
                  "host that allows process_vm_readv"}
    if any(r.get("crowded") for r in rows):
        why.update({link: "the ranks outnumbered the CPUs of their host, so the times "
                          "measure the scheduler; rerun with a --world of at most the "
                          "host's CPUs" for link in ("local", "shm", "cma")})
    notes = sorted({f"{link}: no points ({why[link]}); kept as it was"
                    for link in links if link not in fitted})
    previous_exponent = _C._thread_exponent()
    exponent, thread_points, thread_note = _thread_fit(opts, points, fitted)
    if thread_note:
        notes.append(thread_note)
    # Only a fit writes these: a file's earlier fit keeps its points with its exponent.
    threads = {} if exponent is None else {
        "thread_exponent": exponent, "previous_thread_exponent": previous_exponent,
        "thread_points": thread_points}
    return {
        **threads,
        "links": fitted,
        "previous": previous,
        "kept": kept,
        "host": socket.gethostname(),
        "date": datetime.datetime.now().astimezone().isoformat(timespec="seconds"),
        "world": world_run,
        "ops": list(ops),
        "sizes": sorted({p["size"] for p in points}),
        "iters": iters,
        "rounds": rounds,
        "warmup": warmup,
        "warmup_ms": warmup_ms,
        "stat": stat,
        "tdx_version": torchdist_ext.__version__,
        "ucx_version": torchdist_ext.ucx_version(),
        "notes": notes,
        "points": points,
    }


def _thread_fit(opts: Options, points: Sequence[dict[str, Any]],
                fitted: dict[str, dict[str, float]]
                ) -> tuple[float | None, list[dict[str, Any]], str | None]:
    """Times the shm all_reduce again with the ranks' own thread count (TDX_SHM_THREADS as
    this process has it: auto by default) at the sizes from THREAD_FIT_MIN_BYTES that the
    one-thread run measured, and fits the thread exponent; with a note where it cannot."""
    sizes = sorted({p["size"] for p in points if p["op"] == "all_reduce" and
                    p["algo"] == "shm" and p["size"] >= THREAD_FIT_MIN_BYTES})
    if "shm" not in fitted or not sizes:
        return None, [], (f"threads: no one-thread shm all_reduce point from "
                          f"{THREAD_FIT_MIN_BYTES >> 10} KiB (all_reduce among --ops, shm "
                          "among --links and a size that large); the thread exponent stays "
                          f"{_C._thread_exponent():g}")
    stays = f"the thread exponent stays {_C._thread_exponent():g}"
    try:
        rows = run(dataclasses.replace(opts, ops=("all_reduce",), backends=("tdx:shm",),
                                       sizes=tuple(sizes)))
    except Exception as exc:  # noqa: BLE001 - the one-thread fit stands without it
        return None, [], f"threads: timing the threaded shm all_reduce failed ({exc}); {stays}"
    threads = sorted({int(r.get("pass_threads", 1)) for r in rows})
    exponent, thread_points = fit_thread_exponent(points, rows, fitted["shm"])
    if exponent is not None:
        return exponent, thread_points, None
    setting = os.environ.get("TDX_SHM_THREADS", "auto")
    if max(threads, default=1) <= 1:
        return None, [], (f"threads: the ranks got 1 thread(s) each for the window "
                          f"all_reduce (TDX_SHM_THREADS={setting}), so no pass split over "
                          f"several; {stays}")
    return None, [], (f"threads: the ranks got {'/'.join(map(str, threads))} threads each, "
                      "but no size gave a usable time (failed, crowded, or no faster than "
                      f"its steps alone); {stays}")


# ---------------------------------------------------------------------------------------
# Report
# ---------------------------------------------------------------------------------------

def _terms_text(t: dict[str, float]) -> str:
    def gbs(s: float) -> str:
        return f"{1e-9 / s:.2f} GB/s" if s > 0 else "inf"

    return (f"alpha {t['alpha']:.3e} s ({t['alpha'] * 1e6:.1f} us/step)  "
            f"beta {t['beta']:.3e} s/B ({gbs(t['beta'])})  "
            f"gamma {t['gamma']:.3e} s/B ({gbs(t['gamma'])})")


def _choices(points: Sequence[dict[str, Any]], model: dict[str, dict[str, float]]
             ) -> list[tuple[str, int, str, float, str, float]]:
    """Per (op, size): the algorithm ``model`` picks among the measured ones, its measured
    time, and the fastest measured algorithm and its time."""
    out = []
    keys = dict.fromkeys((p["op"], p["size"]) for p in points)
    for op, size in keys:
        mine = [p for p in points if p["op"] == op and p["size"] == size
                and p["link"] in model]
        if not mine:
            continue
        pick = min(mine, key=lambda p: predict(model[p["link"]], p))
        best = min(mine, key=lambda p: p["measured_s"])
        out.append((op, size, pick["algo"], pick["measured_s"], best["algo"],
                    best["measured_s"]))
    return out


def report_lines(data: dict[str, Any]) -> list[str]:
    """The fitted model, every point's relative error, and which algorithm the fitted (and
    the previous) model would pick at each measured op and size."""
    points = data["points"]
    lines = [
        f"# tdx cost-model calibration on {data['host']}: world {data['world']}, "
        f"ops {', '.join(data['ops'])}, {len(data['sizes'])} sizes, {len(points)} points, "
        f"{data['iters']} iters ({data['stat']}), {data.get('rounds', 1)} round(s)",
        "# model: t = alpha * steps + beta * bytes_moved + gamma * bytes_reduced, per link; "
        "fit: non-negative least squares on the relative error",
        "#",
    ]
    for link, terms in data["links"].items():
        mine = [p for p in points if p["link"] == link]
        errs = [abs(p["rel_error"]) for p in mine]
        worst = max(mine, key=lambda p: abs(p["rel_error"]))
        rms = math.sqrt(sum(e * e for e in errs) / len(errs))
        lines.append(f"# {link:>5}: {_terms_text(terms)}")
        lines.append(f"#        was   {_terms_text(data['previous'][link])}")
        lines.append(f"#        {len(mine)} points; relative error rms {rms * 100:.1f}%, max "
                     f"{abs(worst['rel_error']) * 100:.1f}% ({worst['op']} {worst['algo']} "
                     f"{worst['size']} B)")
        if data["kept"].get(link):
            lines.append(f"#        kept (no point depends on them): "
                         f"{', '.join(data['kept'][link])}")
    if "thread_exponent" in data:
        lines.append(f"# threads: a window all_reduce pass over T threads runs "
                     f"T^{data['thread_exponent']:.2f} times faster (was "
                     f"T^{data['previous_thread_exponent']:.2f}); per size:")
        for p in data["thread_points"]:
            lines.append(f"#        {p['size']:>10} B  {p['threads']} threads, {p['ways']} "
                         f"ways: {p['one_thread_s'] * 1e6:.1f} -> {p['threaded_s'] * 1e6:.1f}"
                         f" us, exponent {p['exponent']:+.2f}")
    for note in data.get("notes", []):
        lines.append(f"# note: {note}")
    lines += [
        "#",
        "# " + " ".join(f"{h:>{w}}" for h, w in (
            ("link", 5), ("op", 14), ("algo", 10), ("size", 10), ("steps", 6),
            ("moved (B)", 11), ("reduced (B)", 11), ("measured us", 11), ("model us", 10),
            ("error", 8))),
    ]
    for p in sorted(points, key=lambda p: (p["link"], p["op"], p["algo"], p["size"])):
        lines.append("  " + " ".join(f"{v:>{w}}" for v, w in (
            (p["link"], 5), (p["op"], 14), (p["algo"], 10), (p["size"], 10),
            (f"{p['steps']:g}", 6), (f"{p['bytes_moved']:.0f}", 11),
            (f"{p['bytes_reduced']:.0f}", 11), (f"{p['measured_s'] * 1e6:.1f}", 11),
            (f"{p['model_s'] * 1e6:.1f}" if "model_s" in p else "-", 10),
            (f"{p['rel_error'] * 100:+.1f}%" if "rel_error" in p else "-", 8))))
    for name, model in (("fitted", data["links"]), ("previous", data["previous"])):
        picks = _choices(points, model)
        if not picks:
            continue
        right = sum(1 for *_, a, ta, b, tb in picks if tb >= ta or a == b)
        losses = [(ta / tb - 1.0, op, size, a, b) for op, size, a, ta, b, tb in picks]
        worst = max(losses)
        lines += ["#", f"# with the {name} model, auto would pick the fastest measured "
                       f"algorithm at {right} of {len(picks)} op/sizes; worst: "
                       f"{worst[1]} {worst[2]} B picks {worst[3]}, "
                       f"{worst[0] * 100:+.1f}% vs {worst[4]}"]
        if name == "fitted":
            lines.append("# " + " ".join(f"{h:>{w}}" for h, w in (
                ("op", 14), ("size", 10), ("picks", 10), ("its us", 10), ("fastest", 10),
                ("its us", 10), ("loss", 8))))
            for op, size, a, ta, b, tb in picks:
                lines.append("  " + " ".join(f"{v:>{w}}" for v, w in (
                    (op, 14), (size, 10), (a, 10), (f"{ta * 1e6:.1f}", 10), (b, 10),
                    (f"{tb * 1e6:.1f}", 10), (f"{(ta / tb - 1) * 100:+.1f}%", 8))))
    return lines


# ---------------------------------------------------------------------------------------
# Command line
# ---------------------------------------------------------------------------------------

def _sizes(text: str) -> tuple[int, ...]:
    try:
        out = tuple(parse_size(s) for s in text.split(",") if s.strip())
    except ValueError as exc:
        raise argparse.ArgumentTypeError(str(exc)) from None
    if not out or min(out) < 1:
        raise argparse.ArgumentTypeError(f"need positive sizes, got {text!r}")
    return out


def add_run_args(p: argparse.ArgumentParser, ops: Sequence[str], iters: int, warmup: int,
                 rounds: int) -> None:
    """The measuring flags ``calibrate`` and ``tune`` share, with their own defaults."""
    p.add_argument("--world", type=int, default=2, help="ranks to spawn (default 2)")
    p.add_argument("--sizes", type=_sizes, default=DEFAULT_SIZES,
                   help="comma-separated sizes, K/M/G allowed (default 4K,16K,64K,256K,1M,4M,16M)")
    p.add_argument("--ops", default=",".join(ops),
                   help=f"ops to time, or all (default {','.join(ops)})")
    p.add_argument("-n", "--iters", type=int, default=iters,
                   help=f"timed iterations (default {iters})")
    p.add_argument("-w", "--warmup", type=int, default=warmup,
                   help=f"untimed iterations (default {warmup})")
    p.add_argument("--warmup-ms", type=float, default=20.0, metavar="MS",
                   help="after -w, untimed iterations until this many milliseconds have "
                        "passed (0, or -w 0: only -w; default 20)")
    p.add_argument("--rounds", type=int, default=rounds,
                   help="time every size this many times, the algorithms taking turns, and "
                        f"keep each one's median round (default {rounds})")


def run_args(parser: argparse.ArgumentParser, a: argparse.Namespace,
             allowed: Sequence[str] = DEFAULT_OPS,
             refused: dict[str, str] | None = None) -> list[str]:
    """The ``--ops`` of ``add_run_args`` as canonical op names (``all``: every op of
    ``allowed``; those of ``refused`` are refused with their reason, by default those
    without algorithms), after checking the counts; a bad value exits through
    ``parser.error``."""
    try:
        ops = pick_ops(a.ops, allowed, UNCALIBRATABLE if refused is None else refused)
    except ValueError as exc:
        parser.error(str(exc))
    if a.world < 1 or a.iters < 1 or a.warmup < 0 or a.rounds < 1 or \
            not (math.isfinite(a.warmup_ms) and a.warmup_ms >= 0):
        parser.error("need --world >= 1, -n >= 1, -w >= 0, --warmup-ms >= 0, --rounds >= 1")
    return ops


def add_output_args(p: argparse.ArgumentParser, json_help: str, dry_run_help: str) -> None:
    """Where the result goes, and the run's own settings, as both commands take them."""
    p.add_argument("--out", metavar="PATH", help="where to save (default: calibration_path())")
    p.add_argument("--json", dest="json_path", metavar="PATH", help=json_help)
    p.add_argument("--dry-run", action="store_true", help=dry_run_help)
    p.add_argument("--timeout", type=float, default=300.0,
                   help="process-group timeout in seconds (default 300)")
    p.add_argument("--no-progress", dest="progress", action="store_false",
                   help="no progress indicator on stderr")


@contextlib.contextmanager
def checked_outputs(parser: argparse.ArgumentParser,
                    a: argparse.Namespace) -> Iterator[Path]:
    """Check the flags of ``add_output_args`` before anything is measured (a path that
    cannot be written would otherwise lose the whole run), and yield where to save; a bad
    value exits through ``parser.error``. The body measures.

    Under torchrun the group the run measures with is started first (and held for the
    body): only rank 0 writes, so only rank 0 judges where, and every rank learns its
    answer at once, so that all exit with the same error and none waits for rank 0
    until the group timeout."""
    if why := timeout_problem(a.timeout):  # the same on every rank
        parser.error(why)
    target = Path(a.out) if a.out else calibration.calibration_path()
    with torchrun_group(a.timeout):
        if why := agree_across_ranks(_output_problem(a, target)):
            parser.error(why)
        yield target


def _output_problem(a: argparse.Namespace, target: Path) -> str | None:
    """What is wrong with ``--out`` (saved to ``target``) and ``--json``, as this rank
    sees it, or None."""
    if a.out:
        # Even a dry run reads --out (tune prices its picks with it), on every rank.
        try:
            if Path(a.out).is_dir():
                return f"--out {a.out}: is a directory; name a calibration file"
        except OSError as e:  # a reason, not a raise: every rank must reach the agreement
            return f"--out {a.out}: {e.strerror or e}; choose another --out path"
    if not is_lead():  # only rank 0 writes
        return None
    if not a.dry_run:
        # calibration.save creates missing directories, as the default path needs, and
        # renames a temporary file over the target: its directory must be writable.
        why = report.unwritable(target, "--out" if a.out else "the calibration file "
                                "(--out, TDX_CALIBRATION)", replaced=True)
        if why:
            return why
    if a.json_path:
        return report.unwritable(a.json_path, "--json")
    return None


def json_written(path: str, data: dict[str, Any]) -> bool:
    """Write ``data`` to ``--json path`` (:func:`report.write_json`); False, with a
    one-line message on stderr, when that fails after all, so that the caller can still
    report what it saved."""
    try:
        report.write_json(path, data)
    except OSError as exc:
        print(f"# --json {path}: could not write it: {exc}", file=sys.stderr)
        return False
    return True


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="python -m torchdist_ext.bench calibrate",
        description="Time every tdx algorithm of a few collectives pinned in turn, fit the "
                    "cost model's alpha (per step), beta (per byte moved) and gamma (per "
                    "byte reduced) per link, and, where the ranks get several threads each "
                    "for the window all_reduce, its thread exponent; save them for this "
                    "host.",
        epilog=f"Saved to {calibration.calibration_path()} (TDX_CALIBRATION overrides); "
               "every later 'import torchdist_ext' loads it.",
    )
    add_run_args(p, DEFAULT_OPS, iters=20, warmup=3, rounds=1)
    p.add_argument("--links", default=",".join(LINKS),
                   help="links to fit, any of net, local, shm, cma (default all)")
    p.add_argument("--stat", choices=("mean", "median"), default="median",
                   help="per-op time of a point: median of the iterations (default), or "
                        "their mean")
    add_output_args(p, "also write the fit with every point here (even with --dry-run)",
                    "fit and print, save nothing")
    return p


def main(argv: Sequence[str] | None = None) -> int:
    """Calibrate, print, save; 0 on success, 1 when no link could be fitted (or the fit
    was saved but ``--json`` could not be written)."""
    parser = build_parser()
    a = parser.parse_args(argv)
    links = [x.strip() for x in a.links.split(",") if x.strip()]
    if not links or any(x not in LINKS for x in links):
        parser.error(f"--links takes net, local, shm and/or cma, not {a.links!r}")
    ops = run_args(parser, a)
    if why := _too_few_ranks(a.world, f"--world {a.world}"):
        parser.error(why)
    cpus = _C._usable_cpus()  # affinity mask and cgroup quota, as tdx counts them
    if "RANK" not in os.environ and a.world > cpus:
        parser.error(f"--world {a.world} spawns more ranks than the {cpus} CPUs this process "
                     f"may run on: they would take turns on the cores and the fit would "
                     f"measure the scheduler; use --world {cpus} or less (crowded hosts are "
                     f"priced with TDX_CROWDED_STEP_US instead)")
    with checked_outputs(parser, a) as target:
        data = calibrate(world=a.world, sizes=a.sizes, ops=ops, links=links, iters=a.iters,
                         warmup=a.warmup, stat=a.stat, timeout=a.timeout,
                         progress=a.progress, rounds=a.rounds, warmup_ms=a.warmup_ms)
    if not is_lead():  # under torchrun (or in a group) only rank 0 reports and saves
        return 0
    for line in report_lines(data):
        print(line)
    if not data["links"]:
        print("# nothing fitted: no point ran", file=sys.stderr)
        if a.json_path:
            json_written(a.json_path, data)
        return 1
    # The fit first, the --json after it: a --json that fails after all must not cost
    # the fit that minutes of measuring produced.
    if a.dry_run:
        print(f"# dry run: nothing saved (would write {target})")
    else:
        before = calibration.load(target) if target.exists() else None
        path = calibration.save(data, target)
        print(f"# saved to {path}; processes that import torchdist_ext from now on use it")
        kept = sorted(set(before["links"]) - set(data["links"])) if before else []
        if kept:
            print(f"# kept from the file, not measured by this run: {', '.join(kept)}")
    if a.json_path and not json_written(a.json_path, data):
        return 1
    return 0


if __name__ == "__main__":  # pragma: no cover
    sys.exit(main())

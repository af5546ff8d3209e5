"""``python -m torchdist_ext.bench tune``: measured rules where the cost model misjudges.

The cost model (``calibrate``) prices each algorithm from a few terms per link. Where
those terms cannot describe the time, as on a host whose ranks outnumber its CPUs (each
step then waits for the scheduler to run a peer, and how long depends on how many ranks
the algorithm keeps busy at once), ``auto`` can lose to a fixed algorithm. Tuning times
every algorithm of each collective pinned in turn, at this world size and placement.
Where the model's own pick ran more than ``--margin`` (10%) slower than the fastest, it
records the fastest at that size as a rule::

    {"collective": "reduce", "world": 4, "placement": "windows", "crowded": true,
     "threads": 1, "min_bytes": 0, "max_bytes": 32768, "algorithm": "tree"}

``threads`` is the thread count each rank split the window all_reduce over in the run
(``TDX_SHM_THREADS`` as the group decided it, 1 without windows): it changes which
algorithm wins, so a rule applies only to groups with the same count, and a tuning with
another count keeps this one.

Elsewhere the model stays, so two algorithms within the timing noise of each other do
not trade places from one tuning to the next. A measured size's rule reaches halfway
(geometrically) to the next measured size, the smallest down to 0 and the largest up to
twice itself; beyond that the model decides. Adjacent sizes with the same winner share
one rule. ``auto`` takes a rule whenever one matches the op's collective, byte count,
group size, placement and thread count and its algorithm can run the op; rules travel with rank 0's
cost model, so every rank of a group agrees. The latest run's details (each size's
fastest, runner-up and the model's pick) are kept under ``tuning``.

A row with a wrong element fails the run (exit 1, nothing saved). all_to_all cannot be
tuned: it picks its algorithm before the ranks know each other's byte counts.

The rules go to the host's calibration file (:func:`torchdist_ext.calibration.save`), or
to ``--out``, whose terms (over the backend's defaults, as the spawned ranks load them)
then price the model's picks: they replace the stored rules of
every collective, world size, placement and thread count this run measured and keep the
rest, and the links. ``--dry-run`` saves nothing.

Usage::

    python -m torchdist_ext.bench tune --world 4
    python -m torchdist_ext.bench tune --world 3 --ops reduce,broadcast --rounds 5 --dry-run
"""

from __future__ import annotations

import argparse
import datetime
import math
import os
import socket
import sys
from pathlib import Path
from typing import Any, Callable, Iterable, Sequence

import torchdist_ext
from torchdist_ext import _C, calibration

from .calibrate import (
    DEFAULT_SIZES,
    add_output_args,
    add_run_args,
    checked_outputs,
    json_written,
    pick_ops,
    run_args,
)
from .core import COLLECTIVES, OPS, Options
from .runner import is_lead, run

__all__ = ["DEFAULT_MARGIN", "DEFAULT_OPS", "build_parser", "main", "model_pick",
           "rules_from_rows", "tune", "wrong_rows"]

DEFAULT_MARGIN = 0.1  # a rule only where the model's pick loses by more than this
DEFAULT_OPS = ("all_reduce", "all_gather", "broadcast", "reduce_scatter", "reduce")
# all_to_all picks its algorithm before its byte count is known on every rank (each rank's
# splits are its own), so a rule by size cannot apply to it; sendrecv has no algorithms.
UNTUNABLE = {"all_to_all": "all_to_all picks its algorithm before the ranks know each "
                           "other's byte counts (their splits differ), so no rule by size "
                           "can apply to it",
             "sendrecv": "point-to-point has no algorithms to pin, so there is nothing to "
                         "tune"}


def _labels(ops: Sequence[str]) -> list[str]:
    """``tdx:<name>`` for every algorithm of these ops; the runner drops those a world
    cannot run (a power-of-two algorithm at 3 ranks, windows under TDX_SHM=0)."""
    wanted = {COLLECTIVES[o] for o in ops}
    names: dict[str, None] = {}
    for a in _C._algorithms():
        if a["collective"] in wanted:
            names.setdefault(a["name"])
    return [f"tdx:{n}" for n in names]


def _placement(row: dict[str, Any]) -> str:
    if not row["one_host"]:
        return "hosts"
    return "windows" if row["windows"] else "host"


def _threads(row: dict[str, Any]) -> int:
    """The threads each rank of the row's group split the window all_reduce over (the
    group's placement says 1 without windows)."""
    return int(row.get("pass_threads", 1))


def _prefix(row: dict[str, Any]) -> str:
    """The form ``--check-auto`` judges: in place where the op has that form."""
    return "ip_" if OPS[row["op"]].in_place else "oop_"


def _time_us(row: dict[str, Any]) -> float | None:
    """The row's time, or None when it failed or gave a wrong element (a fast wrong
    answer must never become a rule)."""
    prefix = _prefix(row)
    t = row.get(f"{prefix}time_us")
    if row.get(f"{prefix}error") or row.get(f"{prefix}wrong") or not t:
        return None
    return float(t)


def wrong_rows(rows: Iterable[dict[str, Any]]) -> list[str]:
    """``op size algorithm`` of every pinned row that gave a wrong element."""
    return [f"{r['op']} {r['size']} B {r['algo']}: {r[_prefix(r) + 'wrong']} wrong"
            for r in rows if r.get("pinned") and r.get(_prefix(r) + "wrong")]


ModelPick = Callable[[str, int, int, str, bool, int], str]


def model_pick(op: str, size: int, world: int, placement: str, crowded: bool,
               threads: int = 1) -> str:
    """What the cost model alone (no rules, no pins such as ``TDX_ALGO``) picks for ``op``
    at ``size`` bytes, each rank splitting the window all_reduce over ``threads``."""
    collective = COLLECTIVES[op]
    saved, pin = _C._cost_rules(), torchdist_ext.get_algorithm(collective)
    _C._set_cost_rules([])
    torchdist_ext.set_algorithm(collective, "auto")
    try:
        return torchdist_ext.predict(collective, size, world, same_host=placement == "windows",
                                     one_host=placement != "hosts", crowded=crowded,
                                     pass_threads=threads)[0]
    finally:
        torchdist_ext.set_algorithm(collective, pin)
        _C._set_cost_rules(saved)


def rules_from_rows(rows: Iterable[dict[str, Any]], margin: float = DEFAULT_MARGIN,
                    model: ModelPick = model_pick) -> tuple[list[dict[str, Any]],
                                                           list[dict[str, Any]]]:
    """The rules that the pinned rows of a benchmark run support, and per (op, size) the
    winner (``op``, ``size``, ``algorithm``, ``us``, ``runner_up``, ``runner_up_us``,
    ``model``: what ``model`` picks there, ``model_us``: its time, ``ruled``: whether a
    rule overrides it). A size gets a rule only where the model's pick ran more than
    ``margin`` (a fraction) slower than the fastest; elsewhere the model stays, so two
    algorithms within the timing noise of each other do not flip from run to run."""
    times: dict[tuple[str, int, str, bool, int], dict[int, dict[str, float]]] = {}
    for r in rows:
        if not r.get("pinned") or not r.get("algo"):
            continue
        t = _time_us(r)
        if t is None:
            continue
        key = (r["op"], r["world"], _placement(r), bool(r.get("crowded")), _threads(r))
        times.setdefault(key, {}).setdefault(int(r["size"]), {})[r["algo"]] = t
    rules: list[dict[str, Any]] = []
    winners: list[dict[str, Any]] = []
    for (op, world, placement, crowded, threads), by_size in sorted(times.items()):
        sizes = sorted(by_size)
        best: list[str | None] = []
        for s in sizes:
            ranked = sorted(by_size[s].items(), key=lambda kv: kv[1])
            pick = model(op, s, world, placement, crowded, threads)
            pick_us = by_size[s].get(pick)
            ruled = pick_us is None or pick_us > (1.0 + margin) * ranked[0][1]
            best.append(ranked[0][0] if ruled else None)
            winners.append({"op": op, "size": s, "threads": threads,
                            "algorithm": ranked[0][0], "us": ranked[0][1],
                            "runner_up": ranked[1][0] if len(ranked) > 1 else None,
                            "runner_up_us": ranked[1][1] if len(ranked) > 1 else None,
                            "model": pick, "model_us": pick_us, "ruled": ruled})
        bounds = [0.0] + [math.sqrt(a * b) for a, b in zip(sizes, sizes[1:])] + \
            [max(2.0 * sizes[-1], 1.0)]  # a barrier's 0 bytes still get [0, 1)
        for i, algo in enumerate(best):
            if algo is None:
                continue
            lo, hi = bounds[i], bounds[i + 1]
            if rules and rules[-1]["algorithm"] == algo and rules[-1]["max_bytes"] == lo and \
                    calibration.rule_key(rules[-1]) == (COLLECTIVES[op], world, placement,
                                                        crowded, threads):
                rules[-1]["max_bytes"] = hi
                continue
            rules.append({"collective": COLLECTIVES[op], "world": world, "placement": placement,
                          "crowded": crowded, "threads": threads, "min_bytes": lo,
                          "max_bytes": hi, "algorithm": algo})
    return rules, winners


def tune(world: int = 2, sizes: Sequence[int] = DEFAULT_SIZES,
         ops: Sequence[str] = DEFAULT_OPS, iters: int = 10, warmup: int = 2,
         rounds: int = 5, timeout: float = 300.0, progress: bool = True,
         margin: float = DEFAULT_MARGIN, warmup_ms: float = 20.0) -> dict[str, Any]:
    """Time every algorithm of ``ops`` pinned in turn and derive the rules; returns what
    :func:`calibration.save` takes (``rules``) with the winners and the run's settings.
    ``rounds`` > 1 lets the algorithms take turns each round and keeps each one's median,
    so a slow spell of a shared machine lands on all of them."""
    ops = pick_ops(ops, DEFAULT_OPS, UNTUNABLE)
    opts = Options(ops=tuple(ops), backends=tuple(_labels(ops)), world=world,
                   sizes=tuple(sizes), iters=iters, warmup=warmup, warmup_ms=warmup_ms,
                   stat="median",
                   timeout=timeout, quiet=True, progress=progress, rounds=rounds)
    rows = run(opts)
    rules, winners = rules_from_rows(rows, margin)
    tuning = {
        "winners": winners,
        "wrong": wrong_rows(rows),
        "host": socket.gethostname(),
        "date": datetime.datetime.now().astimezone().isoformat(timespec="seconds"),
        "world": rows[0]["world"] if rows else world,
        # each rank's threads for the window all_reduce (the rules hold for it alone)
        "threads": sorted({_threads(r) for r in rows}),
        "ops": list(ops),
        "sizes": sorted(sizes),
        "iters": iters,
        "rounds": rounds,
        "warmup": warmup,
        "warmup_ms": warmup_ms,
        "margin": margin,
        # what this run measured: a later save replaces the stored rules of these keys
        # (only those with a timed row: an op that failed everywhere keeps its rules)
        "keys": sorted({(COLLECTIVES[r["op"]], r["world"], _placement(r), bool(r["crowded"]),
                         _threads(r))
                        for r in rows if r.get("pinned") and _time_us(r) is not None}),
        "tdx_version": torchdist_ext.__version__,
    }
    return {"rules": rules, "tuning": tuning}


def _size_text(b: float) -> str:
    for unit, scale in (("G", 1 << 30), ("M", 1 << 20), ("K", 1 << 10)):
        if b >= scale:
            return f"{b / scale:g}{unit}"
    return f"{b:g}"


def report_lines(data: dict[str, Any]) -> list[str]:
    t = data["tuning"]
    threads = "/".join(str(n) for n in t.get("threads", [])) or "1"
    out = [f"# tdx tune on {t['host']}, {t['date']}: world {t['world']}, "
           f"{threads} thread(s) per rank for the window all_reduce, "
           f"{t['iters']} iterations x {t['rounds']} rounds, median"]
    out.append(f"# {'op':<15}{'size':>8}  {'fastest':<12}{'us':>10}  {'next':<12}{'us':>10}"
               f"  {'model':<12}{'us':>10}  rule")
    for w in t["winners"]:
        nxt = w["runner_up"] or "-"
        nxt_us = f"{w['runner_up_us']:.1f}" if w["runner_up_us"] is not None else "-"
        model_us = f"{w['model_us']:.1f}" if w["model_us"] is not None else "-"
        out.append(f"  {w['op']:<15}{_size_text(w['size']):>8}  {w['algorithm']:<12}"
                   f"{w['us']:>10.1f}  {nxt:<12}{nxt_us:>10}  {w['model']:<12}{model_us:>10}"
                   f"  {'yes' if w['ruled'] else '-'}")
    out.append("# rules:")
    for r in data["rules"]:
        threads = f" threads {r['threads']}" if r["placement"] == "windows" else ""
        out.append(f"  {r['collective']:<15} world {r['world']} {r['placement']}"
                   f"{' crowded' if r['crowded'] else ''}{threads}: "
                   f"[{_size_text(r['min_bytes'])}, {_size_text(r['max_bytes'])}) -> "
                   f"{r['algorithm']}")
    return out


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="python -m torchdist_ext.bench tune",
        description="Time every tdx algorithm of a few collectives pinned in turn at one "
                    "world size and, at sizes where the cost model's pick lost by more than "
                    "--margin, record the fastest as a rule that auto follows (for that "
                    "world size, placement and threads per rank) instead of the model.",
        epilog=f"Saved to {calibration.calibration_path()} (TDX_CALIBRATION overrides), "
               "beside the calibrated terms; every later 'import torchdist_ext' loads them.",
    )
    add_run_args(p, DEFAULT_OPS, iters=10, warmup=2, rounds=5)
    p.add_argument("--margin", type=float, default=DEFAULT_MARGIN,
                   help="a rule only where the cost model's pick ran more than this fraction "
                        f"slower than the fastest (default {DEFAULT_MARGIN})")
    add_output_args(p, "also write the rules and every winner here (even with --dry-run)",
                    "measure and print, save nothing")
    return p


def main(argv: Sequence[str] | None = None) -> int:
    """Tune, print, save; 0 on success, 1 when no algorithm ran (or the rules were saved
    but ``--json`` could not be written)."""
    parser = build_parser()
    a = parser.parse_args(argv)
    ops = run_args(parser, a, DEFAULT_OPS, UNTUNABLE)
    if not a.margin >= 0:
        parser.error(f"need --margin >= 0, got {a.margin}")
    with checked_outputs(parser, a) as target:
        if a.out:
            # Price the model's picks with the file the rules go to, in this process and
            # in the ranks it spawns. The ranks import torchdist_ext afresh: the defaults,
            # then what the file holds. This process already holds the host's file
            # (loaded at import), so it goes back to the defaults first; a missing file,
            # or one without links, then prices with the defaults here as there.
            os.environ["TDX_CALIBRATION"] = a.out
            _C._set_cost_model(calibration.DEFAULT_LINKS)
            _C._set_cost_rules([])
            _C._set_thread_exponent(calibration.DEFAULT_THREAD_EXPONENT)
            calibration.load_into_backend(Path(a.out))
        data = tune(world=a.world, sizes=a.sizes, ops=ops, iters=a.iters, warmup=a.warmup,
                    rounds=a.rounds, timeout=a.timeout, progress=a.progress,
                    margin=a.margin, warmup_ms=a.warmup_ms)
    if not is_lead():  # under torchrun (or in a group) only rank 0 reports and saves
        return 0
    for line in report_lines(data):
        print(line)
    rc = _save(data, a, target)
    # The rules first, the --json after them, as calibrate does.
    if a.json_path and not json_written(a.json_path, data):
        rc = 1
    return rc


def _save(data: dict[str, Any], a: argparse.Namespace, target: Path) -> int:
    """Save what ``tune`` found to ``target`` unless it must not be; the exit code."""
    if data["tuning"]["wrong"]:
        # Something computed a wrong answer: that wants a bug report, not a rule.
        print("# wrong results, nothing saved:\n" +
              "\n".join(f"#   {w}" for w in data["tuning"]["wrong"]), file=sys.stderr)
        return 1
    if not data["tuning"]["winners"]:
        print("# nothing measured: no algorithm ran", file=sys.stderr)
        return 1
    if not data["rules"]:
        print(f"# no rules: the cost model's pick was within {a.margin:.0%} of the fastest "
              "at every size")
    if a.dry_run:
        print(f"# dry run: nothing saved (would write {target})")
    else:
        path = calibration.save(data, target, replaces=data["tuning"]["keys"])
        if path.exists():
            print(f"# saved to {path}; processes that import torchdist_ext from now on use it")
        else:
            print(f"# removed {path}: it held only rules this run replaced with none")
    return 0

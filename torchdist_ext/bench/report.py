"""Text tables, ratio summary, JSON, plot and the progress indicator (rank 0 only)."""

from __future__ import annotations

import importlib.util
import json
import math
import os
import sys
from pathlib import Path
from typing import Any, Iterable, Sequence, TextIO

from .core import OPS, OpSpec

__all__ = [
    "SKIPPED",
    "UNUSABLE",
    "Progress",
    "auto_losses",
    "check_auto_lines",
    "compare_auto",
    "error_lines",
    "avg_busbw_lines",
    "format_row",
    "header_lines",
    "is_skipped",
    "lead_columns",
    "matplotlib_missing",
    "ratio_lines",
    "table_header",
    "plot_unwritable",
    "unwritable",
    "write_json",
    "write_plot",
]

SKIPPED = "skipped after an earlier error"
UNUSABLE = "skipped, the pinned algorithm cannot run this size"
_LEAD = (("backend", 8), ("size", 12), ("count", 12), ("type", 9), ("redop", 6), ("root", 5))
_BLOCK = (("time", 10), ("algbw", 7), ("busbw", 7), ("#wrong", 7))
_UNITS = {"size": "(B)", "count": "(elements)", "time": "(us)", "algbw": "(GB/s)",
          "busbw": "(GB/s)"}
_BLOCK_W = sum(w + 1 for _, w in _BLOCK)


def is_skipped(error: str | None) -> bool:
    """An error that only says the op did not run (after an earlier error, or a pinned
    algorithm that cannot run the size), as opposed to a failure."""
    return bool(error) and (error.startswith(SKIPPED) or error.startswith(UNUSABLE))


def lead_columns(labels: Iterable[str]) -> tuple[tuple[str, int], ...]:
    """The columns before the timing blocks: the backend column fits the longest label, and
    an ``algo`` column (which tdx algorithm ran) follows it when a label is tdx."""
    labels = list(labels)
    width = max([8] + [len(lb) for lb in labels])
    cols = [("backend", width)]
    if any(lb.split(":")[0] == "tdx" for lb in labels):
        cols.append(("algo", 10))
    return tuple(cols) + _LEAD[1:]


def _line(cells: Iterable[tuple[str, int]]) -> str:
    return " ".join(f"{text:>{width}}" for text, width in cells)


def _fmt_time(us: float) -> str:
    if us < 1e4:
        return f"{us:.2f}"
    if us < 1e6:
        return f"{us:.1f}"
    return f"{us:.0f}"


def _fmt_bw(bw: float) -> str:
    return f"{bw:.3f}" if bw < 100 else f"{bw:.1f}"


def header_lines(meta: dict[str, Any], rank_lines: Sequence[str], opts: Any,
                 notes: Sequence[str]) -> list[str]:
    """The run's preamble: what ran where, with which settings."""
    gpu = f"  GPU {meta['gpu']}" if meta.get("gpu") else ""
    lines = [
        f"# torchdist_ext.bench  ops: {', '.join(opts.ops)}  "
        f"backends: {', '.join(meta['backends'])}",
        f"# machine: {meta['host']} ({meta['cpu_count']} CPUs){gpu}",
        f"# torch {meta['torch_version']}  torchdist_ext {meta['tdx_version']}  "
        f"UCX {meta['ucx_version']}  python {meta['python_version']}",
        f"# world {meta['world']}  device {meta['device']}  dtype {opts.dtype}  "
        f"date {meta['date']}",
        f"# minBytes {opts.minbytes} maxBytes {opts.maxbytes} step: {opts.stepfactor}(factor) "
        f"warmup iters: {opts.warmup}"
        f"{f' (at least {opts.warmup_ms:g} ms)' if opts.warmup and opts.warmup_ms else ''} "
        f"iters: {opts.iters} validation: {int(opts.check)}",
        f"# time: max over ranks of the {getattr(opts, 'stat', 'mean')} per-op time"
        + (f", median of {opts.rounds} rounds with the backends taking turns"
           if getattr(opts, "rounds", 1) > 1 else "")
        + "; algbw = size / time; busbw = algbw * factor (nccl-tests)",
        "#",
        "# Using devices",
    ]
    lines += [f"#  {line}" for line in rank_lines]
    lines += [f"# note: {note}" for note in notes]
    return lines


def table_header(spec: OpSpec, lead: Sequence[tuple[str, int]] = _LEAD) -> list[str]:
    """Column titles for one op's table (``lead``: :func:`lead_columns`)."""
    blocks = ["out-of-place"] + (["in-place"] if spec.in_place else [])
    titles = " " * sum(w + 1 for _, w in lead) + "".join(f"{b:^{_BLOCK_W}}" for b in blocks)
    names = _line(lead) + " " + " ".join(_line(_BLOCK) for _ in blocks)
    units = _line((_UNITS.get(n, ""), w) for n, w in lead) + " " + " ".join(
        _line((_UNITS.get(n, ""), w) for n, w in _BLOCK) for _ in blocks)
    note = {
        "all_reduce": "out-of-place = torchdist_ext.all_reduce_into (tdx on cpu: one op; "
                      "other backends: copy into the output + in-place all_reduce)",
        "broadcast": "out-of-place = root copies into its output buffer + broadcast",
        "reduce": "out-of-place = copy into the output buffer + in-place reduce",
        "all_gather": "in-place: the input is this rank's chunk of the output",
        "reduce_scatter": "in-place: the output is this rank's chunk of the input",
        "all_to_all": "no in-place form",
        "sendrecv": "no in-place form; each rank sends to rank+1 and receives from rank-1",
    }[spec.name]
    return [
        "#",
        f"# {spec.name} (torch.distributed.{spec.torch_call})  busbw factor {spec.bus_formula}"
        f"  {note}",
        ("# " + titles).rstrip(),
        ("# " + names).rstrip(),
        ("# " + units).rstrip(),
    ]


def _block(row: dict[str, Any], prefix: str) -> str:
    err = row.get(f"{prefix}error")
    if err:
        word = "skipped" if is_skipped(err) else "error (see below)"
        return f"{word:>{_BLOCK_W - 1}}"
    wrong = row.get(f"{prefix}wrong")
    return _line((
        (_fmt_time(row[f"{prefix}time_us"]), 10),
        (_fmt_bw(row[f"{prefix}algbw_gb_s"]), 7),
        (_fmt_bw(row[f"{prefix}busbw_gb_s"]), 7),
        ("N/A" if wrong is None else str(wrong), 7),
    ))


def error_lines(row: dict[str, Any]) -> list[str]:
    """A note under a row for each of its forms that failed (not those skipped after)."""
    out = []
    for prefix, form in (("oop_", "out-of-place"), ("ip_", "in-place")):
        err = row.get(f"{prefix}error")
        if err and not is_skipped(err):
            out.append(f"#   {row['backend']} {row['op']} {form} failed, later sizes skipped: "
                       f"{err}")
    return out


def format_row(row: dict[str, Any], lead: Sequence[tuple[str, int]] = _LEAD) -> str:
    """One backend's row in nccl-tests layout (``lead``: :func:`lead_columns`)."""
    spec = OPS[row["op"]]
    values = {
        "backend": row["backend"], "algo": row.get("algo") or "-", "size": str(row["size"]),
        "count": str(row["count"]), "type": row["dtype"], "redop": row["redop"],
        "root": str(row["root"]) if row["root"] is not None else "-",
    }
    parts = [_line((values[name], w) for name, w in lead), _block(row, "oop_")]
    if spec.in_place:
        parts.append(_block(row, "ip_"))
    return ("  " + " ".join(parts)).rstrip()


def _ok(row: dict[str, Any], prefix: str) -> bool:
    return not row.get(f"{prefix}error") and row.get(f"{prefix}time_us") is not None


def avg_busbw_lines(rows: Sequence[dict[str, Any]], op: str, backends: Sequence[str]) -> list[str]:
    """nccl-tests' closing 'Avg bus bandwidth' per backend for one op."""
    parts = []
    for b in backends:
        mine = [r for r in rows if r["op"] == op and r["backend"] == b]
        vals = [r[f"{p}busbw_gb_s"] for r in mine for p in ("oop_", "ip_") if _ok(r, p)]
        if vals:
            parts.append(f"{b} {sum(vals) / len(vals):.3f}")
        else:
            parts.append(f"{b} n/a")
    return [f"# Avg bus bandwidth (GB/s, out-of-place and in-place): {', '.join(parts)}"]


def _ratio(a: float | None, b: float | None) -> str:
    if a is None or b is None or b == 0 or not math.isfinite(a / b):
        return "n/a"
    return f"{a / b:.2f}x"


def ratio_lines(rows: Sequence[dict[str, Any]], backends: Sequence[str]) -> list[str]:
    """Per size: busbw and time of tdx (or the first backend) relative to each other
    backend (tdx with pinned algorithms is compared by :func:`check_auto_lines` instead)."""
    if len(backends) < 2:
        return []
    base = "tdx" if "tdx" in backends else backends[0]
    index = {(r["op"], r["backend"], r["size"]): r for r in rows}
    out: list[str] = []
    for other in (b for b in backends if b.split(":")[0] != base.split(":")[0]):
        out += [
            "#",
            f"# {base} vs {other}: busbw ratio {base}/{other} (>1: {base} faster), "
            f"time ratio {base}/{other} (<1: {base} faster)",
            "# " + _line((("op", 15), ("size", 12), ("oop busbw", 10), ("oop time", 10),
                          ("ip busbw", 10), ("ip time", 10))),
        ]
        for r in rows:
            if r["backend"] != base:
                continue
            o = index.get((r["op"], other, r["size"]))
            if o is None:
                continue
            cells = [(r["op"], 15), (str(r["size"]), 12)]
            for p in ("oop_", "ip_"):
                if p == "ip_" and not OPS[r["op"]].in_place:
                    cells += [("-", 10), ("-", 10)]
                    continue
                ok = _ok(r, p) and _ok(o, p)
                cells += [
                    (_ratio(r[f"{p}busbw_gb_s"], o[f"{p}busbw_gb_s"]) if ok else "n/a", 10),
                    (_ratio(r[f"{p}time_us"], o[f"{p}time_us"]) if ok else "n/a", 10),
                ]
            out.append("  " + _line(cells))
    return out


def _op_time(row: dict[str, Any]) -> float | None:
    """The time check-auto compares: in-place (the op alone) where the op has that form."""
    prefix = "ip_" if OPS[row["op"]].in_place else "oop_"
    return row[f"{prefix}time_us"] if _ok(row, prefix) else None


def compare_auto(rows: Sequence[dict[str, Any]],
                 tolerance: float = 0.10) -> dict[str, list[dict[str, Any]]]:
    """Per op and size: plain tdx (auto) against the fastest pinned ``tdx:<algorithm>``.

    Each entry: size, auto_algo, auto_us, best (label), best_algo, best_us, loss
    (``auto_us / best_us - 1``), choice_loss (the pinned row of the algorithm auto picked
    against the best: ``chosen_us / best_us - 1``; None without that row), lost (auto
    picked another algorithm than the fastest and that choice costs more than
    ``tolerance``: choice_loss when the pinned row of auto's pick ran, which was measured
    like the best row, else loss), noise (loss > tolerance but not lost: the same
    algorithm, or an equally fast one, timed at another moment). Entries whose auto or
    pinned rows did not run have None times.
    """
    out: dict[str, list[dict[str, Any]]] = {}
    for op in dict.fromkeys(r["op"] for r in rows):
        sizes = dict.fromkeys(r["size"] for r in rows if r["op"] == op)
        entries = []
        for size in sizes:
            mine = [r for r in rows if r["op"] == op and r["size"] == size]
            auto = next((r for r in mine if r["backend"] == "tdx"), None)
            pinned = [(t, r) for r in mine if r["backend"].startswith("tdx:")
                      and (t := _op_time(r)) is not None]
            e: dict[str, Any] = {"size": size, "auto_algo": auto.get("algo") if auto else None,
                                 "auto_us": _op_time(auto) if auto else None, "best": None,
                                 "best_algo": None, "best_us": None, "loss": None,
                                 "chosen_us": None, "choice_loss": None,
                                 "lost": False, "noise": False}
            if pinned:
                t, best = min(pinned, key=lambda p: p[0])
                e.update(best=best["backend"], best_algo=best.get("algo"), best_us=t)
                chosen = [t for t, r in pinned if e["auto_algo"] and r.get("algo") == e["auto_algo"]]
                if chosen:
                    e["chosen_us"] = min(chosen)
                    e["choice_loss"] = e["chosen_us"] / t - 1.0
            if e["auto_us"] is not None and e["best_us"]:
                e["loss"] = e["auto_us"] / e["best_us"] - 1.0
            # The choice is judged by the pinned row of the algorithm auto picked, timed
            # with the others; auto's own row only where that pick has no pinned row.
            other = e["auto_algo"] is None or e["auto_algo"] != e["best_algo"]
            if e["choice_loss"] is not None:
                e["lost"] = other and e["choice_loss"] > tolerance
            elif e["loss"] is not None:
                e["lost"] = other and e["loss"] > tolerance
            e["noise"] = e["loss"] is not None and e["loss"] > tolerance and not e["lost"]
            entries.append(e)
        out[op] = entries
    return out


def auto_losses(rows: Sequence[dict[str, Any]], tolerance: float = 0.10) -> dict[str, list[int]]:
    """Per op, the sizes where auto lost by more than ``tolerance`` to a pinned algorithm
    (``--check-auto=strict`` fails when any op has one)."""
    return {op: [e["size"] for e in entries if e["lost"]]
            for op, entries in compare_auto(rows, tolerance).items()}


def _pct(x: float) -> str:
    return f"{x * 100:+.1f}%"


def check_auto_lines(rows: Sequence[dict[str, Any]], tolerance: float = 0.10) -> list[str]:
    """The ``--check-auto`` table and one summary line per op."""
    tol = f"{tolerance * 100:g}%"
    out = [
        "#",
        "# check-auto: tdx (auto) vs the fastest pinned tdx:<algorithm> per size; time: "
        "in-place (out-of-place for all_to_all), loss = auto / best - 1, pick = the "
        "pinned row of auto's algorithm / best - 1 (what LOST judges)",
        "# " + _line((("op", 15), ("size", 12), ("auto algo", 10), ("auto us", 10),
                      ("best", 16), ("best us", 10), ("loss", 8), ("pick", 8))),
    ]
    summary = []
    for op, entries in compare_auto(rows, tolerance).items():
        for e in entries:
            out.append("  " + _line((
                (op, 15), (str(e["size"]), 12), (e["auto_algo"] or "-", 10),
                (_fmt_time(e["auto_us"]) if e["auto_us"] is not None else "n/a", 10),
                (e["best"] or "-", 16),
                (_fmt_time(e["best_us"]) if e["best_us"] is not None else "n/a", 10),
                (_pct(e["loss"]) if e["loss"] is not None else "n/a", 8),
                (_pct(e["choice_loss"]) if e["choice_loss"] is not None else "-", 8),
            )) + ("  LOST" if e["lost"] else "  (noise)" if e["noise"] else ""))
        compared = [e for e in entries if e["loss"] is not None]
        head = f"# check-auto {op}:"
        if not any(e["best"] for e in entries):
            summary.append(f"{head} no pinned tdx:<algorithm> rows to compare with "
                           "(add e.g. tdx:all to --backends)")
            continue
        if not compared:
            summary.append(f"{head} no tdx (auto) rows to compare (add tdx to --backends)")
            continue
        lost = [e for e in compared if e["lost"]]
        noise = [e for e in compared if e["noise"]]
        missing = len(entries) - len(compared)
        if lost:
            text = ", ".join(
                f"{e['size']} B ({_pct(e['choice_loss'] if e['choice_loss'] is not None else e['loss'])}"
                f": picked {e['auto_algo']}, best {e['best_algo']})" for e in lost)
            line = f"{head} auto lost by >{tol} at {len(lost)} of {len(compared)} sizes: {text}"
        else:
            worst = max(compared, key=lambda e: e["loss"])
            if noise:
                line = (f"{head} auto picked the fastest algorithm or was within {tol} of it "
                        f"at every size ({len(compared)} sizes)")
            elif worst["loss"] <= 0:
                line = (f"{head} auto at least as fast as the best pinned algorithm at every "
                        f"size ({len(compared)} sizes)")
            else:
                line = (f"{head} auto within {worst['loss'] * 100:.1f}% of best at every size "
                        f"({len(compared)} sizes, worst {worst['size']} B)")
        if noise:
            line += ("; slower by >" + tol + " but running the fastest algorithm, or one "
                     "whose pinned row was within " + tol + " of it (timing noise; raise -n "
                     "or --rounds) at " + ", ".join(f"{e['size']} B" for e in noise))
        if missing:
            line += f"; {missing} size(s) not compared (a row did not run)"
        summary.append(line)
    if rows and all(r.get("world") == 1 for r in rows):
        summary.append("# check-auto: one rank: every algorithm only copies locally, so these "
                       "differences are noise")
    return out + ["#"] + summary


def unwritable(path: str | os.PathLike[str], option: str,
               replaced: bool = False) -> str | None:
    """Why ``path`` cannot be written (a message naming ``option``, e.g. ``--json``), or
    None. Checked before a run starts, so that a typo in a path costs nothing instead of
    the whole measurement.

    By default the writer opens ``path`` itself (``--json``, ``--plot``): a file that
    exists and is writable will do, whatever its directory allows (``/dev/stdout``);
    otherwise its directory must exist and be writable, to create it there.

    ``replaced``: the writer creates missing directories, writes a temporary file beside
    ``path`` and renames it over (:func:`torchdist_ext.calibration.save`), so only the
    directory counts: the nearest existing one must be writable, even when the file
    exists.

    A path the system refuses to look at (a name too long, a directory that may not be
    searched) is a reason too, never an exception: under torchrun the lead rank's answer
    is agreed on by every rank, which a raise on the lead would leave waiting."""
    fix = f"choose another {option} path"
    try:
        return _unwritable(os.fspath(path), option, replaced, fix)
    except OSError as e:
        return f"{option} {path}: {e.strerror or e}; {fix}"


def _unwritable(path: str, option: str, replaced: bool, fix: str) -> str | None:
    target = Path(path)
    if target.is_dir():
        return f"{option} {path}: is a directory; name a file in it, or {fix}"
    if target.exists() and not replaced:
        if os.access(target, os.W_OK):
            return None
        return f"{option} {path}: the file exists and is not writable; {fix}"
    parent = target.parent
    if replaced:
        while not parent.exists() and parent != parent.parent:
            parent = parent.parent
    if not parent.exists():
        return f"{option} {path}: directory {parent} does not exist; create it or {fix}"
    if not parent.is_dir():
        return f"{option} {path}: {parent} is not a directory; {fix}"
    if not os.access(parent, os.W_OK | os.X_OK):
        return f"{option} {path}: directory {parent} is not writable; {fix}"
    return None


def plot_unwritable(path: str) -> str | None:
    """Why ``--plot path`` cannot work (a path that cannot be written, no matplotlib, a
    format it lacks), or None. The path comes first: its error is the same whether or not
    matplotlib is installed."""
    why = unwritable(path, "--plot") or matplotlib_missing()
    if why:
        return why
    suffix = Path(path).suffix.lstrip(".").lower()
    if suffix:
        # savefig picks the format from the suffix, and fails on one it lacks only after
        # the measurements; ask matplotlib up front.
        from matplotlib.backend_bases import FigureCanvasBase

        formats = FigureCanvasBase.get_supported_filetypes()
        if suffix not in formats:
            return (f"--plot {path}: matplotlib cannot write .{suffix} files; use one of "
                    f"{', '.join('.' + f for f in sorted(formats))}")
    return None


def bytes_text(b: float) -> str:
    """A byte count for a table cell: "1.5 MiB", "300 B"."""
    for unit, scale in (("GiB", 1 << 30), ("MiB", 1 << 20), ("KiB", 1 << 10)):
        if b >= scale:
            return f"{b / scale:.1f} {unit}"
    return f"{int(b)} B"


def write_json(path: str, data: Any) -> None:
    """Write ``data`` to ``path`` as indented JSON (``--json`` of the bench, calibrate and
    tune); an OSError when it cannot. The bench writes ``{"meta": {...}, "rows": [...]}``."""
    with open(path, "w", encoding="utf-8") as f:
        json.dump(data, f, indent=1)
        f.write("\n")


def matplotlib_missing() -> str | None:
    """Why --plot cannot work here, or None when matplotlib is importable."""
    if importlib.util.find_spec("matplotlib") is None:
        return ("--plot needs matplotlib, which is not installed; "
                "install it (pip install matplotlib) or drop --plot")
    return None


def write_plot(path: str, rows: Sequence[dict[str, Any]], backends: Sequence[str],
               title: str) -> None:
    """busbw (out-of-place) against size, one line per backend, one panel per op."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    ops = list(dict.fromkeys(r["op"] for r in rows))
    ncols = min(3, len(ops))
    nrows = (len(ops) + ncols - 1) // ncols
    fig, axes = plt.subplots(nrows, ncols, figsize=(5.5 * ncols, 4 * nrows), squeeze=False)
    for ax, op in zip(axes.flat, ops, strict=False):
        for b in backends:
            pts = [(r["size"], r["oop_busbw_gb_s"]) for r in rows
                   if r["op"] == op and r["backend"] == b and _ok(r, "oop_")]
            if pts:
                ax.plot(*zip(*pts, strict=True), marker="o", label=b)
        ax.set_xscale("log", base=2)
        ax.set_xlabel("size (bytes)")
        ax.set_ylabel("busbw (GB/s), out-of-place")
        ax.set_title(op)
        ax.grid(True, alpha=0.3)
        ax.legend()
    for ax in list(axes.flat)[len(ops):]:
        ax.set_visible(False)
    fig.suptitle(title)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


class Progress:
    """A one-line progress indicator on stderr: tqdm when it is installed and stderr is a
    terminal, a redrawn line on other terminals, one line per op otherwise."""

    def __init__(self, total: int, enabled: bool = True, stream: TextIO | None = None) -> None:
        self.total, self.done, self.enabled = total, 0, enabled
        self.stream = stream or sys.stderr
        self.tty = self.enabled and self.stream.isatty()
        self._bar: Any = None
        self._text = ""
        if self.tty and importlib.util.find_spec("tqdm") is not None:
            from tqdm import tqdm

            self._bar = tqdm(total=total, file=self.stream, unit="case", leave=False)

    def note(self, text: str) -> None:
        """A coarse message for non-terminal stderr (one per op)."""
        if self.enabled and not self.tty:
            print(f"[bench] {text}", file=self.stream, flush=True)

    def step(self, text: str) -> None:
        """Say what runs next, then count it once it has run (call before running it)."""
        if not self.tty:
            return
        if self._bar is not None:
            self._bar.set_description_str(text, refresh=False)
            return
        self._text = f"[{self.done + 1}/{self.total}] {text}"
        self.stream.write("\r\033[K" + self._text)
        self.stream.flush()

    def advance(self) -> None:
        self.done += 1
        if self._bar is not None:
            self._bar.update(1)

    def print(self, line: str, out: TextIO | None = None) -> None:
        """Print a table line to stdout without tearing the progress line."""
        out = out or sys.stdout
        if self._bar is not None:
            self._bar.write(line, file=out)
            return
        if self.tty and self._text:
            self.stream.write("\r\033[K")
            self.stream.flush()
        print(line, file=out, flush=True)
        if self.tty and self._text:
            self.stream.write(self._text)
            self.stream.flush()

    def close(self) -> None:
        if self._bar is not None:
            self._bar.close()
        elif self.tty and self._text:
            self.stream.write("\r\033[K")
            self.stream.flush()

"""Options, collective definitions, known inputs and their expected results.

Nothing here talks to other processes: the functions build inputs, predict what every rank
must hold after a collective, and count the elements that differ. ``runner`` drives the
collectives themselves.
"""

from __future__ import annotations

import argparse
import math
import re
from dataclasses import dataclass, field
from typing import Any, Callable

import torch

from torchdist_ext.calibration import as_real

__all__ = [
    "ALL_OPS",
    "BACKENDS",
    "COLLECTIVES",
    "Label",
    "REDOPS",
    "OpSpec",
    "Options",
    "OPS",
    "canonical_op",
    "count_wrong",
    "expected_output",
    "labels_for_op",
    "make_input",
    "op_input",
    "parse_backend",
    "parse_dtype",
    "parse_size",
    "poison",
    "sizes_for",
    "sweep",
    "timeout_problem",
    "unusable",
]

KNOWN_BACKENDS = ("tdx", "gloo", "nccl")
BACKENDS = KNOWN_BACKENDS
REDOPS = ("sum", "prod", "min", "max", "avg", "premul_sum", "band", "bor", "bxor")
_REDOP_ALIASES = {"product": "prod", "mean": "avg", "premulsum": "premul_sum"}
# Reductions that scale each share (or the sum) and so may round on floating types, and
# every reduction that adds.
_SCALING = ("avg", "premul_sum")
_SUMS = ("sum",) + _SCALING
# Reductions on the bits of integers and bools: every backend refuses them on floating
# and complex tensors, so a run would fail every row.
_BITWISE = ("band", "bor", "bxor")

_SIZE_RE = re.compile(r"^\s*(\d+(?:\.\d+)?)\s*([kKmMgG]?)(?:i?[bB])?\s*$")
_SUFFIX = {"": 1, "k": 1 << 10, "m": 1 << 20, "g": 1 << 30}
_DTYPE_ALIASES = {"fp32": "float32", "fp64": "float64", "fp16": "float16", "bf16": "bfloat16"}


def parse_size(text: str | int) -> int:
    """Bytes from ``"512"``, ``"1K"``, ``"64M"``, ``"1G"`` (binary multiples; ``"8KB"`` too)."""
    if isinstance(text, int):
        return text
    m = _SIZE_RE.match(text)
    if not m:
        raise ValueError(f"not a size: {text!r} (expected a number with an optional K, M or G)")
    return int(float(m.group(1)) * _SUFFIX[m.group(2).lower()])


def size_arg(text: str) -> int:
    """:func:`parse_size` as an argparse ``type``: a bad size is a usage error."""
    try:
        return parse_size(text)
    except ValueError as exc:
        raise argparse.ArgumentTypeError(str(exc)) from None


def names_arg(text: str) -> tuple[str, ...]:
    """A comma-separated list as a tuple, blanks dropped: ``"tdx, gloo"`` -> both."""
    return tuple(x.strip() for x in text.split(",") if x.strip())


def sizes_arg(text: str) -> tuple[int, ...]:
    """Comma-separated sizes with K/M suffixes, as an argparse ``type``; an empty list is
    left to the options' own check, which names the option."""
    return tuple(size_arg(x) for x in names_arg(text))


def parse_dtype(name: str | torch.dtype) -> torch.dtype:
    """``torch.float32`` from ``"float32"``, ``"torch.float32"``, ``"half"``, ``"bf16"``."""
    if isinstance(name, torch.dtype):
        return name
    key = name.strip().removeprefix("torch.")
    dtype = getattr(torch, _DTYPE_ALIASES.get(key, key), None)
    if not isinstance(dtype, torch.dtype):
        raise ValueError(f"not a torch dtype: {name!r}")
    return dtype


def dtype_name(dtype: torch.dtype) -> str:
    """``"float32"`` for ``torch.float32``."""
    return str(dtype).removeprefix("torch.")


def _bus_allreduce(n: int) -> float:
    return 2.0 * (n - 1) / n


def _bus_ring(n: int) -> float:
    return (n - 1) / n


def _bus_one(n: int) -> float:
    return 1.0


@dataclass(frozen=True)
class OpSpec:
    """One benchmarked collective.

    ``divisible``: the element count must be a multiple of the world size (the op splits
    the buffer into one chunk per rank). ``bus_factor(n)`` turns algbw into busbw exactly as
    nccl-tests does. ``bus_formula`` is the same factor in words, for the table header.
    """

    name: str
    torch_call: str
    bus_factor: Callable[[int], float]
    bus_formula: str
    reduces: bool
    rooted: bool
    in_place: bool
    divisible: bool


OPS: dict[str, OpSpec] = {
    s.name: s
    for s in (
        OpSpec("all_reduce", "all_reduce", _bus_allreduce, "2(n-1)/n", True, False, True, False),
        OpSpec("all_gather", "all_gather_into_tensor", _bus_ring, "(n-1)/n", False, False, True,
               True),
        OpSpec("reduce_scatter", "reduce_scatter_tensor", _bus_ring, "(n-1)/n", True, False,
               True, True),
        OpSpec("broadcast", "broadcast", _bus_one, "1", False, True, True, False),
        OpSpec("reduce", "reduce", _bus_one, "1", True, True, True, False),
        OpSpec("all_to_all", "all_to_all_single", _bus_ring, "(n-1)/n", False, False, False,
               True),
        # nccl-tests' sendrecv: every rank sends its buffer to the next rank and receives
        # the previous rank's, both at once (batch_isend_irecv).
        OpSpec("sendrecv", "batch_isend_irecv", _bus_one, "1", False, False, False, False),
    )
}
ALL_OPS = tuple(OPS)

_OP_ALIASES = {
    "allreduce": "all_reduce",
    "allgather": "all_gather",
    "all_gather_into_tensor": "all_gather",
    "reducescatter": "reduce_scatter",
    "reduce_scatter_tensor": "reduce_scatter",
    "bcast": "broadcast",
    "alltoall": "all_to_all",
    "all_to_all_single": "all_to_all",
    "send_recv": "sendrecv",
    "p2p": "sendrecv",
}


def canonical_op(name: str) -> str:
    """``"all_gather"`` from ``"all_gather"``, ``"allgather"`` or ``"all_gather_into_tensor"``."""
    key = name.strip().lower().replace("-", "_")
    key = _OP_ALIASES.get(key, key)
    if key not in OPS:
        raise ValueError(f"unknown op {name!r}; choose from {', '.join(ALL_OPS)} or 'all'")
    return key


# The tdx registry's collective for each op (torchdist_ext.algorithms(), set_algorithm()).
# Point-to-point (sendrecv) has none: there is nothing to pin.
COLLECTIVES = {
    "all_reduce": "allreduce",
    "all_gather": "allgather",
    "reduce_scatter": "reduce_scatter",
    "broadcast": "broadcast",
    "reduce": "reduce",
    "all_to_all": "alltoall",
}

TDX = "tdx"
ALL_ALGORITHMS = "all"


def parse_backend(label: str) -> tuple[str, str | None]:
    """``("tdx", None)`` from ``"tdx"`` (or ``"tdx:auto"``), ``("tdx", "ring")`` from
    ``"tdx:ring"``, ``("gloo", None)`` from ``"gloo"``. Only tdx takes an algorithm."""
    base, sep, algo = label.strip().lower().partition(":")
    if not sep:
        return base, None
    algo = algo.strip()
    if base != TDX:
        raise ValueError(f"{label!r}: only tdx takes an algorithm (tdx:<algorithm>)")
    if not algo:
        raise ValueError(f"{label!r}: no algorithm after 'tdx:'")
    return base, None if algo == "auto" else algo


def _label(base: str, algo: str | None) -> str:
    return base if algo is None else f"{base}:{algo}"


@dataclass(frozen=True)
class Label:
    """One column group of the tables: a backend, and for tdx optionally a pinned algorithm."""

    label: str
    backend: str
    algo: str | None = None


def _tdx_algorithms() -> dict[str, list[str]]:
    import torchdist_ext

    return torchdist_ext.algorithms()


def unusable(op: str, algo: str, nbytes: int, world: int, same_host: bool) -> str:
    """Why tdx cannot run ``op`` of ``nbytes`` at ``world`` ranks with ``algo`` pinned
    (``""`` when it can): a power-of-two-only algorithm, a shared-memory one without every
    rank on one host, or a size limit."""
    from torchdist_ext import _C

    if op not in COLLECTIVES:
        return f"{op} has no algorithms to pin"
    info = _C._algorithm_cost(COLLECTIVES[op], algo, float(nbytes), int(world))
    if info["unusable"]:
        return str(info["unusable"])
    if info["link"] != "net" and not same_host:
        return "needs every rank of the group on one host"
    return ""


def labels_for_op(op: str, labels: tuple[str, ...], world: int,
                  same_host: bool) -> tuple[list[Label], list[str]]:
    """The labels that run ``op`` (``tdx:all`` expanded into every algorithm of the op), and
    a note for each pinned algorithm left out: it does not exist for the op, or it cannot
    run at any size at this world size / placement."""
    known = _tdx_algorithms().get(COLLECTIVES.get(op, ""), []) if any(
        parse_backend(lb)[0] == TDX for lb in labels) else []
    out: dict[str, Label] = {}
    notes: list[str] = []
    for lb in labels:
        base, algo = parse_backend(lb)
        if algo is None:
            out.setdefault(base, Label(base, base))
            continue
        algos = known if algo == ALL_ALGORITHMS else [algo]
        for a in algos:
            name = _label(base, a)
            if a not in known:
                notes.append(f"{name} left out of {op}: tdx has no {op} algorithm {a!r} "
                             f"(it has {', '.join(known) or 'none'})")
                continue
            why = unusable(op, a, 0, world, same_host)
            if why:
                notes.append(f"{name} left out of {op}: {a} {why}")
                continue
            out.setdefault(name, Label(name, base, a))
    return list(out.values()), notes


# The longest group timeout: a year; datetime.timedelta overflows not far beyond 1e13 s.
_MAX_TIMEOUT_S = 365 * 24 * 3600.0


def _finite(value: Any) -> bool:
    """A real number (not bool) that is neither NaN nor infinite."""
    x = as_real(value)
    return x is not None and math.isfinite(x)


def timeout_problem(seconds: Any) -> str | None:
    """Why ``seconds`` is no group timeout (None when it is one): it must be a finite
    number of seconds > 0, at most a year (a process-group timeout of 0 fails every op,
    and torch's timedelta overflows far beyond a year)."""
    if not (_finite(seconds) and 0 < seconds <= _MAX_TIMEOUT_S):
        return (f"timeout (--timeout) must be a number of seconds > 0 and at most "
                f"{_MAX_TIMEOUT_S:.0f}, got {seconds!r}")
    return None


def _split(value: str | tuple[str, ...] | list[str]) -> tuple[str, ...]:
    if isinstance(value, str):
        value = value.split(",")
    return tuple(v.strip() for v in value if v.strip())


@dataclass(frozen=True)
class Options:
    """Everything one benchmark run needs; the CLI flags map one to one onto these fields.

    ``ops`` and ``backends`` accept a comma-separated string or a sequence; ``ops`` also
    accepts ``"all"``. Sizes are bytes of the buffer nccl-tests reports for the op (the
    whole gathered / scattered buffer for all_gather, reduce_scatter and all_to_all).
    ``world`` is ignored when the process group comes from the environment (torchrun) or
    is already initialised.

    A backend ``tdx:<algorithm>`` runs tdx with that algorithm pinned for each op
    (``set_algorithm``); ``tdx:all`` stands for every algorithm of each op. ``check_auto``
    (``"report"`` or ``"strict"``) compares plain tdx (auto) with the fastest pinned
    algorithm per size, adding ``tdx`` and ``tdx:all`` to ``backends`` when they have no
    plain tdx or no pinned algorithm; auto loses at a size when it is slower by more than
    ``auto_tolerance`` (a fraction). ``sizes``, when given, replaces the minbytes .. maxbytes
    sweep. ``stat="median"`` times each iteration on its own and reports the median, which
    a busy machine's stalls barely move (``"mean"``: the whole loop over ``iters``).
    ``warmup_ms``: after the ``warmup`` untimed iterations, untimed iterations go on
    until this many milliseconds have passed since the first (every rank runs as many as
    the slowest needs; none when ``warmup`` is 0). A few calls of a small size take
    microseconds, too short for an idle core to leave its sleep states and raise its
    clock, so without it the first small size of an op is timed on a cold machine.
    ``rounds`` > 1 measures every size that many times with the backends taking turns
    (round r times each of them once) and reports the median round: a shared host's slow
    spells then land on every backend alike, which is what comparing them, and
    ``check_auto``, need.
    """

    ops: tuple[str, ...] = ("all_reduce",)
    backends: tuple[str, ...] = ("tdx", "gloo")
    world: int = 2
    device: str = "cpu"
    minbytes: int = 1 << 10
    maxbytes: int = 64 << 20
    stepfactor: int = 2
    iters: int = 20
    warmup: int = 5
    warmup_ms: float = 20.0
    dtype: str = "float32"
    redop: str = "sum"
    premul_factor: float = 0.5  # premul_sum's factor (0.5 keeps the bench's sums exact)
    root: int = 0
    check: bool = True
    json_path: str | None = None
    plot_path: str | None = None
    timeout: float = 300.0
    quiet: bool = False
    progress: bool = True
    stat: str = "mean"
    rounds: int = 1
    check_auto: str | None = None
    auto_tolerance: float = 0.10
    sizes: tuple[int, ...] | None = None
    _corrupt: bool = field(default=False, repr=False)  # test hook: spoil results before checking

    def __post_init__(self) -> None:
        ops = _split(self.ops)
        if any(o.lower() == "all" for o in ops):
            ops = ALL_OPS
        ops = tuple(dict.fromkeys(canonical_op(o) for o in ops))
        backends = tuple(dict.fromkeys(_label(*parse_backend(b)) for b in _split(self.backends)))
        if not ops:
            raise ValueError("no op given")
        if not backends:
            raise ValueError("no backend given")
        unknown = [b for b in backends if parse_backend(b)[0] not in KNOWN_BACKENDS]
        if unknown:
            # Refused here rather than as a failed group per rank after the ranks start.
            raise ValueError(f"unknown backend(s) {', '.join(unknown)} in backends "
                             f"(--backends); use {', '.join(KNOWN_BACKENDS)}, or "
                             "tdx:<algorithm> (torchdist_ext.algorithms()), tdx:all")
        if self.device not in ("cpu", "cuda"):
            raise ValueError(f"device must be cpu or cuda, not {self.device!r}")
        # nccl without device="cuda" is no error: the run leaves it out with a note
        # (runner._skip_reason), so "--backends tdx,gloo,nccl" runs the others on CPU.
        if self.check_auto not in (None, "report", "strict"):
            raise ValueError(f"check_auto must be None, 'report' or 'strict', not "
                             f"{self.check_auto!r}")
        if self.check_auto:
            # comparing auto needs auto and pinned algorithms: add what is missing
            pinned = [b for b in backends if parse_backend(b)[1] is not None]
            backends = ((() if TDX in backends else (TDX,)) + backends
                        + (() if pinned else (f"{TDX}:{ALL_ALGORITHMS}",)))
        pinned_algos = {parse_backend(b)[1] for b in backends} - {None, ALL_ALGORITHMS}
        if pinned_algos:
            everything = {a for names in _tdx_algorithms().values() for a in names}
            unknown = sorted(a for a in pinned_algos if a not in everything)
            if unknown:
                raise ValueError(f"unknown tdx algorithm(s) {', '.join(unknown)}; choose from "
                                 f"{', '.join(sorted(everything))}, all or auto")
        if self.rounds < 1:
            raise ValueError(f"rounds must be >= 1, got {self.rounds}")
        if self.stat not in ("mean", "median"):
            raise ValueError(f"stat must be mean or median, not {self.stat!r}")
        if not 0 <= self.auto_tolerance:
            raise ValueError(f"auto_tolerance must be >= 0, got {self.auto_tolerance}")
        sizes = None
        if self.sizes is not None:
            sizes = tuple(sorted({parse_size(x) for x in _split_sizes(self.sizes)}))
            if not sizes or sizes[0] < 1:
                raise ValueError(f"sizes must be positive byte counts, got {self.sizes!r}")
        redop = _REDOP_ALIASES.get(self.redop.lower(), self.redop.lower())
        if redop not in REDOPS:
            raise ValueError(f"unknown redop {self.redop!r}; choose from {', '.join(REDOPS)}")
        dtype = parse_dtype(self.dtype)
        if redop == "premul_sum" and not (dtype.is_floating_point or dtype.is_complex):
            raise ValueError(f"premul_sum needs a floating dtype, not {dtype_name(dtype)}")
        if redop in _BITWISE and (dtype.is_floating_point or dtype.is_complex):
            raise ValueError(f"{redop} needs an integer or bool dtype, not "
                             f"{dtype_name(dtype)}; pick one with -d (e.g. int32)")
        if not _finite(self.premul_factor):
            # A NaN or infinite factor makes every element NaN or inf: no row could pass.
            raise ValueError(f"premul_factor (--premul-factor) must be a finite number, got "
                             f"{self.premul_factor!r}")
        if why := timeout_problem(self.timeout):
            raise ValueError(why)
        minbytes, maxbytes = parse_size(self.minbytes), parse_size(self.maxbytes)
        if minbytes < 1 or maxbytes < minbytes:
            raise ValueError(f"need 1 <= minbytes <= maxbytes, got {minbytes} and {maxbytes}")
        if self.stepfactor < 2:
            raise ValueError(f"stepfactor must be at least 2, got {self.stepfactor}")
        if self.world < 1:
            raise ValueError(f"world must be at least 1, got {self.world}")
        if self.iters < 1 or self.warmup < 0:
            raise ValueError(f"need iters >= 1 and warmup >= 0, got {self.iters}, {self.warmup}")
        if not (_finite(self.warmup_ms) and self.warmup_ms >= 0):
            raise ValueError(f"warmup_ms (--warmup-ms) must be a finite number >= 0, got "
                             f"{self.warmup_ms!r}")
        if self.root < 0:
            raise ValueError(f"root must be a rank, got {self.root}")
        for name, value in (("ops", ops), ("backends", backends), ("redop", redop),
                            ("dtype", dtype_name(dtype)), ("minbytes", minbytes),
                            ("maxbytes", maxbytes), ("sizes", sizes)):
            object.__setattr__(self, name, value)

    @property
    def groups(self) -> tuple[str, ...]:
        """The backends that need a group: ``backends`` without algorithms, deduplicated."""
        return tuple(dict.fromkeys(parse_backend(b)[0] for b in self.backends))

    @property
    def torch_dtype(self) -> torch.dtype:
        """The element type as a ``torch.dtype``."""
        return parse_dtype(self.dtype)


def _split_sizes(value: Any) -> list[str | int]:
    if isinstance(value, (str, int)):
        value = str(value).split(",")
    return [v.strip() if isinstance(v, str) else v for v in value
            if not isinstance(v, str) or v.strip()]


def sweep(minbytes: int, maxbytes: int, factor: int) -> list[int]:
    """nccl-tests' size sweep: minbytes, minbytes*factor, ... up to maxbytes inclusive."""
    out, size = [], minbytes
    while size <= maxbytes:
        out.append(size)
        size *= factor
    return out


def sizes_for(spec: OpSpec, opts: Options, world: int) -> list[tuple[int, int]]:
    """(bytes, count) per row for one op (``opts.sizes`` when given, else the sweep); counts
    round down to a multiple of world where the op splits the buffer into per-rank chunks,
    as nccl-tests does; empty rows are dropped."""
    elsize = opts.torch_dtype.itemsize
    rows: dict[int, int] = {}
    for size in opts.sizes or sweep(opts.minbytes, opts.maxbytes, opts.stepfactor):
        count = size // elsize
        if spec.divisible:
            count -= count % world
        if count > 0:
            rows.setdefault(count, count * elsize)
    return [(nbytes, count) for count, nbytes in rows.items()]


# ---------------------------------------------------------------------------------------
# Known inputs and their exact results
# ---------------------------------------------------------------------------------------

def make_input(rank: int, count: int, dtype: torch.dtype, redop: str = "sum",
               offset: int = 0, world: int = 0) -> torch.Tensor:
    """Rank ``rank``'s input elements ``offset .. offset+count`` (CPU).

    Small integers (1..13), so every sum, min and max over a dozen ranks is exact in
    float32, float16 and bfloat16; a product input is 1 or 2. Each element depends on
    the rank (an affine map of the position, distinct for the first 156 ranks) and on
    its position without a short period, so a chunk that lands in the wrong place or
    comes from the wrong rank is counted wrong, and sums over the ranks are not the
    same everywhere. Given the ``world`` a sum or average runs over, a floating input
    stays small enough that the sum of ``world`` of them is an integer the dtype holds
    exactly (bfloat16: 1..6 over 40 ranks, down to 1..4 over 64), so such sums are
    checked exactly.
    """
    index = torch.int32 if (offset + count) * 13 + rank < 2**31 else torch.int64
    i = torch.arange(offset, offset + count, dtype=index)
    mixed = ((i * (1 + rank % 12) + rank // 12) ^ (i >> 4)) % 13
    if dtype == torch.bool:
        return mixed < 6
    if redop == "prod":
        return (1 + (mixed % 7 == 0).to(index)).to(dtype)
    if redop in _SUMS and world > 0 and (dtype.is_floating_point or dtype.is_complex):
        largest = int(2.0 / torch.finfo(dtype).eps) // world
        # Fewer than four values would no longer tell ranks and positions apart: beyond
        # that (bfloat16 past 64 ranks) the inputs stay as they are and the sums round.
        if 4 <= largest < 13:
            mixed = mixed % largest
    return (mixed + 1).to(dtype)


def poison(count: int, dtype: torch.dtype, redop: str = "sum") -> torch.Tensor:
    """A buffer the collective must overwrite: NaN, the dtype's largest integer, or for
    bool the value the reduction is least likely to give (False where it acts as OR, as
    it gives True almost everywhere over many ranks; True otherwise)."""
    if dtype == torch.bool:
        return torch.full((count,), redop not in ("sum", "max", "bor"), dtype=dtype)
    if dtype.is_floating_point or dtype.is_complex:
        return torch.full((count,), float("nan"), dtype=dtype)
    return torch.full((count,), torch.iinfo(dtype).max, dtype=dtype)


def _combine(acc: torch.Tensor, x: torch.Tensor, redop: str) -> torch.Tensor:
    if redop in _SUMS:
        return acc + x
    if redop == "prod":
        return acc * x
    if redop == "min":
        return torch.minimum(acc, x)
    if redop == "max":
        return torch.maximum(acc, x)
    return {"band": torch.bitwise_and, "bor": torch.bitwise_or,
            "bxor": torch.bitwise_xor}[redop](acc, x)


def reduced_input(world: int, count: int, dtype: torch.dtype, redop: str,
                  offset: int = 0, factor: float = 1.0) -> torch.Tensor:
    """The reduction over all ranks of ``make_input``, computed in float64/int64, then cast.

    Bool reduces as 0/1 integers, so the cast back gives SUM=OR and PRODUCT=AND as NCCL
    does; AVG on integers divides the sum as the dtype holds it (wrapped, as SUM wraps)
    and truncates; PREMUL_SUM is the sum times ``factor``.
    """
    wide = torch.complex128 if dtype.is_complex else (
        torch.float64 if dtype.is_floating_point else torch.int64)

    def part(r: int) -> torch.Tensor:
        return make_input(r, count, dtype, redop, offset, world).to(wide)

    acc = part(0)
    for r in range(1, world):
        acc = _combine(acc, part(r), redop)
    if redop == "premul_sum":
        acc = acc * factor
    if redop == "avg":
        if wide != torch.int64:
            acc = acc / world
        else:
            wrapped = acc.to(dtype).to(torch.int64)
            acc = torch.div(wrapped, world, rounding_mode="trunc")
    return acc.to(dtype)


def expected_output(op: str, rank: int, world: int, count: int, dtype: torch.dtype,
                    redop: str = "sum", root: int = 0,
                    factor: float = 1.0) -> torch.Tensor | None:
    """What ``rank``'s output buffer must hold after ``op`` on ``make_input`` data.

    ``count`` is the row's element count (the whole buffer for all_gather, reduce_scatter
    and all_to_all). None where the rank's output is undefined (reduce, rank != root).
    The inputs of ops that reduce depend on the redop and the world (``op_input``);
    those of ops that only move data do not.
    """
    chunk = count // world
    if op == "all_reduce":
        return reduced_input(world, count, dtype, redop, factor=factor)
    if op == "reduce":
        return reduced_input(world, count, dtype, redop, factor=factor) if rank == root else None
    if op == "broadcast":
        return make_input(root, count, dtype)
    if op == "all_gather":
        return torch.cat([make_input(r, chunk, dtype) for r in range(world)])
    if op == "reduce_scatter":
        return reduced_input(world, chunk, dtype, redop, offset=rank * chunk, factor=factor)
    if op == "all_to_all":
        return torch.cat([make_input(r, chunk, dtype, offset=rank * chunk)
                          for r in range(world)])
    if op == "sendrecv":
        return make_input((rank - 1) % world, count, dtype)
    raise ValueError(f"unknown op {op!r}")


def op_input(op: str, rank: int, world: int, count: int, dtype: torch.dtype,
             redop: str = "sum", offset: int = 0) -> torch.Tensor:
    """``rank``'s input to ``op``, as ``expected_output`` assumes it."""
    if OPS[op].reduces:
        return make_input(rank, count, dtype, redop, offset, world)
    return make_input(rank, count, dtype, offset=offset)


def count_wrong(got: torch.Tensor, want: torch.Tensor, world: int = 2,
                redop: str | None = None) -> int:
    """Number of elements of ``got`` that differ from ``want``.

    Exact, except where a floating reduction may round: ``redop`` "sum" beyond the
    integers the dtype holds exactly (bfloat16 past 256, float16 past 2048), where each
    of the ``world - 1`` additions may round by half an ulp of the result, and "avg" and
    "premul_sum": "premul_sum" (and "avg" on float16) scales each share, so each share
    and each addition may round, and "avg" elsewhere divides a sum that may have rounded:
    ``(world + 2) / 2`` ulps, relative, covers either. Copies (``redop`` None), products, minima and
    maxima of the small integer inputs are exact. Equal infinities match; NaN is always
    wrong. A shape mismatch counts every element as wrong.
    """
    got = got.detach().to("cpu")
    if got.shape != want.shape:
        return max(want.numel(), got.numel())
    floating = want.dtype.is_floating_point or want.dtype.is_complex
    if not floating or redop not in _SUMS:
        return int((got != want).sum())
    wide = torch.complex128 if want.dtype.is_complex else torch.float64
    g, w = got.to(wide), want.to(wide)
    info = torch.finfo(want.dtype)
    exact_below = 2.0 / info.eps  # 2^(mantissa bits + 1): integers up to it are exact
    if redop == "sum":
        # the additions' half ulps, relative, once the sums outgrow the exact integers
        rtol = torch.where(w.abs() > exact_below, max(1, world - 1) / 2 * info.eps, 0.0)
    else:
        rtol = torch.full(w.shape, (world + 2) / 2 * info.eps, dtype=torch.float64)
    close = (g == w) | (torch.isfinite(w) & ((g - w).abs() <= rtol * w.abs()))
    return int((~close).sum())

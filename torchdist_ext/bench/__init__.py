"""nccl-tests-style benchmark of torch.distributed collectives, several backends at once.

Every backend under test gets its own group (``dist.new_group(backend=...)``) inside the
same processes, so one run puts, say, tdx and gloo side by side on the same machine. Each
row is checked against the exact result of known inputs (``#wrong`` counts bad elements)
and timed: a barrier, then ``iters`` back-to-back ops; the reported time is the maximum
over ranks of the mean time per op (``--stat median``: of the median of the iterations
timed one by one), combined over a separate gloo CPU group so the bookkeeping never runs
on the backend under test. ``algbw = size / time`` with the buffer
size nccl-tests reports for the op; ``busbw = algbw * factor`` with nccl-tests' factors:
all_reduce 2(n-1)/n; all_gather, reduce_scatter, all_to_all (n-1)/n; broadcast, reduce 1.

Usage::

    # all_reduce, tdx vs gloo, 2 spawned ranks on CPU, 1K .. 64M
    python -m torchdist_ext.bench

    # every collective, small sizes, quick
    python -m torchdist_ext.bench --op all -b 1K -e 1M -n 5 -w 1

    # 4 ranks on one GPU (nccl is skipped: it refuses two ranks on one GPU)
    python -m torchdist_ext.bench --world 4 --device cuda --backends tdx,gloo,nccl

    # machine-readable rows and a busbw plot (needs matplotlib)
    python -m torchdist_ext.bench --op all_gather,reduce_scatter --json rows.json --plot busbw.png

    # under torchrun the ranks come from the environment; rank 0 prints
    torchrun --nproc-per-node 4 -m torchdist_ext.bench --op all --dtype bfloat16

    # tdx with each algorithm pinned, next to auto: is auto within 10% of the best?
    python -m torchdist_ext.bench --backends tdx,tdx:ring,tdx:rhd,tdx:shm,gloo --check-auto
    python -m torchdist_ext.bench --op all --backends tdx,tdx:all --check-auto=strict

    # fit tdx's cost model to this machine (see torchdist_ext.bench.calibrate)
    python -m torchdist_ext.bench calibrate --world 2

    # time every algorithm at 4 ranks and let auto follow the fastest per size there
    # (see torchdist_ext.bench.tune); for hosts whose ranks outnumber their CPUs
    python -m torchdist_ext.bench tune --world 4

    # compressed all_reduce (torchdist_ext.compression) against exact, per method
    # (see torchdist_ext.bench.compressed)
    python -m torchdist_ext.bench compressed --world 2

Backends: ``tdx``, ``gloo``, ``nccl``, and ``tdx:<algorithm>`` (``torchdist_ext.algorithms()``
lists them per collective): tdx with that algorithm pinned (``set_algorithm``, on every
rank, right before the label's rows; the previous choice, normally auto, comes back right
after). All tdx labels share one tdx group. ``tdx:all`` is every algorithm of each op. An
op without that algorithm, or one it cannot run at this world size or placement (``rd``
at 3 ranks, ``shm`` across hosts), is left out with a note; a size it cannot run (direct
all_reduce's scratch limit) is a skipped row. Each label is its own group of rows, its
own ``Avg bus bandwidth`` entry and its own line in ``--plot``.

``--check-auto`` compares, per op and size, plain tdx (auto) with the fastest pinned
algorithm (in-place times; out-of-place for all_to_all) and prints a verdict per op;
auto loses a size when it is more than ``--auto-tolerance`` (10%) slower and picked a
different algorithm (slower while running the fastest algorithm itself is reported as
timing noise). ``--check-auto=strict`` exits 1 when auto lost anywhere.

From Python::

    from torchdist_ext.bench import Options, run
    rows = run(Options(ops=("all_reduce", "all_gather"), maxbytes=1 << 20, iters=5))
    print(rows[0]["backend"], rows[0]["oop_busbw_gb_s"])

Out-of-place and in-place: torch's all_reduce, broadcast and reduce only work in place, so
their out-of-place columns time a copy of the input into a separate output buffer plus the
in-place call (as torch's functional collectives do), except tdx's all_reduce on CPU,
which is one op, ``torchdist_ext.all_reduce_into`` (the table's header says which); the
in-place columns time the call alone. all_gather's in-place form passes this rank's chunk of the output as the input;
reduce_scatter's passes this rank's chunk of the input as the output. all_to_all has no
in-place form. Out-of-place ops also count elements of their input that changed as wrong.

Each row (``run``'s result and ``--json``'s ``rows``) holds: op, backend (the label, e.g.
``tdx:ring``), world, device, size (bytes), count (elements), dtype, redop, root; for tdx
labels ``algo`` (the algorithm that ran, as the group's flight recorder names it, e.g.
``ring``, ``shm`` or ``cuda-peer``; where it names none, the pinned one or
``torchdist_ext.predict``'s choice), ``algo_from`` (which of the three said so),
``pinned`` and ``predicted_us`` (the cost model's time for ``algo``), all None for other
backends; for ``oop_`` (out-of-place) and ``ip_`` (in-place, None
where there is none): ``time_us``, ``algbw_gb_s``, ``busbw_gb_s`` (GB/s = 1e9 bytes/s),
``wrong`` (None with --check 0) and ``error`` (None, or why the op failed or was
skipped on that backend); then iters, warmup, warmup_ms, stat, rounds, host, one_host,
windows, crowded, pass_threads (the threads per rank of the window all_reduce),
torch_version, tdx_version, ucx_version, date. ``--json``'s ``meta`` lists the labels as
``backends`` and the groups created as ``groups``.
"""

from __future__ import annotations

from .cli import build_parser, main, options_from_args
from .core import (
    ALL_OPS,
    OPS,
    Options,
    count_wrong,
    expected_output,
    make_input,
    op_input,
    parse_dtype,
    parse_size,
    sizes_for,
    sweep,
)
from .runner import rank_main, run

bench = run  # ``torchdist_ext.bench.bench(options)`` reads naturally too

__all__ = [
    "ALL_OPS",
    "OPS",
    "Options",
    "bench",
    "build_parser",
    "count_wrong",
    "expected_output",
    "main",
    "make_input",
    "op_input",
    "options_from_args",
    "parse_dtype",
    "parse_size",
    "rank_main",
    "run",
    "sizes_for",
    "sweep",
]

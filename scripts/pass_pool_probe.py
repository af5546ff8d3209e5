"""The helper pool's cost per pass, without a collective: passes of 128 KiB to 4 MiB
through `_C._pass_pool_check` (each part adds one to a counter per byte, so the work
splits like a reduction), asked for 9 ways after a 9-way pass has started 8 helpers.
A pass under 64 KiB a part uses fewer ways than the pool holds (128 KiB: 2), which is
where waking and waiting for helpers it does not use would show. Two patterns:
"asleep", a pass after 1 ms idle (the helpers have stopped spinning and sleep), and
"back to back", passes in a row (helpers still spinning). Median and 90th percentile
in microseconds per pass; every pass is checked to cover each byte once."""

from __future__ import annotations

import argparse
import statistics
import time

import torchdist_ext  # noqa: F401  (loads the extension)
from torchdist_ext import _C

SIZES = [128 << 10, 256 << 10, 512 << 10, 1 << 20, 4 << 20]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--ways", type=int, default=9)
    ap.add_argument("--samples", type=int, default=300)
    args = ap.parse_args()
    check = _C._pass_pool_check
    check(1 << 20, 4096, [args.ways], 3)  # start the helpers
    print(f"{'size':>8} {'parts':>5} {'asleep med':>10} {'p90':>7} {'b2b med':>8} {'p90':>7}")
    for size in SIZES:
        asleep, b2b = [], []
        parts = 0
        for _ in range(args.samples):
            time.sleep(0.001)
            r = check(size, 4096, [args.ways], 1)
            assert r["exact"], r
            asleep.append(r["seconds"] * 1e6)
            parts = r["most_parts"]
        for _ in range(max(1, args.samples // 20)):
            r = check(size, 4096, [args.ways], 20)
            assert r["exact"], r
            b2b.append(r["seconds"] / r["passes"] * 1e6)
        q = lambda xs: sorted(xs)[int(0.9 * (len(xs) - 1))]  # noqa: E731
        print(f"{size >> 10:>6}Ki {parts:>5} {statistics.median(asleep):>10.1f} "
              f"{q(asleep):>7.1f} {statistics.median(b2b):>8.1f} {q(b2b):>7.1f}")


if __name__ == "__main__":
    main()

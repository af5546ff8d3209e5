"""The compression codecs alone, one core: encode and decode of 16 MiB of float32 (4M
elements in 2 rows), by the CPU kernels and by the torch ops (the CUDA path), best of 3,
next to a memcpy of the same bytes. No process group.

    OMP_NUM_THREADS=1 .venv/bin/python scripts/codec_probe.py
"""

from __future__ import annotations

import time

import torch

from torchdist_ext.compression import codecs


def _best(call, tries: int = 3) -> float:
    best = float("inf")
    for _ in range(tries):
        start = time.perf_counter()
        call()
        best = min(best, time.perf_counter() - start)
    return best


def main() -> None:
    torch.set_num_threads(1)
    n = 1 << 22
    half = n // 2
    x = torch.randn(2, half)
    gb = n * 4 / 1e9
    for codec in (codecs.Int8(), codecs.Sign()):
        out = torch.empty(2, codec.nbytes(half, torch.float32), dtype=torch.uint8)
        lost = torch.empty_like(x)
        payload, _ = codec.encode(x, [half, half])
        runs = {
            "kernel": (lambda: codec.encode_into(x, [half, half], out, lost),
                       lambda: codec.decode_rows(out, half, torch.float32)),
            "torch ops": (lambda: codec.encode(x, [half, half]),
                          lambda: codec.decode(payload, half, torch.float32)),
        }
        for name, (enc, dec) in runs.items():
            te, td = _best(enc), _best(dec)
            print(f"{codec} {name}: encode {te * 1e3:.1f} ms ({gb / te:.2f} GB/s), "
                  f"decode {td * 1e3:.1f} ms ({gb / td:.2f} GB/s)")
    y = torch.empty_like(x)
    tc = _best(lambda: y.copy_(x))
    print(f"memcpy: {tc * 1e3:.1f} ms ({gb / tc:.2f} GB/s)")


if __name__ == "__main__":
    main()

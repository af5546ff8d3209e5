"""Sizes and factors at the edges: the block an all_to_all rank sends itself, an empty
all_reduce against a peer's non-empty one, and integer PREMUL_SUM by a factor that is not
a whole number. Each used to be a silent wrong answer (or a write past the output) or a
wait for the whole group timeout. Also the dtypes that only move (no reduction takes
them), through every data-movement op."""

from __future__ import annotations

import time

import pytest
import torch
import torch.distributed as dist

from torchdist_ext.testing import run_ranks


def _own_block_mismatch(rank: int, n: int) -> list[str]:
    """Every rank's own block differs in size between input and output; the sizes the
    peers exchange agree. Without the check the message path (no windows) copied the
    whole input block into the smaller output block and on, past the output."""
    msgs: list[str] = []
    big = torch.zeros(4 * n + 2)
    out_rows = [4] * n
    out_rows[rank] = 2
    out = big[:sum(out_rows)]
    try:
        dist.all_to_all_single(out, torch.arange(4. * n), out_rows, [4] * n)
    except ValueError as e:
        msgs.append(str(e))
    if torch.any(big != 0):
        msgs.append(f"written: {big}")
    outs = [torch.zeros(4) for _ in range(n)]
    outs[rank] = torch.zeros(3)
    try:
        dist.all_to_all(outs, [torch.ones(4) for _ in range(n)])
    except ValueError as e:
        msgs.append(str(e))
    # The group is still whole: nothing was sent.
    t = torch.ones(3)
    dist.all_reduce(t)
    msgs.append(f"sum {t.tolist()}")
    return msgs


@pytest.mark.parametrize("world,shm", [(1, "1"), (2, "0"), (2, "1"), (3, "0")])
def test_all_to_all_refuses_an_own_block_of_another_size(world: int, shm: str) -> None:
    for rank, msgs in enumerate(run_ranks(_own_block_mismatch, world, timeout=60,
                                          env={"TDX_SHM": shm})):
        assert len(msgs) == 3, (rank, msgs)
        assert (f"all_to_all_single: rank {rank} sends 4 rows to itself (input split "
                f"sizes[{rank}]) but expects 2") in msgs[0], (rank, msgs)
        assert (f"all_to_all: rank {rank}'s input {rank} has 4 elements but its output "
                f"{rank} has 3") in msgs[1], (rank, msgs)
        assert msgs[2] == f"sum {[float(world)] * 3}", (rank, msgs)


def _empty_against_full(rank: int, n: int) -> tuple[str, float]:
    start = time.monotonic()
    try:
        dist.all_reduce(torch.ones(0 if rank == 0 else 4))
        what = "ok"
    except dist.DistBackendError as e:
        what = str(e)
    return what, time.monotonic() - start


@pytest.mark.parametrize("algo", ["ring", "rhd", "direct"])
def test_empty_all_reduce_against_a_full_one_fails_at_once(algo: str) -> None:
    """One rank's all_reduce of 0 elements against another's of 4: both fail on the
    size at once (before, the empty one returned and the other waited out the timeout)."""
    results = run_ranks(_empty_against_full, 2, timeout=60,
                        env={"TDX_SHM": "0", "TDX_ALGO": f"allreduce:{algo}"})
    for rank, (what, took) in enumerate(results):
        assert what != "ok", (rank, results)
        assert f"rank {1 - rank}" in what and took < 10, (rank, what, took)


def _premul_ints(rank: int, n: int) -> dict[str, list[int]]:
    got = {}
    for dtype in (torch.int32, torch.uint8, torch.int64):
        for factor in (2.5, -1.5, 1e19):
            x = torch.tensor([10 ** 9 + rank, 7, -3, 0], dtype=torch.int64).to(dtype)
            dist.all_reduce(x, op=dist._make_nccl_premul_sum(factor))
            got[f"{dtype} {factor}"] = x.tolist()
    try:
        dist.all_reduce(torch.ones(2, dtype=torch.int32),
                        op=dist._make_nccl_premul_sum(float("nan")))
        got["nan"] = ["accepted"]
    except ValueError as e:
        got["nan"] = [str(e)]
    try:
        dist.all_reduce(torch.ones(2, dtype=torch.int32),
                        op=dist._make_nccl_premul_sum(torch.tensor([float("inf")])))
        got["inf tensor"] = ["accepted"]
    except ValueError as e:
        got["inf tensor"] = [str(e)]
    return got


def _wrapped(value: float, bits: int, signed: bool) -> int:
    """trunc(value) modulo 2**bits, as the dtype holds it."""
    v = int(value) % (1 << bits)
    return v - (1 << bits) if signed and v >= 1 << (bits - 1) else v


@pytest.mark.parametrize("world,env", [
    (1, {}), (2, {}), (3, {}),
    (3, {"TDX_SHM": "0", "TDX_ALGO": "allreduce:ring"}),
    (3, {"TDX_SHM": "0", "TDX_ALGO": "allreduce:rhd"}),
    (2, {"TDX_SHM": "0", "TDX_ALGO": "allreduce:direct"}),
    (3, {"TDX_ALGO": "allreduce:shm_direct"}),
], ids=["1", "2", "3", "ring", "rhd", "direct", "shm_direct"])
def test_integer_premul_sum_by_a_fraction_truncates_and_wraps(world: int,
                                                              env: dict[str, str]) -> None:
    """By a fraction, each rank's share is multiplied in double, truncated toward zero
    and wrapped modulo 2^bits, then summed with wrap-around (README, "Reductions"), on
    every path; by a whole factor beyond int64's range (1e19), exactly modulo 2^bits."""
    results = run_ranks(_premul_ints, world, timeout=60, env=env)
    for dtype, bits, signed in ((torch.int32, 32, True), (torch.uint8, 8, False),
                                (torch.int64, 64, True)):
        for factor in (2.5, -1.5, 1e19):
            want = []
            for i in range(4):
                total = 0
                for r in range(world):
                    x = [10 ** 9 + r, 7, -3, 0][i]
                    x = _wrapped(x, bits, signed)  # the value the dtype holds
                    if factor == int(factor):  # a whole factor, however large: exact
                        total += _wrapped(x * int(factor), bits, signed)
                    else:
                        total += _wrapped(float(x) * factor, bits, signed)
                want.append(_wrapped(total, bits, signed))
            for rank, got in enumerate(results):
                assert got[f"{dtype} {factor}"] == want, (rank, dtype, factor)
    for rank, got in enumerate(results):
        assert "the PREMUL_SUM factor nan is not finite" in got["nan"][0], (rank, got["nan"])
        assert "the PREMUL_SUM factor inf is not finite" in got["inf tensor"][0], (rank, got)


MOVED_DTYPES = [torch.uint16, torch.uint32, torch.uint64, torch.complex64, torch.complex128,
                torch.float8_e4m3fn, torch.float8_e5m2]


def _bits(t: torch.Tensor) -> torch.Tensor:
    """The tensor's bytes: float8 has no equality op, and NaN bit patterns must match too."""
    return t.contiguous().view(torch.uint8)


def _pattern(rank: int, slot: int, count: int, dtype: torch.dtype) -> torch.Tensor:
    """Bytes that name the rank, the slot and the position, as `dtype` (any bit pattern,
    NaNs and the unsigned types' top bit included)."""
    size = torch.empty(0, dtype=dtype).element_size()
    i = torch.arange(count * size, dtype=torch.int64)
    return ((i * 37 + rank * 101 + slot * 13 + 200) % 256).to(torch.uint8).view(dtype)


def _moves_other_dtypes(rank: int, n: int) -> list[str]:
    fails: list[str] = []

    def same(what: str, got: torch.Tensor, want: torch.Tensor) -> None:
        if got.dtype != want.dtype or not torch.equal(_bits(got), _bits(want)):
            fails.append(f"r{rank} {what}")

    for dtype in MOVED_DTYPES:
        for count in (1, 7):
            p = lambda r, s=0: _pattern(r, s, count, dtype)  # noqa: E731
            t = p(rank) if rank == n - 1 else torch.zeros(count, dtype=dtype)
            dist.broadcast(t, src=n - 1)
            same(f"broadcast {dtype} {count}", t, p(n - 1))
            flat = torch.zeros(n * count, dtype=dtype)
            dist.all_gather_into_tensor(flat, p(rank))
            same(f"all_gather_into_tensor {dtype}", flat, torch.cat([p(r) for r in range(n)]))
            outs = [torch.zeros(count, dtype=dtype) for _ in range(n)]
            dist.all_gather(outs, p(rank))
            same(f"all_gather {dtype}", torch.cat(outs), torch.cat([p(r) for r in range(n)]))
            out = torch.zeros(n * count, dtype=dtype)
            dist.all_to_all_single(out, torch.cat([p(rank, q) for q in range(n)]))
            same(f"all_to_all_single {dtype}", out, torch.cat([p(q, rank) for q in range(n)]))
            glist = [torch.zeros(count, dtype=dtype) for _ in range(n)] if rank == 0 else None
            dist.gather(p(rank), glist, dst=0)
            if rank == 0:
                same(f"gather {dtype}", torch.cat(glist), torch.cat([p(r) for r in range(n)]))
            got = torch.zeros(count, dtype=dtype)
            dist.scatter(got, [p(0, q) for q in range(n)] if rank == 0 else None, src=0)
            same(f"scatter {dtype}", got, p(0, rank))
            if n > 1:
                if rank == 0:
                    dist.send(p(0, 9), 1)
                elif rank == 1:
                    got = torch.zeros(count, dtype=dtype)
                    dist.recv(got, 0)
                    same(f"send/recv {dtype}", got, p(0, 9))
    return fails


@pytest.mark.parametrize("world,shm", [(1, "1"), (2, "1"), (3, "1"), (3, "0")])
def test_data_movement_of_every_other_dtype(world: int, shm: str) -> None:
    """The README's "any dtype" for data movement, for the dtypes no reduction takes:
    unsigned 16/32/64-bit, complex, float8; byte-exact, NaN patterns included."""
    results = run_ranks(_moves_other_dtypes, world, timeout=120, env={"TDX_SHM": shm})
    fails = [f for per_rank in results for f in per_rank]
    assert not fails, fails[:20]

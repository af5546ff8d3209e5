"""torchdist_ext.bench: a real (tiny) run of every op on tdx and gloo, and the checker."""

from __future__ import annotations

import dataclasses
import importlib.util
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

import torchdist_ext
from torchdist_ext import bench
from torchdist_ext.bench import Options, count_wrong, expected_output, make_input, op_input


def test_bench_all_ops_tdx_and_gloo(tmp_path: Path, capfd: pytest.CaptureFixture[str]) -> None:
    """One spawn of 2 ranks: every op, 1K..64K, through the CLI entry point with --json."""
    path = tmp_path / "rows.json"
    rc = bench.main(["--op", "all", "--backends", "tdx,gloo", "--world", "2",
                     "--device", "cpu", "-b", "1K", "-e", "64K", "-n", "2", "-w", "1",
                     "--json", str(path), "--no-progress"])
    out = capfd.readouterr().out
    doc = json.loads(path.read_text())
    rows = doc["rows"]
    assert rc == 0
    assert doc["meta"]["world"] == 2 and doc["meta"]["backends"] == ["tdx", "gloo"]
    assert {r["backend"] for r in rows} == {"tdx", "gloo"}
    assert {r["op"] for r in rows} == set(bench.ALL_OPS)
    sizes = [1 << k for k in range(10, 17)]
    for op in bench.ALL_OPS:
        for b in ("tdx", "gloo"):
            assert sorted(r["size"] for r in rows if r["op"] == op and r["backend"] == b) == sizes
    for r in rows:
        where = f"{r['op']} {r['backend']} {r['size']}"
        assert r["oop_error"] is None, where
        assert r["oop_wrong"] == 0, where
        assert r["oop_time_us"] > 0 and r["oop_busbw_gb_s"] > 0, where
        assert r["count"] * 4 == r["size"] and r["dtype"] == "float32", where
        for key in ("world", "device", "host", "torch_version", "date"):
            assert r[key], (where, key)
        if bench.OPS[r["op"]].in_place:
            assert r["ip_error"] is None, where
            assert r["ip_wrong"] == 0, where
            assert r["ip_time_us"] > 0, where
        else:
            assert r["ip_time_us"] is None and r["ip_wrong"] is None, where
    # busbw factors as nccl-tests, world 2
    for r in rows:
        factor = {"all_reduce": 1.0, "broadcast": 1.0, "reduce": 1.0,
                  "sendrecv": 1.0}.get(r["op"], 0.5)
        assert r["oop_busbw_gb_s"] == pytest.approx(r["oop_algbw_gb_s"] * factor)
        assert r["oop_algbw_gb_s"] == pytest.approx(r["size"] / r["oop_time_us"] / 1e3)
    assert "tdx vs gloo" in out and "# Wrong elements : 0 OK" in out


def test_sparse_bench_tdx_and_gloo(tmp_path: Path, capfd: pytest.CaptureFixture[str]) -> None:
    """``bench sparse``: one spawn of 3 ranks, lookups 1, a prime and more than the table
    has rows, both backends checked; the rows of each result are the union of the
    ranks' lookups."""
    from torchdist_ext.bench import sparse

    path = tmp_path / "sparse.json"
    argv = ["sparse", "--world", "3", "--rows", "97", "--dim", "3", "--lookups", "1,37,300",
            "-n", "2", "-w", "1", "--json", str(path)]
    assert bench.main(argv) == 0
    out = capfd.readouterr().out
    doc = json.loads(path.read_text())
    opts = sparse.SparseOptions(world=3, rows=97, dim=3, lookups=(1, 37, 300))
    for lookups in (1, 37, 300):
        union = set()
        for r in range(3):
            union |= set(sparse._gradient(r, opts, lookups, torch.device("cpu"))
                         ._indices()[0].tolist())
        for b in ("tdx", "gloo"):
            row = doc["backends"][b]["sizes"][str(lookups)]
            assert row["wrong"] == 0 and row["us"] > 0, (b, lookups, row)
            assert row["result_rows"] == len(union), (b, lookups, row)
    assert all(doc["backends"][b]["dense_us"] > 0 for b in ("tdx", "gloo"))
    assert "97 x 3 float32 table's gradient" in out and "tdx/gloo" in out, out


def test_compressed_bench_tdx_and_gloo(tmp_path: Path,
                                       capfd: pytest.CaptureFixture[str]) -> None:
    """``bench compressed``: 3 ranks, a size of one element and one not divisible by the
    blocks, each method against exact on both backends; the errors are the codecs'."""
    from torchdist_ext.bench import compressed

    path = tmp_path / "compressed.json"
    argv = ["compressed", "--world", "3", "--sizes", "4,40004", "--block", "64",
            "--ratio", "0.5", "-n", "2", "-w", "1", "--json", str(path)]
    assert bench.main(argv) == 0
    out = capfd.readouterr().out
    doc = json.loads(path.read_text())
    for b in ("tdx", "gloo"):
        for size in ("4", "40004"):
            row = doc["backends"][b][size]
            assert set(row) == {"exact", "int8", "sign", "topk"}, row
            assert all(cell["us"] > 0 for cell in row.values()), row
            assert row["exact"]["error"] == 0.0
            # Int8: two encodings, each within 1/254 of its largest element, relative
            # to the sum's largest (the ranks' data are alike in size).
            if size == "4":  # one element: each method sends it whole
                assert all(cell["error"] < 1e-6 for cell in row.values()), row
            else:
                assert 0 < row["int8"]["error"] < 3 * 3 / 254, row
                assert row["topk"]["error"] < 1.0 and row["sign"]["error"] < 3.0, row
    opts = compressed.CompressedOptions(world=3, block=64, ratio=0.5)
    # int8 at 3 ranks: 2 phases x 2 peers x (16 + 3392 values + 53 scales x 4) bytes
    assert compressed.sent_bytes(opts.method("int8"), 10001, 3) == 4 * (16 + 3392
                                                                               + 53 * 4)
    assert compressed.sent_bytes(None, 10001, 3) == 2 * 2 * 3334 * 4
    assert "Int8(block=64)" in out and "TopK(ratio=0.5)" in out and "vs exact" in out, out


def test_zero_bench_tdx_and_gloo(tmp_path: Path, capfd: pytest.CaptureFixture[str]) -> None:
    """``bench zero``: 3 ranks, each strategy on both backends; the bytes each rank holds
    are what the strategies promise: ZeRO-1 a third of DDP's optimizer state (plus
    padding), ZeRO-2 a third of its gradients as well, ZeRO-3 a third of its parameters
    too."""
    path = tmp_path / "zero.json"
    argv = ["zero", "--world", "3", "--params", "3001", "--layers", "2", "--batch", "4",
            "--bucket-bytes", "1K", "-n", "2", "-w", "1", "--json", str(path)]
    assert bench.main(argv) == 0
    out = capfd.readouterr().out
    doc = json.loads(path.read_text())
    for b in ("tdx", "gloo"):
        row = doc["backends"][b]["3001"]
        assert set(row) == {"ddp", "zero1", "zero2", "zero3"}, row
        assert all(cell["ms"] > 0 for cell in row.values()), row
        params = row["ddp"]["params"]
        assert params == 2 * (38 * 38 + 38)  # width sqrt(3001 / 2) = 38
        assert all(cell["params"] == params for cell in row.values()), row
        # Adam: exp_avg and exp_avg_sq per element, a float32 step per tensor.
        assert row["ddp"]["state"] == 2 * 4 * params + 4 * 4
        assert row["ddp"]["grads"] == 4 * params
        assert row["ddp"]["weights"] == 4 * params
        for name in ("zero1", "zero2", "zero3"):
            assert 2 * 4 * params / 3 <= row[name]["state"] <= 2 * 4 * (params / 3 + 64), row
        assert row["zero1"]["grads"] >= 4 * params, row  # gradients whole, and the shard
        for name in ("zero2", "zero3"):
            assert 4 * params / 3 <= row[name]["grads"] <= 4 * (params / 3 + 64), row
        # Whole parameters and their shard at stages 1 and 2; the shard alone at stage 3.
        for name in ("zero1", "zero2"):
            assert 4 * params * 4 / 3 <= row[name]["weights"] <= 4 * (params * 4 / 3 + 256)
        assert 4 * params / 3 <= row["zero3"]["weights"] <= 4 * (params / 3 + 64), row
    assert "zero3" in out and "params/rank" in out and "gloo ms" in out, out


def test_zero_bench_compressed(tmp_path: Path, capfd: pytest.CaptureFixture[str]) -> None:
    """``bench zero --compression int8``: every strategy trains with its gradients
    compressed, and the bytes of error feedback (a residual and buffers per bucket) count
    among the gradients' bytes, beyond what the same strategies hold uncompressed."""
    held = {}
    for compression in ("none", "int8"):
        path = tmp_path / f"{compression}.json"
        argv = ["zero", "--world", "2", "--params", "3001", "--layers", "2", "--batch", "4",
                "--bucket-bytes", "1K", "--backends", "tdx", "--compression", compression,
                "-n", "1", "-w", "1", "--json", str(path)]
        assert bench.main(argv) == 0
        out = capfd.readouterr().out
        assert f"gradients compressed: {compression}" in out, out
        doc = json.loads(path.read_text())
        assert doc["options"]["compression"] == compression
        held[compression] = doc["backends"]["tdx"]["3001"]
    for name in ("ddp", "zero1", "zero2", "zero3"):
        plain, packed = held["none"][name], held["int8"][name]
        assert packed["ms"] > 0, packed
        assert packed["grads"] > plain["grads"], (name, plain, packed)
        assert (packed["state"], packed["weights"]) == (plain["state"], plain["weights"])


def test_zero_bench_mixed_precision(tmp_path: Path, capfd: pytest.CaptureFixture[str]) -> None:
    """``bench zero --param-dtype bfloat16``: ZeRO's flat buffers, whole at stages 1 and
    2, take half the bytes over the same float32 shards; stage 3 holds only its shards
    after backward, as in float32; DDP is untouched."""
    held = {}
    for dtype in ("float32", "bfloat16"):
        path = tmp_path / f"{dtype}.json"
        argv = ["zero", "--world", "2", "--params", "3001", "--layers", "2", "--batch", "4",
                "--backends", "tdx", "--param-dtype", dtype, "-n", "1", "-w", "1",
                "--json", str(path)]
        assert bench.main(argv) == 0
        out = capfd.readouterr().out
        assert f"ZeRO parameters in {dtype}" in out, out
        held[dtype] = json.loads(path.read_text())["backends"]["tdx"]["3001"]
    full, mixed = held["float32"], held["bfloat16"]
    params = full["zero1"]["params"]
    for name in ("zero1", "zero2"):
        # The flat buffer lost 2 bytes per parameter; the padding differs (layouts are
        # aligned in the buffer's dtype) by a few elements per bucket.
        saved = full[name]["weights"] - mixed[name]["weights"]
        assert 2 * params - 256 <= saved <= 2 * params + 256, (name, full[name], mixed[name])
    assert mixed["zero1"]["grads"] < full["zero1"]["grads"]  # param.grad in bfloat16
    assert mixed["zero3"]["weights"] == full["zero3"]["weights"]
    for key in ("state", "grads", "weights"):
        assert mixed["ddp"][key] == full["ddp"][key], key


def test_ps_bench_tdx_and_gloo(tmp_path: Path, capfd: pytest.CaptureFixture[str]) -> None:
    """``bench ps``: one server and two workers, each strategy on both backends; every
    cell ran, and a push and its answer carry the model once each."""
    path = tmp_path / "ps.json"
    argv = ["ps", "--world", "3", "--params", "3001", "--layers", "2", "--batch", "4",
            "-n", "3", "-w", "1", "--json", str(path)]
    assert bench.main(argv) == 0
    out = capfd.readouterr().out
    doc = json.loads(path.read_text())
    assert doc["world"] == 3 and doc["options"]["servers"] == 1
    for b in ("tdx", "gloo"):
        row = doc["backends"][b]["3001"]
        assert set(row) == {"ddp", "sync", "async"}, row
        assert all(cell["ms"] > 0 for cell in row.values()), row
        params = 2 * (38 * 38 + 38)
        assert all(cell["params"] == params for cell in row.values()), row
        assert row["sync"]["bytes"] == row["async"]["bytes"] == 8 * params, row
        assert row["ddp"]["bytes"] is None, row
        assert row["sync"]["stalest"] == 0 and row["ddp"]["busy"] == 0, row
        assert all(0 < row[m]["busy"] < 1 for m in ("sync", "async")), row
        # Two workers: a push misses at most the steps of the other worker's pushes.
        assert 0 <= row["async"]["stalest"] <= 1 + 3 + 1, row
    assert "1 server(s) and 2 worker(s)" in out and "tdx stalest" in out, out


def test_sparse_bench_checker_counts_wrong_elements() -> None:
    from torchdist_ext.bench import sparse

    opts = sparse.SparseOptions(rows=50, dim=4, lookups=(20,))
    ref = sparse._reference(2, opts, 20)
    # The ranks' gradients summed in float32, one after the other, are within the bound.
    grads = [sparse._gradient(r, opts, 20, torch.device("cpu")) for r in range(2)]
    good = (grads[0] + grads[1]).coalesce()
    assert sparse._wrong(good, ref) == 0
    bad = good.to_dense()
    bad[3, 1] += 1e-3
    bad[7, 2] = float("nan")
    assert sparse._wrong(bad.to_sparse(), ref) == 2
    # A dense result, or one of another shape, is wrong everywhere.
    assert sparse._wrong(bad, ref) == 200
    assert sparse._wrong(good.to_dense()[:10].to_sparse(), ref) == 200


def test_bench_detects_wrong_results(tmp_path: Path) -> None:
    """The test hook spoils one element per checked output; the rows must count it.

    Runs in this process on a one-rank default group (no spawn, so it costs ~1 s):
    ``run`` uses an already initialised group as it is.
    """
    import torch.distributed as dist

    dist.init_process_group("gloo", store=dist.FileStore(str(tmp_path / "store"), 1),
                            rank=0, world_size=1)
    try:
        rows = bench.run(Options(ops="all_reduce,reduce,all_to_all,sendrecv",
                                 backends="tdx,gloo", minbytes=1024, maxbytes=2048, iters=1,
                                 warmup=0, quiet=True, progress=False, _corrupt=True))
    finally:
        dist.destroy_process_group()
    # sendrecv is skipped at one rank (it has no peer), with a note rather than a row
    assert len(rows) == 3 * 2 * 2 and "sendrecv" not in {r["op"] for r in rows}
    for r in rows:
        assert r["oop_error"] is None and r["oop_wrong"] == 1, r
        if r["op"] != "all_to_all":
            assert r["ip_wrong"] == 1, r


@pytest.mark.parametrize("corrupt", [False, True])
def test_bench_premul_sum(tmp_path: Path, corrupt: bool) -> None:
    """-o premul_sum runs torch's PREMUL_SUM with --premul-factor and checks the scaled sum
    (0.3 rounds, so the checker's allowance for scaling ops is exercised too)."""
    import torch.distributed as dist

    dist.init_process_group("gloo", store=dist.FileStore(str(tmp_path / "store"), 1),
                            rank=0, world_size=1)
    try:
        rows = bench.run(Options(ops="all_reduce,reduce_scatter,reduce", backends="tdx",
                                 minbytes=1024, maxbytes=2048, iters=1, warmup=0,
                                 dtype="bfloat16", redop="premulsum", premul_factor=0.3,
                                 quiet=True, progress=False, _corrupt=corrupt))
    finally:
        dist.destroy_process_group()
    assert len(rows) == 3 * 2
    for r in rows:
        assert r["redop"] == "premul_sum", r
        assert r["oop_error"] is None and r["ip_error"] is None, r
        assert r["oop_wrong"] == r["ip_wrong"] == (1 if corrupt else 0), r
    with pytest.raises(ValueError, match="premul_sum needs a floating dtype"):
        Options(redop="premul_sum", dtype="int32")
    parsed = bench.options_from_args(["-o", "premul_sum", "--premul-factor", "0.25"])
    assert (parsed.redop, parsed.premul_factor) == ("premul_sum", 0.25)
    want = expected_output("all_reduce", 0, 3, 64, torch.float32, "premul_sum", factor=0.25)
    ins = [op_input("all_reduce", r, 3, 64, torch.float32, "premul_sum") for r in range(3)]
    assert torch.equal(want, sum(ins) * 0.25)


def _simulate(op: str, world: int, count: int, dtype: torch.dtype, redop: str,
              root: int) -> list[torch.Tensor | None]:
    """Each rank's output computed directly from the inputs, independent of the checker."""
    chunk = count // world
    if op == "all_gather":
        parts = [op_input(op, r, world, chunk, dtype, redop) for r in range(world)]
        return [torch.cat(parts)] * world
    ins = [op_input(op, r, world, count, dtype, redop) for r in range(world)]
    if op == "broadcast":
        return [ins[root]] * world
    if op == "all_to_all":
        return [torch.cat([ins[r][j * chunk:(j + 1) * chunk] for r in range(world)])
                for j in range(world)]
    if op == "sendrecv":  # rank r holds what rank r-1 sent
        return [ins[(r - 1) % world] for r in range(world)]
    stack = torch.stack([t.double() for t in ins])
    total = {"sum": stack.sum(0), "max": stack.max(0).values, "prod": stack.prod(0)}[redop]
    total = total.to(dtype)
    if op == "all_reduce":
        return [total] * world
    if op == "reduce":
        return [total if r == root else None for r in range(world)]
    return [total[j * chunk:(j + 1) * chunk] for j in range(world)]  # reduce_scatter


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.int32])
@pytest.mark.parametrize("redop", ["sum", "max", "prod"])
@pytest.mark.parametrize("op", bench.ALL_OPS)
def test_checker_counts_exactly(op: str, redop: str, dtype: torch.dtype) -> None:
    world, count, root = 3, 3 * 40, 1
    got = _simulate(op, world, count, dtype, redop, root)
    for rank in range(world):
        want = expected_output(op, rank, world, count, dtype, redop, root)
        if got[rank] is None:
            assert want is None
            continue
        how = redop if bench.OPS[op].reduces else None
        assert count_wrong(got[rank], want, world, how) == 0
        bad = got[rank].clone()
        bad[5] += 1
        bad[17] = -bad[17] - 1
        assert count_wrong(bad, want, world, how) == 2
        assert count_wrong(torch.roll(got[rank], 1), want, world, how) > 0  # misplaced data
        assert count_wrong(got[rank][:-1], want) == count_wrong(torch.empty(0), want) > 0


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
def test_checker_is_exact_where_the_result_is(dtype: torch.dtype) -> None:
    """Copies, and sums the dtype holds exactly, must match to the last bit: one ulp off
    in every element is every element wrong."""
    world = 8
    gathered = expected_output("all_gather", 0, world, 1024, dtype)
    flipped = (gathered.view(torch.int16 if dtype.itemsize == 2 else torch.int32) ^ 1
               ).view(dtype)
    assert count_wrong(flipped, gathered, world) == 1024
    total = expected_output("all_reduce", 0, world, 1024, dtype, "sum")
    assert count_wrong(total + 1, total, world, "sum") == 1024
    # bfloat16 over 40 ranks: the inputs stay small enough for an exact sum, so three
    # ranks' missing contributions show in every element.
    world = 40
    ins = [op_input("all_reduce", r, world, 512, torch.bfloat16) for r in range(world)]
    assert max(torch.stack(ins).double().sum(0)) <= 256
    short = torch.stack(ins[:-3]).double().sum(0).to(torch.bfloat16)
    want = expected_output("all_reduce", 0, world, 512, torch.bfloat16, "sum")
    assert count_wrong(short, want, world, "sum") == 512
    # Product inputs tell ranks apart too (rank 7 is not rank 0).
    assert not torch.equal(make_input(0, 64, torch.float32, "prod"),
                           make_input(7, 64, torch.float32, "prod"))


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
@pytest.mark.parametrize("world", [10, 20, 40, 150])
def test_checker_allows_what_scaling_rounds(world: int, dtype: torch.dtype) -> None:
    """Each share scaled and rounded, then added rank by rank in the dtype (how PREMUL_SUM
    by 0.1 and float16 AVG are computed) is not counted wrong; equal infinities match."""
    count = 4096
    for redop, factor in (("avg", 1.0 / world), ("premul_sum", 0.1)):
        acc = None
        for r in range(world):
            x = op_input("all_reduce", r, world, count, dtype, redop)
            share = (x.double() * factor).to(dtype)
            acc = share if acc is None else acc + share
        want = expected_output("all_reduce", 0, world, count, dtype, redop, factor=0.1)
        assert count_wrong(acc, want, world, redop) == 0, redop
        if (world + 2) / 2 * torch.finfo(dtype).eps < 0.5:  # (bfloat16 at 150 ranks: 59%)
            assert count_wrong(acc * 1.5, want, world, redop) == count, redop
    inf = torch.full((4,), float("inf"), dtype=dtype)
    assert count_wrong(inf, inf, world, "premul_sum") == 0
    assert count_wrong(inf, -inf, world, "premul_sum") == 4


def test_checker_nan_and_chunks_from_the_wrong_rank() -> None:
    want = expected_output("all_gather", 0, 4, 64, torch.float32)
    swapped = torch.cat([want[16:32], want[:16], want[32:]])
    assert count_wrong(swapped, want) > 0
    nan = want.clone()
    nan[3] = float("nan")
    assert count_wrong(nan, want) == 1


def test_options_and_sizes() -> None:
    assert bench.parse_size("1K") == 1024 and bench.parse_size("64M") == 64 << 20
    assert bench.parse_size("1G") == 1 << 30 and bench.parse_size("512") == 512
    o = Options(ops="all", backends="tdx, gloo,nccl", minbytes="1K", maxbytes="8K",
                dtype="bf16", redop="product")
    assert o.ops == bench.ALL_OPS and o.backends == ("tdx", "gloo", "nccl")
    assert (o.minbytes, o.maxbytes, o.dtype, o.redop) == (1024, 8192, "bfloat16", "prod")
    assert Options(ops="allreduce,all_gather_into_tensor").ops == ("all_reduce", "all_gather")
    assert bench.sweep(1024, 8192, 2) == [1024, 2048, 4096, 8192]
    # per-rank chunks: counts round down to a multiple of the world size, as nccl-tests
    assert bench.sizes_for(bench.OPS["all_gather"], Options(minbytes=1024, maxbytes=1024),
                           3) == [(1020, 255)]
    with pytest.raises(ValueError):
        Options(ops="all_reduce,bogus")
    with pytest.raises(ValueError):
        Options(dtype="float33")
    with pytest.raises(dataclasses.FrozenInstanceError):
        o.iters = 3  # type: ignore[misc]  # frozen
    parsed = bench.options_from_args(["--op", "broadcast,reduce", "-b", "2K", "-e", "1M",
                                      "-f", "4", "-n", "3", "-w", "1", "--backends", "gloo"])
    assert parsed.ops == ("broadcast", "reduce") and parsed.maxbytes == 1 << 20
    assert (parsed.iters, parsed.warmup, parsed.stepfactor) == (3, 1, 4)


# ---------------------------------------------------------------------------------------
# Pinned algorithms (tdx:<algo>), --check-auto, calibrate
# ---------------------------------------------------------------------------------------

def test_bench_pinned_algorithms(tmp_path: Path, capfd: pytest.CaptureFixture[str]) -> None:
    """One spawn of 2 ranks: tdx (auto) and tdx:<algo> labels side by side with gloo.

    Every label gets its own rows and right results; an algorithm an op lacks is left out
    with a note; the flight recorder shows that the pinned algorithm really ran, and what
    auto ran; --check-auto prints its verdict per op; --rounds 2 interleaves the labels
    and still gives one row each.
    """
    import torchdist_ext

    path = tmp_path / "rows.json"
    rc = bench.main(["--op", "all_reduce,all_gather,broadcast", "--backends",
                     "tdx,tdx:ring,tdx:rd,tdx:shm,gloo", "--world", "2", "-b", "1K", "-e", "4K",
                     "-f", "4", "-n", "2", "-w", "1", "--json", str(path), "--no-progress",
                     "--check-auto", "--rounds", "2"])
    out = capfd.readouterr().out
    doc = json.loads(path.read_text())
    rows = doc["rows"]
    assert rc == 0
    assert doc["meta"]["backends"] == ["tdx", "tdx:ring", "tdx:rd", "tdx:shm", "gloo"]
    assert doc["meta"]["groups"] == ["tdx", "gloo"]
    labels = {op: {r["backend"] for r in rows if r["op"] == op} for op in
              ("all_reduce", "all_gather", "broadcast")}
    assert labels["all_reduce"] == {"tdx", "tdx:ring", "tdx:shm", "gloo"}  # no rd all_reduce
    assert labels["all_gather"] == {"tdx", "tdx:ring", "tdx:rd", "tdx:shm", "gloo"}
    assert labels["broadcast"] == {"tdx", "tdx:shm", "gloo"}
    notes = " | ".join(doc["meta"]["notes"])
    assert "tdx:rd left out of all_reduce" in notes and "tdx:ring left out of broadcast" in notes
    collective = {"all_reduce": "allreduce", "all_gather": "allgather", "broadcast": "broadcast"}
    for r in rows:
        where = f"{r['op']} {r['backend']} {r['size']}"
        assert r["oop_error"] is None and r["ip_error"] is None, where
        assert r["oop_wrong"] == 0 and r["ip_wrong"] == 0, where
        assert r["oop_time_us"] > 0 and r["ip_time_us"] > 0, where
        if r["backend"] == "gloo":
            assert r["algo"] is None and r["pinned"] is None, where
            continue
        assert r["algo_from"] == "flight recorder" and r["predicted_us"] > 0, where
        assert r["one_host"] is True, where  # the tdx group's own placement
        if r["backend"] == "tdx":
            assert not r["pinned"], where
            assert r["algo"] == torchdist_ext.predict(collective[r["op"]], r["size"], 2)[0], where
        else:
            assert r["pinned"] and r["algo"] == r["backend"].split(":")[1], where
    # rows of one size are back to back, in the order asked for
    first = [r["backend"] for r in rows if r["op"] == "all_gather" and r["size"] == 1024]
    assert first == ["tdx", "tdx:ring", "tdx:rd", "tdx:shm", "gloo"]  # one row per round set
    assert all(r["rounds"] == 2 for r in rows) and "median of 2 rounds" in out
    assert " algo " in out and "tdx:shm" in out and "# Wrong elements : 0 OK" in out
    for op in ("all_reduce", "all_gather", "broadcast"):
        assert f"# check-auto {op}: auto " in out, op
    assert "tdx vs gloo" in out and "tdx vs tdx:ring" not in out


def test_labels_for_op_and_backend_options() -> None:
    """Which tdx:<algo> labels run an op, and the notes for those left out (no spawn)."""
    from torchdist_ext.bench import core

    labels, notes = core.labels_for_op("all_gather", ("tdx", "tdx:rd", "tdx:ring", "gloo"), 3,
                                       True)
    assert [lb.label for lb in labels] == ["tdx", "tdx:ring", "gloo"]
    assert len(notes) == 1 and "tdx:rd" in notes[0] and "power-of-two" in notes[0]
    labels, notes = core.labels_for_op("all_reduce", ("tdx:all",), 2, False)
    assert [lb.algo for lb in labels] == ["ring", "rhd", "direct"]
    assert len(notes) == 3 and all("one host" in n for n in notes)
    labels, _ = core.labels_for_op("broadcast", ("tdx", "tdx:all"), 4, True)
    assert [lb.label for lb in labels] == ["tdx", "tdx:tree", "tdx:chain", "tdx:shm"]
    assert core.unusable("all_reduce", "direct", 64 << 20, 2, True)  # scratch limit
    assert core.unusable("all_reduce", "direct", 1 << 20, 2, True) == ""
    assert Options(backends="TDX:Ring, tdx:auto,gloo").backends == ("tdx:ring", "tdx", "gloo")
    assert Options(backends="tdx:ring,gloo").groups == ("tdx", "gloo")
    assert Options(backends="gloo", check_auto="report").backends == ("tdx", "gloo", "tdx:all")
    for bad in ("gloo:ring", "tdx:bogus", "tdx:"):
        with pytest.raises(ValueError):
            Options(backends=bad)
    assert Options(sizes="4K,1K,4K").sizes == (1024, 4096)
    assert bench.sizes_for(bench.OPS["all_reduce"], Options(sizes=(8, 16)), 2) == [(8, 2),
                                                                                   (16, 4)]


def _row(op: str, backend: str, size: int, t: float | None, algo: str | None) -> dict:
    ok = t is not None
    return {"op": op, "backend": backend, "size": size, "algo": algo,
            "oop_time_us": t, "oop_error": None if ok else "x",
            "ip_time_us": t, "ip_error": None if ok else "x"}


def test_check_auto_verdicts(monkeypatch: pytest.MonkeyPatch) -> None:
    """--check-auto on made-up rows: within, lost, noise; strict makes main fail."""
    from torchdist_ext.bench import cli, report

    rows = [
        # all_reduce: auto within 5% at 1K, loses 50% at 2K by picking ring over shm
        _row("all_reduce", "tdx", 1024, 105.0, "shm"),
        _row("all_reduce", "tdx:ring", 1024, 200.0, "ring"),
        _row("all_reduce", "tdx:shm", 1024, 100.0, "shm"),
        _row("all_reduce", "tdx", 2048, 150.0, "ring"),
        _row("all_reduce", "tdx:ring", 2048, 140.0, "ring"),
        _row("all_reduce", "tdx:shm", 2048, 100.0, "shm"),
        _row("all_reduce", "gloo", 2048, 50.0, None),  # other backends do not count
        # broadcast: slower than its own pinned run (same algorithm): noise, not a loss
        _row("broadcast", "tdx", 1024, 130.0, "shm"),
        _row("broadcast", "tdx:shm", 1024, 100.0, "shm"),
        _row("broadcast", "tdx:tree", 1024, 300.0, "tree"),
        # reduce: auto picked tree, whose pinned row is within 5% of the best: its own slow
        # row is noise, not a wrong choice
        _row("reduce", "tdx", 1024, 150.0, "tree"),
        _row("reduce", "tdx:tree", 1024, 105.0, "tree"),
        _row("reduce", "tdx:shm", 1024, 100.0, "shm"),
        # all_gather: nothing pinned
        _row("all_gather", "tdx", 1024, 10.0, "shm"),
        # reduce_scatter: auto's own row was timed fast, but the pinned row of its pick
        # (ring) is 30% behind the best: a wrong choice all the same
        _row("reduce_scatter", "tdx", 1024, 105.0, "ring"),
        _row("reduce_scatter", "tdx:shm", 1024, 100.0, "shm"),
        _row("reduce_scatter", "tdx:ring", 1024, 130.0, "ring"),
    ]
    assert report.auto_losses(rows) == {"all_reduce": [2048], "broadcast": [], "reduce": [],
                                        "all_gather": [], "reduce_scatter": [1024]}
    assert report.auto_losses(rows, tolerance=0.6) == {"all_reduce": [], "broadcast": [],
                                                       "reduce": [], "all_gather": [],
                                                       "reduce_scatter": []}
    rs_entry = report.compare_auto(rows)["reduce_scatter"][0]
    assert rs_entry["lost"] and not rs_entry["noise"]
    assert rs_entry["choice_loss"] == pytest.approx(0.3)
    entry = report.compare_auto(rows)["all_reduce"][1]
    # The loss that counts is the choice's: pinned ring (140) against pinned shm (100).
    assert entry["best"] == "tdx:shm" and entry["loss"] == pytest.approx(0.5) and entry["lost"]
    assert entry["choice_loss"] == pytest.approx(0.4)
    reduce_entry = report.compare_auto(rows)["reduce"][0]
    assert reduce_entry["noise"] and not reduce_entry["lost"]
    text = "\n".join(report.check_auto_lines(rows))
    assert "# check-auto all_reduce: auto lost by >10% at 1 of 2 sizes: 2048 B (+40.0%: " \
           "picked ring, best shm)" in text
    assert "# check-auto broadcast: auto picked the fastest algorithm" in text
    assert "timing noise" in text
    assert "# check-auto all_gather: no pinned tdx:<algorithm> rows" in text
    good = [r for r in rows if r["size"] == 1024 and r["op"] == "all_reduce"]
    assert "auto within 5.0% of best at every size" in "\n".join(report.check_auto_lines(good))

    for r in rows:
        r.update(oop_wrong=0, ip_wrong=0)
    monkeypatch.setattr(cli, "run", lambda opts: rows)
    assert cli.main(["--backends", "tdx,tdx:all", "--check-auto"]) == 0
    assert cli.main(["--backends", "tdx,tdx:all", "--check-auto=strict"]) == 1
    assert cli.main(["--backends", "tdx,tdx:all", "--check-auto=strict",
                     "--auto-tolerance", "60"]) == 0
    # An op that failed makes the run fail; one that was skipped does not; no rows at all
    # is a failure too.
    rows[0]["ip_error"] = report.SKIPPED + " after an earlier error"
    assert cli.main(["--backends", "tdx,tdx:all"]) == 0
    rows[0]["ip_error"] = "rank 0: RuntimeError: boom"
    assert cli.main(["--backends", "tdx,tdx:all"]) == 1
    monkeypatch.setattr(cli, "run", lambda opts: [])
    assert cli.main(["--backends", "tdx"]) == 1


def _warm_up(rank: int, n: int, per_call_s: list[float], fail_rank: int) -> dict:
    """Each rank's calls take per_call_s[rank]; what _warm did here."""
    import time

    import torch.distributed as dist

    from torchdist_ext.bench import runner

    calls = []

    def call() -> None:
        if rank == fail_rank and len(calls) == 1:
            raise RuntimeError("the second call failed")
        calls.append(1)
        time.sleep(per_call_s[rank])

    side = dist.new_group(backend="gloo")
    ctx = runner._Ctx(Options(warmup=2, warmup_ms=60.0, backends="gloo"), rank, n,
                      torch.device("cpu"), side)
    begun = time.perf_counter()
    error = runner._warm(runner._Case(call, lambda: 0), ctx)
    took = time.perf_counter() - begun
    # A floor no run reaches: the cap ends it.
    capped = []
    unlimited = dataclasses.replace(ctx, opts=Options(warmup=2, warmup_ms=1e9, backends="gloo"))
    runner._warm(runner._Case(lambda: capped.append(1), lambda: 0), unlimited)
    return {"error": error, "calls": len(calls), "took": took, "capped": len(capped)}


@pytest.mark.parametrize("fail_rank", [-1, 1])
def test_warmup_floor_runs_as_many_calls_on_every_rank(fail_rank: int) -> None:
    """--warmup-ms: untimed calls go on until the floor has passed on the slowest rank,
    the same number on every rank (a count that differed would leave a rank waiting in a
    collective its peers never call), capped; a rank's failure reaches every rank."""
    from torchdist_ext.bench import runner
    from torchdist_ext.testing import run_ranks

    results = run_ranks(_warm_up, 2, backend="gloo", timeout=60,
                        args=([0.002, 0.01], fail_rank))
    if fail_rank >= 0:
        assert all(r["error"] == "rank 1: RuntimeError: the second call failed"
                   for r in results), results
        return
    assert all(r["error"] is None for r in results), results
    assert results[0]["calls"] == results[1]["calls"] >= 2, results
    assert max(r["took"] for r in results) >= 0.060, results
    assert all(r["capped"] == 2 + runner.MAX_EXTRA_WARMUP for r in results), results


def test_rounds_take_the_median_round() -> None:
    """--rounds: each label's figure is its median round; any failed round makes it an
    error; the option is validated."""
    from torchdist_ext.bench import cli, runner

    assert runner._combine([(30.0, 0, None), (10.0, 0, None), (20.0, 1, None)]) == (20.0, 1, None)
    assert runner._combine([(10.0, 3, None), (None, None, "boom")]) == (None, 3, "boom")
    assert runner._combine([(None, None, None)]) == (None, None, None)
    assert cli.options_from_args(["--rounds", "3"]).rounds == 3
    with pytest.raises(ValueError, match="rounds must be >= 1"):
        Options(rounds=0)


def test_nnls_recovers_known_terms() -> None:
    """The calibration fit on synthetic points: exact terms back, never a negative one."""
    import numpy as np

    from torchdist_ext import _C
    from torchdist_ext.bench import calibrate

    truth = {"alpha": 7e-6, "beta": 3e-10, "gamma": 5e-10}
    points = []
    for coll, name in (("allreduce", "ring"), ("allreduce", "direct"), ("allgather", "ring"),
                       ("broadcast", "tree"), ("reduce_scatter", "ring")):
        for world in (2, 4):
            for size in (4096, 65536, 1 << 20, 16 << 20):
                c = _C._algorithm_cost(coll, name, float(size), world)
                p = {k: c[k] for k in ("steps", "bytes_moved", "bytes_reduced")}
                p["measured_s"] = calibrate.predict(truth, p)
                points.append(p)
    terms, kept = calibrate.fit_link(points)
    assert kept == []
    for k, v in truth.items():
        assert terms[k] == pytest.approx(v, rel=1e-6), k
    # no point reduces anything: gamma keeps the current value
    gathers = [p for p in points if p["bytes_reduced"] == 0]
    terms, kept = calibrate.fit_link(gathers, {"alpha": 1, "beta": 1, "gamma": 0.25})
    assert kept == ["gamma"] and terms["gamma"] == 0.25
    assert terms["alpha"] == pytest.approx(truth["alpha"], rel=1e-6)
    # data that wants a negative coefficient: the best non-negative fit, here x = (0, 1)
    a = np.array([[1.0, 1.0], [1.0, 2.0], [1.0, 3.0]])
    x, r = calibrate.nnls(a, a @ np.array([-1.0, 1.5]))
    assert np.all(x >= 0) and x[0] == 0
    assert x[1] == pytest.approx(np.dot(a[:, 1], a @ [-1.0, 1.5]) / np.dot(a[:, 1], a[:, 1]))
    x, r = calibrate.nnls(a, np.array([-1.0, -2.0, -3.0]))
    assert np.all(x == 0) and r == pytest.approx(14.0)


def test_calibration_fits_nothing_from_a_crowded_host(
        capfd: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch) -> None:
    """Rows whose ranks outnumbered their host's CPUs give no point (their times are the
    scheduler's as much as the links'), and the CLI refuses to spawn such a run."""
    from torchdist_ext.bench import calibrate

    row = {"op": "all_reduce", "algo": "ring", "pinned": True, "predicted_us": 1.0,
           "size": 1 << 20, "world": 4, "one_host": True, "ip_time_us": 5000.0}
    assert calibrate.points_from_rows([row])[0]["measured_s"] == pytest.approx(5e-3)
    assert calibrate.points_from_rows([dict(row, crowded=True)]) == []
    assert calibrate.points_from_rows([dict(row, algo="shm", crowded=True)]) == []
    from torchdist_ext import _C

    monkeypatch.delenv("RANK", raising=False)  # a run of its own, not under torchrun
    too_many = _C._usable_cpus() + 1
    with pytest.raises(SystemExit):
        calibrate.main(["--world", str(too_many), "--dry-run"])
    assert f"--world {too_many} spawns more ranks than" in capfd.readouterr().err


def test_calibrate_dry_run(tmp_path: Path, capfd: pytest.CaptureFixture[str]) -> None:
    """2 ranks, 2 sizes, 3 ops, 2 rounds (then the shm all_reduce at 256 KiB again with
    the ranks' own threads): the same-host links (local, shm, cma) fitted, non-negative,
    nothing saved; the result is what calibration.save accepts."""
    from torchdist_ext import calibration

    out, js = tmp_path / "cal.json", tmp_path / "fit.json"
    rc = bench.main(["calibrate", "--world", "2", "--sizes", "4K,256K", "--ops",
                     "all_reduce,all_gather,broadcast", "-n", "3", "-w", "1", "--rounds", "2",
                     "--dry-run",
                     "--out", str(out), "--json", str(js), "--no-progress"])
    text = capfd.readouterr().out
    assert rc == 0 and not out.exists()
    data = json.loads(js.read_text())
    # Spawned ranks share this host: their messages fit `local`; `net` is left alone.
    assert set(data["links"]) == {"local", "shm", "cma"} and data["world"] == 2
    assert data["rounds"] == 2 and "2 round(s)" in text
    assert any(n.startswith("net: no points") for n in data["notes"]), data["notes"]
    # The thread exponent: fitted where the ranks got several threads (auto: a host with
    # cores to spare), else left as it was, with a note saying why.
    if "thread_exponent" in data:
        assert 0 <= data["thread_exponent"] <= 1 and data["thread_points"], data
    else:
        assert any(n.startswith("threads: the ranks got") for n in data["notes"]), \
            data["notes"]
    for link, terms in data["links"].items():
        assert set(terms) == {"alpha", "beta", "gamma"}
        assert all(v >= 0 and v == v and v != float("inf") for v in terms.values()), link
    algos = {(p["link"], p["op"], p["algo"]) for p in data["points"]}
    assert ("local", "all_reduce", "ring") in algos and ("shm", "all_reduce", "shm_direct") in algos
    assert ("local", "broadcast", "tree") in algos and ("shm", "all_gather", "shm") in algos
    assert not any(link == "net" for link, _, _ in algos)
    assert all(p["measured_s"] > 0 and "rel_error" in p for p in data["points"])
    assert "dry run: nothing saved" in text and " local: alpha " in text and " shm: alpha " in text
    assert calibration.load(calibration.save(data, out))["links"] == data["links"]


def test_calibration_files_old_and_merged(tmp_path: Path) -> None:
    """A file from before the `local` link prices same-host messages with its `net` terms,
    as it did when saved; saving a one-host fit keeps the file's `net` (from a run across
    hosts) instead of dropping it."""
    from torchdist_ext import calibration

    net = {"alpha": 2e-5, "beta": 1e-10, "gamma": 2e-10}
    shm = {"alpha": 1e-6, "beta": 5e-11, "gamma": 1e-10}
    old = tmp_path / "old.json"
    old.write_text(json.dumps({"links": {"net": net, "shm": shm}}))
    data = calibration.load(old)
    assert data["links"]["local"] == net and data["links"]["net"] == net
    local = {"alpha": 9e-6, "beta": 3e-10, "gamma": 4e-10}
    calibration.save({"links": {"local": local, "shm": shm}}, old)
    saved = json.loads(old.read_text())
    assert saved["links"] == {"net": net, "local": local, "shm": shm}
    assert saved["kept_from_file"] == ["net"]
    # A fresh file has nothing to keep.
    fresh = tmp_path / "fresh.json"
    calibration.save({"links": {"local": local}}, fresh)
    assert json.loads(fresh.read_text())["links"] == {"local": local}
    # Nothing but the two files is left in the directory (no temporary files).
    assert sorted(p.name for p in tmp_path.iterdir()) == ["fresh.json", "old.json"]
    # What the backend gets from an old file: both message links at its net terms.
    before = torchdist_ext.cost_model()
    try:
        assert calibration.load_into_backend(tmp_path / "nothing.json") is False
        old.write_text(json.dumps({"links": {"net": net}}))
        assert calibration.load_into_backend(old) is True
        model = torchdist_ext.cost_model()
        assert model["local"] == pytest.approx(net) and model["net"] == pytest.approx(net)
    finally:
        torchdist_ext.set_cost_model(before)


@pytest.mark.parametrize("text", ["[]", "null", '"net"', '{"links": []}',
                                  '{"links": {"net": {"alpha": 1e-5, "beta": true, "gamma": 0}}}',
                                  '{"links": {"net": {"alpha": NaN, "beta": 1e-10, "gamma": 0}}}',
                                  '{"links": {"net": {"alpha": 1e-5, "beta": Infinity, "gamma": 0}}}',
                                  '{"links": {"net": {"alpha": -1, "beta": 1e-10, "gamma": 0}}}',
                                  '{"links": {"net": {"alpha": 1e400, "beta": 0, "gamma": 0}}}',
                                  '{"links": {"net": {"alpha": 1%s, "beta": 0, "gamma": 0}}}'
                                  % ("0" * 400),
                                  '{"links": {"wire": {"alpha": 1, "beta": 1, "gamma": 1}}}'])
def test_malformed_calibration_is_ignored_with_a_warning(tmp_path: Path, text: str) -> None:
    """A calibration file that is not an object of finite non-negative terms is ignored
    (with a warning naming it), never applied and never an error at import."""
    from torchdist_ext import calibration

    bad = tmp_path / "bad.json"
    bad.write_text(text)
    before = torchdist_ext.cost_model()
    with pytest.warns(UserWarning, match="malformed calibration"):
        assert calibration.load_into_backend(bad) is False
    assert torchdist_ext.cost_model() == before
    with pytest.raises(ValueError, match="finite number"):
        calibration.save(json.loads(text), tmp_path / "out.json")
    if text != "[]":
        return
    # The import itself survives such a file (one case: each import takes seconds).
    env = {**os.environ, "TDX_CALIBRATION": str(bad)}
    proc = subprocess.run([sys.executable, "-c", "import torchdist_ext"], env=env,
                          capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stderr
    assert "malformed calibration" in proc.stderr


def test_checker_sees_what_a_short_pattern_would_hide() -> None:
    """The inputs tell ranks apart beyond the pattern's modulus, sums over the ranks vary
    along the buffer, a never-written bool output is caught, integer AVG wraps as the
    dtype's SUM does, and bfloat16 sums over many ranks are not flagged."""
    from torchdist_ext.bench.core import poison, reduced_input

    assert not torch.equal(make_input(0, 64, torch.float32), make_input(13, 64, torch.float32))
    assert not torch.equal(make_input(0, 64, torch.bool), make_input(3, 64, torch.bool))
    # World 13: every rank's reduce_scatter chunk differs from every other's.
    world, chunk = 13, 40
    wants = [expected_output("reduce_scatter", r, world, world * chunk, torch.float32)
             for r in range(world)]
    for r in range(1, world):
        assert count_wrong(wants[r], wants[0], world) > 0, r
    # bool OR over several ranks, output never written: caught at most positions.
    for world in (3, 8):
        want = expected_output("all_reduce", 0, world, 256, torch.bool, "sum")
        assert count_wrong(poison(256, torch.bool, "sum"), want) > 128
        want = expected_output("all_reduce", 0, world, 256, torch.bool, "min")
        assert count_wrong(poison(256, torch.bool, "min"), want) > 128
    # int8 AVG at 20 ranks: the sum wraps in int8, then divides.
    got = reduced_input(20, 50, torch.int8, "avg")
    wide = sum(make_input(r, 50, torch.int8).to(torch.int64) for r in range(20))
    assert torch.equal(got, torch.div(wide.to(torch.int8).to(torch.int64), 20,
                                      rounding_mode="trunc").to(torch.int8))
    # bfloat16 SUM of inputs up to 13, accumulated rank by rank as a ring does, at 48
    # ranks: past 256 each addition may round, within the checker's allowance.
    acc = make_input(0, 512, torch.bfloat16)
    wide = acc.double()
    for r in range(1, 48):
        acc = acc + make_input(r, 512, torch.bfloat16)
        wide = wide + make_input(r, 512, torch.bfloat16).double()
    assert count_wrong(acc, wide.to(torch.bfloat16), 48, "sum") == 0


def _child_that_never_finishes(rank: int, world: int, store_path: str, opts: Options,
                               results: object) -> None:
    """Rank 0 reports at once; every other rank hangs (a teardown that never returns)."""
    import time

    if rank == 0:
        results.put((0, True, []))  # type: ignore[attr-defined]
    else:
        time.sleep(600)


def _lead_that_never_finishes(rank: int, world: int, store_path: str, opts: Options,
                              results: object) -> None:
    """Rank 1 reports at once; rank 0 hangs."""
    import time

    if rank == 1:
        results.put((1, True, None))  # type: ignore[attr-defined]
    else:
        time.sleep(600)


def test_spawner_stops_a_rank_that_never_finishes(monkeypatch: pytest.MonkeyPatch) -> None:
    """A rank stuck outside any op (which the group timeout bounds) fails the run once
    the group timeout and the slack have passed since another rank finished."""
    import time

    from torchdist_ext.bench import runner

    monkeypatch.setattr(runner, "_TEARDOWN_SLACK_S", 1.0)
    monkeypatch.setattr(runner, "_LEAD_SLACK_S", 2.0)
    start = time.monotonic()
    with pytest.raises(RuntimeError, match=r"rank\(s\) \[1\] did not finish within 3 s "
                                           r"of rank\(s\) \[0\]"):
        runner._spawn(Options(world=2, timeout=2.0), child=_child_that_never_finishes)
    assert time.monotonic() - start < 30
    # Rank 0 left behind gets the lead's slack on top (it writes the report last).
    start = time.monotonic()
    with pytest.raises(RuntimeError, match=r"rank\(s\) \[0\] did not finish within 5 s "
                                           r"of rank\(s\) \[1\]"):
        runner._spawn(Options(world=2, timeout=2.0), child=_lead_that_never_finishes)
    assert time.monotonic() - start < 30


# ---------------------------------------------------------------------------------------
# Arguments refused before any rank starts (no spawn: each test stops the CLI before it
# would measure, or runs on a one-rank group in this process)
# ---------------------------------------------------------------------------------------

def _refused(argv: list[str], capsys: pytest.CaptureFixture[str]) -> str:
    """The one-line usage error ``bench.main(argv)`` exits with (status 2)."""
    with pytest.raises(SystemExit) as info:
        bench.main(argv)
    assert info.value.code == 2, argv
    err = capsys.readouterr().err.strip().splitlines()[-1]
    assert "Traceback" not in err, err
    return err


@pytest.fixture
def no_measuring(monkeypatch: pytest.MonkeyPatch) -> None:
    """Any attempt to measure fails the test: the refusals must come first."""
    from torchdist_ext.bench import calibrate, cli, runner, tune

    def measured(*args: object, **kwargs: object) -> None:
        raise AssertionError("measuring started before the arguments were refused")

    for module, name in ((cli, "run"), (runner, "_spawn"), (calibrate, "calibrate"),
                         (tune, "tune")):
        monkeypatch.setattr(module, name, measured)


@pytest.mark.parametrize("argv, message", [
    (["--backends", "tdx,bogus"], "unknown backend(s) bogus in backends (--backends); use "
                                  "tdx, gloo, nccl"),
    (["--op", "broadcast", "-r", "2", "--world", "2"],
     "root 2 (-r) is not a rank of a world of 2, and broadcast take(s) a root"),
    (["--op", "all", "-r", "-1"], "root must be a rank"),
    (["--timeout", "0"], "timeout (--timeout) must be a number of seconds > 0"),
    (["--timeout", "-5"], "timeout (--timeout) must be a number of seconds > 0"),
    (["--timeout", "nan"], "timeout (--timeout) must be a number of seconds > 0"),
    (["-o", "band"], "band needs an integer or bool dtype, not float32"),
    (["-o", "bxor", "-d", "float64"], "bxor needs an integer or bool dtype, not float64"),
    (["-o", "bor", "-d", "complex64"], "bor needs an integer or bool dtype, not complex64"),
    (["-o", "premul_sum", "--premul-factor", "nan"], "must be a finite number, got nan"),
    (["-o", "premul_sum", "--premul-factor", "inf"], "must be a finite number, got inf"),
    (["--warmup-ms", "-1"], "warmup_ms (--warmup-ms) must be a finite number >= 0, got -1"),
    (["--warmup-ms", "nan"], "warmup_ms (--warmup-ms) must be a finite number >= 0, got nan"),
    (["--op", "sendrecv", "--world", "1"], "--op sendrecv needs at least 2 ranks"),
    (["--json", "/nonexistent-dir/rows.json"],
     "--json /nonexistent-dir/rows.json: directory /nonexistent-dir does not exist"),
    (["--plot", "/nonexistent-dir/busbw.png"], "directory /nonexistent-dir does not exist"),
    (["calibrate", "--ops", "sendrecv"], "--ops sendrecv: point-to-point has no algorithms"),
    (["calibrate", "--ops", "bogus"], "unknown op 'bogus' in --ops; use all or any of "
                                      "all_reduce, all_gather, broadcast, reduce_scatter, "
                                      "all_to_all, reduce"),
    (["calibrate", "--world", "1"], "--world 1: one rank sends no messages"),
    (["calibrate", "--timeout", "0"], "timeout (--timeout) must be a number of seconds > 0"),
    (["calibrate", "--json", "/nonexistent-dir/fit.json"], "directory /nonexistent-dir does"),
    (["calibrate", "--out", "/dev/null/cal.json"], "--out /dev/null/cal.json: /dev/null is "
                                                   "not a directory"),
    (["tune", "--ops", "sendrecv"], "--ops sendrecv: point-to-point has no algorithms to pin, "
                                    "so there is nothing to tune"),
    (["tune", "--ops", "bogus"], "use all or any of all_reduce, all_gather, broadcast, "
                                 "reduce_scatter, reduce"),
    (["tune", "--out", "/dev/null/cal.json"], "/dev/null is not a directory"),
    (["tune", "--json", "/nonexistent-dir/t.json", "--dry-run"], "does not exist"),
    (["sparse", "--backends", "tdx,nccl"], "backends (--backends) take tdx and/or gloo, not "
                                           "'tdx,nccl'"),
    (["sparse", "--backends", "tdx,tdx"], "a backend is named twice"),
    (["sparse", "--dim", "0"], "needs at least one row and one column, not 262144 x 0"),
    (["sparse", "--lookups", "16,0"], "lookups (--lookups) must be counts of at least 1, "
                                      "not 16,0"),
    (["sparse", "--lookups", "many"], "not a size: 'many'"),
    (["sparse", "-d", "int64"], "dtype (-d) must be one of float32, float64, float16, "
                                "bfloat16 (an embedding's gradient), not int64"),
    (["sparse", "-d", "bogus"], "not a torch dtype: 'bogus'"),
    (["sparse", "-n", "0"], "iters (-n) must be at least 1"),
    (["sparse", "--timeout", "nan"], "timeout (--timeout) must be a number of seconds > 0"),
    (["sparse", "--json", "/nonexistent-dir/s.json"], "directory /nonexistent-dir does not "
                                                      "exist"),
    (["compressed", "--backends", "nccl"], "backends (--backends) take tdx and/or gloo"),
    (["compressed", "--methods", "int8,fp8"], "methods (--methods) take int8, sign and/or "
                                              "topk, each once, not 'int8,fp8'"),
    (["compressed", "--sizes", "6"], "sizes (--sizes) must be byte counts of float32"),
    (["compressed", "--sizes", "lots"], "not a size: 'lots'"),
    (["compressed", "--block", "0"], "block must be an int from 1 to 2**24"),
    (["compressed", "--ratio", "2"], "ratio must be a number in (0, 1]"),
    (["compressed", "--world", "0"], "world (--world) must be at least 1"),
    (["compressed", "-n", "0"], "iters (-n) must be at least 1"),
    (["compressed", "--json", "/nonexistent-dir/c.json"], "directory /nonexistent-dir"),
    (["zero", "--backends", "nccl"], "backends (--backends) take tdx and/or gloo"),
    (["zero", "--strategies", "ddp,zero4"], "strategies (--strategies) take ddp, zero1, "
                                            "zero2 and/or zero3, each once, not 'ddp,zero4'"),
    (["zero", "--params", "2", "--layers", "4"], "params (--params) must be parameter counts "
                                                 "of at least one per layer (4), not 2"),
    (["zero", "--params", "lots"], "not a size: 'lots'"),
    (["zero", "--batch", "0"], "layers (--layers) and batch (--batch) must be at least 1"),
    (["zero", "--bucket-bytes", "0"], "bucket_bytes must be a positive int"),
    (["zero", "--compression", "fp8"], "compression (--compression) takes none, int8, sign "
                                       "or topk, not 'fp8'"),
    (["zero", "--param-dtype", "int8"], "param_dtype (--param-dtype) takes float32, "
                                        "bfloat16 or float16, not 'int8'"),
    (["zero", "--world", "0"], "world (--world) must be at least 1"),
    (["zero", "-n", "0"], "iters (-n) must be at least 1"),
    (["zero", "--json", "/nonexistent-dir/z.json"], "directory /nonexistent-dir"),
    (["ps", "--strategies", "ddp,hogwild"], "strategies (--strategies) take ddp, sync "
                                            "and/or async, each once, not 'ddp,hogwild'"),
    (["ps", "--servers", "0"], "servers (--servers) must be at least 1"),
    (["ps", "--servers", "3", "--world", "3"], "3 server(s) (--servers) leave no worker "
                                               "among 3 rank(s)"),
    (["ps", "--params", "2", "--layers", "4"], "params (--params) must be parameter counts "
                                               "of at least one per layer (4), not 2"),
    (["ps", "--backends", "nccl"], "backends (--backends) take tdx and/or gloo"),
    (["ps", "-n", "0"], "iters (-n) must be at least 1"),
])
def test_bad_arguments_are_refused_before_measuring(
        argv: list[str], message: str, capsys: pytest.CaptureFixture[str],
        no_measuring: None, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("RANK", raising=False)  # a run of its own, not under torchrun
    assert message in _refused(argv, capsys)


def test_out_that_is_a_directory_is_refused(tmp_path: Path, capsys: pytest.CaptureFixture[str],
                                            no_measuring: None) -> None:
    """A directory is no file to write (--json, --plot) or read (tune --out, even in a dry
    run, prices its picks with it)."""
    for argv in (["--json", str(tmp_path)], ["--plot", str(tmp_path)],
                 ["calibrate", "--out", str(tmp_path)],
                 ["tune", "--out", str(tmp_path), "--dry-run"]):
        assert f"{tmp_path}: is a directory" in _refused(argv, capsys), argv


def test_a_path_the_system_refuses_to_look_at_is_refused_not_raised(
        tmp_path: Path, capsys: pytest.CaptureFixture[str], no_measuring: None) -> None:
    """A name too long for the file system makes ``stat`` fail with ENAMETOOLONG, which
    ``Path.exists`` passes on: it must come back as a usage error like any other bad
    path, or under torchrun the lead rank would raise before the ranks agree."""
    long = str(tmp_path / ("x" * 300))
    for argv in (["--json", long], ["--plot", long + ".png"],
                 ["calibrate", "--out", long], ["calibrate", "--json", long],
                 ["tune", "--out", long, "--dry-run"]):
        err = _refused(argv, capsys)
        assert "File name too long" in err and long in err, (argv, err)


def test_plot_format_and_matplotlib_are_checked_up_front(
        tmp_path: Path, capsys: pytest.CaptureFixture[str], no_measuring: None,
        monkeypatch: pytest.MonkeyPatch) -> None:
    """--plot needs matplotlib (an optional extra) and a format it writes; both are known
    before measuring. The path's own errors come first, matplotlib or not."""
    from torchdist_ext.bench import report

    monkeypatch.delenv("RANK", raising=False)
    if report.matplotlib_missing() is None:
        assert "cannot write .xyz files" in _refused(["--plot", str(tmp_path / "p.xyz")],
                                                     capsys)
    real_find_spec = importlib.util.find_spec
    monkeypatch.setattr(importlib.util, "find_spec",
                        lambda name, *a: None if name == "matplotlib" else
                        real_find_spec(name, *a))
    assert ("--plot needs matplotlib, which is not installed; install it (pip install "
            "matplotlib) or drop --plot") in _refused(["--plot", str(tmp_path / "p.png")], capsys)
    assert f"{tmp_path}: is a directory" in _refused(["--plot", str(tmp_path)], capsys)
    assert "directory /nonexistent-dir does not exist" in _refused(
        ["--plot", "/nonexistent-dir/busbw.png"], capsys)


def test_cuda_without_a_gpu_is_refused(capsys: pytest.CaptureFixture[str], no_measuring: None,
                                       monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    assert "--device cuda: no CUDA device is visible" in _refused(["--device", "cuda"], capsys)
    assert "--device cuda: no CUDA device is visible" in _refused(
        ["sparse", "--device", "cuda"], capsys)
    assert "--device cuda: no CUDA device is visible" in _refused(
        ["compressed", "--device", "cuda"], capsys)
    assert "--device cuda: no CUDA device is visible" in _refused(
        ["zero", "--device", "cuda"], capsys)
    assert "--device cuda: no CUDA device is visible" in _refused(
        ["ps", "--device", "cuda"], capsys)
    with pytest.raises(ValueError, match="no CUDA device is visible"):
        bench.run(Options(device="cuda", world=2))  # the Python entry point, before spawning


def test_arguments_that_are_fine_pass(no_measuring: None) -> None:
    """What the checks must not refuse: a root beyond the world for ops without one, and
    the bitwise reductions on integer and bool dtypes."""
    assert bench.options_from_args(["--op", "all_reduce,all_gather", "-r", "5"]).root == 5
    assert bench.options_from_args(["-o", "band", "-d", "int32"]).redop == "band"
    assert bench.options_from_args(["-o", "bxor", "-d", "bool"]).dtype == "bool"
    assert Options(backends="tdx,nccl", device="cuda").backends == ("tdx", "nccl")
    # nccl on CPU is no error: the run leaves it out with a note (see below)
    assert bench.options_from_args(["--backends", "tdx,gloo,nccl"]).backends == (
        "tdx", "gloo", "nccl")


@pytest.mark.parametrize("command, wanted", [
    ("calibrate", ("all_reduce", "all_gather", "broadcast", "reduce_scatter", "all_to_all",
                   "reduce")),
    ("tune", ("all_reduce", "all_gather", "broadcast", "reduce_scatter", "reduce")),
])
def test_ops_all_means_every_op_that_can_be_measured(
        command: str, wanted: tuple[str, ...], monkeypatch: pytest.MonkeyPatch,
        tmp_path: Path) -> None:
    """``--ops all`` is what the error message offers; it stands for every op with
    algorithms to pin (and, for tune, a size its rules can go by)."""
    from torchdist_ext.bench import calibrate, tune

    seen: dict[str, object] = {}

    class Stop(Exception):
        pass

    def fake(**kwargs: object) -> None:
        seen.update(kwargs)
        raise Stop

    module = calibrate if command == "calibrate" else tune
    real = getattr(module, command)
    monkeypatch.setattr(module, command, fake)
    monkeypatch.setattr(module, "run", lambda opts: pytest.fail("measured"))
    monkeypatch.setenv("TDX_CALIBRATION", str(tmp_path / "cal.json"))  # tune --out sets it
    with pytest.raises(Stop):
        bench.main([command, "--ops", "all", "--world", "2", "--dry-run",
                    "--out", str(tmp_path / "cal.json")])
    assert tuple(seen["ops"]) == wanted  # type: ignore[arg-type]
    # The Python entry point refuses point-to-point before measuring, too.
    with pytest.raises(ValueError, match="--ops sendrecv: point-to-point"):
        real(ops=["sendrecv"])


def test_calibrate_refuses_one_rank_from_python(monkeypatch: pytest.MonkeyPatch) -> None:
    from torchdist_ext.bench import calibrate

    monkeypatch.setattr(calibrate, "run", lambda opts: pytest.fail("measured"))
    monkeypatch.delenv("RANK", raising=False)
    with pytest.raises(ValueError, match="^world=1: one rank sends no messages"):
        calibrate.calibrate(world=1)
    # The one rank may come from torchrun's environment: the message says so.
    monkeypatch.setenv("RANK", "0")
    monkeypatch.setenv("WORLD_SIZE", "1")
    with pytest.raises(ValueError, match="^WORLD_SIZE=1: one rank sends no messages"):
        calibrate.calibrate(world=4)


def test_calibrate_saves_the_fit_before_the_json(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
        capsys: pytest.CaptureFixture[str]) -> None:
    """--json that turns out unwritable after the measurements (its directory removed
    meanwhile) costs the --json, never the fit: --out is saved first."""
    import shutil

    from torchdist_ext import calibration
    from torchdist_ext.bench import calibrate

    out, gone = tmp_path / "cal.json", tmp_path / "gone"
    gone.mkdir()
    local = {"alpha": 1e-6, "beta": 1e-10, "gamma": 1e-10}

    def fake(**kwargs: object) -> dict:
        shutil.rmtree(gone)  # the --json directory vanishes while "measuring"
        return {"links": {"local": local}, "points": []}

    monkeypatch.setattr(calibrate, "calibrate", fake)
    monkeypatch.setattr(calibrate, "report_lines", lambda data: ["# report"])
    monkeypatch.delenv("RANK", raising=False)
    rc = bench.main(["calibrate", "--out", str(out), "--json", str(gone / "fit.json")])
    captured = capsys.readouterr()
    assert rc == 1
    assert calibration.load(out)["links"]["local"] == local
    assert f"# saved to {out}" in captured.out
    assert f"--json {gone / 'fit.json'}: could not write it" in captured.err
    assert "Traceback" not in captured.err


def test_no_rows_says_why(tmp_path: Path, capfd: pytest.CaptureFixture[str],
                          monkeypatch: pytest.MonkeyPatch) -> None:
    """Rows missing because no backend could run are not blamed on the sweep (-b/-e);
    with -q the reasons still show. One rank in this process, no spawn."""
    import torch.distributed as dist

    from torchdist_ext.bench import runner

    monkeypatch.setattr(runner, "_skip_reason",
                        lambda backend, device, local_world: f"{backend} skipped: test")
    dist.init_process_group("gloo", store=dist.FileStore(str(tmp_path / "store"), 1),
                            rank=0, world_size=1)
    try:
        rc = bench.main(["--op", "all_reduce", "--backends", "gloo", "-b", "1K", "-e", "1K",
                         "-q", "--no-progress"])
        err = capfd.readouterr().err
        assert rc == 1
        assert "no backend under test could run" in err and "widen -b/-e" not in err, err
        assert "gloo skipped: test" in err, err
        monkeypatch.undo()
        # A sweep with no whole element per rank is still told to widen -b/-e.
        rc = bench.main(["--op", "all_reduce", "--backends", "gloo", "-b", "2", "-e", "2",
                         "-q", "--no-progress"])
        assert rc == 1 and "widen -b/-e" in capfd.readouterr().err
    finally:
        dist.destroy_process_group()


def test_sendrecv_at_one_rank_is_skipped_not_failed(
        tmp_path: Path, capfd: pytest.CaptureFixture[str]) -> None:
    """``--op all`` at one rank: sendrecv (no peer) is left out with a note and the run
    passes. One rank in this process, no spawn."""
    import torch.distributed as dist

    dist.init_process_group("gloo", store=dist.FileStore(str(tmp_path / "store"), 1),
                            rank=0, world_size=1)
    try:
        rc = bench.main(["--op", "all", "--backends", "gloo", "-b", "1K", "-e", "1K",
                         "-n", "1", "-w", "0", "--no-progress"])
    finally:
        dist.destroy_process_group()
    out = capfd.readouterr().out
    assert rc == 0, out
    assert "sendrecv skipped: it needs at least 2 ranks, and this run has 1" in out
    assert "Failed ops" not in out


@pytest.fixture
def backend_model():
    """The backend's cost model and rules, restored after the test."""
    from torchdist_ext import _C

    model, rules = torchdist_ext.cost_model(), _C._cost_rules()
    exponent = torchdist_ext.thread_exponent()
    try:
        yield
    finally:
        _C._set_cost_rules(rules)
        torchdist_ext.set_cost_model(model)
        torchdist_ext.set_thread_exponent(exponent)


@pytest.mark.parametrize("content", [None, {"rules": [{
    "collective": "broadcast", "world": 2, "placement": "windows", "crowded": False,
    "min_bytes": 0, "max_bytes": 1e9, "algorithm": "tree"}]}])
def test_tune_out_prices_with_what_the_ranks_load(
        content: dict | None, tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
        backend_model: None) -> None:
    """tune --out FILE, FILE missing or without links: the ranks it spawns load FILE over
    the defaults, so the parent must price the model's picks with the defaults too, not
    with the host's calibration it loaded at import."""
    from torchdist_ext import _C, calibration
    from torchdist_ext.bench import tune

    host = {link: {"alpha": 1.0, "beta": 1.0, "gamma": 1.0} for link in calibration.LINKS}
    torchdist_ext.set_cost_model(host)  # as if the host's file had said so
    torchdist_ext.set_thread_exponent(0.9)
    out = tmp_path / "tuned.json"
    if content is not None:
        out.write_text(json.dumps(content))
    seen: dict[str, object] = {}

    class Stop(Exception):
        pass

    def fake(**kwargs: object) -> None:
        seen["model"], seen["rules"] = torchdist_ext.cost_model(), _C._cost_rules()
        seen["exponent"] = torchdist_ext.thread_exponent()
        raise Stop

    monkeypatch.setattr(tune, "tune", fake)
    monkeypatch.setenv("TDX_CALIBRATION", str(tmp_path / "host.json"))  # main changes it
    with pytest.raises(Stop):
        tune.main(["--out", str(out), "--ops", "broadcast", "--dry-run"])
    assert seen["model"] == calibration.DEFAULT_LINKS
    assert seen["exponent"] == calibration.DEFAULT_THREAD_EXPONENT
    # (the file's rule, written without a thread count, loads as 1 thread)
    assert seen["rules"] == [{**r, "threads": 1} for r in (content or {}).get("rules", [])]
    assert os.environ["TDX_CALIBRATION"] == str(out)  # what the ranks will load


def test_nccl_without_cuda_is_a_note_not_an_error(
        tmp_path: Path, capfd: pytest.CaptureFixture[str]) -> None:
    """``--backends gloo,nccl`` on CPU runs gloo and leaves nccl out with a note (the
    run's own skip, not a refusal of the arguments). One rank in this process."""
    import torch.distributed as dist

    dist.init_process_group("gloo", store=dist.FileStore(str(tmp_path / "store"), 1),
                            rank=0, world_size=1)
    try:
        rc = bench.main(["--op", "all_reduce", "--backends", "gloo,nccl", "-b", "1K",
                         "-e", "1K", "-n", "1", "-w", "0", "--no-progress"])
    finally:
        dist.destroy_process_group()
    out = capfd.readouterr().out
    why = "it needs --device cuda" if dist.is_nccl_available() else "this torch has no NCCL"
    assert rc == 0, out
    assert f"nccl skipped: {why}" in out, out


def test_output_paths_that_exist_and_are_writable_pass(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch, no_measuring: None) -> None:
    """--json and --plot open their file: one that exists and is writable will do, in a
    directory this process may not write (/dev/stdout, /dev/null). calibrate and tune
    save --out through a temporary file renamed over it: there only the directory counts."""
    from torchdist_ext.bench import report

    locked = tmp_path / "locked"
    locked.mkdir()
    existing = locked / "rows.json"
    existing.write_text("")
    real_access = os.access
    # As if `locked` were read-only (root may write anywhere, so pretend).
    monkeypatch.setattr(os, "access", lambda p, mode: Path(p) != locked and real_access(p, mode))
    assert report.unwritable(existing, "--json") is None
    assert "directory" in report.unwritable(locked / "new.json", "--json")
    assert f"directory {locked} is not writable" in report.unwritable(existing, "--out",
                                                                     replaced=True)
    monkeypatch.undo()
    monkeypatch.delenv("RANK", raising=False)
    assert bench.options_from_args(["--json", "/dev/null"]).json_path == "/dev/null"
    assert report.unwritable("/dev/stdout", "--json") is None


def test_bad_json_in_an_initialised_group_is_a_usage_error(
        tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    """In a group already initialised, rank 0 judges the --json path after the group
    agrees (every rank learns its answer); the CLI exits with it as a usage error."""
    import torch.distributed as dist

    from torchdist_ext.bench import runner

    dist.init_process_group("gloo", store=dist.FileStore(str(tmp_path / "store"), 1),
                            rank=0, world_size=1)
    try:
        assert runner.launched()
        err = _refused(["--json", "/nonexistent-dir/rows.json", "-b", "1K", "-e", "1K"],
                       capsys)
    finally:
        dist.destroy_process_group()
    assert "rank 0: --json /nonexistent-dir/rows.json: directory /nonexistent-dir" in err


def _free_port() -> int:
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.mark.parametrize("argv, message", [
    (["--json", "/nonexistent-dir/rows.json", "-b", "1K", "-e", "1K"],
     "--json /nonexistent-dir/rows.json: directory /nonexistent-dir does not exist"),
    (["calibrate", "--dry-run", "--json", "/nonexistent-dir/fit.json"],
     "--json /nonexistent-dir/fit.json: directory /nonexistent-dir does not exist"),
    (["tune", "--out", "/dev/null/cal.json"], "--out /dev/null/cal.json: /dev/null is not a "
                                              "directory"),
], ids=["bench", "calibrate", "tune"])
def test_bad_output_under_torchrun_stops_every_rank(argv: list[str], message: str,
                                                    tmp_path: Path) -> None:
    """Two ranks launched as torchrun launches them (RANK, WORLD_SIZE, MASTER_ADDR/PORT):
    only rank 0 writes the outputs, so only it can judge the path; both ranks must still
    exit at once with its usage error, not rank 0 alone while rank 1 waits for it until
    the group timeout."""
    import time

    timeout = 60
    port = _free_port()
    procs = []
    start = time.monotonic()
    for rank in range(2):
        env = {**os.environ, "RANK": str(rank), "WORLD_SIZE": "2", "LOCAL_RANK": str(rank),
               "LOCAL_WORLD_SIZE": "2", "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(port),
               "TDX_CALIBRATION": str(tmp_path / "cal.json")}
        procs.append(subprocess.Popen(
            [sys.executable, "-m", "torchdist_ext.bench", *argv, "--timeout", str(timeout),
             "--no-progress"],
            env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True))
    results = []
    try:
        for p in procs:
            out, err = p.communicate(timeout=4 * timeout)
            results.append((p.returncode, err, time.monotonic() - start))
    finally:
        for p in procs:
            if p.poll() is None:
                p.kill()
                p.wait()
    for rank, (rc, err, elapsed) in enumerate(results):
        assert rc == 2, (rank, err)
        last = err.strip().splitlines()[-1]
        assert f"error: rank 0: {message}" in last, (rank, err)
        assert "Traceback" not in err, (rank, err)
        assert elapsed < timeout, (rank, elapsed)  # nobody waited out the group timeout
    assert not (tmp_path / "cal.json").exists()

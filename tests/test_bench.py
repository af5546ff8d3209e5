"""torchdist_ext.bench: a real (tiny) run of every op on tdx and gloo, and the checker."""

from __future__ import annotations

import dataclasses
import json
from pathlib import Path

import pytest
import torch

from torchdist_ext import bench
from torchdist_ext.bench import Options, count_wrong, expected_output, make_input


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
        factor = {"all_reduce": 1.0, "broadcast": 1.0, "reduce": 1.0}.get(r["op"], 0.5)
        assert r["oop_busbw_gb_s"] == pytest.approx(r["oop_algbw_gb_s"] * factor)
        assert r["oop_algbw_gb_s"] == pytest.approx(r["size"] / r["oop_time_us"] / 1e3)
    assert "tdx vs gloo" in out and "# Wrong elements : 0 OK" in out


def test_bench_detects_wrong_results(tmp_path: Path) -> None:
    """The test hook spoils one element per checked output; the rows must count it.

    Runs in this process on a one-rank default group (no spawn, so it costs ~1 s):
    ``run`` uses an already initialised group as it is.
    """
    import torch.distributed as dist

    dist.init_process_group("gloo", store=dist.FileStore(str(tmp_path / "store"), 1),
                            rank=0, world_size=1)
    try:
        rows = bench.run(Options(ops="all_reduce,reduce,all_to_all", backends="tdx,gloo",
                                 minbytes=1024, maxbytes=2048, iters=1, warmup=0, quiet=True,
                                 progress=False, _corrupt=True))
    finally:
        dist.destroy_process_group()
    assert len(rows) == 3 * 2 * 2
    for r in rows:
        assert r["oop_error"] is None and r["oop_wrong"] == 1, r
        if r["op"] != "all_to_all":
            assert r["ip_wrong"] == 1, r


def _simulate(op: str, world: int, count: int, dtype: torch.dtype, redop: str,
              root: int) -> list[torch.Tensor | None]:
    """Each rank's output computed directly from the inputs, independent of the checker."""
    chunk = count // world
    if op == "all_gather":
        parts = [make_input(r, chunk, dtype, redop) for r in range(world)]
        return [torch.cat(parts)] * world
    ins = [make_input(r, count, dtype, redop) for r in range(world)]
    if op == "broadcast":
        return [ins[root]] * world
    if op == "all_to_all":
        return [torch.cat([ins[r][j * chunk:(j + 1) * chunk] for r in range(world)])
                for j in range(world)]
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
        assert count_wrong(got[rank], want) == 0
        bad = got[rank].clone()
        bad[5] += 1
        bad[17] = -bad[17] - 1
        assert count_wrong(bad, want) == 2
        assert count_wrong(torch.roll(got[rank], 1), want) > 0  # misplaced data
        assert count_wrong(got[rank][:-1], want) == count_wrong(torch.empty(0), want) > 0


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

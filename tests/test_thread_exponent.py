"""The cost model's thread exponent: a window all_reduce pass split over T threads is
priced T**exponent times faster. ``bench calibrate`` fits it where the ranks get several
threads, the calibration file keeps it, and a group prices with its rank 0's."""

from __future__ import annotations

import json
import math
import os
import statistics
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest
import torch.distributed as dist

import torchdist_ext
from torchdist_ext import _C, calibration
from torchdist_ext.bench import calibrate
from torchdist_ext.testing import run_ranks

REPO = Path(__file__).resolve().parents[1]
MiB = 1 << 20


@pytest.fixture
def exponent():
    """The backend's exponent, restored after the test."""
    before = _C._thread_exponent()
    try:
        yield before
    finally:
        _C._set_thread_exponent(before)


def test_the_exponent_prices_the_threads_a_pass_splits_over(exponent: float) -> None:
    """The byte terms of the shm all_reduce are divided by ways**exponent, ways being the
    threads a pass of that size splits over; steps are not, and other algorithms not."""
    assert calibration.DEFAULT_THREAD_EXPONENT == exponent == 0.5
    shm = torchdist_ext.cost_model()["shm"]
    for p in (0.0, 0.5, 0.8, 1.0):
        _C._set_thread_exponent(p)
        for size, threads in ((16 * MiB, 8), (16 * MiB, 1), (128 << 10, 8)):
            c = _C._algorithm_cost("allreduce", "shm", float(size), 2, True, False, threads)
            want = shm["alpha"] * c["steps"] + (
                shm["beta"] * c["bytes_moved"] + shm["gamma"] * c["bytes_reduced"]
            ) / c["ways"] ** p
            assert c["seconds"] == pytest.approx(want, rel=1e-12), (p, size, threads)
        # 128 KiB at 2 ranks: a 64 KiB pass, too small to split
        assert _C._algorithm_cost("allreduce", "shm", float(128 << 10), 2, True, False,
                                  8)["ways"] == 1
        direct = _C._algorithm_cost("allreduce", "shm_direct", float(16 * MiB), 2, True,
                                    False, 8)
        assert direct["ways"] == 1
    for bad in (-0.1, 1.5, math.nan, math.inf):
        with pytest.raises(ValueError, match="the thread exponent must be a number from 0 to 1"):
            _C._set_thread_exponent(bad)
    assert _C._thread_exponent() == 1.0
    # The public pair, with numpy scalars and ints, and refusals naming the value.
    import numpy as np

    for good in (0, 1, np.float32(0.25), 0.75):
        torchdist_ext.set_thread_exponent(good)
        assert torchdist_ext.thread_exponent() == float(good)
    for bad, kind in ((True, TypeError), ("0.5", TypeError), (None, TypeError),
                      (-1, ValueError), (1.01, ValueError), (math.nan, ValueError)):
        with pytest.raises(kind, match="set_thread_exponent: the exponent must be"):
            torchdist_ext.set_thread_exponent(bad)
    assert torchdist_ext.thread_exponent() == 0.75


def _one_thread_point(size: int, world: int, seconds: float) -> dict[str, Any]:
    return {"op": "all_reduce", "algo": "shm", "size": size, "world": world, "link": "shm",
            "measured_s": seconds}


def _threaded_row(size: int, world: int, seconds: float, threads: int,
                  **kw: Any) -> dict[str, Any]:
    return {"op": "all_reduce", "algo": "shm", "size": size, "world": world,
            "ip_time_us": seconds * 1e6, "ip_error": None, "pass_threads": threads,
            "crowded": False, **kw}


def test_fit_recovers_a_known_exponent() -> None:
    """Times made from a known exponent give it back; the steps' share is taken off first;
    sizes whose pass does not split, failed or crowded rows, and sizes without a
    one-thread point give nothing."""
    shm = {"alpha": 5e-6, "beta": 2e-10, "gamma": 1e-10}
    one, rows, faster = [], [], []
    for size in (256 << 10, 4 * MiB, 64 * MiB):
        c = _C._algorithm_cost("allreduce", "shm", float(size), 2, True, False, 8)
        steps = shm["alpha"] * c["steps"]
        byte_part = shm["beta"] * c["bytes_moved"] + shm["gamma"] * c["bytes_reduced"]
        one.append(_one_thread_point(size, 2, steps + byte_part))
        rows.append(_threaded_row(size, 2, steps + byte_part / c["ways"] ** 0.7, 8))
        faster.append(_threaded_row(size, 2, steps + byte_part / c["ways"] ** 1.5, 8))
    noise = [_threaded_row(64 << 10, 2, 1e-3, 8),  # one pass part: no split
             _threaded_row(4 * MiB, 2, 1e-9, 8, ip_error="boom"),
             _threaded_row(4 * MiB, 2, 1e-9, 8, crowded=True),
             _threaded_row(32 * MiB, 2, 1e-9, 8)]  # no one-thread point
    p, points = calibrate.fit_thread_exponent(one, rows + noise, shm)
    assert p == pytest.approx(0.7, abs=1e-9)
    assert [q["size"] for q in points] == [256 << 10, 4 * MiB, 64 * MiB]
    assert all(q["threads"] == 8 and q["ways"] > 1 for q in points)
    # Threads that slow the pass down (no cores to spare) give 0, not a negative power.
    slower = [dict(r, ip_time_us=r["ip_time_us"] * 10) for r in rows]
    assert calibrate.fit_thread_exponent(one, slower, shm)[0] == 0.0
    # Faster than the threads can explain (noise) stops at 1.
    assert calibrate.fit_thread_exponent(one, faster, shm)[0] == 1.0
    # One thread per rank: nothing to fit.
    assert calibrate.fit_thread_exponent(one, [dict(r, pass_threads=1) for r in rows],
                                         shm) == (None, [])


def test_the_file_keeps_the_exponent(tmp_path: Path) -> None:
    """Saved beside the links, kept by a later save without one, loaded at import; a bad
    value in the file is warned about and ignored, one given to save is refused."""
    path = tmp_path / "cal.json"
    calibration.save({"thread_exponent": 0.8}, path)  # alone, as a fit of it alone
    links = {"shm": {"alpha": 1e-6, "beta": 1e-10, "gamma": 1e-10}}
    calibration.save({"links": links}, path)
    data = calibration.load(path)
    assert data["thread_exponent"] == 0.8 and data["links"]["shm"] == links["shm"]
    code = "from torchdist_ext import _C; print(_C._thread_exponent())"
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                          timeout=120, env={**os.environ, "TDX_CALIBRATION": str(path)})
    assert proc.returncode == 0 and float(proc.stdout.strip()) == 0.8, proc.stderr
    for bad in (1.5, -1, "0.5", True, None):
        path.write_text(json.dumps({"links": links, "thread_exponent": bad}))
        with pytest.warns(UserWarning, match="ignoring thread_exponent"):
            data = calibration.load(path)
        assert "thread_exponent" not in data and data["links"]["shm"] == links["shm"]
        with pytest.raises(ValueError, match="thread_exponent must be a number from 0 to 1"):
            calibration.save({"links": links, "thread_exponent": bad}, tmp_path / "x.json")
    path.write_text(json.dumps({"thread_exponent": 2}))  # nothing valid left
    with pytest.warns(UserWarning, match="ignoring thread_exponent"):
        with pytest.warns(UserWarning, match="ignoring malformed calibration"):
            assert calibration.load(path) is None


def _priced_by_rank0(rank: int, n: int) -> dict:
    """Rank 0 prices threads at exponent 1, rank 1 keeps the default: the group, created
    afterwards, prices with rank 0's on both."""
    if rank == 0:
        _C._set_thread_exponent(1.0)
    group = dist.new_group(list(range(n)))
    threads = torchdist_ext.placement(group)["pass_threads"]
    return {"threads": threads,
            "group": torchdist_ext.predict("allreduce", 16 * MiB, group=group),
            "rank0": None if rank else _C._algorithm_cost(
                "allreduce", "shm", float(16 * MiB), n, True, False, threads)["seconds"]}


def test_a_group_prices_threads_with_rank0s_exponent() -> None:
    results = run_ranks(_priced_by_rank0, 2, timeout=120,
                        env={"TDX_SHM_THREADS": "4", "TDX_ALGO": "allreduce:shm"})
    assert all(r["threads"] == 4 for r in results), results
    assert results[0]["group"] == results[1]["group"], results
    assert results[0]["group"][0] == "shm"
    assert results[0]["group"][1] == pytest.approx(results[0]["rank0"], rel=1e-12), results


def test_calibrate_fits_the_exponent_with_several_threads(tmp_path: Path) -> None:
    """calibrate with 2 threads per rank: after the one-thread fit it times the shm
    all_reduce again with the ranks' threads, fits the exponent (whatever this host's
    cores make of it, within 0 to 1), saves it, and a fresh process prices with it."""
    out, js = tmp_path / "cal.json", tmp_path / "fit.json"
    proc = subprocess.run(
        [sys.executable, "-m", "torchdist_ext.bench", "calibrate", "--world", "2", "--ops",
         "all_reduce", "--links", "shm", "--sizes", "4K,4M,16M", "-n", "3", "-w", "1",
         "--out", str(out), "--json", str(js), "--no-progress"],
        capture_output=True, text=True, timeout=300, cwd=REPO,
        env={**os.environ, "TDX_SHM_THREADS": "2"})
    assert proc.returncode == 0, proc.stdout + proc.stderr
    data = json.loads(js.read_text())
    # The saved exponent is the fit of the points reported beside it.
    median = statistics.median(p["exponent"] for p in data["thread_points"])
    assert data["thread_exponent"] == pytest.approx(min(1.0, max(0.0, median)), abs=1e-12)
    assert data["previous_thread_exponent"] == 0.5
    # A size whose time this noisy host put below its steps' share drops out. On a
    # loaded host that can be 16 MiB too: a 4 KiB op that waits milliseconds for the
    # scheduler makes the fitted per-step cost outweigh its copying.
    sizes = {p["size"] for p in data["thread_points"]}
    assert sizes and sizes <= {4 * MiB, 16 * MiB}, data["thread_points"]
    assert all(p["threads"] == 2 and p["ways"] == 2 for p in data["thread_points"])
    assert "# threads: a window all_reduce pass over T threads runs" in proc.stdout
    saved = calibration.load(out)
    assert saved["thread_exponent"] == data["thread_exponent"]
    code = "from torchdist_ext import _C; print(_C._thread_exponent())"
    got = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                         timeout=120, env={**os.environ, "TDX_CALIBRATION": str(out)})
    assert float(got.stdout.strip()) == data["thread_exponent"], got.stderr


def test_a_failed_threaded_run_keeps_the_one_thread_fit(
        monkeypatch: pytest.MonkeyPatch) -> None:
    """The second run (the shm all_reduce with the ranks' threads) failing, or giving
    nothing usable, costs the exponent only: the links are fitted, a note says why."""
    def row(size: int, algo: str, us: float) -> dict[str, Any]:
        return {"op": "all_reduce", "algo": algo, "pinned": True, "predicted_us": 1.0,
                "size": size, "world": 2, "one_host": True, "ip_time_us": us,
                "pass_threads": 1}

    first = [row(s, a, us) for s in (4096, MiB, 4 * MiB)
             for a, us in (("shm", s / 1000.0), ("shm_direct", s / 800.0))]
    for second, note in ((RuntimeError("boom"), "timing the threaded shm all_reduce failed "
                                                "(boom)"),
                         ([dict(r, pass_threads=4, ip_error="x") for r in first],
                          "the ranks got 4 threads each, but no size gave a usable time"),
                         ([dict(r, pass_threads=1) for r in first],
                          "the ranks got 1 thread(s) each")):
        calls = []

        def fake(opts: Any, second: Any = second) -> list[dict[str, Any]]:
            calls.append(opts)
            if len(calls) == 1:
                return first
            if isinstance(second, Exception):
                raise second
            return second

        monkeypatch.setattr(calibrate, "run", fake)
        data = calibrate.calibrate(world=2, sizes=(4096, MiB, 4 * MiB), ops=["all_reduce"],
                                   links=["shm"], progress=False)
        assert set(data["links"]) == {"shm"} and "thread_exponent" not in data, data
        assert "thread_points" not in data
        assert any(n.startswith("threads: ") and note in n for n in data["notes"]), \
            data["notes"]
        # The second run: the shm all_reduce alone, at the sizes from 256 KiB.
        assert calls[1].backends == ("tdx:shm",) and calls[1].sizes == (MiB, 4 * MiB)

"""Measured rules (``python -m torchdist_ext.bench tune``): what auto does with them, how
they are derived from benchmark rows, stored, exchanged and refused."""

from __future__ import annotations

import json
import math
import os
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest
import torch
import torch.distributed as dist

import torchdist_ext
from torchdist_ext import _C, calibration
from torchdist_ext.bench import tune
from torchdist_ext.testing import run_ranks

REPO = Path(__file__).resolve().parents[1]


def rule(collective: str = "broadcast", world: int = 4, placement: str = "windows",
         crowded: bool = False, lo: float = 0.0, hi: float = 1 << 20,
         algorithm: str = "tree", threads: int = 1) -> dict[str, Any]:
    return {"collective": collective, "world": world, "placement": placement,
            "crowded": crowded, "threads": threads, "min_bytes": lo, "max_bytes": hi,
            "algorithm": algorithm}


@pytest.fixture
def no_rules():
    before = _C._cost_rules()
    _C._set_cost_rules([])
    try:
        yield
    finally:
        _C._set_cost_rules(before)


def test_auto_follows_a_matching_rule_only(no_rules: None) -> None:
    """A rule decides its collective, world size, placement, crowding and byte range and
    nothing else; outside it the model picks as before."""
    cases = [  # (bytes, world, same_host, one_host, crowded)
        (4096, 4, True, False, False), (1 << 19, 4, True, False, False),
        (1 << 20, 4, True, False, False),  # max_bytes is excluded
        (4096, 3, True, False, False), (4096, 4, False, True, False),
        (4096, 4, True, False, True), (4096, 4, False, False, False)]
    model = {c: torchdist_ext.predict("broadcast", c[0], c[1], same_host=c[2], one_host=c[3],
                                      crowded=c[4])[0] for c in cases}
    # The rule names what the model does not pick for the ruled case.
    ruled = cases[0]
    other = next(a for a in torchdist_ext.algorithms()["broadcast"] if a != model[ruled])
    _C._set_cost_rules([rule(algorithm=other)])
    for c in cases:
        got = torchdist_ext.predict("broadcast", c[0], c[1], same_host=c[2], one_host=c[3],
                                    crowded=c[4])
        want = other if c in (cases[0], cases[1]) else model[c]
        assert got[0] == want, c
        assert got[1] == pytest.approx(_C._algorithm_cost(
            "broadcast", got[0], float(c[0]), c[1], one_host=c[2] or c[3],
            crowded=c[4])["seconds"]), c
    # A pin still wins over a rule.
    try:
        torchdist_ext.set_algorithm("broadcast", model[ruled])
        assert torchdist_ext.predict("broadcast", 4096, 4)[0] == model[ruled]
    finally:
        torchdist_ext.set_algorithm("broadcast", "auto")
    # Other collectives are untouched.
    _C._set_cost_rules([])
    ar = torchdist_ext.predict("allreduce", 4096, 4)
    _C._set_cost_rules([rule(algorithm=other)])
    assert torchdist_ext.predict("allreduce", 4096, 4) == ar


def test_a_rule_holds_for_the_thread_count_it_was_measured_with(no_rules: None) -> None:
    """The window all_reduce's speed depends on each rank's threads, so a rule measured
    with 8 decides for groups with 8 and not for groups with 1, and the other way round;
    rules for several counts live side by side."""
    def pick(threads: int) -> str:
        return torchdist_ext.predict("allreduce", 1 << 20, 2, pass_threads=threads)[0]

    model = {t: pick(t) for t in (1, 4, 8)}
    others = [a for a in torchdist_ext.algorithms()["allreduce"] if a not in model.values()]
    assert len(others) >= 2, others
    _C._set_cost_rules([rule("allreduce", 2, algorithm=others[0], hi=1 << 30, threads=8)])
    assert (pick(1), pick(4), pick(8)) == (model[1], model[4], others[0])
    _C._set_cost_rules([rule("allreduce", 2, algorithm=others[0], hi=1 << 30, threads=8),
                        rule("allreduce", 2, algorithm=others[1], hi=1 << 30)])
    assert (pick(1), pick(4), pick(8)) == (others[1], model[4], others[0])
    # A rule given without a count (as files saved before rules had one hold) has 1.
    _C._set_cost_rules([{k: v for k, v in rule("allreduce", 2, algorithm=others[1],
                                               hi=1 << 30).items() if k != "threads"}])
    assert _C._cost_rules() == [rule("allreduce", 2, algorithm=others[1], hi=1 << 30)]
    assert (pick(1), pick(8)) == (others[1], model[8])


def test_rules_saved_without_a_thread_count_load_as_one_thread(tmp_path: Path) -> None:
    """Rules written before they recorded threads load as threads 1, and a tuning at
    another count keeps them."""
    path = tmp_path / "old.json"
    old = {k: v for k, v in rule(world=3).items() if k != "threads"}
    path.write_text(json.dumps({"rules": [old]}))
    assert calibration.load(path)["rules"] == [rule(world=3)]
    calibration.save({"rules": [rule(world=3, algorithm="chain", threads=4)]}, path,
                     replaces=[calibration.rule_key(rule(world=3, threads=4))])
    assert calibration.load(path)["rules"] == [rule(world=3),
                                               rule(world=3, algorithm="chain", threads=4)]
    # Replacing the 1-thread key (given the old way, without its count) drops the old rule.
    calibration.save({"rules": []}, path, replaces=[("broadcast", 3, "windows", False)])
    assert calibration.load(path)["rules"] == [rule(world=3, algorithm="chain", threads=4)]
    with pytest.raises(ValueError, match="threads 1 to 16 with windows and 1 elsewhere"):
        calibration.save({"rules": [rule(placement="hosts", threads=2)]}, path)


@pytest.mark.parametrize("threads", [True, 2.0, None, "2", 0, 17])
def test_a_file_rule_with_a_bad_thread_count_is_skipped(tmp_path: Path, threads: Any) -> None:
    path = tmp_path / "cal.json"
    path.write_text(json.dumps({"rules": [rule(world=3), {**rule(), "threads": threads}]}))
    with pytest.warns(UserWarning, match="ignoring 1 malformed rule"):
        assert calibration.load(path)["rules"] == [rule(world=3)]


def test_a_file_rule_with_threads_without_windows_is_skipped(tmp_path: Path) -> None:
    path = tmp_path / "cal.json"
    path.write_text(json.dumps({"rules": [rule(placement="host", threads=2)]}))
    with pytest.warns(UserWarning, match="ignoring 1 malformed rule"):
        assert calibration.load(path)["rules"] == []


def test_rules_from_rows_keep_thread_counts_apart() -> None:
    """Rows of runs with different thread counts make separate rules, each carrying its
    run's count, and the model is asked with that count."""
    k = 1 << 10
    rows = [_row("all_reduce", 4 * k, "shm", 50, pass_threads=1),
            _row("all_reduce", 4 * k, "rhd", 10, pass_threads=1),
            _row("all_reduce", 4 * k, "shm", 5, pass_threads=8),
            _row("all_reduce", 4 * k, "rhd", 10, pass_threads=8),
            _row("broadcast", 4 * k, "tree", 5, windows=False, pass_threads=1),
            _row("broadcast", 4 * k, "shm", 50, windows=False, pass_threads=1)]
    asked = []

    def model(op: str, size: int, world: int, placement: str, crowded: bool,
              threads: int) -> str:
        asked.append((op, threads))
        return "rhd" if threads == 8 else "shm"

    rules, winners = tune.rules_from_rows(rows, model=model)
    assert rules == [rule("allreduce", 4, "windows", True, 0, 8 * k, "rhd", threads=1),
                     rule("allreduce", 4, "windows", True, 0, 8 * k, "shm", threads=8),
                     rule("broadcast", 4, "host", True, 0, 8 * k, "tree")]
    assert sorted(asked) == [("all_reduce", 1), ("all_reduce", 8), ("broadcast", 1)]
    assert sorted((w["op"], w["threads"]) for w in winners) == sorted(asked)


def test_a_rule_that_cannot_run_the_op_leaves_it_to_the_model(no_rules: None) -> None:
    """Recursive doubling needs a power-of-two world and the windows need them on: a rule
    naming either where it cannot run is passed over, never an error."""
    model3 = torchdist_ext.predict("allgather", 1 << 16, 3)[0]
    _C._set_cost_rules([rule("allgather", 3, algorithm="rd"),
                        rule("allgather", 4, "host", algorithm="shm")])
    assert torchdist_ext.predict("allgather", 1 << 16, 3)[0] == model3
    assert torchdist_ext.predict("allgather", 1 << 16, 4, same_host=False,
                                 one_host=True)[0] in ("ring", "rd")
    # The first usable matching rule wins.
    _C._set_cost_rules([rule("allgather", 4, algorithm="rd", hi=1 << 10),
                        rule("allgather", 4, algorithm="ring")])
    assert torchdist_ext.predict("allgather", 1 << 9, 4)[0] == "rd"
    assert torchdist_ext.predict("allgather", 1 << 16, 4)[0] == "ring"


@pytest.mark.parametrize("bad,match", [
    (rule(algorithm="chainsaw"), "unknown algorithm 'chainsaw'; use one of tree, chain, shm"),
    (rule(collective="allsort"), "unknown collective 'allsort'"),
    (rule(world=0), "world size must be 1 to 16777216"),
    (rule(world=1 << 25), "world size must be 1 to 16777216"),
    (rule(lo=math.nan), "0 <= from_bytes < to_bytes"),
    (rule(lo=math.inf, hi=math.inf), "0 <= from_bytes < to_bytes"),
    (rule(lo=10, hi=10), "0 <= from_bytes < to_bytes"),
    (rule(lo=-1), "0 <= from_bytes < to_bytes"),
    (rule(placement="moon"), "unknown placement 'moon'"),
    (rule(threads=0), "thread count must be 1 to 16, got 0"),
    (rule(threads=17), "thread count must be 1 to 16, got 17"),
    (rule(placement="host", threads=2), "placement host runs 1 thread per rank"),
    (rule(threads=True), "threads must be a whole number, not bool"),
    (rule(threads=2.0), "threads must be a whole number, not float"),
    ({k: v for k, v in rule().items() if k != "world"}, "has no 'world'"),
])
def test_bad_rules_are_refused_and_change_nothing(no_rules: None, bad: dict,
                                                  match: str) -> None:
    _C._set_cost_rules([rule(algorithm="chain")])
    with pytest.raises(ValueError, match=match):
        _C._set_cost_rules([rule(), bad])
    assert _C._cost_rules() == [rule(algorithm="chain")]


def _ruled_group(rank: int, n: int) -> dict:
    """Only rank 0 holds a rule; the group takes rank 0's model, so both ranks run it. The
    rules name the thread count the world's ranks settled on, which a group of the same
    ranks gets too, and a rule for another count must not decide."""
    model = torchdist_ext.predict("broadcast", 4096, n)[0]  # the same on every rank here
    other = "tree" if model != "tree" else "shm"
    threads = torchdist_ext.placement()["pass_threads"]
    if rank == 0:
        # Bounds that only survive the exchange written and read in full: a fraction,
        # a subnormal, infinity.
        # First a rule for a thread count the group does not have: it must not decide,
        # after the exchange as before it.
        third = next(a for a in ("chain", "shm", "tree") if a not in (model, other))
        _C._set_cost_rules([rule(world=n, crowded=c, algorithm=third, hi=math.inf,
                                 threads=1 if threads > 1 else 2)
                            for c in (False, True)] +
                           [rule(world=n, crowded=c, algorithm=other, hi=math.sqrt(2) * 65536,
                                 threads=threads)
                            for c in (False, True)] +
                           [rule("allgather", n, lo=5e-324, hi=math.inf, algorithm="ring",
                                 threads=threads)])
    group = dist.new_group(list(range(n)), backend="tdx")
    paths = []
    assert torchdist_ext.placement(group)["pass_threads"] == threads
    for numel in (1024, 1 << 20):  # 4 KiB (ruled) and 4 MiB (the model's)
        t = torch.full((numel,), float(rank))
        dist.broadcast(t, src=0, group=group)
        assert torch.equal(t, torch.zeros_like(t))
        paths.append(torchdist_ext.flight_recorder(group)[-1]["path"])
    return {"paths": paths, "model": model, "other": other,
            "predicted": [torchdist_ext.predict("broadcast", b, group=group)[0]
                          for b in (4096, 1 << 22)],
            "own": torchdist_ext.predict("broadcast", 4096, n)[0],
            "windows": torchdist_ext.placement(group)["windows"], "threads": threads}


@pytest.mark.parametrize("setting", ["auto", "3"])
def test_a_groups_ranks_follow_rank0s_rules(setting: str) -> None:
    results = run_ranks(_ruled_group, 2, timeout=120, env={"TDX_SHM_THREADS": setting})
    if setting != "auto":
        assert all(r["threads"] == int(setting) for r in results), results
    for rank, res in enumerate(results):
        assert res["windows"], res
        assert res["paths"][0] == res["other"], (rank, res)
        assert res["predicted"] == res["paths"], (rank, res)
    # Rank 1 holds no rule: its own model still picks otherwise.
    assert results[1]["own"] == results[1]["model"] != results[1]["other"]


def _row(op: str, size: int, algo: str, us: float, **kw: Any) -> dict[str, Any]:
    r = {"op": op, "size": size, "algo": algo, "pinned": True, "world": 4, "dtype": "float32",
         "one_host": True, "windows": True, "crowded": True, "ip_time_us": us,
         "oop_time_us": us, "ip_error": None, "oop_error": None, "ip_wrong": 0, "oop_wrong": 0}
    r.update(kw)
    return r


def test_rules_from_rows_take_the_fastest_per_size_and_merge_neighbours() -> None:
    k = 1 << 10
    rows = []
    for size, times in ((4 * k, {"shm": 10, "tree": 20}), (16 * k, {"shm": 30, "tree": 20}),
                        (64 * k, {"shm": 90, "tree": 60}), (256 * k, {"shm": 100, "tree": 300})):
        rows += [_row("broadcast", size, a, t) for a, t in times.items()]
    rows.append(_row("broadcast", 4 * k, "chain", 1.0, ip_error="boom"))  # failed: ignored
    rows.append(_row("broadcast", 16 * k, "chain", 1.0, ip_wrong=3))  # wrong: ignored
    rows.append(_row("broadcast", 4 * k, None, 1.0, pinned=False))  # auto's row: ignored
    rows += [_row("all_gather", 4 * k, "ring", 5, windows=False, crowded=False)]
    rules, winners = tune.rules_from_rows(rows, model=lambda *a: "nothing-timed")
    assert rules == [
        rule("allgather", 4, "host", False, 0, 8 * k, "ring"),
        rule("broadcast", 4, "windows", True, 0, 8 * k, "shm"),
        rule("broadcast", 4, "windows", True, 8 * k, 128 * k, "tree"),
        rule("broadcast", 4, "windows", True, 128 * k, 512 * k, "shm"),
    ]
    w = {(x["op"], x["size"]): x for x in winners}
    assert w[("broadcast", 16 * k)]["algorithm"] == "tree"
    assert w[("broadcast", 16 * k)]["runner_up"] == "shm"
    assert w[("broadcast", 16 * k)]["runner_up_us"] == 30
    assert w[("all_gather", 4 * k)]["runner_up"] is None
    assert tune.wrong_rows(rows) == ["broadcast 16384 B chain: 3 wrong"]
    # Each becomes the backend's own.
    before = _C._cost_rules()
    try:
        _C._set_cost_rules(rules)
        assert _C._cost_rules() == rules
    finally:
        _C._set_cost_rules(before)


def test_rules_only_where_the_model_loses_by_more_than_the_margin() -> None:
    """Sizes where the model's own pick is within the margin of the fastest keep the
    model: no rule, so near-ties do not flip from one tuning to the next."""
    k = 1 << 10
    rows = []
    for size, times in ((4 * k, {"shm": 100, "tree": 95}), (16 * k, {"shm": 100, "tree": 80}),
                        (64 * k, {"shm": 100, "tree": 111})):
        rows += [_row("broadcast", size, a, t) for a, t in times.items()]
    asked = []

    def model(op: str, size: int, world: int, placement: str, crowded: bool,
              threads: int) -> str:
        asked.append((op, size, world, placement, crowded, threads))
        return "shm"

    rules, winners = tune.rules_from_rows(rows, margin=0.1, model=model)
    assert rules == [rule("broadcast", 4, "windows", True, 8 * k, 32 * k, "tree")]
    assert [w["ruled"] for w in winners] == [False, True, False]
    assert [w["model_us"] for w in winners] == [100, 100, 100]
    assert asked[0] == ("broadcast", 4 * k, 4, "windows", True, 1)
    # With no margin every size the model does not win gets a rule.
    rules, _ = tune.rules_from_rows(rows, margin=0.0, model=model)
    assert [r["algorithm"] for r in rules] == ["tree"] and rules[0]["min_bytes"] == 0
    # The real model answers without the rules in force.
    before = _C._cost_rules()
    try:
        _C._set_cost_rules([rule(world=4, algorithm="chain", hi=1e12, crowded=True)])
        assert tune.model_pick("broadcast", 4096, 4, "windows", True) != "chain"
        assert _C._cost_rules() == [rule(world=4, algorithm="chain", hi=1e12, crowded=True)]
    finally:
        _C._set_cost_rules(before)


def test_saved_rules_merge_by_key_and_keep_the_terms(tmp_path: Path) -> None:
    path = tmp_path / "cal.json"
    links = {"shm": {"alpha": 1e-6, "beta": 1e-10, "gamma": 2e-10}}
    calibration.save({"links": links, "points": [1, 2]}, path)
    calibration.save({"rules": [rule(world=3), rule(world=4)], "tuning": {"world": 4}}, path)
    calibration.save({"rules": [rule(world=4, algorithm="chain")]}, path)
    data = calibration.load(path)
    assert data["links"]["shm"] == links["shm"]
    assert data["points"] == [1, 2] and data["tuning"] == {"world": 4}
    assert data["rules"] == [rule(world=3), rule(world=4, algorithm="chain")]
    # A later calibration keeps the rules.
    calibration.save({"links": links}, path)
    assert calibration.load(path)["rules"] == data["rules"]
    # A tuning that measured world 3 and found the model right there removes its rule.
    calibration.save({"rules": []}, path, replaces=[calibration.rule_key(rule(world=3))])
    assert calibration.load(path)["rules"] == [rule(world=4, algorithm="chain")]
    only_rules = tmp_path / "only-rules.json"
    calibration.save({"rules": [rule()]}, only_rules)
    calibration.save({}, only_rules, replaces=[calibration.rule_key(rule())])
    assert not only_rules.exists()  # nothing left to hold
    with pytest.raises(ValueError, match="nothing to save"):
        calibration.save({"rules": []}, tmp_path / "empty.json")
    with pytest.raises(ValueError, match="each measured rule needs"):
        calibration.save({"rules": [rule(hi=math.nan)]}, tmp_path / "nan.json")
    # A rule edited by hand into a shape the backend refuses is skipped, and kept aside.
    edited = tmp_path / "edited.json"
    edited.write_text(json.dumps({"rules": [rule(), {**rule(world=2), "note": "mine"}]}))
    with pytest.warns(UserWarning, match="ignoring 1 malformed rule"):
        calibration.save({"rules": [rule(world=5)]}, edited)
    kept = calibration.load(edited)  # once set aside, no longer a warning
    assert kept["rules"] == [rule(), rule(world=5)]
    assert kept["ignored_rules"] == [{**rule(world=2), "note": "mine"}]
    # A file that does not load is moved aside, not overwritten.
    broken = tmp_path / "broken.json"
    broken.write_text("{not json")
    with pytest.warns(UserWarning, match="moved the unreadable calibration"):
        calibration.save({"rules": [rule()]}, broken)
    assert (tmp_path / "broken.json.unreadable").read_text() == "{not json"
    assert calibration.load(broken)["rules"] == [rule()]


def test_stored_rules_load_at_import_and_bad_ones_are_skipped(tmp_path: Path) -> None:
    """Rules in the host's file apply from ``import torchdist_ext``; a rule naming an
    algorithm this build lacks is warned about and dropped, the terms still apply."""
    good = tmp_path / "good.json"
    good.write_text(json.dumps({"rules": [rule(world=5, algorithm="chain", hi=1e9)]}))
    unknown = tmp_path / "unknown.json"
    unknown.write_text(json.dumps({
        "links": {"shm": {"alpha": 7e-6, "beta": 1e-10, "gamma": 1e-10}},
        "rules": [rule(world=5, algorithm="telepathy"), rule(world=5, algorithm="chain"),
                  {**rule(world=5), "note": "hand-edited"}]}))
    code = ("import torchdist_ext, json; print(json.dumps(["
            "torchdist_ext.predict('broadcast', 4096, 5)[0], "
            "torchdist_ext.cost_model()['shm']['alpha']]))")
    for path, want in ((good, ["chain", None]), (unknown, ["chain", 7e-6])):
        proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                              env={**os.environ, "TDX_CALIBRATION": str(path)}, timeout=120)
        assert proc.returncode == 0, proc.stderr
        got = json.loads(proc.stdout.strip().splitlines()[-1])
        if want[0]:
            assert got[0] == want[0]
        if want[1]:
            assert got[1] == want[1]
            assert "ignoring a measured rule" in proc.stderr
            assert "unknown algorithm 'telepathy'" in proc.stderr
            assert "ignoring 1 malformed rule(s)" in proc.stderr


def test_tune_refuses_all_to_all() -> None:
    proc = subprocess.run([sys.executable, "-m", "torchdist_ext.bench", "tune", "--ops",
                           "all_to_all", "--dry-run"], capture_output=True, text=True,
                          timeout=120, cwd=REPO)
    assert proc.returncode == 2 and "before the ranks know each other's byte counts" in \
        proc.stderr, proc.stderr


def test_tune_end_to_end(tmp_path: Path) -> None:
    """``bench tune`` at 2 ranks with no margin: every algorithm of broadcast timed, a rule
    wherever the model's pick was not the fastest, saved beside the file's terms, for the
    thread count the ranks ran with; a fresh process then picks the fastest at each
    measured size for that count."""
    out = tmp_path / "cal.json"
    calibration.save({"links": {"shm": {"alpha": 3e-6, "beta": 2e-10, "gamma": 3e-10}}}, out)
    proc = subprocess.run(
        [sys.executable, "-m", "torchdist_ext.bench", "tune", "--world", "2", "--ops",
         "broadcast", "--sizes", "4K,64K", "-n", "2", "-w", "1", "--rounds", "1",
         "--margin", "0", "--out", str(out), "--json", str(tmp_path / "tune.json"),
         "--no-progress"],
        capture_output=True, text=True, timeout=300, cwd=REPO,
        env={**os.environ, "TDX_SHM_THREADS": "2"})
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert "# saved to" in proc.stdout
    data = calibration.load(out)
    assert data["links"]["shm"]["alpha"] == 3e-6
    names = set(torchdist_ext.algorithms()["broadcast"])
    tuning = json.loads((tmp_path / "tune.json").read_text())["tuning"]
    winners = tuning["winners"]
    assert [w["size"] for w in winners] == [4096, 65536]
    crowded = tuning["keys"][0][3]
    assert tuning["keys"] == [["broadcast", 2, "windows", crowded, 2]]  # spawned: one host
    assert tuning["threads"] == [2] and "2 thread(s) per rank" in proc.stdout
    for w in winners:
        assert w["algorithm"] in names and w["model"] in names
        assert w["runner_up_us"] is None or w["us"] <= w["runner_up_us"]
        assert w["ruled"] == (w["model_us"] is None or w["model_us"] > w["us"])
        assert f"{w['algorithm']}" in proc.stdout
    rules = data.get("rules", [])
    assert all(r["collective"] == "broadcast" and r["world"] == 2 and
               r["placement"] == "windows" and r["crowded"] == crowded and
               r["threads"] == 2 and r["algorithm"] in names for r in rules)
    assert len(rules) == (sum(w["ruled"] for w in winners) -
                          (winners[0]["ruled"] and winners[1]["ruled"] and
                           winners[0]["algorithm"] == winners[1]["algorithm"]))
    # A fresh process loads them: auto picks each measured size's fastest.
    code = ("import torchdist_ext; print(' '.join(torchdist_ext.predict('broadcast', s, 2, "
            f"crowded={crowded}, pass_threads=2)[0] for s in (4096, 65536)))")
    got = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                         timeout=120, env={**os.environ, "TDX_CALIBRATION": str(out)})
    assert got.stdout.split() == [w["algorithm"] for w in winners], got.stdout + got.stderr

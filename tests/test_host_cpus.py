"""How tdx counts the CPUs that the ranks of one host can run on at once.

A group is crowded when its ranks outnumber those CPUs (see docs/ALGORITHMS.md, "Crowded
hosts"). The count comes from every rank's affinity mask and cgroup v2 CPU limits, which
these tests feed in from files and texts of their own, so they need no cgroup v2 host.
"""
from __future__ import annotations

import os
from pathlib import Path

import pytest

from torchdist_ext import _C


def _cgroup(root: Path, path: str, cpu_max: str | None) -> str:
    d = root / path.lstrip("/")
    d.mkdir(parents=True, exist_ok=True)
    if cpu_max is not None:
        (d / "cpu.max").write_text(cpu_max + "\n")
    st = os.stat(d)
    return f"{st.st_dev:x}.{st.st_ino:x}"


def _proc(tmp_path: Path, text: str) -> str:
    f = tmp_path / "cgroup"
    f.write_text(text)
    return str(f)


def test_cgroup_limits_are_read_from_the_cgroup_and_each_ancestor(tmp_path: Path) -> None:
    root = tmp_path / "fs"
    a = _cgroup(root, "/a", "200000 100000")       # 2 CPUs
    _cgroup(root, "/a/b", "max 100000")            # no limit of its own
    c = _cgroup(root, "/a/b/c", "150000 100000")   # 1.5 CPUs: one rank's worth
    proc = _proc(tmp_path, "12:cpu,cpuacct:/elsewhere\n0::/a/b/c\n")
    assert _C._cpu_limits(proc, str(root)) == [(c, 1), (a, 2)]


def test_cgroup_limits_round_down_but_grant_at_least_one_cpu(tmp_path: Path) -> None:
    root = tmp_path / "fs"
    tiny = _cgroup(root, "/tiny", "1000 100000")
    huge = _cgroup(root, "/huge", "100000000000000 1")
    assert _C._cpu_limits(_proc(tmp_path, "0::/tiny\n"), str(root)) == [(tiny, 1)]
    assert _C._cpu_limits(_proc(tmp_path, "0::/huge\n"), str(root)) == [(huge, 10**6)]


def test_a_container_reads_its_own_cgroup_at_the_root(tmp_path: Path) -> None:
    # Inside a cgroup namespace the process sees "0::/" and its cgroup is the mount.
    root = tmp_path / "fs"
    top = _cgroup(root, "/", "300000 100000")
    assert _C._cpu_limits(_proc(tmp_path, "0::/\n"), str(root)) == [(top, 3)]


@pytest.mark.parametrize("text", ["", "3:cpu:/v1/only\n", "0::/missing\n", "0::relative\n"])
def test_no_cgroup_v2_limit_reads_as_none(tmp_path: Path, text: str) -> None:
    root = tmp_path / "fs"
    _cgroup(root, "/unlimited", "max 100000")
    assert _C._cpu_limits(_proc(tmp_path, text), str(root)) == []
    assert _C._cpu_limits(_proc(tmp_path, "0::/unlimited\n"), str(root)) == []
    assert _C._cpu_limits(str(tmp_path / "absent"), str(root)) == []


FOUR = "f"  # CPUs 0-3


@pytest.mark.parametrize("texts, together", [
    ([FOUR + ","] * 4, 4),                                  # no limits: the masks decide
    (["1,", "1,", "f,"], 2),                                 # two pinned to CPU 0 share it
    ([FOUR + ",x:2"] * 4, 2),                                # one cgroup of 2 CPUs for all
    ([FOUR + f",x{r}:1" for r in range(4)], 4),              # a cgroup of 1 CPU each: they add up
    ([FOUR + f",x{r}:1;p:3" for r in range(4)], 3),          # ... under a parent of 3
    ([FOUR + ",x:1", FOUR + ",x:1", FOUR + ",", FOUR + ","], 3),  # two limited, two not
    # A parent of 2 holds a process directly and a child cgroup of 5 with three.
    ([FOUR + ",a:2"] + [FOUR + ",b:5;a:2"] * 3, 2),
    (["f,x:4"] * 2 + ["1,x:4"] * 2, 3),                      # the cgroup allows 4, the masks 3
    (["zz", "f,"], 1),                                       # a malformed text is left out
    (["f,a:1;b:2", "f,b:2;a:1"], 2),                         # parents in a cycle: no limit
])
def test_cpus_together(texts: list[str], together: int) -> None:
    assert _C._cpus_together(texts) == together


@pytest.mark.parametrize("texts, shared", [
    ([FOUR + ","] * 4, 4),                                   # the masks' CPUs, not one each
    (["1,", "1,", "f,"], 4),                                 # two pinned to CPU 0, one not
    (["ff,"] * 2, 8),                                        # two ranks, eight CPUs
    (["3,", "c,"], 4),                                       # masks apart: they add up
    (["1,"] * 3, 1),                                         # all on one CPU
    ([FOUR + ",x:2"] * 4, 2),                                # one cgroup of 2 CPUs for all
    ([FOUR + f",x{r}:1" for r in range(4)], 4),              # a cgroup of 1 CPU each
    ([FOUR + f",x{r}:1;p:3" for r in range(4)], 3),          # ... under a parent of 3
    (["ffff,x:6"] * 2, 6),                                   # the cgroup allows 6 of 16
    ([FOUR + ",x:1", FOUR + ","], 4),                        # one limited, one not
    (["zz", "f,"], 4),                                       # a malformed text is left out
    ([",", "f,"], 4),                                        # an empty mask adds nothing
])
def test_cpus_shared(texts: list[str], shared: int) -> None:
    """What ranks that each run several threads may keep busy at once (the shared-memory
    all_reduce's helper threads): the CPUs of their masks together, within their
    cgroups' limits."""
    assert _C._cpus_shared(texts) == shared


def test_this_process_publishes_what_it_counts() -> None:
    """k ranks with this process's mask and cgroups run min(k, its usable CPUs) at once."""
    text = _C._cpu_text()
    assert "|" not in text and "#" not in text and "," in text
    for k in range(1, 5):
        assert _C._cpus_together([text] * k) == min(k, _C._usable_cpus())
        assert _C._cpus_shared([text] * k) == _C._usable_cpus()

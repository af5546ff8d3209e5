"""Bad arguments to the Python API, bad calibration files and bad example flags: each is a
clear error naming the argument (or a warning naming the file), never a traceback from
deep inside and never silently accepted. No ranks are spawned: the checks come first."""

from __future__ import annotations

import importlib
import json
import math
import os
import subprocess
import sys
import warnings
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch
import torch.distributed as dist

import torchdist_ext
from torchdist_ext import _C, calibration

REPO = Path(__file__).resolve().parents[1]
TERMS = {"alpha": 1e-6, "beta": 1e-10, "gamma": 1e-10}


@pytest.fixture
def backend_model():
    """The backend's cost model and rules, restored after the test."""
    model, rules = torchdist_ext.cost_model(), _C._cost_rules()
    try:
        yield model
    finally:
        _C._set_cost_rules(rules)
        _C._set_cost_model(model)


# ---------------------------------------------------------------------------------------
# set_cost_model
# ---------------------------------------------------------------------------------------

@pytest.mark.parametrize("model, error, message", [
    ({"wire": TERMS}, ValueError, "unknown link 'wire'; the links are net, local, shm, cma"),
    ({"net": {"alpha": 1e-6, "beta": 1e-10}}, ValueError,
     "link 'net' needs alpha, beta and gamma; missing gamma"),
    ({"net": {**TERMS, "alpha": math.nan}}, ValueError, "net.alpha must be a finite number >= 0"),
    ({"shm": {**TERMS, "beta": math.inf}}, ValueError, "shm.beta must be a finite number >= 0"),
    ({"cma": {**TERMS, "gamma": -1e-9}}, ValueError, "cma.gamma must be a finite number >= 0"),
    ({"net": {**TERMS, "alpha": 10**400}}, ValueError, "net.alpha must be a finite number"),
    ({"net": {**TERMS, "alpha": True}}, TypeError, "net.alpha must be a number of seconds, "
                                                   "not bool"),
    ({"net": {**TERMS, "beta": "1e-10"}}, TypeError, "net.beta must be a number of seconds"),
    ({"net": {**TERMS, "beta": None}}, TypeError, "net.beta must be a number of seconds"),
    ({"net": 5}, TypeError, "link 'net' must map alpha, beta and gamma to numbers"),
    ([("net", TERMS)], TypeError, "the model must be a dict"),
])
def test_set_cost_model_refuses_what_the_file_loader_refuses(
        model: Any, error: type, message: str, backend_model: dict, tmp_path: Path) -> None:
    with pytest.raises(error, match="^set_cost_model: ") as info:
        torchdist_ext.set_cost_model(model)
    assert message in str(info.value)
    assert torchdist_ext.cost_model() == backend_model  # nothing applied
    # The same links as a calibration file's: the loader ignores the file.
    path = tmp_path / "cal.json"
    path.write_text(json.dumps({"links": model}))
    with pytest.warns(UserWarning, match="ignoring malformed calibration"):
        assert calibration.load_into_backend(path) is False
    assert torchdist_ext.cost_model() == backend_model


def test_set_cost_model_takes_good_links(backend_model: dict) -> None:
    torchdist_ext.set_cost_model({"local": TERMS, "cma": {"alpha": 0, "beta": 1, "gamma": 0}})
    model = torchdist_ext.cost_model()
    assert model["local"] == pytest.approx(TERMS) and model["net"] == backend_model["net"]


@pytest.mark.parametrize("number", [np.float64, np.float32, np.int64, np.int32])
def test_set_cost_model_takes_numpy_numbers(number: Any, backend_model: dict) -> None:
    """Terms straight from a numpy fit: any real number but a bool, stored as floats."""
    terms = {"alpha": number(2), "beta": number(0), "gamma": number(1)}
    torchdist_ext.set_cost_model({"shm": terms})
    assert torchdist_ext.cost_model()["shm"] == {"alpha": 2.0, "beta": 0.0, "gamma": 1.0}
    with pytest.raises(TypeError, match="shm.alpha must be a number of seconds, not bool"):
        torchdist_ext.set_cost_model({"shm": {**terms, "alpha": np.bool_(True)}})
    with pytest.raises(ValueError, match="shm.beta must be a finite number >= 0"):
        torchdist_ext.set_cost_model({"shm": {**terms, "beta": np.float64("nan")}})


def test_keys_beside_the_terms_are_ignored_as_in_a_file(backend_model: dict,
                                                        tmp_path: Path) -> None:
    """A link's other keys (a note, a term of a later version) are ignored, by
    set_cost_model as by the file loader: the two take the same links."""
    links = {"net": {**TERMS, "delta": 1.0, "note": "measured by hand"}}
    torchdist_ext.set_cost_model(links)
    assert torchdist_ext.cost_model()["net"] == pytest.approx(TERMS)
    torchdist_ext.set_cost_model(backend_model)
    path = tmp_path / "cal.json"
    path.write_text(json.dumps({"links": links}))
    assert calibration.load_into_backend(path) is True
    assert torchdist_ext.cost_model()["net"] == pytest.approx(TERMS)


# ---------------------------------------------------------------------------------------
# predict
# ---------------------------------------------------------------------------------------

@pytest.mark.parametrize("args, kwargs, error, message", [
    (("allreduce", 4096, 0), {}, ValueError, "world must be from 1 to 16777216 ranks, got 0"),
    (("allreduce", 4096, -3), {}, ValueError, "world must be from 1 to"),
    (("allreduce", 4096, 1 << 40), {}, ValueError, "world must be from 1 to"),
    (("allreduce", 4096, 2.5), {}, TypeError, "world must be a whole number of ranks"),
    (("allreduce", 4096, np.float32(2.5)), {}, TypeError, "world must be a whole number"),
    (("allreduce", 4096, math.inf), {}, TypeError, "world must be a whole number of ranks"),
    (("allreduce", 4096, math.nan), {}, TypeError, "world must be a whole number of ranks"),
    (("allreduce", 4096, "4"), {}, TypeError, "world must be a whole number of ranks"),
    (("allreduce", 4096, True), {}, TypeError, "world must be a whole number of ranks"),
    (("allreduce", 4096, np.bool_(True)), {}, TypeError, "world must be a whole number"),
    (("allreduce", 4096, 0.0), {}, ValueError, "world must be from 1 to 16777216 ranks, got 0"),
    (("allreduce", -1, 4), {}, ValueError, "nbytes must be a finite number >= 0, got -1"),
    (("allreduce", math.nan, 4), {}, ValueError, "nbytes must be a finite number >= 0"),
    (("allreduce", math.inf, 4), {}, ValueError, "nbytes must be a finite number >= 0"),
    (("allreduce", 10**400, 4), {}, ValueError, "nbytes must be a finite number >= 0"),
    (("allreduce", "4096", 4), {}, TypeError, "nbytes must be a number of bytes"),
    (("allreduce", 4096, 4), {"same_host": False, "crowded": True}, ValueError,
     "crowded=True describes ranks that share one host's CPUs"),
])
def test_predict_refuses_bad_arguments(args: tuple, kwargs: dict, error: type,
                                       message: str) -> None:
    with pytest.raises(error, match="^predict: ") as info:
        torchdist_ext.predict(*args, **kwargs)
    assert message in str(info.value)


def test_predict_takes_good_arguments() -> None:
    for args, kwargs in ((("allreduce", 0, 1), {}), (("broadcast", 4096.0, 1 << 24), {}),
                         (("allreduce", 4096, 4), {"crowded": True}),
                         (("allreduce", 4096, 4), {"same_host": False, "one_host": True,
                                                   "crowded": True})):
        name, seconds = torchdist_ext.predict(*args, **kwargs)
        assert isinstance(name, str) and math.isfinite(seconds) and seconds >= 0


@pytest.mark.parametrize("world", [4.0, np.int64(4), np.int32(4), np.uint8(4),
                                   np.float64(4.0), np.float32(4.0)])
def test_predict_takes_any_whole_world(world: Any) -> None:
    """A whole number of ranks in any numeric type prices as the int would."""
    assert torchdist_ext.predict("allreduce", np.float32(4096), world) == \
        torchdist_ext.predict("allreduce", 4096, 4)


# ---------------------------------------------------------------------------------------
# Queries on a rank outside the group
# ---------------------------------------------------------------------------------------

@pytest.mark.parametrize("call", [
    lambda g: torchdist_ext.placement(g),
    lambda g: torchdist_ext.flight_recorder(g),
    lambda g: torchdist_ext.predict("allreduce", 4096, group=g),
], ids=["placement", "flight_recorder", "predict"])
def test_queries_on_a_rank_outside_the_group(call: Any) -> None:
    """new_group() returns this placeholder on the ranks it leaves out: the query says so
    rather than failing with an AttributeError on it."""
    with pytest.raises(ValueError, match="this rank is not a member of the group"):
        call(dist.GroupMember.NON_GROUP_MEMBER)
    with pytest.raises(TypeError, match="group must be a process group"):
        call("world")


# ---------------------------------------------------------------------------------------
# Calibration files: loading never raises
# ---------------------------------------------------------------------------------------

def _rule(**kw: Any) -> dict[str, Any]:
    return {"collective": "broadcast", "world": 5, "placement": "windows", "crowded": False,
            "threads": 1, "min_bytes": 0, "max_bytes": 1e9, "algorithm": "tree", **kw}


def test_ignored_rules_that_are_not_a_list(tmp_path: Path, backend_model: dict) -> None:
    """A hand-edited ``ignored_rules`` that is not a list, beside a malformed rule: the
    good rule and the terms still load, the bad rule is kept aside, nothing raises."""
    path = tmp_path / "cal.json"
    path.write_text(json.dumps({"links": {"shm": TERMS}, "ignored_rules": 5,
                                "rules": [_rule(), _rule(world="five")]}))
    with pytest.warns(UserWarning, match="ignoring 1 malformed rule"):
        data = calibration.load(path)
    assert data["rules"] == [_rule()]
    assert data["ignored_rules"] == [5, _rule(world="five")]
    with pytest.warns(UserWarning, match="ignoring 1 malformed rule"):
        assert calibration.load_into_backend(path) is True
    assert torchdist_ext.cost_model()["shm"] == pytest.approx(TERMS)


def test_deeply_nested_calibration_is_ignored(tmp_path: Path, backend_model: dict) -> None:
    path = tmp_path / "deep.json"
    path.write_text('{"links": {}, "rules": ' + "[" * 100_000 + "]" * 100_000 + "}")
    with pytest.warns(UserWarning, match="nested too deeply"):
        assert calibration.load_into_backend(path) is False
    assert torchdist_ext.cost_model() == backend_model


def test_rule_warning_names_the_file_read(tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
                                          backend_model: dict) -> None:
    """load_into_backend() without a path reads calibration_path(); its warnings name that
    file, not "None"."""
    path = tmp_path / "host.json"
    path.write_text(json.dumps({"rules": [_rule(algorithm="telepathy")]}))
    monkeypatch.setenv("TDX_CALIBRATION", str(path))
    with pytest.warns(UserWarning, match="ignoring a measured rule") as record:
        calibration.load_into_backend()
    texts = [str(w.message) for w in record]
    assert any(f"of {path}:" in t for t in texts), texts
    assert not any(" of None" in t for t in texts), texts


def test_a_failed_rule_probe_restores_the_rules(tmp_path: Path,
                                                 monkeypatch: pytest.MonkeyPatch,
                                                 backend_model: dict) -> None:
    """Loading tries each rule alone as the backend's only rule. Should anything escape
    meanwhile, the backend keeps the rules it had, never one probe."""
    path = tmp_path / "cal.json"
    path.write_text(json.dumps({"rules": [_rule(), _rule(world=6)]}))
    _C._set_cost_rules([_rule(world=7)])
    real = _C._set_cost_rules
    calls: list[Any] = []

    class Bug(Exception):
        pass

    def probe(rules: Any) -> None:
        calls.append(rules)
        if len(calls) == 2:  # the second probe fails, as no file problem would
            raise Bug("a bug, not a bad file")
        real(rules)

    monkeypatch.setattr(_C, "_set_cost_rules", probe)
    with pytest.raises(Bug):
        calibration.load_into_backend(path)
    monkeypatch.undo()
    assert [r["world"] for r in _C._cost_rules()] == [7]


def _import(tmp_path: Path, calibration_file: Path, before: str = "") -> Any:
    """``import torchdist_ext`` in a fresh process with ``calibration_file``; ``before``
    runs first (each import takes seconds)."""
    code = (before + "\nimport torchdist_ext\nfrom torchdist_ext import _C\n"
            "print('rules', [r['world'] for r in _C._cost_rules()])")
    env = {**os.environ, "TDX_CALIBRATION": str(calibration_file)}
    return subprocess.run([sys.executable, "-c", code], env=env, capture_output=True,
                          text=True, timeout=300, cwd=tmp_path)


def test_import_survives_such_files(tmp_path: Path) -> None:
    """The import itself: a bad file is a warning, and the good rule still loads."""
    path = tmp_path / "bad.json"
    path.write_text(json.dumps({"ignored_rules": 5, "rules": [_rule(), {"world": 1}]}))
    proc = _import(tmp_path, path)
    assert proc.returncode == 0 and proc.stdout.strip() == "rules [5]", proc.stderr
    assert "ignoring 1 malformed rule(s)" in proc.stderr and "Traceback" not in proc.stderr


def test_import_does_not_hide_a_bug_as_a_bad_file(tmp_path: Path) -> None:
    """Only file problems are warnings at import; an error of the code itself (here a
    json.loads that breaks) surfaces as itself, not as advice to delete the file."""
    path = tmp_path / "good.json"
    path.write_text(json.dumps({"rules": [_rule()]}))
    proc = _import(tmp_path, path, "import json\n"
                                   "def broken(*a, **k):\n"
                                   "    raise RuntimeError('a bug in the loader')\n"
                                   "json.loads = broken")
    assert proc.returncode != 0, proc.stdout
    assert "RuntimeError: a bug in the loader" in proc.stderr, proc.stderr
    assert "ignoring" not in proc.stderr and "delete it" not in proc.stderr, proc.stderr


# ---------------------------------------------------------------------------------------
# Examples: bad flags stop before any process group starts
# ---------------------------------------------------------------------------------------

@pytest.fixture
def examples(monkeypatch: pytest.MonkeyPatch):
    """The examples directory on sys.path; their modules are imported fresh."""
    monkeypatch.syspath_prepend(str(REPO / "examples"))
    for name in ("common", "data", "train", "tensor_parallel", "pipeline"):
        monkeypatch.delitem(sys.modules, name, raising=False)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        yield importlib.import_module("common")


def _exits_with_usage(main: Any, capsys: pytest.CaptureFixture[str]) -> str:
    with pytest.raises(SystemExit) as info:
        main()
    assert info.value.code == 2
    err = capsys.readouterr().err
    assert "Traceback" not in err
    return err.strip().splitlines()[-1]


def test_examples_refuse_cuda_without_a_gpu(examples: Any, monkeypatch: pytest.MonkeyPatch,
                                            capsys: pytest.CaptureFixture[str]) -> None:
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    monkeypatch.setattr(dist, "init_process_group", lambda *a, **k: pytest.fail("started"))
    monkeypatch.setattr(sys, "argv", ["ddp.py", "--device", "cuda"])
    assert "--device cuda: no CUDA device is visible" in _exits_with_usage(
        lambda: examples.parse_args("doc"), capsys)
    train = importlib.import_module("train")
    monkeypatch.setattr(sys, "argv", ["train.py", "--device", "cuda"])
    assert "--device cuda: no CUDA device is visible" in _exits_with_usage(train.main, capsys)
    monkeypatch.setattr(sys, "argv", ["train.py", "--device", "cuda:0"])
    assert "--device cuda:0: no CUDA device is visible" in _exits_with_usage(train.main, capsys)


def test_train_takes_a_gpu_index(examples: Any, monkeypatch: pytest.MonkeyPatch,
                                 capsys: pytest.CaptureFixture[str]) -> None:
    """train.py's --device takes cuda:N, as it always did, and refuses what it cannot
    train on."""
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    train = importlib.import_module("train")
    for device in ("cpu", "cuda", "cuda:0", "cuda:3"):
        monkeypatch.setattr(sys, "argv", ["train.py", "--device", device])
        assert train.parse_args().device == device
    for device in ("tpu", "cuda:x", "mps"):
        monkeypatch.setattr(sys, "argv", ["train.py", "--device", device])
        assert f"{device!r}: use cpu, cuda or cuda:N" in _exits_with_usage(
            train.parse_args, capsys)


@pytest.mark.parametrize("tp", ["0", "-2"])
def test_tensor_parallel_refuses_a_degree_below_one(
        tp: str, examples: Any, monkeypatch: pytest.MonkeyPatch,
        capsys: pytest.CaptureFixture[str]) -> None:
    tensor_parallel = importlib.import_module("tensor_parallel")
    monkeypatch.setattr(tensor_parallel, "setup", lambda args: pytest.fail("started"))
    monkeypatch.setattr(sys, "argv", ["tensor_parallel.py", "--tp", tp])
    assert f"--tp: must be at least 1, got {tp}" in _exits_with_usage(
        tensor_parallel.main, capsys)


@pytest.mark.parametrize("script, flag, value, message", [
    ("ddp.py", "--epochs", "0", "must be at least 1, got 0"),
    ("ddp.py", "--batch-size", "-4", "must be at least 1, got -4"),
    ("ddp.py", "--hidden", "0", "must be at least 1, got 0"),
    ("ddp.py", "--samples", "0", "must be at least 1, got 0"),
    ("ddp.py", "--lr", "0", "must be a finite number > 0, got 0"),
    ("ddp.py", "--lr", "nan", "must be a finite number > 0, got nan"),
    ("train.py", "--epochs", "0", "must be at least 1, got 0"),
    ("train.py", "--batch-size", "0", "must be at least 1, got 0"),
    ("train.py", "--lr", "-1", "must be a finite number > 0, got -1"),
    ("pipeline.py", "--microbatches", "0", "must be at least 1, got 0"),
])
def test_examples_refuse_counts_below_one(
        script: str, flag: str, value: str, message: str, examples: Any,
        monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]) -> None:
    """A zero epoch, batch or microbatch count used to train nothing, or divide by zero,
    after the group had started; it is a usage error naming the flag."""
    monkeypatch.setattr(dist, "init_process_group", lambda *a, **k: pytest.fail("started"))
    module = importlib.import_module(script[:-3]) if script != "ddp.py" else None
    monkeypatch.setattr(sys, "argv", [script, f"{flag}={value}"])
    main = module.main if module is not None else lambda: examples.parse_args("doc")
    assert f"{flag}: {message}" in _exits_with_usage(main, capsys)


def test_pipeline_refuses_more_microbatches_than_samples(
        examples: Any, monkeypatch: pytest.MonkeyPatch) -> None:
    pipeline = importlib.import_module("pipeline")
    monkeypatch.setattr(pipeline, "setup", lambda args: pytest.fail("started"))
    monkeypatch.setattr(sys, "argv", ["pipeline.py", "--batch-size", "4", "--microbatches", "8"])
    with pytest.raises(SystemExit, match="--microbatches 8 exceeds --batch-size 4"):
        pipeline.main()


def test_a_group_larger_than_the_tags_can_name_is_refused(tmp_path: Path) -> None:
    """A message's tag names its sender in 16 bits, so a group of 65536 ranks would give
    two ranks one name: its creation fails at once, naming the limit, before any rank is
    waited for."""
    import datetime

    store = dist.FileStore(str(tmp_path / "store"), 1)
    with pytest.raises(ValueError, match="groups are limited to 65535 ranks"):
        _C._create_backend(store, 0, 65536, datetime.timedelta(seconds=2), "big",
                           list(range(65536)))

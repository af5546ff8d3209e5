"""Stored cost-model calibrations, one per host.

``python -m torchdist_ext.bench calibrate`` measures the α (per step), β (per byte moved)
and γ (per byte reduced) terms of each link on this machine and writes them here, with
``thread_exponent`` where the ranks got several threads each for the window all_reduce
(a pass over T threads is priced T**exponent times faster);
``python -m torchdist_ext.bench tune`` adds measured rules (for a collective, world size,
placement, crowding and thread count, which algorithm runs which sizes) where the terms do
not predict well, as on hosts whose ranks outnumber their CPUs. Importing
:mod:`torchdist_ext` loads all of it.
Without a file the backend's defaults apply.

The file is ``$TDX_CALIBRATION`` when set, else
``$XDG_CACHE_HOME/torchdist_ext/calibration-<hostname>.json`` (``~/.cache`` by default).
"""

from __future__ import annotations

import json
import math
import numbers
import os
import socket
import tempfile
import warnings
from pathlib import Path
from typing import Any, Iterable

from . import _C

__all__ = ["DEFAULT_LINKS", "DEFAULT_THREAD_EXPONENT", "LINKS", "MAX_THREADS", "MAX_WORLD",
           "RULE_KEYS", "TERMS", "as_real", "calibration_path", "check_links", "load", "save",
           "load_into_backend", "rule_key"]

# The backend's links, in its order: net, local, shm, cma.
LINKS = tuple(_C._cost_model())


def calibration_path() -> Path:
    """Where this host's calibration lives."""
    explicit = os.environ.get("TDX_CALIBRATION")
    if explicit:
        return Path(explicit)
    cache = os.environ.get("XDG_CACHE_HOME") or os.path.join(os.path.expanduser("~"), ".cache")
    return Path(cache) / "torchdist_ext" / f"calibration-{socket.gethostname()}.json"


TERMS = ("alpha", "beta", "gamma")
# The backend's cost model at import, before any calibration file is applied: what a
# process prices with when it has no file (tune --out falls back to it, as the ranks it
# spawns do).
DEFAULT_LINKS = {name: dict(terms) for name, terms in _C._cost_model().items()}
# A window all_reduce pass split over T threads is priced T**exponent times faster; the
# file's ``thread_exponent`` (fitted by calibrate where the ranks get several threads)
# replaces this default.
DEFAULT_THREAD_EXPONENT = _C._thread_exponent()


def _exponent(v: Any) -> bool:
    """A thread exponent: a real number (not bool) from 0 to 1."""
    x = as_real(v)
    return x is not None and 0.0 <= x <= 1.0


def as_real(value: Any) -> float | None:
    """``value`` as a float when it is a real number (an int, a float, a numpy scalar, any
    :class:`numbers.Real`) other than a bool, which is an int to Python but never a size,
    a count or a cost; else None. An int beyond a double's range is ``inf``. The one test
    of "a number" behind the cost terms, ``predict``'s arguments and the bench's options."""
    if isinstance(value, bool) or not isinstance(value, numbers.Real):
        return None
    try:
        return float(value)
    except OverflowError:
        return math.inf


def _number(v: Any) -> bool:
    # JSON admits NaN and Infinity: neither is a cost. A NaN term would make every
    # comparison false and auto pick the first algorithm.
    x = as_real(v)
    return x is not None and math.isfinite(x) and x >= 0


def _plain(v: Any) -> int | float:
    """A number that passed :func:`_number` as a plain int or float (what JSON writes)."""
    return v if type(v) in (int, float) else float(v)


def _valid(links: Any) -> bool:
    if not isinstance(links, dict):
        return False
    for name, terms in links.items():
        if name not in LINKS or not isinstance(terms, dict):
            return False
        if not all(_number(terms.get(key)) for key in TERMS):
            return False
    return True


def _shown(value: Any) -> str:
    """``repr(value)``, cut short: a 400-digit number must not flood a one-line error."""
    text = repr(value)
    return text if len(text) <= 40 else text[:37] + "..."


def check_links(links: Any, where: str = "set_cost_model") -> dict[str, dict[str, float]]:
    """``links`` (``{link: {alpha, beta, gamma}}``, any of :data:`LINKS`, each term a finite
    number >= 0, numpy scalars included) with each term a float and nothing else, as the
    file loader takes a file's links: other keys beside the three terms are ignored, as
    they are in a file. Anything the loader would refuse is a TypeError or ValueError
    naming it; ``where`` names the caller in the message."""
    shape = ("a dict {link: {'alpha': a, 'beta': b, 'gamma': c}} with links among "
             f"{', '.join(LINKS)}")
    if not isinstance(links, dict):
        raise TypeError(f"{where}: the model must be {shape}, not {type(links).__name__}")
    out: dict[str, dict[str, float]] = {}
    for name, terms in links.items():
        if name not in LINKS:
            raise ValueError(f"{where}: unknown link {name!r}; the links are "
                             f"{', '.join(LINKS)}")
        if not isinstance(terms, dict):
            raise TypeError(f"{where}: link {name!r} must map alpha, beta and gamma to "
                            f"numbers, not {type(terms).__name__}")
        missing = [k for k in TERMS if k not in terms]
        if missing:
            raise ValueError(f"{where}: link {name!r} needs alpha, beta and gamma; missing "
                             f"{', '.join(missing)} (torchdist_ext.cost_model() shows the "
                             "current terms)")
        for key in TERMS:
            v = terms[key]
            if as_real(v) is None:
                raise TypeError(f"{where}: {name}.{key} must be a number of seconds, not "
                                f"{type(v).__name__} {_shown(v)}")
            if not _number(v):
                raise ValueError(f"{where}: {name}.{key} must be a finite number >= 0, got "
                                 f"{_shown(v)}")
        out[name] = {key: float(terms[key]) for key in TERMS}
    return out


# What a measured rule holds; sizes in [min_bytes, max_bytes) of `collective` at `world`
# ranks placed as `placement` (hosts, host or windows), `crowded`, each rank splitting the
# window all_reduce over `threads` threads (TDX_SHM_THREADS as the group decided it) run
# `algorithm`. A rule saved before rules counted threads has none and reads as threads 1:
# the default count when most such files were tuned, and auto's on a crowded host.
RULE_KEYS = ("collective", "world", "placement", "crowded", "threads", "min_bytes",
             "max_bytes", "algorithm")
_PLACEMENTS = ("hosts", "host", "windows")
MAX_THREADS = 16  # TDX_SHM_THREADS' range: the backend's kMaxPassThreads (_C._MAX_PASS_THREADS)


# The backend's limit on a rule's world size, and the largest world predict() prices: far
# beyond any job, and pricing a much larger one takes the backend minutes.
MAX_WORLD = 1 << 24


def _valid_rule(r: Any) -> bool:
    return (isinstance(r, dict) and set(RULE_KEYS) - {"threads"} <= set(r) <= set(RULE_KEYS)
            and isinstance(r["collective"], str) and isinstance(r["algorithm"], str)
            and type(r["world"]) is int and 1 <= r["world"] <= MAX_WORLD
            and r["placement"] in _PLACEMENTS and type(r["crowded"]) is bool
            # only the windows' all_reduce splits its passes; elsewhere a group has 1
            and type(r.get("threads", 1)) is int
            and (1 <= r.get("threads", 1) <= MAX_THREADS if r["placement"] == "windows"
                 else r.get("threads", 1) == 1)
            and _number(r["min_bytes"])
            # the last rule of a range may reach any size
            and (r["max_bytes"] == math.inf or _number(r["max_bytes"]))
            and r["min_bytes"] < r["max_bytes"])


def _valid_rules(rules: Any) -> bool:
    return isinstance(rules, list) and all(_valid_rule(r) for r in rules)


def rule_key(rule: dict[str, Any]) -> tuple[str, int, str, bool, int]:
    """What a rule applies to, but for its sizes: a tuning run replaces the rules of the
    keys it measured and keeps the others (those of another thread count among them)."""
    return (rule["collective"], rule["world"], rule["placement"], rule["crowded"],
            rule.get("threads", 1))


def _counted(rule: dict[str, Any]) -> dict[str, Any]:
    """A valid rule with its thread count written out (1 where it has none)."""
    return {**rule, "threads": rule.get("threads", 1)}


def load(path: Path | None = None) -> dict[str, Any] | None:
    """The stored calibration (``{"links": {...}, "rules": [...], ...}``, either possibly
    empty), or None when there is none. Never raises on a bad file: it warns and returns
    None (or drops the bad rules), since every ``import torchdist_ext`` calls it."""
    path = path or calibration_path()
    try:
        return _load(path)
    except RecursionError:
        # json (and repr) recurse per level of nesting: a file nested thousands deep
        # would otherwise end the import.
        warnings.warn(f"torchdist_ext: ignoring calibration {path}: nested too deeply to "
                      "read; rerun `python -m torchdist_ext.bench calibrate` or delete it")
        return None


def _load(path: Path) -> dict[str, Any] | None:
    try:
        data = json.loads(path.read_text())
    except FileNotFoundError:
        return None
    except (OSError, ValueError) as exc:
        warnings.warn(f"torchdist_ext: ignoring unreadable calibration {path}: {exc}")
        return None
    if isinstance(data, dict) and "thread_exponent" in data and \
            not _exponent(data["thread_exponent"]):
        warnings.warn(f"torchdist_ext: ignoring thread_exponent "
                      f"{_shown(data['thread_exponent'])} of {path}: it is a number from 0 "
                      "to 1; rerun `python -m torchdist_ext.bench calibrate` or delete it")
        del data["thread_exponent"]
    if (not isinstance(data, dict) or not _valid(data.setdefault("links", {}))
            or not isinstance(data.setdefault("rules", []), list)
            or not (data["links"] or data["rules"] or "thread_exponent" in data)):
        warnings.warn(f"torchdist_ext: ignoring malformed calibration {path}; "
                      "rerun `python -m torchdist_ext.bench calibrate` or delete it")
        return None
    bad = [r for r in data["rules"] if not _valid_rule(r)]
    if bad:
        # A rule edited by hand may be wrong; the terms and the other rules still hold.
        warnings.warn(f"torchdist_ext: ignoring {len(bad)} malformed rule(s) of {path} "
                      f"(each needs exactly {', '.join(RULE_KEYS)}, threads optional): "
                      f"{bad[0]!r}; a later save keeps them under 'ignored_rules'")
        data["rules"] = [r for r in data["rules"] if _valid_rule(r)]
        # An earlier save wrote a list here, but the file may have been edited: keep
        # whatever else stands there as one more entry rather than fail on it.
        before = data.get("ignored_rules")
        before = [] if before is None else before if isinstance(before, list) else [before]
        data["ignored_rules"] = before + bad
    data["rules"] = [_counted(r) for r in data["rules"]]
    links = data["links"]
    if "net" in links and "local" not in links:
        # Written before same-host messages had a link of their own: its `net` priced
        # them (spawned ranks share a host), as it did when it was saved.
        links["local"] = dict(links["net"])
    return data


def save(data: dict[str, Any], path: Path | None = None,
         replaces: Iterable[tuple[str, int, str, bool, int]] = ()) -> Path:
    """Write a calibration (its ``links``, its ``rules``, its ``thread_exponent``, any of
    them) atomically; returns the path. Links the file already holds and ``data`` does
    not (``net`` from a run across hosts, when this one ran on one host) are kept, their
    names listed in
    ``data["kept_from_file"]``; so are rules for keys (:func:`rule_key`) that ``data`` has
    none for, unless ``replaces`` names the key (a tuning that measured it and found the
    model right), and the file's thread exponent unless ``data`` has one. A file left with
    none of the three is removed."""
    if not isinstance(data, dict):
        raise ValueError("a calibration is a dict with links {net|local|shm|cma: {alpha, "
                         "beta, gamma}}, each a finite number >= 0, and/or rules")
    data = {**data, "links": data.get("links", {}), "rules": data.get("rules", [])}
    if not _valid(data["links"]):
        raise ValueError("calibration needs links {net|local|shm|cma: {alpha, beta, gamma}}, "
                         "each a finite number >= 0")
    if not _valid_rules(data["rules"]):
        raise ValueError(f"each measured rule needs exactly {', '.join(RULE_KEYS)} "
                         f"(threads optional, 1 when left out): a world >= 1, a placement "
                         f"of {', '.join(_PLACEMENTS)}, crowded true or false, threads 1 to "
                         f"{MAX_THREADS} with windows and 1 elsewhere, and "
                         f"0 <= min_bytes < max_bytes")
    # Terms and sizes may be any real numbers (numpy scalars among them); the file holds
    # plain ints and floats, which JSON can write.
    data["links"] = {name: {**terms, **{k: _plain(terms[k]) for k in TERMS}}
                     for name, terms in data["links"].items()}
    data["rules"] = [{**_counted(r), "min_bytes": _plain(r["min_bytes"]),
                      "max_bytes": _plain(r["max_bytes"])} for r in data["rules"]]
    # (a key without its thread count, as rule_key gave before it had one, means 1)
    replaces = {tuple(k) if len(k) == 5 else (*k, 1) for k in replaces}
    if "thread_exponent" in data:
        if not _exponent(data["thread_exponent"]):
            raise ValueError(f"thread_exponent must be a number from 0 to 1, got "
                             f"{_shown(data['thread_exponent'])}")
        data["thread_exponent"] = float(data["thread_exponent"])
    if not (data["links"] or data["rules"] or replaces or "thread_exponent" in data):
        raise ValueError("nothing to save: the calibration has neither links, rules nor a "
                         "thread exponent")
    path = path or calibration_path()
    before = load(path) if path.exists() else None
    if before is None and path.exists():
        # Unreadable (load warned why): keep it beside the new one rather than lose it.
        aside = path.with_name(path.name + ".unreadable")
        os.replace(path, aside)
        warnings.warn(f"torchdist_ext: moved the unreadable calibration {path} to {aside}")
    if before is not None:
        # (a file of rules alone keeps no links on anyone's behalf)
        kept = sorted(set(before["links"]) - set(data["links"])) if data["links"] else \
            before.get("kept_from_file", [])
        fresh = {rule_key(r) for r in data["rules"]} | replaces
        rules = [r for r in before["rules"] if rule_key(r) not in fresh] + data["rules"]
        # The file's other entries (a calibration's points, a tuning's winners) stay
        # unless this one has its own.
        data = {**before, **data, "links": {**before["links"], **data["links"]},
                "rules": rules, "kept_from_file": kept}
    if not (data["links"] or data["rules"] or "thread_exponent" in data):
        if path.exists():
            path.unlink()
        return path
    path.parent.mkdir(parents=True, exist_ok=True)
    # A temporary file of its own in the same directory: two saves at once never write
    # into one file, and the rename is atomic.
    fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=f".{path.name}.", suffix=".tmp")
    try:
        with os.fdopen(fd, "w") as f:
            f.write(json.dumps(data, indent=2, sort_keys=True))
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
    except BaseException:
        try:
            os.unlink(tmp)
        except OSError:
            pass
        raise
    return path


def load_into_backend(path: Path | None = None) -> bool:
    """Apply the stored calibration to the backend's cost model; False when none."""
    path = path or calibration_path()  # resolved once: the warnings name this file
    data = load(path)
    if data is None:
        return False
    # Each rule is tried alone (one naming an algorithm this build lacks drops alone) by
    # installing it as the backend's only rule; whatever happens meanwhile, the backend
    # ends with the rules it had or the rules that passed, never with one probe.
    before = _C._cost_rules()
    rules = []
    installed = False
    try:
        for r in data["rules"]:
            try:
                _C._set_cost_rules([r])
                rules.append(r)
            except (ValueError, TypeError, RuntimeError) as exc:
                warnings.warn(f"torchdist_ext: ignoring a measured rule of {path}: {exc}; "
                              "rerun `python -m torchdist_ext.bench tune` or delete it")
        _C._set_cost_rules(rules)
        installed = True
    finally:
        if not installed:
            _C._set_cost_rules(before)
    _C._set_cost_model(data["links"])
    if "thread_exponent" in data:
        _C._set_thread_exponent(float(data["thread_exponent"]))
    return True

"""Stored cost-model calibrations, one per host.

``python -m torchdist_ext.bench calibrate`` measures the α (per step), β (per byte moved)
and γ (per byte reduced) terms of each link on this machine and writes them here;
importing :mod:`torchdist_ext` loads them. Without a file the backend's defaults apply.

The file is ``$TDX_CALIBRATION`` when set, else
``$XDG_CACHE_HOME/torchdist_ext/calibration-<hostname>.json`` (``~/.cache`` by default).
"""

from __future__ import annotations

import json
import math
import os
import socket
import tempfile
import warnings
from pathlib import Path
from typing import Any

from . import _C

__all__ = ["calibration_path", "load", "save", "load_into_backend"]

# The backend's links, in its order: net, local, shm, cma.
LINKS = tuple(_C._cost_model())


def calibration_path() -> Path:
    """Where this host's calibration lives."""
    explicit = os.environ.get("TDX_CALIBRATION")
    if explicit:
        return Path(explicit)
    cache = os.environ.get("XDG_CACHE_HOME") or os.path.join(os.path.expanduser("~"), ".cache")
    return Path(cache) / "torchdist_ext" / f"calibration-{socket.gethostname()}.json"


def _valid(links: Any) -> bool:
    if not isinstance(links, dict):
        return False
    for name, terms in links.items():
        if name not in LINKS or not isinstance(terms, dict):
            return False
        for key in ("alpha", "beta", "gamma"):
            v = terms.get(key)
            # JSON admits NaN and Infinity, and bool is an int: none is a cost. A NaN
            # term would make every comparison false and auto pick the first algorithm.
            try:  # a huge JSON integer overflows float()
                ok = type(v) in (int, float) and math.isfinite(float(v)) and v >= 0
            except OverflowError:
                ok = False
            if not ok:
                return False
    return True


def load(path: Path | None = None) -> dict[str, Any] | None:
    """The stored calibration (``{"links": {...}, ...}``), or None when there is none."""
    path = path or calibration_path()
    try:
        data = json.loads(path.read_text())
    except FileNotFoundError:
        return None
    except (OSError, ValueError) as exc:
        warnings.warn(f"torchdist_ext: ignoring unreadable calibration {path}: {exc}")
        return None
    if not isinstance(data, dict) or not _valid(data.get("links")):
        warnings.warn(f"torchdist_ext: ignoring malformed calibration {path}; "
                      "rerun `python -m torchdist_ext.bench calibrate` or delete it")
        return None
    links = data["links"]
    if "net" in links and "local" not in links:
        # Written before same-host messages had a link of their own: its `net` priced
        # them (spawned ranks share a host), as it did when it was saved.
        links["local"] = dict(links["net"])
    return data


def save(data: dict[str, Any], path: Path | None = None) -> Path:
    """Write a calibration (with its ``links``) atomically; returns the path. Links the
    file already holds and ``data`` does not (``net`` from a run across hosts, when this
    one ran on one host) are kept; their names go to ``data["kept_from_file"]``."""
    if not isinstance(data, dict) or not _valid(data.get("links")):
        raise ValueError("calibration needs links {net|local|shm|cma: {alpha, beta, gamma}}, "
                         "each a finite number >= 0")
    path = path or calibration_path()
    before = load(path) if path.exists() else None
    if before is not None:
        kept = sorted(set(before["links"]) - set(data["links"]))
        data = {**data, "links": {**before["links"], **data["links"]},
                "kept_from_file": kept}
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
    data = load(path)
    if data is None:
        return False
    _C._set_cost_model(data["links"])
    return True

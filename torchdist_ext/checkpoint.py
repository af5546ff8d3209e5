"""Per-rank checkpoints that survive a crash mid-save, for restarting a job where it
stopped (torchrun ``--max-restarts``).

    from torchdist_ext.checkpoint import Checkpointer, rng_state, set_rng_state

    ckpt = Checkpointer("ckpt/", keep=2)
    found = ckpt.load()                      # collective; None on a fresh start
    if found is not None:
        step, state = found
        model.load_state_dict(state["model"]); opt.load_state_dict(state["opt"])
        set_rng_state(state["rng"])
    ...
    ckpt.save(step, {"model": model.state_dict(), "opt": opt.state_dict(),
                     "rng": rng_state()})    # collective

Each rank writes its own file, ``step-<step>/rank-<r>-of-<world>.<token>.pt``: a
temporary file, flushed to disk, then renamed, so a file that exists is whole. The token
is drawn by the group's first rank for each save, so files of an interrupted save of the
same step (a crash, then a restart that saves that step again) never pass for a part of
the new one. A step is complete when every rank of the group has its file with one token
and the group's size; ``load`` takes the newest complete step every rank can read, so a
save cut short by a crash is skipped, never half-loaded.

``save``, ``wait``, ``load`` and ``steps`` are collectives over ``group``: every rank
calls them, in the same order. A rank that cannot write or read its file makes every
rank raise :class:`CheckpointError` naming it, instead of leaving the others waiting.
Files work on a shared file system and on per-node disks alike: each rank reads and
writes only its own. State that every rank holds alike (a DDP model) is written by every
rank; to save it once, or to load at another world size, use torch.distributed.checkpoint,
which reshards.
"""

from __future__ import annotations

import copy
import os
import random
import re
import threading
import time
import uuid
import warnings
from pathlib import Path
from typing import Any, Mapping, Optional

import torch
import torch.distributed as dist

__all__ = ["Checkpointer", "CheckpointError", "rng_state", "set_rng_state"]

_FORMAT = 1
_STEP_DIR = re.compile(r"^step-(\d+)$")
_RANK_FILE = re.compile(r"^rank-(\d+)-of-(\d+)\.([0-9a-f]+)\.pt$")


class CheckpointError(RuntimeError):
    """A save or load that failed on some rank; raised on every rank of the group."""


class Checkpointer:
    """Saves and loads this rank's part of a job's state under ``directory``.

    ``keep``: how many complete steps to keep. A save that completes keeps its step and
    the ``keep - 1`` newest complete steps before it, and removes this rank's files of
    every other step, newer ones too: those of a run rewound by ``load(step=...)``, or of
    an earlier run in the same directory (so ``load()`` before the first save).
    ``group``: the ranks that save together (default: all).
    """

    def __init__(self, directory: str | os.PathLike, keep: int = 2,
                 group: Optional[dist.ProcessGroup] = None) -> None:
        if not isinstance(directory, (str, os.PathLike)) or not os.fspath(directory):
            raise TypeError(f"Checkpointer: directory must be a path, not {directory!r}")
        if isinstance(keep, bool) or not isinstance(keep, int) or keep < 1:
            raise ValueError(f"Checkpointer: keep must be an int >= 1 (complete steps kept), "
                             f"not {keep!r}")
        if not dist.is_initialized():
            raise RuntimeError("Checkpointer: torch.distributed is not initialized; call "
                               "dist.init_process_group first")
        self.directory = Path(directory)
        self.keep = keep
        self.group = group
        self.rank = dist.get_rank(group)
        self.world = dist.get_world_size(group)
        if self.rank < 0:
            raise ValueError("Checkpointer: this process is not a member of group")
        self._pending: Optional[_Write] = None

    # --- saving ------------------------------------------------------------------------

    def save(self, step: int, state: Mapping[str, Any], blocking: bool = True) -> None:
        """Writes ``state`` as this rank's part of ``step``. Collective.

        ``blocking=False`` copies the state's tensors to CPU memory now and writes them
        on a thread, so training goes on while the file is written; the next ``save``,
        ``load`` or ``wait`` finishes it (and raises its errors). Until then the step
        counts as complete only if every rank's write ended, so a crash meanwhile
        resumes from the step before."""
        if isinstance(step, bool) or not isinstance(step, int) or step < 0:
            raise ValueError(f"Checkpointer.save (rank {self.rank}): step must be an int "
                             f">= 0, not {step!r}")
        if not isinstance(state, Mapping):
            raise TypeError(f"Checkpointer.save (rank {self.rank}): state must be a "
                            f"mapping (a dict of state dicts), not {type(state).__name__}")
        self.wait()
        token = self._token()
        path = self._step_dir(step) / f"rank-{self.rank:05d}-of-{self.world:05d}.{token}.pt"
        write = _Write(step, path, {"format": _FORMAT, "step": step, "rank": self.rank,
                                    "world": self.world, "state": state})
        self._pending = write
        if blocking:
            write.run()
            self.wait()
            return
        try:
            write.payload["state"] = _snapshot(state)
        except Exception as e:  # noqa: BLE001 - reported to every rank by wait()
            # Not raised here: the other ranks went on, and hear of it at the next save,
            # load or wait, with this rank.
            write.error = (f"could not copy its state for checkpoint step {step}: "
                           f"{type(e).__name__}: {e}")
            return
        write.start()

    def wait(self) -> None:
        """Finishes the last ``save``: waits for this rank's write, learns whether every
        rank's succeeded (raising :class:`CheckpointError` naming the ranks that failed)
        and removes this rank's files of steps no longer kept. Collective when a save is
        pending; a no-op otherwise."""
        write, self._pending = self._pending, None
        if write is None:
            return
        write.join()
        every = self._look(write.error, f"; checkpoint step {write.step} is incomplete and "
                           "load() skips it. Fix the cause (space, permissions, an object "
                           "torch.save cannot pickle) and save again")
        # The step just saved is the newest: steps after it belong to a run rewound by
        # load(step=...) or to an interrupted save, and go.
        complete = _complete(every, self.world)
        older = sorted(s for s in complete if s < write.step)
        kept = {write.step, *older[max(0, len(older) - self.keep + 1):]}
        self._prune({s: complete[s] for s in kept if s in complete})

    # --- loading -----------------------------------------------------------------------

    def steps(self) -> list[int]:
        """The complete steps every rank can load, oldest first. Collective."""
        self.wait()
        return sorted(_complete(self._look(), self.world))

    def load(self, step: Optional[int] = None, map_location: Any = "cpu",
             weights_only: bool = True) -> Optional[tuple[int, dict]]:
        """``(step, state)`` of the newest complete step (or of ``step``), or None when
        there is none. Collective: every rank gets the same step, and its own state.

        Raises :class:`CheckpointError` on every rank when ``step`` is not complete, when
        the newest checkpoint was saved by another number of ranks, or when some rank
        cannot read its file. ``weights_only`` is torch.load's: True reads tensors and
        plain Python values only; pass False, for files you trust, to unpickle other
        objects."""
        if step is not None and (isinstance(step, bool) or not isinstance(step, int)
                                 or step < 0):
            raise ValueError(f"Checkpointer.load (rank {self.rank}): step must be None or "
                             f"an int >= 0, not {step!r}")
        self.wait()
        every = self._look()
        complete = _complete(every, self.world)
        foreign = _foreign(every, self.world)
        if step is None:
            newest = max(complete, default=None)
            stale = [(s, w) for s, w in foreign.items() if newest is None or s > newest]
            if stale:
                s, w = max(stale)
                raise CheckpointError(
                    f"Checkpointer.load (rank {self.rank}): the newest checkpoint in "
                    f"{self.directory}, step {s}, was saved by {w} ranks and this group has "
                    f"{self.world}. Load it at {w} ranks; or save through "
                    "torch.distributed.checkpoint, which reshards; or use another directory "
                    "to start afresh")
            if newest is None:
                if self.rank == 0 and any(files for _, files in every):
                    warnings.warn(
                        f"Checkpointer.load: {self.directory} holds checkpoint files but no "
                        "step that every rank of this group can read whole (a first save "
                        "cut short, or ranks restarted on other nodes than their files' "
                        "disks); starting afresh", stacklevel=2)
                return None
            step = newest
        elif step not in complete:
            have = sorted(complete)
            raise CheckpointError(
                f"Checkpointer.load (rank {self.rank}): step {step} is not a complete "
                f"checkpoint of {self.world} ranks in {self.directory}; complete steps: "
                f"{have if have else 'none'}")
        path = self._step_dir(step) / (f"rank-{self.rank:05d}-of-{self.world:05d}."
                                       f"{complete[step]}.pt")
        error, state = None, None
        try:
            payload = torch.load(path, map_location=map_location, weights_only=weights_only)
            if (not isinstance(payload, dict) or payload.get("format") != _FORMAT
                    or payload.get("rank") != self.rank or payload.get("step") != step):
                raise ValueError("not a checkpoint file of this rank and step")
            state = payload["state"]
        except Exception as e:  # noqa: BLE001 - every rank must hear of it
            error = f"{path}: {type(e).__name__}: {e}"
        errors = self._gather(error)
        failed = [(r, err) for r, err in enumerate(errors) if err is not None]
        if failed:
            raise CheckpointError(
                f"checkpoint step {step}: "
                + "; ".join(f"rank {r} of {self.world} could not read {err}"
                            for r, err in failed)
                + ". Pass an older step to load(step=...), see steps()")
        return step, state

    # --- helpers -----------------------------------------------------------------------

    def _step_dir(self, step: int) -> Path:
        return self.directory / f"step-{step:012d}"

    def _token(self) -> str:
        """A fresh hex token, the group's first rank's, the same on every rank; tokens
        sort in the order of their saves (the clock first), so of two whole saves of one
        step the later wins. An all_gather rather than a broadcast: no rank starts
        writing before every rank has finished pruning after the last save (which may
        remove a step directory)."""
        return self._gather(f"{time.time_ns():016x}{uuid.uuid4().hex[:8]}")[0]

    def _gather(self, value: Any) -> list[Any]:
        every: list[Any] = [None] * self.world
        dist.all_gather_object(every, value, group=self.group)
        return every

    def _listing(self) -> tuple[Optional[str], dict[int, list[tuple[int, str]]]]:
        """(error, files): this rank's files, step -> [(world, token)], from the rank's own
        view of the directory (another node's disk may hold the other ranks' files); an
        error reading it is returned, for every rank to hear of."""
        out: dict[int, list[tuple[int, str]]] = {}
        try:
            steps = list(os.scandir(self.directory))
        except FileNotFoundError:
            return None, out
        except OSError as e:
            return f"could not list {self.directory}: {type(e).__name__}: {e}", out
        for entry in steps:
            m = _STEP_DIR.match(entry.name)
            try:
                names = os.listdir(entry.path) if m and entry.is_dir() else []
            except FileNotFoundError:
                continue  # removed meanwhile by another rank's pruning
            except OSError as e:
                return f"could not list {entry.path}: {type(e).__name__}: {e}", out
            for name in names:
                f = _RANK_FILE.match(name)
                if f and int(f.group(1)) == self.rank:
                    out.setdefault(int(m.group(1)), []).append((int(f.group(2)), f.group(3)))
                elif f and int(f.group(1)) >= self.world and self.rank == 0:
                    # A rank this group lacks: tells the first rank of a larger world's save.
                    out.setdefault(int(m.group(1)), []).append((int(f.group(2)), "-"))
        return None, out

    def _look(self, error: Optional[str] = None, consequence: str = "") -> list[Any]:
        """Every rank's listing (a collective). Raises on every rank when some rank could
        not list the directory, or had ``error`` (what it could not do, and why), with
        ``consequence`` after the ranks' errors."""
        listed_error, files = self._listing()
        every = self._gather((error or listed_error, files))
        failed = [(r, err) for r, (err, _) in enumerate(every) if err is not None]
        if failed:
            raise CheckpointError(
                f"Checkpointer (rank {self.rank}): "
                + "; ".join(f"rank {r} of {self.world} {err}" for r, err in failed)
                + consequence)
        return every

    def _prune(self, kept: dict[int, str]) -> None:
        """Removes this rank's files of steps not in ``kept`` (step -> the token of its
        whole save), its files of kept steps under another token (an earlier save of the
        step), leftovers of its writes, and step directories left empty. Best effort:
        another rank may remove a directory meanwhile, and nothing here may raise on one
        rank alone."""
        try:
            steps = list(os.scandir(self.directory))
        except OSError:
            return
        mine = re.compile(rf"^rank-{self.rank:05d}-of-\d+\.([0-9a-f]+)\.pt$")
        leftover = re.compile(rf"^\.rank-{self.rank:05d}-")
        for entry in steps:
            m = _STEP_DIR.match(entry.name)
            if not m:
                continue
            step = int(m.group(1))
            try:
                names = os.listdir(entry.path)
            except OSError:
                continue
            for name in names:
                f = mine.match(name)
                if (leftover.match(name)
                        or (f and (step not in kept or f.group(1) != kept[step]))):
                    _remove(os.path.join(entry.path, name))
            if step not in kept:
                try:
                    os.rmdir(entry.path)
                except OSError:
                    pass  # other ranks' files are still there, or another rank removed it


class _Write:
    """One rank's file of one step: written whole under a temporary name, then renamed;
    on a thread for a save that does not block. Errors are kept for ``wait``."""

    def __init__(self, step: int, path: Path, payload: dict) -> None:
        self.step, self.path, self.payload = step, path, payload
        self.error: Optional[str] = None
        self._thread: Optional[threading.Thread] = None

    def start(self) -> None:
        # Not a daemon: a process that exits with a save pending still finishes the file.
        self._thread = threading.Thread(target=self.run, name="tdx-checkpoint", daemon=False)
        self._thread.start()

    def join(self) -> None:
        if self._thread is not None:
            self._thread.join()

    def run(self) -> None:
        tmp = self.path.parent / f".{self.path.name}.tmp"
        try:
            self.path.parent.mkdir(parents=True, exist_ok=True)
            with open(tmp, "wb") as f:
                torch.save(self.payload, f)
                f.flush()
                os.fsync(f.fileno())
            os.replace(tmp, self.path)
            _fsync_dir(self.path.parent)
        except Exception as e:  # noqa: BLE001 - reported to every rank by wait()
            self.error = (f"could not write its file of checkpoint step {self.step}, "
                          f"{self.path}: {type(e).__name__}: {e}")
            _remove(tmp)
        finally:
            self.payload = None  # the snapshot's memory goes with the write


def _complete(every: list[Any], world: int) -> dict[int, str]:
    """step -> token of the steps every rank has a file of, of ``world`` ranks, with the
    same token: the latest such save of the step, should two be whole."""
    common: Optional[dict[int, set[str]]] = None
    for _, listing in every:
        mine = {s: {t for w, t in files if w == world} for s, files in listing.items()}
        if common is None:
            common = mine
        else:
            common = {s: common[s] & mine[s] for s in common.keys() & mine.keys()}
    out = {}
    for s, tokens in (common or {}).items():
        if tokens:
            out[s] = max(tokens)
    return out


def _foreign(every: list[Any], world: int) -> dict[int, int]:
    """step -> the world size of files some rank holds of another number of ranks."""
    out: dict[int, int] = {}
    for _, listing in every:
        for s, files in listing.items():
            for w, _token in files:
                if w != world:
                    out[s] = max(out.get(s, 0), w)
    return out


def _snapshot(obj: Any) -> Any:
    """A copy of ``obj`` that later training cannot change: tensors copied to CPU memory,
    containers rebuilt, other values deep-copied."""
    if isinstance(obj, torch.Tensor):
        return obj.detach().to("cpu", copy=True)
    if isinstance(obj, dict):
        out = copy.copy(obj)  # keeps the type and attributes (a state dict's _metadata)
        for k, v in obj.items():
            out[k] = _snapshot(v)
        return out
    if isinstance(obj, (list, tuple)) and type(obj) in (list, tuple):
        return type(obj)(_snapshot(v) for v in obj)
    return copy.deepcopy(obj)


def _remove(path: str | os.PathLike) -> None:
    try:
        os.remove(path)
    except OSError:
        pass


def _fsync_dir(path: Path) -> None:
    """Makes a rename in ``path`` durable (where the file system supports it)."""
    try:
        fd = os.open(path, os.O_RDONLY)
    except OSError:
        return
    try:
        os.fsync(fd)
    except OSError:
        pass
    finally:
        os.close(fd)


def rng_state() -> dict[str, Any]:
    """The random number generators' states: Python's, torch's CPU one, every visible
    GPU's (if CUDA is initialised) and NumPy's global one (if NumPy is imported), in a
    form ``torch.load(weights_only=True)`` reads back."""
    state: dict[str, Any] = {"python": random.getstate(), "torch": torch.get_rng_state()}
    if torch.cuda.is_available() and torch.cuda.is_initialized():
        state["cuda"] = torch.cuda.get_rng_state_all()
    np = _numpy()
    if np is not None:
        kind, keys, pos, has_gauss, cached = np.random.get_state()
        state["numpy"] = (kind, torch.from_numpy(keys.astype("int64")), int(pos),
                          int(has_gauss), float(cached))
    return state


def set_rng_state(state: Mapping[str, Any]) -> None:
    """Restores what :func:`rng_state` returned. A GPU state is set only where CUDA is
    available, on as many devices as both runs have."""
    if not isinstance(state, Mapping) or "torch" not in state:
        raise TypeError("set_rng_state: state must be what rng_state() returned")
    version, internal, gauss = state["python"]
    random.setstate((version, tuple(internal), gauss))
    torch.set_rng_state(state["torch"].cpu())  # loaded with map_location="cuda" too
    if "cuda" in state and torch.cuda.is_available():
        for device, s in enumerate(state["cuda"][:torch.cuda.device_count()]):
            torch.cuda.set_rng_state(s.cpu(), device)
    np = _numpy()
    if "numpy" in state and np is not None:
        kind, keys, pos, has_gauss, cached = state["numpy"]
        np.random.set_state((kind, keys.cpu().numpy().astype("uint32"), pos, has_gauss,
                             cached))


def _numpy() -> Any:
    import sys

    return sys.modules.get("numpy")

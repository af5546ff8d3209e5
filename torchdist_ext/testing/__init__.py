"""Multi-process test harness: real ranks, a FileStore in a temp dir, no fixed ports.

``run_ranks(fn, world_size)`` spawns ``world_size`` processes. Each one initialises the
default process group on the requested backend, calls ``fn(rank, world_size, *args)``,
destroys the group and sends the return value back. The parent enforces one deadline for
the whole call: on timeout it kills every rank and says which ones never finished. If a
rank raises, the parent kills the rest and re-raises with that rank's traceback. Spawning
costs a few seconds, so a test should run a whole sweep inside one call and return the
list of failures instead of spawning once per case.
"""

from __future__ import annotations

import os
import queue
import shutil
import tempfile
import time
import traceback
from datetime import timedelta
from typing import Any, Callable, Mapping, Sequence

import torch
import torch.multiprocessing as mp

__all__ = ["run_ranks", "new_gloo_group", "RankFailure", "log_to_file", "expect_refusal"]


class RankFailure(AssertionError):
    """A rank raised, died or timed out; the message holds the evidence."""


def expect_refusal(fails: list[str], fn: Callable[[], Any], *words: str,
                   errors: tuple[type[BaseException], ...] = (ValueError, TypeError)) -> None:
    """Calls ``fn``; appends to ``fails`` unless it raises one of ``errors`` whose message
    holds every one of ``words``. For rank functions that return their failures."""
    try:
        fn()
        fails.append(f"accepted: {words}")
    except errors as e:
        if not all(w in str(e) for w in words):
            fails.append(f"{words}: {e}")


def new_gloo_group() -> Any:
    """A gloo group over every rank, for differential checks inside a tdx test."""
    import torch.distributed as dist

    return dist.new_group(backend="gloo")


def _child(
    rank: int,
    world_size: int,
    backend: str,
    store_path: str,
    timeout: float,
    fn: Callable[..., Any],
    args: Sequence[Any],
    results: Any,
    cpus: Sequence[int] | None = None,
) -> None:
    try:
        if cpus is not None:
            os.sched_setaffinity(0, cpus)
        torch.set_num_threads(1)
        import torch.distributed as dist

        import torchdist_ext  # noqa: F401  (registers "tdx")

        store = dist.FileStore(store_path, world_size)
        dist.init_process_group(
            backend,
            store=store,
            rank=rank,
            world_size=world_size,
            timeout=timedelta(seconds=timeout),
        )
        try:
            value = fn(rank, world_size, *args)
        finally:
            dist.destroy_process_group()
        results.put((rank, True, value))
    except BaseException:  # report everything, including KeyboardInterrupt in a child
        results.put((rank, False, traceback.format_exc()))


def log_to_file(log_dir: str, rank: int, fds: Sequence[int] = (1, 2)) -> None:
    """Sends this process's file descriptors ``fds`` to ``<log_dir>/rank<rank>.log``, for
    a test that reads what a rank printed. UCX writes its log to standard output, the
    backend to standard error, both below Python, so a redirect of ``sys.stdout`` would
    miss them."""
    fd = os.open(os.path.join(log_dir, f"rank{rank}.log"), os.O_WRONLY | os.O_CREAT, 0o644)
    for target in fds:
        os.dup2(fd, target)
    os.close(fd)


def run_ranks(
    fn: Callable[..., Any],
    world_size: int,
    backend: str = "tdx",
    timeout: float = 120.0,
    args: Sequence[Any] = (),
    env: Mapping[str, str] | None = None,
    may_exit: Sequence[int] = (),
    rank_env: Mapping[int, Mapping[str, str]] | None = None,
    affinity: Mapping[int, Sequence[int]] | None = None,
) -> list[Any]:
    """Run ``fn(rank, world_size, *args)`` on ``world_size`` spawned ranks.

    Returns the per-rank return values ordered by rank. ``timeout`` bounds the whole call
    and is also the process group's timeout, so a hung collective fails rather than
    blocking the suite. Ranks in ``may_exit`` are allowed to vanish without reporting
    (fault tests kill them on purpose); their value is None. Any other rank that exits
    without reporting is a failure. ``env`` is set for every rank, ``rank_env[r]`` (on
    top of it) for rank ``r`` alone. ``affinity[r]``: the CPUs rank ``r`` pins itself to
    before it creates its process group.
    """
    ctx = mp.get_context("spawn")
    tmp = tempfile.mkdtemp(prefix="tdx-test-")
    child_env = {"OMP_NUM_THREADS": "1", "TDX_SPIN_US": os.environ.get("TDX_SPIN_US", "0")}
    child_env.update(env or {})
    results = ctx.Queue()
    procs = [
        ctx.Process(
            target=_child,
            args=(r, world_size, backend, os.path.join(tmp, "store"), timeout, fn, args,
                  results, (affinity or {}).get(r)),
            daemon=True,
        )
        for r in range(world_size)
    ]
    # A spawned child imports torchdist_ext to unpickle its target, before any code of
    # ours runs there, and the import reads TDX_ALGO and TDX_CALIBRATION: the variables
    # must be in the environment it starts with.
    extra = rank_env or {}
    keys = set(child_env).union(*(set(e) for e in extra.values()))
    saved = {k: os.environ.get(k) for k in keys}

    def restore() -> None:  # the parent's own values of the keys set here
        for k, v in saved.items():
            if v is None:
                os.environ.pop(k, None)
            else:
                os.environ[k] = v

    try:
        for r, p in enumerate(procs):
            restore()  # under this rank's overrides, not the previous rank's
            os.environ.update(child_env)
            os.environ.update(extra.get(r, {}))
            p.start()
    finally:
        restore()
    values: dict[int, Any] = {}
    vanished = set()
    deadline = time.monotonic() + timeout + 30.0  # ranks time out first, with evidence
    try:
        while len(values) + len(vanished) < world_size:
            remaining = deadline - time.monotonic()
            if remaining <= 0:
                missing = sorted(set(range(world_size)) - set(values))
                raise RankFailure(
                    f"ranks {missing} of {world_size} did not finish {fn.__name__} "
                    f"within {timeout + 30:.0f} s (backend {backend})"
                )
            try:
                rank, ok, value = results.get(timeout=min(remaining, 1.0))
            except queue.Empty:
                gone = [r for r, p in enumerate(procs)
                        if r not in values and r not in vanished and p.exitcode is not None]
                vanished.update(r for r in gone if r in may_exit)
                dead = [r for r in gone if r not in may_exit]
                if dead:
                    # Give a dying rank a moment to deliver its traceback first.
                    try:
                        rank, ok, value = results.get(timeout=2.0)
                    except queue.Empty:
                        codes = {r: procs[r].exitcode for r in dead}
                        raise RankFailure(
                            f"rank(s) {dead} exited with codes {codes} without reporting "
                            f"(crash?) while running {fn.__name__}"
                        ) from None
                else:
                    continue
            if rank in vanished:  # reported after all, before it exited
                vanished.discard(rank)
            if not ok:
                raise RankFailure(f"rank {rank}/{world_size} raised in {fn.__name__}:\n{value}")
            values[rank] = value
        return [values.get(r) for r in range(world_size)]
    finally:
        for p in procs:
            p.join(timeout=10.0 if len(values) + len(vanished) == world_size else 0.5)
        for p in procs:
            if p.is_alive():
                p.kill()
                p.join(timeout=5.0)
        results.close()
        shutil.rmtree(tmp, ignore_errors=True)

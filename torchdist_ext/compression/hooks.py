"""A DDP communication hook that averages gradients through a compressed all_reduce.

    state = CompressionState(Int8(), group=None)          # the group DDP runs on
    model.register_comm_hook(state, ddp_comm_hook)

Each bucket is averaged with ``all_reduce(..., op=AVG)`` of this package, with error
feedback kept per bucket (on by default). For the first ``warmup_steps`` steps the
buckets are averaged exactly instead, as PowerSGD's hook does before its start
iteration: early gradients are large and change fast, and DDP rebuilds its buckets
after the first step, so a residual kept across that change would be dropped anyway.
A bucket whose size changes (DDP's rebuild) starts its residual afresh.

Int8 and Sign make two collectives per bucket, the second on the first one's data, so
the hook runs both before it returns, and the backward pass waits for them. With
``overlap=True`` a thread reduces the buckets on a group of its own over the same ranks,
one after another in the order DDP hands them over (which is the same on every rank):
the backward pass goes on meanwhile. On a group of its own, those collectives cannot meet
the ones the main thread issues on DDP's group during the backward pass (a
SyncBatchNorm's, say). After DDP's first step, which rebuilds its buckets in another
order, the error feedback starts afresh.
"""

import contextlib
import queue
import threading
import weakref
from typing import Any, Optional

import torch
import torch.distributed as dist
from torch.distributed.algorithms.ddp_comm_hooks import default_hooks

from .allreduce import ErrorFeedback, _reduce
from .codecs import Int8, Method, Sign, TopK

__all__ = ["CompressionState", "ddp_comm_hook"]


class CompressionState:
    """What :func:`ddp_comm_hook` needs: the method, the process group DDP runs on
    (None: the default group), whether to keep error feedback, how many steps to
    average exactly first, and whether Int8's and Sign's buckets reduce on a thread and
    group of their own while the backward pass goes on (``overlap``).

    The overlap's group is ``overlap_group`` (the same ranks as ``group``, used for
    nothing else), or, on the default group, one the state makes with
    ``dist.new_group`` (a collective: every rank makes its state at the same point
    among its new groups). On another group pass ``overlap_group``, made by every rank of
    the default group, since ``dist.new_group`` is a collective of all of them.

    ``steps`` counts the steps the hook has seen; ``feedback`` is the
    :class:`ErrorFeedback` (None without it). ``close()`` stops the thread once the
    buckets handed to it are reduced, and destroys the group if the state made it;
    dropping the state stops the thread. After a bucket's reduction fails on the thread,
    every later bucket's fails at once, naming that error: the thread issues nothing
    more on its group, whose other ranks would otherwise receive this rank's next bucket
    for the one that failed."""

    def __init__(self, method: Method, group: Any = None, error_feedback: bool = True,
                 warmup_steps: int = 0, overlap: bool = False,
                 overlap_group: Any = None) -> None:
        if not isinstance(method, (Int8, Sign, TopK)):
            raise TypeError(f"CompressionState: method must be Int8(...), Sign(...) or "
                            f"TopK(...), not {method!r}")
        if isinstance(warmup_steps, bool) or not isinstance(warmup_steps, int) \
                or warmup_steps < 0:
            raise ValueError(f"CompressionState: warmup_steps must be an int >= 0, not "
                             f"{warmup_steps!r}")
        if not isinstance(overlap, bool):
            raise TypeError(f"CompressionState: overlap must be a bool, not {overlap!r}")
        self.method = method
        self.group = group
        self.warmup_steps = warmup_steps
        self.feedback = ErrorFeedback() if error_feedback else None
        self.steps = 0
        self.overlap = overlap
        # TopK's one collective runs asynchronously anyway: it needs no thread.
        self._worker: Optional[_Worker] = None
        if overlap_group is not None and not overlap:
            raise ValueError("CompressionState: overlap_group is for overlap=True")
        if overlap and not isinstance(method, TopK):
            self._worker = _Worker(self._overlap_group(group, overlap_group),
                                   owned=overlap_group is None)
            weakref.finalize(self, self._worker.close)

    @staticmethod
    def _overlap_group(group: Any, given: Any) -> Any:
        if not dist.is_initialized():
            raise RuntimeError("CompressionState: overlap=True needs a process group; call "
                               "dist.init_process_group first")
        default = group is None or group is dist.group.WORLD
        ranks = dist.get_process_group_ranks(dist.group.WORLD if default else group)
        if given is not None:
            if given is group or (default and given is dist.group.WORLD):
                raise ValueError("CompressionState: overlap_group must be a group of its "
                                 "own, not DDP's: the thread's collectives would meet the "
                                 "backward pass's own on it")
            theirs = dist.get_process_group_ranks(given)
            if theirs != ranks:
                raise ValueError(f"CompressionState: overlap_group holds ranks {theirs}, "
                                 f"DDP's group {ranks}; make it over the same ranks, in "
                                 "the same order")
            return given
        if not default:
            raise ValueError(
                "CompressionState: overlap=True on a group other than the default needs "
                "overlap_group=dist.new_group(ranks, backend=...) over the same ranks, "
                "made by every rank of the default group (dist.new_group is a collective "
                "of all of them, which the state cannot make on its ranks alone)")
        # On DDP's backend.
        return dist.new_group(backend=dist.get_backend())

    def close(self) -> None:
        """Stops the overlap thread once the buckets handed to it are reduced, and
        destroys the overlap group if the state made it (and it is not gone already,
        with the default group)."""
        if self._worker is None or self._worker.closed:
            return
        self._worker.close()
        self._worker.join()
        if self._worker.owned and dist.is_initialized():
            try:
                dist.destroy_process_group(self._worker.group)
            except (ValueError, RuntimeError):
                pass  # destroyed already, by the user's own teardown

    def __getstate__(self) -> dict[str, Any]:
        # So that the state pickles (in a checkpoint, say): a process group and a thread
        # do not. A state loaded so reduces on the default group, inline.
        return {k: v for k, v in self.__dict__.items() if k not in ("group", "_worker")}

    def __setstate__(self, values: dict[str, Any]) -> None:
        self.__dict__.update(values)
        self.group = None
        self.overlap = False
        self._worker = None


class _Worker:
    """A thread that reduces the buckets handed to it on its own group, in order, and
    completes each bucket's future."""

    def __init__(self, group: Any, owned: bool) -> None:
        self.group = group
        self.owned = owned  # made by the state: close() destroys it
        self._jobs: queue.SimpleQueue = queue.SimpleQueue()
        self._lock = threading.Lock()  # submit against close: no job after the stop
        self.closed = False
        self.failed: Optional[BaseException] = None  # the first bucket that failed
        self.reduced = 0  # buckets reduced
        self._streams: dict[torch.device, Any] = {}
        self._thread = threading.Thread(target=self._run, name="tdx-compression",
                                        daemon=True)
        self._thread.start()

    def submit(self, buf: torch.Tensor, method: Method, feedback: Optional[ErrorFeedback],
               key: int) -> torch.futures.Future:
        fut: torch.futures.Future = torch.futures.Future()
        # On CUDA the thread's stream must wait for the gradients the backward pass's
        # stream wrote into the bucket.
        ready = None
        if buf.is_cuda:
            ready = torch.cuda.Event()
            ready.record(torch.cuda.current_stream(buf.device))
        with self._lock:
            if self.closed:
                raise RuntimeError("ddp_comm_hook: the CompressionState was closed; make a "
                                   "new one (overlap=True) or register the hook with one "
                                   "that does not overlap")
            self._jobs.put((buf, method, feedback, key, ready, fut))
        return fut

    def close(self) -> None:
        with self._lock:
            if not self.closed:
                self.closed = True
                self._jobs.put(None)

    def join(self) -> None:
        self._thread.join()

    def _reduce(self, buf: torch.Tensor, method: Method, feedback: Optional[ErrorFeedback],
                key: int, ready: Any) -> None:
        # On CUDA, a stream of the thread's own (a new thread's current stream is the
        # default one, which backward's kernels also use): it waits for the bucket's
        # gradients, and DDP reads the bucket once this stream is done with it.
        stream = None
        if ready is not None:
            stream = self._streams.get(buf.device)
            if stream is None:
                stream = self._streams[buf.device] = torch.cuda.Stream(buf.device)
            stream.wait_event(ready)
        with contextlib.nullcontext() if stream is None else torch.cuda.stream(stream):
            _reduce(buf, method, self.group, True, feedback, key, "reset", async_op=False)
        if stream is not None:
            stream.synchronize()

    def _run(self) -> None:
        while True:
            job = self._jobs.get()
            if job is None:
                return
            buf, method, feedback, key, ready, fut = job
            if self.failed is not None:
                fut.set_exception(RuntimeError(
                    f"ddp_comm_hook: bucket {key} was not reduced: an earlier bucket's "
                    f"reduction failed on this rank ({self.failed}), after which the "
                    "overlap thread issues nothing more on its group; make a new "
                    "CompressionState (and DistributedDataParallel) to go on"))
                continue
            try:
                self._reduce(buf, method, feedback, key, ready)
            except BaseException as e:  # the backward pass's wait raises it
                self.failed = e
                fut.set_exception(e)
            else:
                self.reduced += 1
                fut.set_result(buf)


# DDP accepts a hook whose annotations are exactly these (not strings).
def ddp_comm_hook(state: "CompressionState", bucket: dist.GradBucket,
                  ) -> torch.futures.Future[torch.Tensor]:
    """Averages ``bucket``'s gradients across ``state.group``, compressed with
    ``state.method``; register it with ``model.register_comm_hook(state, ddp_comm_hook)``."""
    buf = bucket.buffer()
    last = bucket.is_last()
    if state.steps == 1 and bucket.index() == 0 and state.feedback is not None:
        # DDP rebuilt its buckets after the first step, in the order gradients came: a
        # bucket of the same size may hold other parameters now, which must not receive
        # the old one's residual.
        state.feedback.clear()
    if state.steps < state.warmup_steps:
        fut = default_hooks.allreduce_hook(state.group, bucket)
    elif state._worker is not None:
        fut = state._worker.submit(buf, state.method, state.feedback, bucket.index())
    else:
        fut = _reduce(buf, state.method, state.group, True, state.feedback,
                      bucket.index(), "reset", async_op=True)
    if last:
        state.steps += 1
    return fut

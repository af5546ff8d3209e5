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
``overlap=True`` the state makes a group of its own over the same ranks and a thread
that reduces the buckets on it, one after another in the order DDP hands them over
(which is the same on every rank): the backward pass goes on meanwhile. On a group of its
own, those collectives cannot meet the ones the main thread issues on DDP's group during
the backward pass (a SyncBatchNorm's, say).
"""

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
    group of their own while the backward pass goes on (``overlap``; making the group is
    a collective of the group's ranks: each must make its state in the same order
    relative to its other new groups). ``steps`` counts the steps the hook has seen;
    ``feedback`` is the :class:`ErrorFeedback` (None without it). ``close()`` stops the
    thread and destroys its group; dropping the state stops the thread."""

    def __init__(self, method: Method, group: Any = None, error_feedback: bool = True,
                 warmup_steps: int = 0, overlap: bool = False) -> None:
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
        if overlap and not isinstance(method, TopK):
            if not dist.is_initialized():
                raise RuntimeError("CompressionState: overlap=True makes a process group; "
                                   "call dist.init_process_group first")
            # Over DDP's ranks, on DDP's backend.
            backend = dist.get_backend(group)
            ranks = dist.get_process_group_ranks(group or dist.group.WORLD)
            own = dist.new_group(ranks, backend=backend, use_local_synchronization=True) \
                if group is not None else dist.new_group(backend=backend)
            self._worker = _Worker(own)
            weakref.finalize(self, self._worker.close)

    def close(self) -> None:
        """Stops the overlap thread once the buckets handed to it are reduced, and
        destroys its group."""
        if self._worker is not None and not self._worker.closed:
            self._worker.close()
            self._worker.join()
            dist.destroy_process_group(self._worker.group)

    def __getstate__(self) -> dict[str, Any]:
        # So that the state pickles (in a checkpoint, say): a process group and a thread
        # do not. A state loaded so reduces on the main thread.
        return {k: v for k, v in self.__dict__.items() if k not in ("group", "_worker")}

    def __setstate__(self, values: dict[str, Any]) -> None:
        self.__dict__.update(values)
        self.group = None
        self._worker = None


class _Worker:
    """A thread that reduces the buckets handed to it on its own group, in order, and
    completes each bucket's future."""

    def __init__(self, group: Any) -> None:
        self.group = group
        self._jobs: queue.SimpleQueue = queue.SimpleQueue()
        self._thread = threading.Thread(target=self._run, name="tdx-compression",
                                        daemon=True)
        self.closed = False
        self.reduced = 0  # buckets reduced
        self._thread.start()

    def submit(self, buf: torch.Tensor, method: Method, feedback: Optional[ErrorFeedback],
               key: int) -> torch.futures.Future:
        if self.closed:
            raise RuntimeError("ddp_comm_hook: the CompressionState was closed; make a new "
                               "one (overlap=True) or register the hook with one that "
                               "does not overlap")
        fut: torch.futures.Future = torch.futures.Future()
        # On CUDA the thread's stream must wait for the gradients the backward pass's
        # stream wrote into the bucket.
        ready = None
        if buf.is_cuda:
            ready = torch.cuda.Event()
            ready.record(torch.cuda.current_stream(buf.device))
        self._jobs.put((buf, method, feedback, key, ready, fut))
        return fut

    def close(self) -> None:
        if not self.closed:
            self.closed = True
            self._jobs.put(None)

    def join(self) -> None:
        self._thread.join()

    def _run(self) -> None:
        while True:
            job = self._jobs.get()
            if job is None:
                return
            buf, method, feedback, key, ready, fut = job
            try:
                if ready is not None:
                    with torch.cuda.device(buf.device):
                        torch.cuda.current_stream().wait_event(ready)
                        _reduce(buf, method, self.group, True, feedback, key, "reset",
                                async_op=False)
                        # DDP reads the bucket on its own stream once the future is done.
                        torch.cuda.current_stream().synchronize()
                else:
                    _reduce(buf, method, self.group, True, feedback, key, "reset",
                            async_op=False)
            except BaseException as e:  # the backward pass's wait raises it
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

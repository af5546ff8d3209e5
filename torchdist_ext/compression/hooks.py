"""A DDP communication hook that averages gradients through a compressed all_reduce.

    state = CompressionState(Int8(), group=None)          # the group DDP runs on
    model.register_comm_hook(state, ddp_comm_hook)

Each bucket is averaged with ``all_reduce(..., op=AVG)`` of this package, with error
feedback kept per bucket (on by default). For the first ``warmup_steps`` steps the
buckets are averaged exactly instead, as PowerSGD's hook does before its start
iteration: early gradients are large and change fast, and DDP rebuilds its buckets
after the first step, so a residual kept across that change would be dropped anyway.
A bucket whose size changes (DDP's rebuild) starts its residual afresh.
"""

from typing import Any

import torch
import torch.distributed as dist
from torch.distributed.algorithms.ddp_comm_hooks import default_hooks

from .allreduce import ErrorFeedback, _reduce
from .codecs import Int8, Method, Sign, TopK

__all__ = ["CompressionState", "ddp_comm_hook"]


class CompressionState:
    """What :func:`ddp_comm_hook` needs: the method, the process group DDP runs on
    (None: the default group), whether to keep error feedback, and how many steps to
    average exactly first. ``steps`` counts the steps the hook has seen; ``feedback`` is
    the :class:`ErrorFeedback` (None without it)."""

    def __init__(self, method: Method, group: Any = None, error_feedback: bool = True,
                 warmup_steps: int = 0) -> None:
        if not isinstance(method, (Int8, Sign, TopK)):
            raise TypeError(f"CompressionState: method must be Int8(...), Sign(...) or "
                            f"TopK(...), not {method!r}")
        if isinstance(warmup_steps, bool) or not isinstance(warmup_steps, int) \
                or warmup_steps < 0:
            raise ValueError(f"CompressionState: warmup_steps must be an int >= 0, not "
                             f"{warmup_steps!r}")
        self.method = method
        self.group = group
        self.warmup_steps = warmup_steps
        self.feedback = ErrorFeedback() if error_feedback else None
        self.steps = 0

    def __getstate__(self) -> dict[str, Any]:
        # So that the state pickles (in a checkpoint, say): a process group does not.
        return {k: v for k, v in self.__dict__.items() if k != "group"}

    def __setstate__(self, values: dict[str, Any]) -> None:
        self.__dict__.update(values)
        self.group = None


# DDP accepts a hook whose annotations are exactly these (not strings).
def ddp_comm_hook(state: "CompressionState", bucket: dist.GradBucket,
                  ) -> torch.futures.Future[torch.Tensor]:
    """Averages ``bucket``'s gradients across ``state.group``, compressed with
    ``state.method``; register it with ``model.register_comm_hook(state, ddp_comm_hook)``."""
    buf = bucket.buffer()
    last = bucket.is_last()
    if state.steps < state.warmup_steps:
        fut = default_hooks.allreduce_hook(state.group, bucket)
    else:
        fut = _reduce(buf, state.method, state.group, True, state.feedback,
                      bucket.index(), "reset", async_op=True)
    if last:
        state.steps += 1
    return fut

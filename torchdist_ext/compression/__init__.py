"""Compressed all_reduce with error feedback, for gradients whose exact sum costs more
time on the wire than a close one is worth.

    from torchdist_ext import compression as tc

    ef = tc.ErrorFeedback()
    tc.all_reduce(grad, tc.Int8(), op=dist.ReduceOp.AVG, state=ef, key="w")
    tc.reduce_scatter(shard, flat, tc.Int8(), state=ef, key="bucket 0")

    model.register_comm_hook(tc.CompressionState(tc.Sign()), tc.ddp_comm_hook)

Methods: ``Int8(block)`` (block-scaled int8, about a quarter of float32's bytes),
``Sign(block)`` (one bit and a scale per block, about 1/29) and ``TopK(ratio)`` (the
largest elements with their indices). It runs on any torch.distributed group (tdx,
gloo, nccl) through its all_to_all and all_gather; the result is the same on every
rank. See README, "Compressed all_reduce".
"""

from .allreduce import ErrorFeedback, all_reduce
from .codecs import Int8, Method, Sign, TopK
from .hooks import CompressionState, ddp_comm_hook
from .reduce_scatter import reduce_scatter

__all__ = ["Int8", "Sign", "TopK", "Method", "ErrorFeedback", "all_reduce",
           "reduce_scatter", "CompressionState", "ddp_comm_hook"]

"""Compressed reduce_scatter over any torch.distributed group.

Rank ``r`` receives the sum (or average) of every rank's ``r``-th chunk of the input.
Each rank cuts its input (plus its error feedback) into ``n`` chunks, encodes each, and
one ``all_to_all_single`` gives rank ``r`` every rank's chunk ``r``, which it decodes and
sums in rank order. Each rank sends and receives ``(n - 1) / n`` of its compressed
input, and the sum is not encoded again: the result is exact but for what the senders'
encodings lost, which error feedback carries into the next call under the same key.

- Int8 and Sign encode each chunk as a row of blocks (a chunk's tail block padded with
  zeros, which sway no scale).
- TopK sends each chunk's own ``ratio`` share of elements largest in magnitude, so that
  every rank receives the same number of values from every rank.

Rows carry the 16-byte header of ``allreduce.py`` (the method and working dtype, and the
input's element count), so ranks that disagree raise, naming each other.
"""

from __future__ import annotations

from typing import Any, Hashable

import torch
import torch.distributed as dist

from .allreduce import (_HEADER, ErrorFeedback, Rest, _buffer, _check, _check_headers,
                        _payload_rows, _rank_text, complete)
from .codecs import Int8, Method, Sign, TopK, as_dtype

__all__ = ["reduce_scatter"]

_OP = "torchdist_ext.compression.reduce_scatter"
# The state's space for buffers used only before the collective starts, which every key
# shares: kept per key, they would hold several copies of every gradient.
_SCRATCH = ("torchdist_ext.compression.reduce_scatter", "scratch")


def reduce_scatter(output: torch.Tensor, input: torch.Tensor, method: Method,
                   op: Any = dist.ReduceOp.SUM, group: Any = None,
                   state: ErrorFeedback | None = None, key: Hashable = "default",
                   async_op: bool = False) -> Any:
    """Writes into ``output`` the sum (or average, ``op=AVG``) over the ranks of ``group``
    of their ``input``'s chunk numbered this rank, through ``method``'s compression.
    ``input`` holds ``world_size * output.numel()`` elements of ``output``'s dtype and
    device, as ``dist.reduce_scatter_tensor`` takes them. With ``state``, what encoding
    loses this call is added to the next call with the same ``key`` (error feedback);
    the state then holds a residual of ``input``'s size in the working precision
    (float32 below float64) and, for Int8 and Sign, the key's encoded send and receive
    buffers and two scratch tensors of ``input``'s size that every key shares. With ``async_op=True`` it
    returns a ``torch.futures.Future`` whose value is ``output`` once reduced; otherwise
    None. Calls under one ``key`` of one ``state`` must not overlap."""
    average = _check(input, method, op, _OP)
    if not isinstance(output, torch.Tensor) or output.dtype != input.dtype \
            or output.device != input.device:
        raise TypeError(f"{_OP}: rank {_rank_text(group)}: output must be a tensor of "
                        f"input's dtype and device ({input.dtype}, {input.device}), not "
                        f"{_describe(output)}")
    n = dist.get_world_size(group)
    if input.numel() != n * output.numel():
        raise ValueError(f"{_OP}: rank {_rank_text(group)}: input has {input.numel()} "
                         f"elements and output {output.numel()}; input must hold one "
                         f"chunk of output's size per rank, {n} * {output.numel()}")
    if state is not None and not isinstance(state, ErrorFeedback):
        raise TypeError(f"{_OP}: rank {_rank_text(group)}: state must be an "
                        f"ErrorFeedback or None, not {type(state).__name__}")
    wdtype = torch.float64 if input.dtype == torch.float64 else torch.float32
    chunk = output.numel()
    rows = input.detach().reshape(n, chunk).to(wdtype, copy=True)
    if state is not None:
        rows += state._take((key, "sent"), rows, "raise").view(n, chunk)
    if isinstance(method, TopK):
        work, rest = _topk(rows, method, group, n, state, key, input.numel())
    else:
        work, rest = _blocks(rows, method, group, n, state, key, input.numel())

    def finish() -> torch.Tensor:
        total = rest()
        if average and n > 1:
            total /= n
        if chunk:
            output.copy_(total.reshape(output.shape))
        return output

    return complete(work, finish, async_op)


def _describe(t: Any) -> str:
    if isinstance(t, torch.Tensor):
        return f"a {t.dtype} tensor on {t.device}"
    return type(t).__name__


def _blocks(rows: torch.Tensor, method: Int8 | Sign, group: Any, n: int,
            state: ErrorFeedback | None, key: Hashable, numel: int) -> tuple[Any, Rest]:
    chunk, wdtype, device = rows.shape[1], rows.dtype, rows.device
    unit = method.unit
    length = -(-chunk // unit) * unit
    space = None if state is None else state._space(key)
    scratch = None if state is None else state._space(_SCRATCH)
    padded = _buffer(scratch, "rows", (n, length), wdtype, device)
    padded[:, :chunk] = rows
    padded[:, chunk:] = 0
    nbytes = _HEADER + method.nbytes(length, wdtype)
    word = method.word(wdtype)
    send = _payload_rows(_buffer(space, "rs_send", (n, nbytes), torch.uint8, device), word,
                         numel)
    lost = None if state is None else _buffer(scratch, "lost", (n, length), wdtype, device)
    if length:
        method.encode_into(padded, [chunk] * n, send[:, _HEADER:], lost)
    if lost is not None:
        state._put((key, "sent"), lost[:, :chunk].reshape(-1).clone())
    recv = _buffer(space, "rs_recv", (n, nbytes), torch.uint8, device)
    work = dist.all_to_all_single(recv, send, group=group, async_op=True)

    def total() -> torch.Tensor:
        _check_headers(recv, word, numel, group, "its chunks", _OP)
        if not length:
            return torch.empty(0, dtype=wdtype, device=device)
        out = method.decode_sum(recv[:, _HEADER:], length, wdtype)
        return out[:chunk]

    return work, total


def _topk(rows: torch.Tensor, method: TopK, group: Any, n: int,
          state: ErrorFeedback | None, key: Hashable, numel: int) -> tuple[Any, Rest]:
    chunk, wdtype, device = rows.shape[1], rows.dtype, rows.device
    k = method.k(chunk) if chunk else 0
    idx_dtype = method.index_dtype(chunk)
    idx = rows.abs().topk(k, dim=1, sorted=False).indices
    vals = rows.gather(1, idx)
    if state is not None:
        residual = rows.clone()
        residual.scatter_(1, idx, 0.0)
        # An infinity or a NaN left out of the selection is dropped, not kept.
        state._put((key, "sent"), residual.reshape(-1).nan_to_num_(0.0, 0.0, 0.0))
    vbytes = k * rows.element_size()
    ibytes = k * idx_dtype.itemsize
    send = _payload_rows(torch.empty(n, _HEADER + vbytes + ibytes, dtype=torch.uint8,
                                     device=device), method.word(wdtype), numel)
    send[:, _HEADER:_HEADER + vbytes] = vals.contiguous().view(torch.uint8)
    send[:, _HEADER + vbytes:] = idx.to(idx_dtype).contiguous().view(torch.uint8)
    recv = torch.empty_like(send)
    work = dist.all_to_all_single(recv, send, group=group, async_op=True)

    def total() -> torch.Tensor:
        _check_headers(recv, method.word(wdtype), numel, group, "its selections", _OP)
        out = torch.zeros(chunk, dtype=wdtype, device=device)
        body = recv[:, _HEADER:]
        for r in range(n):  # in rank order; no index repeats within a rank's selection
            v = as_dtype(body[r, :vbytes], wdtype)
            i = as_dtype(body[r, vbytes:], idx_dtype).long()
            out.index_add_(0, i, v)
        return out

    return work, total

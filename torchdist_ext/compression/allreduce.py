"""Compressed all_reduce over any torch.distributed group.

Int8 and Sign run in two phases, as a ring all_reduce does, so each rank sends and
receives about ``2 (n - 1) / n`` of the compressed tensor whatever the world size:

1. the tensor (plus this rank's error feedback) is cut into ``n`` chunks, each is
   encoded, and one ``all_to_all_single`` gives rank ``r`` every rank's chunk ``r``;
2. rank ``r`` decodes and sums its chunks in rank order (AVG divides here), encodes the
   sum (plus its own second error-feedback term) once, and ``all_gather_into_tensor``
   gives every rank every sum.

Every rank decodes the same bytes the same way, so the result is identical on every
rank, bit for bit, and the same on any backend. TopK's selections do not add up
chunk-wise, so it gathers every rank's selection and sums them in rank order.

Each payload row starts with 16 bytes: a word naming the method and working dtype, and
the element count. A rank that finds another rank's row different raises, naming both,
rather than decode bytes it would misread. Rows of different lengths are the backend's
size mismatch error.
"""

from __future__ import annotations

from typing import Any, Callable, Hashable

import torch
import torch.distributed as dist

from .codecs import Int8, Method, Sign, TopK, as_dtype, describe_word

__all__ = ["ErrorFeedback", "all_reduce"]

_HEADER = 16
_OP = "torchdist_ext.compression.all_reduce"
# torch 2.14 renamed all_gather_into_tensor (which warns there); older releases lack the
# new name.
_all_gather = getattr(dist, "all_gather_single", dist.all_gather_into_tensor)


class ErrorFeedback:
    """What compression left out on this rank, per tensor stream, added to the next call
    with the same ``key``. Keep one per model or optimizer; a key names one tensor (a
    DDP bucket, a parameter's gradient) whose size stays the same from call to call."""

    def __init__(self) -> None:
        self._residuals: dict[Hashable, torch.Tensor] = {}
        # Per key, the op's buffers, kept from call to call: a fresh tensor of tens of
        # MiB is fresh pages from the kernel, whose faults cost more than the codec's
        # passes over them. The residuals live in them too.
        self._spaces: dict[Hashable, dict[str, torch.Tensor]] = {}
        self._layouts: dict[Hashable, tuple[int, int, int]] = {}

    def __len__(self) -> int:
        """How many keys hold a residual."""
        return len({key for key, _ in self._residuals})

    def residual(self, key: Hashable) -> tuple[torch.Tensor | None, torch.Tensor | None]:
        """What the calls under ``key`` have lost so far on this rank, as two flat tensors
        (None before the first call): what this rank's own tensor lost when it was
        encoded, and what the chunk of the sum this rank encodes for the others lost
        (Int8 and Sign, whose rank ``r`` encodes the sum's ``r``-th chunk; None for
        TopK). Added to the next call, they make the results of ``T`` calls sum to
        ``T`` exact sums less what is held here. They are the state's own memory,
        which the next call under ``key`` overwrites: clone them to keep them."""
        return self._residuals.get((key, "sent")), self._residuals.get((key, "owned"))

    def nbytes(self) -> int:
        """Bytes held: the residuals and the buffers kept for the next calls, each
        storage once (a residual may live in a buffer)."""
        storages = {}
        for t in [*self._residuals.values(),
                  *(b for space in self._spaces.values() for b in space.values())]:
            if isinstance(t, torch.Tensor):
                st = t.untyped_storage()
                storages[st.data_ptr()] = st.nbytes()
        return sum(storages.values())

    def clear(self) -> None:
        """Forget every residual (after loading a checkpoint, say)."""
        self._residuals.clear()
        self._spaces.clear()
        self._layouts.clear()

    def _space(self, key: Hashable) -> dict[str, torch.Tensor]:
        return self._spaces.setdefault(key, {})

    def _take(self, key: tuple[Hashable, str], like: torch.Tensor, resize: str,
              ) -> torch.Tensor:
        """The residual for ``key`` (the user's key and the part) shaped as ``like``
        (zeros the first time). ``resize`` says what to do when the stored one has
        another size: "raise" or "reset"."""
        old = self._residuals.get(key)
        if old is not None and old.numel() == like.numel():
            return old if old.device == like.device and old.dtype == like.dtype \
                else old.to(device=like.device, dtype=like.dtype)
        if old is not None and resize == "raise":
            raise ValueError(
                f"{_OP}: rank {_rank_text(None)}: the error feedback under key {key[0]!r} "
                f"holds {old.numel()} elements and this call's needs {like.numel()}; "
                "give each tensor a key of its own (key=...) or clear() the state")
        return torch.zeros_like(like)

    def _put(self, key: Hashable, residual: torch.Tensor) -> None:
        # The codecs leave 0 where a block was not finite: a NaN residual would poison
        # every later step.
        self._residuals[key] = residual


def all_reduce(tensor: torch.Tensor, method: Method, op: Any = dist.ReduceOp.SUM,
               group: Any = None, state: ErrorFeedback | None = None,
               key: Hashable = "default", async_op: bool = False) -> Any:
    """Sum (or average) ``tensor`` across ``group`` through ``method``'s compression,
    in place. With ``state``, what compression loses this call is added to the next
    call with the same ``key`` (error feedback), so it is delayed rather than lost.

    ``tensor`` is a floating-point tensor (float32, float64, float16 or bfloat16; the
    codecs work in float64 for float64 and in float32 otherwise) of the same size on
    every rank, and every rank passes the same ``method``. ``op`` is SUM or AVG. The
    result is the same on every rank. With ``async_op=True`` it returns a
    ``torch.futures.Future`` whose value is ``tensor`` once reduced; otherwise None.
    Int8 and Sign make two collectives, the second on the first one's data, and even
    with ``async_op=True`` both run before the call returns (a second collective issued
    as the first one ends would go out in another order on each rank when several ops are
    in flight); TopK's one collective runs while the caller goes on.
    Calls under one ``key`` of one ``state`` must not overlap: they share its buffers.
    """
    average = _check(tensor, method, op)
    if state is not None and not isinstance(state, ErrorFeedback):
        raise TypeError(f"{_OP}: rank {_rank_text(group)}: state must be an "
                        f"ErrorFeedback or None, not {type(state).__name__}")
    return _reduce(tensor, method, group, average, state, key, "raise", async_op)


# Each op is a first collective, issued at the call, and the rest (decode, the second
# collective where there is one, the copy back), run once it completes. A synchronous
# call waits and runs the rest itself, so a backend's error reaches the caller as its
# own exception (a DistBackendError naming the peer); an asynchronous one chains the rest
# on the first op's future, where torch wraps an error in a RuntimeError.
Rest = Callable[[], torch.Tensor]


def _reduce(tensor: torch.Tensor, method: Method, group: Any, average: bool,
            state: ErrorFeedback | None, key: Hashable, resize: str, async_op: bool,
            ) -> torch.futures.Future | None:
    """The op, in place: a future whose value is ``tensor`` when ``async_op``, else
    None once it is done."""
    flat = tensor.detach().reshape(-1)
    wdtype = torch.float64 if tensor.dtype == torch.float64 else torch.float32
    n = dist.get_world_size(group)
    if isinstance(method, TopK):
        x = flat.to(wdtype, copy=True)
        if state is not None:
            x += state._take((key, "sent"), x, resize)
        work, rest = _topk(x, method, group, n, state, key)
    else:
        work, rest = _two_phase(flat, wdtype, method, group, n, average and n > 1, state,
                                key, resize)

    def finish() -> torch.Tensor:
        out = rest()
        if isinstance(method, TopK) and average and n > 1:
            out /= n
        if tensor.numel():
            tensor.copy_(out.reshape(tensor.shape))
        return tensor

    if async_op and not isinstance(method, TopK):
        # Int8's and Sign's second collective needs the first one's data. Issued from the
        # first one's completion callback, it would go out in the order the first ones
        # completed on this rank, which differs from rank to rank when several are in
        # flight (DDP's buckets): then the ranks' second collectives met other ops' (a
        # mismatch, or, between ops of one size, sums of other ops' data). Both run here,
        # in the caller's order; the future is done on return.
        complete(work, finish, False)
        done: torch.futures.Future = torch.futures.Future()
        done.set_result(tensor)
        return done
    return complete(work, finish, async_op)


def complete(work: Any, finish: Rest, async_op: bool) -> torch.futures.Future | None:
    """Runs ``finish`` once ``work`` (the op's first collective) is done: here, after
    waiting for it, or, with ``async_op``, chained on its future, whose value is then
    what ``finish`` returns."""
    if not async_op:
        work.wait()
        finish()
        return None

    def chained(fut: torch.futures.Future) -> torch.Tensor:
        fut.wait()  # raises the first op's error
        return finish()

    return work.get_future().then(chained)


def _buffer(space: dict[str, torch.Tensor] | None, name: str, shape: tuple[int, ...],
            dtype: torch.dtype, device: torch.device) -> torch.Tensor:
    """An uninitialised tensor: ``space``'s own ``name`` when it has that shape, dtype and
    device (it is then reused), a new one (kept there) otherwise."""
    old = None if space is None else space.get(name)
    if old is not None and old.shape == shape and old.dtype == dtype \
            and old.device == device:
        return old
    new = torch.empty(shape, dtype=dtype, device=device)
    if space is not None:
        space[name] = new
    return new


def _two_phase(flat: torch.Tensor, wdtype: torch.dtype, method: Int8 | Sign, group: Any,
               n: int, divide: bool, state: ErrorFeedback | None, key: Hashable,
               resize: str) -> tuple[Any, Rest]:
    numel, device = flat.numel(), flat.device
    unit = method.unit
    length = -(-numel // (n * unit)) * unit if numel else 0
    nbytes = _HEADER + method.nbytes(length, wdtype)
    space = None if state is None else state._space(key)
    # The tensor (and its residual) in n rows of `length`, zeros after its end.
    rows = _buffer(space, "rows", (n, length), wdtype, device)
    padded = rows.view(-1)
    padded[:numel].copy_(flat)
    padded[numel:].zero_()
    lost = None
    if state is not None:
        padded[:numel] += state._take((key, "sent"), padded[:numel], resize)
        # Written only after the residual above has been added in: it may be the same
        # memory.
        lost = _buffer(space, "lost", (n, length), wdtype, device)
    word = method.word(wdtype)
    valid = [max(0, min(length, numel - r * length)) for r in range(n)]
    send = _payload_rows(_buffer(space, "send", (n, nbytes), torch.uint8, device), word,
                         numel)
    if length:
        method.encode_into(rows, valid, send[:, _HEADER:], lost)
    if lost is not None:
        state._put((key, "sent"), lost.view(-1)[:numel])
    recv = _buffer(space, "recv", (n, nbytes), torch.uint8, device)
    work = dist.all_to_all_single(recv, send, group=group, async_op=True)

    def second() -> torch.Tensor:
        me = dist.get_rank(group)
        _check_headers(recv, word, numel, group, "its chunks")
        if not length:
            return padded
        total = method.decode_sum(recv[:, _HEADER:], length, wdtype,
                                  out=_buffer(space, "total", (length,), wdtype, device))
        if divide:
            total /= n
        lost2 = None
        if state is not None:
            # The residual of the sum's chunk this rank encodes: it belongs to that chunk
            # (world size, rank, length), and is dropped, never mixed in, when this call
            # cuts the tensor otherwise (the same key on another group). Raising here,
            # after the first collective, would leave the other ranks waiting.
            if state._layouts.get(key) != (n, me, length):
                state._residuals.pop((key, "owned"), None)
                state._layouts[key] = (n, me, length)
            total += state._take((key, "owned"), total, "reset")
            lost2 = _buffer(space, "lost2", (1, length), wdtype, device)
        # Padding past the tensor's end stays zero, so it sways no block's scale, and
        # keeps no residual.
        mine = valid[me]
        total[mine:] = 0
        send2 = _payload_rows(_buffer(space, "send2", (1, nbytes), torch.uint8, device),
                              word, numel)
        method.encode_into(total.view(1, length), [mine], send2[:, _HEADER:], lost2)
        if lost2 is not None:
            lost2[0, mine:] = 0
            state._put((key, "owned"), lost2.view(-1))
        gathered = _buffer(space, "gathered", (n, nbytes), torch.uint8, device)
        _all_gather(gathered, send2, group=group)
        _check_headers(gathered, word, numel, group, "the reduced chunks")
        out = method.decode_rows(gathered[:, _HEADER:], length, wdtype,
                                 out=_buffer(space, "out", (n, length), wdtype, device))
        return out.view(-1)[:numel]

    return work, second


def _topk(x: torch.Tensor, method: TopK, group: Any, n: int, state: ErrorFeedback | None,
          key: Hashable) -> tuple[Any, Rest]:
    numel, wdtype = x.numel(), x.dtype
    word = method.word(wdtype)
    k = method.k(numel)
    idx_dtype = method.index_dtype(numel)
    if k:
        idx = x.abs().topk(k, sorted=False).indices
        vals = x[idx]
    else:
        idx = torch.empty(0, dtype=torch.long, device=x.device)
        vals = x[:0]
    if state is not None:
        residual = x.clone()
        residual[idx] = 0
        # An infinity or a NaN left out of the selection is dropped, not kept.
        state._put((key, "sent"), residual.nan_to_num_(0.0, 0.0, 0.0))
    vbytes = k * vals.element_size()
    ibytes = k * idx_dtype.itemsize
    send = _payload_rows(torch.empty(1, _HEADER + vbytes + ibytes, dtype=torch.uint8,
                                     device=x.device), word, numel)
    send[0, _HEADER:_HEADER + vbytes] = vals.view(torch.uint8)
    send[0, _HEADER + vbytes:] = idx.to(idx_dtype).view(torch.uint8)
    gathered = torch.empty(n, send.shape[1], dtype=torch.uint8, device=x.device)
    work = _all_gather(gathered, send, group=group, async_op=True)

    def total() -> torch.Tensor:
        _check_headers(gathered, word, numel, group, "its selection")
        out = torch.zeros(numel, dtype=wdtype, device=x.device)
        body = gathered[:, _HEADER:]
        for r in range(n):  # one rank at a time: no index repeats within a rank's selection
            v = as_dtype(body[r, :vbytes], wdtype)
            i = as_dtype(body[r, vbytes:], idx_dtype).long()
            out.index_add_(0, i, v)
        return out

    return work, total


def _payload_rows(out: torch.Tensor, word: int, numel: int) -> torch.Tensor:
    """``out`` (uint8 rows) with the header written at the start of each row, the rest
    for the codec to fill."""
    head = torch.tensor([_signed(word), numel], dtype=torch.int64)
    out[:, :_HEADER] = head.view(torch.uint8).to(out.device)
    return out


def _check_headers(rows: torch.Tensor, word: int, numel: int, group: Any,
                   what: str, name: str = _OP) -> None:
    heads = as_dtype(rows[:, :_HEADER], torch.int64).reshape(-1, 2).cpu()
    for r in range(heads.shape[0]):
        theirs, count = _unsigned(int(heads[r, 0])), int(heads[r, 1])
        if theirs != word or count != numel:
            raise RuntimeError(
                f"{name}: rank {_rank_text(group)} received {what} from group rank {r}, "
                f"which compresses {count} elements with {describe_word(theirs)}, where "
                f"this rank compresses {numel} with {describe_word(word)}; every rank must "
                "pass the same method and a tensor of the same size and working dtype "
                "(float64, or any other float)")


def _check(tensor: Any, method: Any, op: Any, name: str = _OP) -> bool:
    """Refuses what the op cannot do, naming it; returns whether op is AVG."""
    if not isinstance(tensor, torch.Tensor):
        raise TypeError(f"{name}: rank {_rank_text(None)}: tensor must be a torch.Tensor, "
                        f"not {type(tensor).__name__}")
    if not isinstance(method, (Int8, Sign, TopK)):
        raise TypeError(f"{name}: rank {_rank_text(None)}: method must be Int8(...), "
                        f"Sign(...) or TopK(...), not {method!r}")
    if tensor.layout != torch.strided or not tensor.is_floating_point():
        raise TypeError(
            f"{name}: rank {_rank_text(None)}: cannot compress a tensor of dtype "
            f"{tensor.dtype} and layout {tensor.layout}; pass a dense float32, float64, "
            "float16 or bfloat16 tensor, or use dist.all_reduce")
    if tensor.dtype not in (torch.float32, torch.float64, torch.float16, torch.bfloat16):
        raise TypeError(f"{name}: rank {_rank_text(None)}: cannot compress {tensor.dtype}; "
                        "pass float32, float64, float16 or bfloat16")
    if op == dist.ReduceOp.SUM:
        return False
    if op == dist.ReduceOp.AVG:
        return True
    raise ValueError(f"{name}: rank {_rank_text(None)}: op must be ReduceOp.SUM or "
                     f"ReduceOp.AVG, not {op}; compression sums, and a minimum or product "
                     "of approximations has no error bound: use dist.all_reduce")


def _rank_text(group: Any) -> str:
    if not dist.is_initialized():
        return "?"
    g = dist.get_rank()
    if group is None:
        return str(g)
    return f"{dist.get_rank(group)} of its group (global rank {g})"


def _signed(word: int) -> int:
    return word - (1 << 64) if word >= 1 << 63 else word


def _unsigned(value: int) -> int:
    return value + (1 << 64) if value < 0 else value


"""A parameter server: some ranks of a group hold the parameters and the optimizer, the
others compute gradients and push them.

The group's first ``servers`` ranks serve; the rest are workers. Each trainable
parameter of every optimizer group and dtype is laid out in one flat buffer, cut into
``servers`` contiguous slices: server s keeps slice s of each, with the optimizer state
for it. A worker's ``step()`` sends each server its slice of the worker's gradient (one
message per server) and waits for the slice of parameters the server answers with.

- ``mode="sync"``: a server waits for every worker's push, averages them in worker order
  and steps once, then answers every worker: the same update as one process training
  on all the workers' batches (with a loss that is the mean over each worker's equal
  share), as in data parallelism.
- ``mode="async"``: a server steps on each push as it comes, with that worker's gradient
  alone, and answers that worker at once, unless ``max_staleness`` holds the answer back
  until the slowest worker that still trains is at most that many pushes behind
  (``csrc/parallel/staleness_clock.h``). A worker's gradient may then be computed on
  parameters that miss other workers' recent pushes.

Workers end with ``close()``, which returns once every worker has closed, with the final
parameters on every worker. A server's ``serve()`` returns then too.

Messages go as point-to-point sends and receives of byte buffers on the parameters'
device; in async mode a server receives from any source, so the group must support that
(tdx and gloo do, NCCL does not).
"""

from __future__ import annotations

import dataclasses
import time
from typing import Any, Callable, Iterable, Optional

import torch
import torch.distributed as dist

from .. import _C
from ._common import check_wrapper_args, group_as_list, ranks_that_differ

__all__ = ["ParameterServer", "ServeReport", "ServerConfig", "Update"]

# A message is a header of six int64 (kind, three fields, the parameter server's number
# on its group, and one spare) and then, per flat buffer, a section aligned to 16 bytes
# holding the server's slice of it: gradients from a worker, parameters from a server.
# The number tells a message left over from an earlier parameter server on the same
# group (one that failed) from this one's.
_HEADER_BYTES = 48
_SECTION_ALIGN = 16
_MIN_MESSAGE_BYTES = 512
# Kinds. Worker to server: a gradient (clock, version the worker computed it on), the
# end of training (clock), or the end of a worker that another server refused (that
# server). Server to worker: parameters (version), the final parameters (version), or a
# refusal (version, the worker at fault or -1, bytes of text).
_PUSH, _STOP, _ABANDON = 1, 2, 3
_PARAMS, _FINAL, _ERROR = 11, 12, 13


@dataclasses.dataclass(frozen=True)
class ServerConfig:
    """How a :class:`ParameterServer` splits the group and applies pushes.

    servers: the group's first ``servers`` ranks serve, the others are workers; at least
        one of each.
    mode: ``"sync"`` (one averaged step per round of every worker's push) or ``"async"``
        (a step per push, as it arrives).
    max_staleness: async only. A worker's answer waits until every worker still training
        is at most this many pushes behind it; 0 advances the workers in rounds. None: no
        bound.
    """

    servers: int = 1
    mode: str = "sync"
    max_staleness: Optional[int] = None

    def __post_init__(self) -> None:
        if not isinstance(self.servers, int) or self.servers < 1:
            raise ValueError(f"ServerConfig: servers must be a positive int, not "
                             f"{self.servers!r}")
        if self.mode not in ("sync", "async"):
            raise ValueError(f"ServerConfig: mode must be 'sync' or 'async', not {self.mode!r}")
        if self.max_staleness is not None:
            if self.mode != "async":
                raise ValueError("ServerConfig: max_staleness bounds async mode; sync mode "
                                 "never lets a worker run ahead (leave it None)")
            if not isinstance(self.max_staleness, int) or self.max_staleness < 0:
                raise ValueError(f"ServerConfig: max_staleness must be None or an int >= 0, "
                                 f"not {self.max_staleness!r}")


@dataclasses.dataclass(frozen=True)
class Update:
    """One optimizer step of a server: the ``version`` it made (the first is 1) and the
    pushes it applied, each ``(worker, clock, base_version)``: the worker's group rank,
    its push count, and the version of this server's slice its gradient was computed on.
    A sync step applies a push of every worker, an async step one."""

    version: int
    pushes: tuple[tuple[int, int, int], ...]

    @property
    def staleness(self) -> int:
        """The most steps of this server that a push's gradient missed."""
        return max(self.version - 1 - base for _, _, base in self.pushes)


@dataclasses.dataclass(frozen=True)
class ServeReport:
    """What ``serve()`` did: ``version`` (steps taken), ``pushes`` (per worker group rank),
    ``stalest`` (the most steps of this server any push's gradient missed: a bound of s
    on the lead lets a gradient miss up to 2s + 1 pushes of each other worker, since their
    pushes are applied while it is computed), ``widest_gap`` (the largest lead, in
    pushes, of an answered worker over the slowest one still training: at most
    ``ServerConfig.max_staleness``),
    ``seconds`` (the whole of ``serve()``), ``step_seconds`` (of which applying pushes:
    averaging, the optimizer's step and ``on_update``; on CUDA, launching them) and, when
    ``serve(record=True)``, every step in order (``updates``)."""

    version: int
    pushes: dict[int, int]
    stalest: int
    widest_gap: int
    seconds: float = 0.0
    step_seconds: float = 0.0
    updates: tuple[Update, ...] = ()


def _write_head(buf: torch.Tensor, *fields: int) -> None:
    head = list(fields) + [0] * (_HEADER_BYTES // 8 - len(fields))
    buf[:_HEADER_BYTES].view(torch.int64).copy_(torch.tensor(head, dtype=torch.int64))


def _read_head(buf: torch.Tensor) -> list[int]:
    return buf[:_HEADER_BYTES].view(torch.int64).tolist()


def _round_up(n: int, to: int) -> int:
    return (n + to - 1) // to * to


class _Flat:
    """The trainable parameters of one optimizer group and dtype, as views of one flat
    buffer, and where each server's slice of it sits in that server's messages."""

    def __init__(self, group_index: int, params: list[torch.Tensor], servers: int) -> None:
        self.group_index = group_index
        self.params = params
        self.dtype = params[0].dtype
        numel = sum(p.numel() for p in params)
        self.flat = torch.empty(numel, dtype=self.dtype, device=params[0].device)
        at = 0
        with torch.no_grad():
            for p in params:
                view = self.flat[at:at + p.numel()]
                view.copy_(p.detach().reshape(-1))
                p.data = view.view_as(p)
                at += p.numel()
        self.grad = torch.empty_like(self.flat)  # a worker's gradient, gathered
        self.bounds = [(numel * s // servers, numel * (s + 1) // servers)
                       for s in range(servers)]
        self.section_at = [0] * servers  # byte offset in server s's messages

    def slice(self, t: torch.Tensor, server: int) -> torch.Tensor:
        lo, hi = self.bounds[server]
        return t[lo:hi]

    def section(self, message: torch.Tensor, server: int) -> torch.Tensor:
        lo, hi = self.bounds[server]
        at = self.section_at[server]
        return message[at:at + (hi - lo) * self.dtype.itemsize].view(self.dtype)

    def gather_grad(self) -> None:
        """Each parameter's .grad into ``grad``; a parameter without one counts as zero."""
        with torch.no_grad():
            at = 0
            for p in self.params:
                view = self.grad[at:at + p.numel()]
                if p.grad is None:
                    view.zero_()
                else:
                    view.copy_(p.grad.reshape(-1))
                at += p.numel()


class ParameterServer:
    """Parameters and optimizer on the group's first ``config.servers`` ranks; gradients
    from the others.

    Every rank builds it over the same parameters (an iterable of tensors or of
    parameter-group dicts, as ``optimizer_class`` takes them), in the same order, with
    the same shapes and dtypes. The servers' values are the starting point: a worker's
    constructor returns once its servers have called ``serve()``, with their values.
    Frozen parameters are copied from the group's first rank. A server's parameters are
    views of what it keeps, so with one server its module holds the trained model; with
    several, each holds its slice.

    On a server rank: ``serve()`` (until every worker has closed), ``optimizer`` (the
    ``optimizer_class`` over this server's slices, for schedulers), and ``state_dict()``
    and ``load_state_dict()`` (this server's slices, version and optimizer state; load
    before ``serve()`` to resume). On a worker: ``step()`` after each backward pass,
    ``zero_grad()``, and ``close()`` at the end.
    """

    _made: dict[str, int] = {}  # per group name: parameter servers made on it

    def __init__(self, params: Iterable[Any], optimizer_class: type, *,
                 group: Optional[dist.ProcessGroup] = None,
                 config: ServerConfig = ServerConfig(), **defaults: Any) -> None:
        check_wrapper_args("ParameterServer", optimizer_class, config, ServerConfig,
                           "torch.optim.SGD")
        self._group = group if group is not None else dist.group.WORLD
        self._world = dist.get_world_size(self._group)
        self._rank = dist.get_rank(self._group)
        # Numbered in the order they are made on the group, alike on every rank.
        key = getattr(self._group, "group_name", "")
        self._number = ParameterServer._made.get(key, 0)
        ParameterServer._made[key] = self._number + 1
        self._config = config
        self.is_server = self._rank < config.servers
        role = "server" if self.is_server else "worker"
        self._who = f"ParameterServer ({role}, rank {self._rank} of {self._world})"
        if config.servers >= self._world:
            raise ValueError(f"{self._who}: {config.servers} server(s) leave no worker in a "
                             f"group of {self._world}; lower ServerConfig.servers or add ranks")
        self._workers = list(range(config.servers, self._world))

        entries = [group_as_list(x) if isinstance(x, dict) else x for x in params]
        loose = [x for x in entries if not isinstance(x, dict)]
        if loose and len(loose) != len(entries):
            raise TypeError(f"{self._who}: params mixes tensors and parameter-group dicts; "
                            "pass one or the other")
        groups = [{"params": loose}] if loose else entries
        self.param_groups = groups
        self._check_params()
        devices = {p.device for g in groups for p in g["params"] if p.requires_grad}
        if len(devices) > 1:
            raise ValueError(f"{self._who}: trainable parameters on {sorted(map(str, devices))}; "
                             "a rank's messages are one buffer, so its parameters must share "
                             "one device")
        self._device = devices.pop() if devices else torch.device("cpu")

        self._flats: list[_Flat] = []
        for gi, g in enumerate(groups):
            by_dtype: dict[torch.dtype, list[torch.Tensor]] = {}
            for p in g["params"]:
                if p.requires_grad:
                    by_dtype.setdefault(p.dtype, []).append(p)
            for kind in by_dtype.values():
                self._flats.append(_Flat(gi, kind, config.servers))
        self._message_bytes = []
        for s in range(config.servers):
            at = _HEADER_BYTES
            for f in self._flats:
                f.section_at[s] = at
                lo, hi = f.bounds[s]
                at = _round_up(at + (hi - lo) * f.dtype.itemsize, _SECTION_ALIGN)
            # Room for a refusal's text even when the slices are small.
            self._message_bytes.append(max(at, _MIN_MESSAGE_BYTES))
        self._check_same_layout()
        self._copy_frozen()

        # The options, checked alike on every rank (a bad one raises everywhere, with no
        # message sent); a server's groups may still refuse theirs, below.
        optimizer_class([torch.zeros(1, requires_grad=True)], **defaults)
        self._version = 0
        self.optimizer: Optional[torch.optim.Optimizer] = None
        if self.is_server:
            me = self._rank
            self._replies: dict[int, Any] = {}  # worker -> its last answer's send
            self._reply_bufs = {w: self._message(me) for w in self._workers}
            self._served = False
            self._refused = False
            self._shards = [torch.nn.Parameter(f.slice(f.flat, me)) for f in self._flats]
            inner = []
            for f, shard in zip(self._flats, self._shards):
                hyper = {k: v for k, v in groups[f.group_index].items() if k != "params"}
                inner.append({**hyper, "params": [shard]})
            try:
                self.optimizer = optimizer_class(inner, **defaults) if inner else None
            except Exception as e:  # the workers wait for their first answer
                self._refuse_all(f"{optimizer_class.__name__} refused its options on the "
                                 f"server: {e}", -1)
                raise
        else:
            self._clock = 0
            self._closed = False
            self._versions = [0] * config.servers
            self._push_bufs = [self._message(s) for s in range(config.servers)]
            self._reply_bufs_w = [self._message(s) for s in range(config.servers)]
            self._pushes: list[Any] = [None] * config.servers
            self._receive(expect=(_PARAMS,))

    # ----- set-up

    def _check_params(self) -> None:
        seen = set()
        for gi, g in enumerate(self.param_groups):
            for pi, p in enumerate(g["params"]):
                name = f"parameter {pi} of group {gi}"
                if not isinstance(p, torch.Tensor):
                    raise TypeError(f"{self._who}: {name} is {type(p).__name__}, not a tensor")
                if id(p) in seen:
                    raise ValueError(f"{self._who}: {name} appears twice; pass each "
                                     "parameter once")
                seen.add(id(p))
                if p.layout != torch.strided:
                    raise ValueError(f"{self._who}: {name} is {p.layout}; a parameter "
                                     "server keeps dense parameters only")
                if p.requires_grad and not p.is_floating_point():
                    raise ValueError(f"{self._who}: {name} is {p.dtype}; view complex "
                                     "parameters as real (torch.view_as_real) to serve them")

    def _message(self, server: int) -> torch.Tensor:
        return torch.zeros(self._message_bytes[server], dtype=torch.uint8, device=self._device)

    def _check_same_layout(self) -> None:
        """Ranks whose layouts differ would read each other's messages as other tensors:
        compare a hash of each rank's, once, and name the ranks that differ."""
        frozen = [tuple(p.shape) for g in self.param_groups for p in g["params"]
                  if not p.requires_grad]
        text = f"{self._config}\nfrozen {frozen}\n" + "\n".join(
            f"{f.group_index} {f.dtype} " + ",".join(str(tuple(p.shape)) for p in f.params)
            for f in self._flats)
        others = ranks_that_differ(text, self._group, self._device)
        if others:
            raise ValueError(
                f"{self._who}: ranks {others} lay their parameters out otherwise than this "
                f"rank ({sum(f.flat.numel() for f in self._flats)} trainable elements in "
                f"{len(self._flats)} flat buffer(s), {self._config}); every rank must pass "
                "the same parameters, in the same order, with the same shapes, dtypes, "
                "requires_grad and groups, and the same ServerConfig")

    def _copy_frozen(self) -> None:
        src = dist.get_global_rank(self._group, 0)
        with torch.no_grad():
            for g in self.param_groups:
                for p in g["params"]:
                    if not p.requires_grad:
                        dist.broadcast(p.data, src=src, group=self._group)

    def _require(self, server: bool, what: str) -> None:
        if self.is_server != server:
            other = "workers" if not server else "servers"
            raise RuntimeError(f"{self._who}: {what} is for {other}; on this rank call "
                               f"{'serve()' if self.is_server else 'step() and close()'}")

    # ----- workers

    @property
    def clock(self) -> int:
        """Pushes this worker has made."""
        self._require(False, "clock")
        return self._clock

    @property
    def versions(self) -> tuple[int, ...]:
        """Per server, the version of its slice this worker's parameters hold."""
        self._require(False, "versions")
        return tuple(self._versions)

    def zero_grad(self, set_to_none: bool = True) -> None:
        for g in self.param_groups:
            for p in g["params"]:
                if p.grad is not None:
                    if set_to_none:
                        p.grad = None
                    else:
                        p.grad.detach_().zero_()

    def step(self) -> None:
        """Pushes this worker's gradients (``param.grad``; None counts as zero) and takes
        the parameters the servers answer with."""
        self._require(False, "step()")
        if self._closed:
            raise RuntimeError(f"{self._who}: step() after close(); make a new "
                               "ParameterServer to train again")
        for f in self._flats:
            f.gather_grad()
        self._send_all(_PUSH, self._clock + 1)
        self._clock += 1
        self._receive(expect=(_PARAMS,))

    def close(self) -> None:
        """Ends this worker's training. Returns once every worker has closed, with the
        final parameters (the same on every worker)."""
        self._require(False, "close()")
        if self._closed:
            return
        self._closed = True
        self._send_all(_STOP, self._clock)
        self._receive(expect=(_FINAL,))
        for w in self._pushes:
            if w is not None:
                w.wait()

    def _send_all(self, kind: int, clock: int) -> None:
        for s in range(self._config.servers):
            if self._pushes[s] is not None:
                self._pushes[s].wait()  # the buffer is about to change
            buf = self._push_bufs[s]
            _write_head(buf, kind, clock, self._versions[s], 0, self._number)
            if kind == _PUSH:
                for f in self._flats:
                    f.section(buf, s).copy_(f.slice(f.grad, s))
            self._pushes[s] = dist.isend(buf, group=self._group, group_dst=s)

    def _receive(self, expect: tuple[int, ...]) -> None:
        for s in range(self._config.servers):
            buf = self._reply_bufs_w[s]
            dist.recv(buf, group=self._group, group_src=s)
            kind, version, culprit, nbytes, number, _ = _read_head(buf)
            if number != self._number:
                self._closed = True
                raise RuntimeError(self._left_over(f"server rank {s}", number))
            if kind == _ERROR:
                self._closed = True
                text = bytes(buf[_HEADER_BYTES:_HEADER_BYTES + nbytes].tolist()).decode(
                    "utf-8", "replace")
                self._abandon(s)
                raise RuntimeError(f"{self._who}: server rank {s} stopped at version "
                                   f"{version}: {text}")
            if kind not in expect:
                raise RuntimeError(f"{self._who}: server rank {s} answered with message "
                                   f"kind {kind} where this worker expects {expect}")
            with torch.no_grad():
                for f in self._flats:
                    f.slice(f.flat, s).copy_(f.section(buf, s))
            self._versions[s] = version

    def _left_over(self, sender: str, number: int) -> str:
        return (f"{self._who}: {sender} sent a message of parameter server {number} on this "
                f"group, where this one is number {self._number}: a message left over from "
                "one that failed, or ranks that made their parameter servers in another "
                "order; make a new group")

    def _abandon(self, failed: int) -> None:
        """Tells the servers other than ``failed`` that this worker stops because that one
        did, so that they stop too instead of waiting for its pushes until the group
        times out. Best effort, not waited for."""
        self._abandoned = []
        for s in range(self._config.servers):
            if s != failed:
                buf = self._message(s)
                _write_head(buf, _ABANDON, failed, 0, 0, self._number)
                try:
                    self._abandoned.append((dist.isend(buf, group=self._group, group_dst=s),
                                            buf))
                except Exception:  # the server's refusal says more than this
                    pass

    # ----- servers

    def state_dict(self) -> dict[str, Any]:
        """This server's part of the training state: its slice of every flat buffer, the
        version (steps taken) and the optimizer's state over those slices."""
        self._require(True, "state_dict()")
        return {"server": self._rank, "servers": self._config.servers,
                "version": self._version,
                "slices": [shard.detach().clone() for shard in self._shards],
                "optimizer": self.optimizer.state_dict() if self.optimizer else None}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Resumes from ``state_dict()`` of the same server of a job with the same
        parameters and ServerConfig; call it before ``serve()``, which sends the workers
        the loaded values."""
        self._require(True, "load_state_dict()")
        if self._served:
            raise RuntimeError(f"{self._who}: load_state_dict() after serve() began; the "
                               "workers already hold the old values")
        where = (state.get("server"), state.get("servers"))
        if where != (self._rank, self._config.servers):
            raise ValueError(f"{self._who}: the state is server {where[0]}'s of "
                             f"{where[1]}; load each server's own state, from a job with "
                             f"{self._config.servers} server(s)")
        slices = state["slices"]
        sizes = [t.numel() for t in slices]
        mine = [shard.numel() for shard in self._shards]
        if sizes != mine:
            raise ValueError(f"{self._who}: the state's slices hold {sizes} elements where "
                             f"this server's hold {mine}; the parameters differ")
        with torch.no_grad():
            for shard, t in zip(self._shards, slices):
                shard.copy_(t)
        if self.optimizer is not None:
            self.optimizer.load_state_dict(state["optimizer"])
        self._version = int(state["version"])

    def serve(self, on_update: Optional[Callable[[torch.optim.Optimizer, int], None]] = None,
              record: bool = False) -> ServeReport:
        """Runs this server until every worker has closed. ``on_update(optimizer,
        version)`` runs after each step (a learning-rate scheduler's ``step()``, say);
        ``record`` keeps every step in the report."""
        self._require(True, "serve()")
        if self._served:
            raise RuntimeError(f"{self._who}: serve() ran already; its workers have closed")
        self._served = True
        self._on_update = on_update
        self._record: Optional[list[Update]] = [] if record else None
        self._pushes_of = {w: 0 for w in self._workers}
        self._stalest = 0
        self._step_seconds = 0.0
        started = time.perf_counter()
        try:
            for w in self._workers:  # the starting point, which load_state_dict may set
                self._answer(w, _PARAMS)
            if self._config.mode == "sync":
                gap = self._serve_sync()
            else:
                gap = self._serve_async()
        except BaseException as e:
            if not self._refused:
                self._refuse_all(f"{type(e).__name__} on the server: {e}", -1)
            raise
        for w in self._workers:
            self._wait_reply(w)
        return ServeReport(self._version, dict(self._pushes_of), self._stalest, gap,
                           time.perf_counter() - started, self._step_seconds,
                           tuple(self._record or ()))

    def _serve_sync(self) -> int:
        me = self._rank
        bufs = {w: self._message(me) for w in self._workers}
        sums = [torch.empty(f.slice(f.flat, me).numel(),
                            dtype=torch.float32 if f.dtype.itemsize < 4 else f.dtype,
                            device=self._device) for f in self._flats]
        for round_ in range(1, 1 << 62):
            for work in [dist.irecv(bufs[w], group=self._group, group_src=w)
                         for w in self._workers]:
                work.wait()
            heads = {w: _read_head(bufs[w]) for w in self._workers}
            for w in self._workers:
                self._check_push(w, heads[w])
            stopped = [w for w in self._workers if heads[w][0] == _STOP]
            if len(stopped) == len(self._workers):
                for w in self._workers:
                    self._answer(w, _FINAL)
                return 0
            if stopped:
                pushing = [w for w in self._workers if w not in stopped]
                text = (f"in sync mode every worker runs the same number of steps, but "
                        f"worker(s) {stopped} closed after {round_ - 1} step(s) while "
                        f"worker(s) {pushing} pushed step {round_}")
                self._refuse_all(text, stopped[0])
                raise RuntimeError(f"{self._who}: {text}")
            for w in self._workers:
                if heads[w][0] != _PUSH or heads[w][1] != round_:
                    raise RuntimeError(f"{self._who}: worker {w} sent kind {heads[w][0]} "
                                       f"clock {heads[w][1]} in round {round_}")
            began = time.perf_counter()
            with torch.no_grad():
                for f, acc, shard in zip(self._flats, sums, self._shards):
                    for i, w in enumerate(self._workers):  # in worker order: reproducible
                        part = f.section(bufs[w], me)
                        if i == 0:
                            acc.copy_(part)
                        else:
                            acc.add_(part)
                    acc.div_(len(self._workers))
                    shard.grad = acc.to(f.dtype, copy=True)
            self._apply(tuple((w, heads[w][1], heads[w][2]) for w in self._workers), began)
            for w in self._workers:
                self._answer(w, _PARAMS)
        raise AssertionError("unreachable")

    def _serve_async(self) -> int:
        me = self._rank
        bound = self._config.max_staleness
        clock = _C._StalenessClock(len(self._workers), -1 if bound is None else bound)
        buf = self._message(me)
        first = self._workers[0]
        while not clock.all_closed:
            src = dist.recv(buf, group=self._group)
            w = dist.get_group_rank(self._group, src)
            head = _read_head(buf)
            self._check_push(w, head)
            kind, pushed, base = head[:3]
            if kind == _PUSH:
                began = time.perf_counter()
                if pushed != clock.clock(w - first) + 1:
                    raise RuntimeError(f"{self._who}: worker {w} sent push {pushed} after "
                                       f"{clock.clock(w - first)}")
                with torch.no_grad():
                    for f, shard in zip(self._flats, self._shards):
                        shard.grad = f.section(buf, me).clone()
                self._apply(((w, pushed, base),), began)
                released = clock.push(w - first)
            elif kind == _STOP:
                released = clock.close(w - first)
            else:
                raise RuntimeError(f"{self._who}: worker {w} sent message kind {kind}")
            for i in released:
                self._answer(first + i, _PARAMS)
        for w in self._workers:
            self._answer(w, _FINAL)
        return clock.widest_gap

    def _check_push(self, worker: int, head: list[int]) -> None:
        """Refuses a message from another parameter server, or from a worker that stops
        because another server failed."""
        if head[4] != self._number:
            text = self._left_over(f"worker {worker}", head[4])
            self._refuse_all(text, worker)
            raise RuntimeError(text)
        if head[0] == _ABANDON:
            text = (f"worker {worker} stopped because server rank {head[1]} failed (see its "
                    "error)")
            self._refuse_all(text, worker)
            raise RuntimeError(f"{self._who}: {text}")

    def _apply(self, pushes: tuple[tuple[int, int, int], ...], began: float) -> None:
        if self.optimizer is not None:
            self.optimizer.step()
            self.optimizer.zero_grad(set_to_none=True)
        self._version += 1
        update = Update(self._version, pushes)
        self._stalest = max(self._stalest, update.staleness)
        for w, _, _ in pushes:
            self._pushes_of[w] += 1
        if self._record is not None:
            self._record.append(update)
        if self._on_update is not None and self.optimizer is not None:
            self._on_update(self.optimizer, self._version)
        self._step_seconds += time.perf_counter() - began

    def _wait_reply(self, worker: int) -> None:
        work = self._replies.pop(worker, None)
        if work is not None:
            work.wait()

    def _answer(self, worker: int, kind: int, culprit: int = -1, text: str = "") -> None:
        me = self._rank
        self._wait_reply(worker)
        buf = self._reply_bufs[worker]
        data = text.encode()[:max(0, buf.numel() - _HEADER_BYTES)]
        _write_head(buf, kind, self._version, culprit, len(data), self._number)
        if kind == _ERROR:
            if data:
                buf[_HEADER_BYTES:_HEADER_BYTES + len(data)].copy_(
                    torch.frombuffer(bytearray(data), dtype=torch.uint8))
        else:
            for f in self._flats:
                f.section(buf, me).copy_(f.slice(f.flat, me))
        self._replies[worker] = dist.isend(buf, group=self._group, group_dst=worker)

    def _refuse_all(self, text: str, culprit: int) -> None:
        """Tells every worker why this server stops, so that none waits for an answer
        until the group times out. Best effort: the server raises either way."""
        self._refused = True
        for w in self._workers:
            try:
                self._answer(w, _ERROR, culprit, text)
            except Exception:
                pass

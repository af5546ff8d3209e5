"""Pipeline parallelism: one stage of a model per rank, microbatches run by a schedule.

A schedule is data: for each stage, the list of actions it runs in order (forward and
backward of a microbatch, and the activation and gradient messages around them), made
and checked by the C++ core (``csrc/parallel/pipeline_schedule.h``). :class:`Schedule`
wraps it; :class:`PipelineStage` runs this rank's list over a process group:

    stage = PipelineStage(my_layers, group=pp_group, loss_fn=nn.functional.cross_entropy,
                          config=PipelineConfig(schedule="1f1b", microbatches=8))
    loss = stage.step(inputs=x if first else None, targets=y if last else None)
    optimizer.step()                       # each rank steps its own stage's parameters
    out = stage.evaluate(inputs=x if first else None)   # forward only: last stage's output

Sends are asynchronous and receives wait, as the schedule's check assumes, so a schedule
that passes the check cannot deadlock on its messages.

The ``pipedream`` and ``2bw`` schedules run 1F1B's list and step the stage's optimizer
during the step; which weight version each microbatch runs on, and which copies the
stage keeps for that, come from the C++ plan (``csrc/parallel/weight_versions.h``).
"""

from __future__ import annotations

import dataclasses
from typing import Any, Callable, Optional, Sequence

import torch
import torch.distributed as dist
import torch.nn as nn

from .. import _C

__all__ = ["PipelineConfig", "PipelineStage", "Schedule"]


class _Aborted(RuntimeError):
    """Another stage failed this call and said so; the stage that failed raised its own
    error."""


class _Count:
    """A tuple's header: how many tensors follow."""

    def __init__(self, n: int) -> None:
        self.n = n


class _Mark:
    """END or DONE: the end of a call (see _END)."""

    def __init__(self, code: int) -> None:
        self.code = code


# What a stage passes on: one tensor, or a tuple of them.
Tensors = Any


def _entries(x: Tensors) -> tuple:
    return tuple(x) if isinstance(x, (tuple, list)) else (x,)


def _rows(x: Tensors) -> int:
    return len(_entries(x)[0])


def _microbatches(batch: Tensors, m: int) -> list:
    """A batch (a tensor, or a tuple of tensors of the same length) cut into m along
    dimension 0."""
    if isinstance(batch, (tuple, list)):
        parts = [torch.tensor_split(t, m) for t in batch]
        return [tuple(p[i] for p in parts) for i in range(m)]
    return list(torch.tensor_split(batch, m))


def _with_grad(x: Tensors) -> Tensors:
    """A received activation, its floating-point tensors marked to take a gradient."""
    if isinstance(x, tuple):
        return tuple(t.requires_grad_() if t is not None and t.is_floating_point() else t
                     for t in x)
    return x.requires_grad_() if x.is_floating_point() else x


def _with_gradients(out: Tensors, grads: Tensors) -> tuple[list, list]:
    """The outputs that take part in the backward and their received gradients: those
    with a gradient (the next stage sends None for the rest) that require one."""
    pairs = [(o, g) for o, g in zip(_entries(out), _entries(grads))
             if g is not None and o.requires_grad]
    return [o for o, _ in pairs], [g for _, g in pairs]


def _call(module: nn.Module, x: Tensors) -> Tensors:
    return module(*x) if isinstance(x, tuple) else module(x)

_SCHEDULES = ("gpipe", "1f1b", "pipedream", "2bw")
# Schedules whose weights change during a step: 1F1B's action order, with updates inside.
_ASYNC = ("pipedream", "2bw")
_MAX_DIMS = 8
# Activations and gradients cross with a header: dtype code, dimensions, the call it
# belongs to (the stages' step() and evaluate() calls, counted alike), the pipeline's
# number on its group, then the sizes. A header with code _ABORT, whose dimensions field
# names the stage that failed, stops the call on every stage.
_HEAD = 4 + _MAX_DIMS
_ABORT = -1
# Several tensors cross as a header with code _TUPLE and their count in the dimensions
# field, then each as above; a missing one (an input without gradient) as _NONE.
_TUPLE = -2
_NONE = -3
# The end of a call: END goes from the first stage to the last, each stage passing it on
# once its own part is done, and DONE comes back. A stage returns only once DONE reaches
# it, so a failure anywhere (which sends _ABORT in place of these) reaches every stage,
# even one that has nothing left to receive from the failed one.
_END = -4
_DONE = -5
_DTYPES = (torch.float32, torch.float64, torch.float16, torch.bfloat16, torch.int64,
           torch.int32, torch.int16, torch.int8, torch.uint8, torch.bool, torch.complex64,
           torch.complex128)


class Schedule:
    """Per stage, the actions it runs: ``("F", mb)`` forward, ``("B", mb)`` backward,
    ``("SA", mb)``/``("RA", mb)`` send/receive an activation, ``("SG", mb)``/``("RG", mb)``
    send/receive a gradient. Made by :meth:`gpipe`, :meth:`one_f_one_b` or from lists of
    your own, which are checked: an error names the stage and the step and prints the grid
    of what could run."""

    def __init__(self, actions: Sequence[Sequence[tuple[str, int]]], microbatches: int) -> None:
        self._core = _C._PipelineSchedule([list(a) for a in actions], microbatches)

    @classmethod
    def _wrap(cls, core: Any) -> "Schedule":
        out = cls.__new__(cls)
        out._core = core
        return out

    @classmethod
    def gpipe(cls, stages: int, microbatches: int) -> "Schedule":
        """Every forward, then every backward: each stage keeps all microbatches'
        activations."""
        return cls._wrap(_C._PipelineSchedule.gpipe(stages, microbatches))

    @classmethod
    def one_f_one_b(cls, stages: int, microbatches: int) -> "Schedule":
        """Forwards to fill the pipeline, then one forward and one backward in turn: stage s
        keeps at most ``stages - s`` microbatches' activations."""
        return cls._wrap(_C._PipelineSchedule.one_f_one_b(stages, microbatches))

    @classmethod
    def named(cls, name: str, stages: int, microbatches: int) -> "Schedule":
        if name == "gpipe":
            return cls.gpipe(stages, microbatches)
        if name in ("1f1b",) + _ASYNC:
            return cls.one_f_one_b(stages, microbatches)
        raise ValueError(f"unknown pipeline schedule {name!r}: {' or '.join(_SCHEDULES)}")

    @property
    def stages(self) -> int:
        return self._core.stages

    @property
    def microbatches(self) -> int:
        return self._core.microbatches

    def actions(self, stage: int) -> list[tuple[str, int]]:
        return self._core.actions(stage)

    @property
    def peak_in_flight(self) -> list[int]:
        """Per stage, the most microbatches whose activations it keeps at once."""
        return list(self._core.peak_in_flight)

    @property
    def makespan(self) -> int:
        """Time units from first forward to last backward (a forward 1, a backward 2)."""
        return self._core.makespan

    @property
    def bubble(self) -> float:
        """Share of the stages' time idle, by the same units."""
        return self._core.bubble

    def grid(self) -> str:
        """One row per stage, one column per time unit: ``F3`` microbatch 3's forward, ``B3``
        its backward (two units), dots idle."""
        return self._core.grid()

    def __repr__(self) -> str:
        return (f"Schedule({self.stages} stages, {self.microbatches} microbatches, "
                f"bubble {self.bubble:.0%})\n{self.grid()}")


@dataclasses.dataclass(frozen=True)
class PipelineConfig:
    """How a :class:`PipelineStage` runs a step.

    schedule: ``"gpipe"`` or ``"1f1b"`` (the step leaves its gradients in ``param.grad``),
        or ``"pipedream"`` or ``"2bw"`` (1F1B's order, with the stage's optimizer stepping
        during the step: after every microbatch with weight stashing, or after every
        ``update_every`` microbatches with each update's gradient one update old).
    microbatches: how many the batch splits into (``torch.tensor_split``: sizes may differ
        by one).
    update_every: 2bw only: microbatches per update, dividing ``microbatches``; None: one
        update per step. A pipeline of S stages needs at least S - 1.
    """

    schedule: str = "1f1b"
    microbatches: int = 4
    update_every: Optional[int] = None

    def __post_init__(self) -> None:
        if self.schedule not in _SCHEDULES:
            raise ValueError(f"PipelineConfig: schedule must be one of {', '.join(_SCHEDULES)}, "
                             f"not {self.schedule!r}")
        if not isinstance(self.microbatches, int) or self.microbatches < 1:
            raise ValueError(f"PipelineConfig: microbatches must be an int of at least 1, not "
                             f"{self.microbatches!r}")
        if self.update_every is not None:
            if self.schedule != "2bw":
                raise ValueError(f"PipelineConfig: update_every is for the 2bw schedule; "
                                 f"{self.schedule} updates "
                                 + ("after every microbatch" if self.schedule == "pipedream"
                                    else "when you step the optimizer"))
            if (not isinstance(self.update_every, int) or self.update_every < 1
                    or self.microbatches % self.update_every):
                raise ValueError(f"PipelineConfig: update_every must be a positive int that "
                                 f"divides microbatches ({self.microbatches}), not "
                                 f"{self.update_every!r}")

    @property
    def every(self) -> int:
        """Microbatches per weight update (2bw), or 1."""
        if self.schedule == "2bw":
            return self.update_every or self.microbatches
        return 1


class PipelineStage:
    """This rank's stage of a pipeline over ``group`` (stage i is the group's rank i).

    A call that fails on one stage (bad arguments, an error in its module or loss) stops
    on every stage: the failing stage tells its neighbours, which tell theirs, and each
    raises at once instead of waiting for the group's timeout. Messages of that call may
    then be left unreceived, so every later call on these stages raises too: make a new
    group and new stages to go on.

    ``step(inputs, targets)`` runs one training step's forward and backward passes over
    every microbatch, leaving the stage's parameter gradients in ``param.grad`` (summed
    over microbatches, each weighted by its share of the batch, so that they equal one
    process's gradients of ``loss_fn`` over the whole batch when ``loss_fn`` averages).
    The first stage takes ``inputs``, the last ``targets`` and returns the batch's loss;
    the others pass None. A stage's module takes and returns one tensor or a tuple of
    them, of any shape and dtype (up to 8 dimensions); gradients flow back through the
    floating-point ones. ``inputs`` and ``targets`` may be tuples, cut along dimension 0.
    Received tensors go to ``device``, by default that of the module's parameters.

    With the ``"pipedream"`` and ``"2bw"`` schedules, ``optimizer`` (over this stage's
    parameters) steps inside ``step()``, and ``version`` counts its updates:

    - pipedream: after each microbatch's backward, with that microbatch's gradient of
      ``loss_fn`` (its own mean). A microbatch's forward runs on the stage's latest
      weights, and its backward on the same version, kept as a copy (weight stashing).
      Stages run a microbatch on different versions: stage s on the weights of
      ``S - 1 - s`` fewer updates than the last stage.
    - 2bw: after every ``update_every`` microbatches (a batch), with the batch's gradient,
      each microbatch weighted by its share of the batch. Batch b, counted over all
      steps, runs on the weights of update ``max(b - 1, 0)`` on every stage, so each
      update applies a gradient one update old, and a stage keeps at most two copies.
    """

    _made: dict[str, int] = {}  # per group name: pipelines made on it

    def __init__(self, module: nn.Module, *, group: Optional[dist.ProcessGroup] = None,
                 config: PipelineConfig = PipelineConfig(),
                 loss_fn: Optional[Callable[[torch.Tensor, torch.Tensor], torch.Tensor]] = None,
                 schedule: Optional[Schedule] = None,
                 device: Optional[torch.device] = None,
                 optimizer: Optional[torch.optim.Optimizer] = None) -> None:
        if not dist.is_initialized():
            raise RuntimeError("PipelineStage: torch.distributed is not initialized; call "
                               "dist.init_process_group first")
        if not isinstance(config, PipelineConfig):
            raise TypeError(f"PipelineStage: config must be a PipelineConfig, not {config!r}")
        self.group = group if group is not None else dist.group.WORLD
        self.stage = dist.get_rank(self.group)
        self.stages = dist.get_world_size(self.group)
        self._who = f"PipelineStage (stage {self.stage} of {self.stages})"
        # Pipelines on one group are numbered in the order they are made, alike on every
        # rank (counted before any check that one stage alone may fail), so that a message
        # left over from another one is told apart.
        key = getattr(self.group, "group_name", "")
        self._pipeline = PipelineStage._made.get(key, 0)
        PipelineStage._made[key] = self._pipeline + 1
        if schedule is None:
            schedule = Schedule.named(config.schedule, self.stages, config.microbatches)
        if schedule.stages != self.stages:
            raise ValueError(f"{self._who}: the schedule has {schedule.stages} stages and the "
                             f"group {self.stages} ranks; make one stage per rank")
        if self.stage == self.stages - 1 and loss_fn is None:
            raise ValueError(f"{self._who}: the last stage computes the loss: pass loss_fn")
        self.module = module
        self.schedule = schedule
        self.loss_fn = loss_fn
        self._actions = schedule.actions(self.stage)
        # Where received tensors go: the module's parameters' device unless told (a stage
        # without parameters has nothing to go by).
        self._device = torch.device(device) if device is not None else next(
            (p.device for p in module.parameters()), torch.device("cpu"))
        self.max_kept = 0  # the most microbatches whose activations this rank kept at once
        self._call = 0  # step() and evaluate() calls begun
        self._broken: Optional[str] = None  # why an earlier call failed
        self._aborts: list = []  # abort notices sent: kept until the stage goes
        self.config = config
        self.optimizer = optimizer
        self.version = 0  # weight updates made inside step() (pipedream, 2bw)
        self.max_copies = 0  # the most weight copies this rank kept at once
        self._copies: dict[int, dict[str, torch.Tensor]] = {}
        # Microbatches per weight update: 2bw's batch (all of a step's, by default), or 1.
        self.update_every = ((config.update_every or schedule.microbatches)
                             if config.schedule == "2bw" else 1)
        if config.schedule in _ASYNC:
            if not isinstance(optimizer, torch.optim.Optimizer):
                raise ValueError(f"{self._who}: the {config.schedule} schedule steps the "
                                 "optimizer inside step(); pass optimizer=, over this "
                                 "stage's parameters")
            if schedule.microbatches % self.update_every:
                raise ValueError(f"{self._who}: update_every ({self.update_every}) must divide "
                                 f"the schedule's {schedule.microbatches} microbatches")
            # Every rank checks every stage, so that all raise alike. From version 1 on,
            # no update exists before the run's first, the strictest case.
            for s in range(self.stages):
                self._plan(s, start=1)
        elif optimizer is not None:
            raise ValueError(f"{self._who}: {config.schedule} leaves the gradients in "
                             "param.grad for you to step the optimizer; optimizer= is for "
                             "the pipedream and 2bw schedules")

    def _plan(self, stage: int, start: int) -> Any:
        try:
            return _C._plan_weights(self.schedule.actions(stage), stage,
                                    self.schedule.microbatches, self.config.schedule,
                                    self.update_every, start)
        except ValueError as e:
            raise ValueError(f"{self._who}: {e} (a pipeline of {self.stages} stages needs "
                             f"at least {max(1, self.stages - 1)})") from None

    def _peer(self, stage: int) -> int:
        return dist.get_global_rank(self.group, stage)

    def _send(self, x: Tensors, stage: int, pending: list) -> None:
        """One tensor, or a tuple of them (None for a missing one), to ``stage``; the sends
        stay in ``pending`` until the call waits for them."""
        if not isinstance(x, (tuple, list)):
            self._send_one(x, stage, pending)
            return
        peer = self._peer(stage)
        head = self._header(_TUPLE, len(x)).to(self._device)
        pending.append((dist.isend(head, peer, group=self.group), head))
        for t in x:
            if t is None:
                head = self._header(_NONE, 0).to(self._device)
                pending.append((dist.isend(head, peer, group=self.group), head))
            else:
                self._send_one(t, stage, pending)

    def _send_one(self, t: torch.Tensor, stage: int, pending: list) -> None:
        if not isinstance(t, torch.Tensor):
            raise TypeError(f"{self._who}: cannot send {type(t).__name__} to stage {stage}; "
                            "a stage passes a tensor or a tuple of tensors")
        t = t.detach().contiguous()
        if t.dim() > _MAX_DIMS or t.dtype not in _DTYPES:
            raise ValueError(f"{self._who}: cannot send a {t.dtype} tensor of {t.dim()} "
                             f"dimensions to stage {stage} (at most {_MAX_DIMS}, dtypes "
                             f"{', '.join(str(d) for d in _DTYPES)})")
        head = self._header(_DTYPES.index(t.dtype), t.dim())
        head[4:4 + t.dim()] = torch.tensor(t.shape, dtype=torch.int64)
        head = head.to(self._device)
        peer = self._peer(stage)
        # Both stay referenced until the step ends and waits for them.
        pending.append((dist.isend(head, peer, group=self.group), head))
        pending.append((dist.isend(t, peer, group=self.group), t))

    def _header(self, code: int, ndim: int) -> torch.Tensor:
        head = torch.zeros(_HEAD, dtype=torch.int64)
        head[0], head[1], head[2], head[3] = code, ndim, self._call, self._pipeline
        return head

    def _recv(self, stage: int) -> Tensors:
        """What ``stage`` sent: a tensor, or a tuple of them (None where one is missing)."""
        first = self._recv_one(stage)
        if isinstance(first, _Mark):
            raise RuntimeError(f"{self._who}: stage {stage} ended the call while this stage "
                               "still expects a message from it; every stage must run the "
                               "same schedule")
        if not isinstance(first, _Count):
            return first
        return tuple(self._recv_one(stage) for _ in range(first.n))

    def _recv_one(self, stage: int) -> Any:
        peer = self._peer(stage)
        head = torch.empty(_HEAD, dtype=torch.int64, device=self._device)
        dist.irecv(head, peer, group=self.group).wait()
        code, ndim, call, pipeline, *dims = head.tolist()
        if (call, pipeline) != (self._call, self._pipeline) and code == _ABORT:
            raise RuntimeError(
                f"{self._who}: stage {stage} passed on notice that stage {ndim} failed call "
                f"{call} of pipeline {pipeline} on this group, which this stage had ended "
                f"(it runs call {self._call} of pipeline {self._pipeline}); make a new group")
        if (call, pipeline) != (self._call, self._pipeline):
            raise RuntimeError(
                f"{self._who}: stage {stage} sent a message of call {call} of pipeline "
                f"{pipeline} on this group, where this stage runs call {self._call} of "
                f"pipeline {self._pipeline}: a message left over from a call that failed, or "
                "stages that made their pipelines or calls in another order")
        if code == _ABORT:
            self._tell_neighbours(origin=ndim, skip=stage)
            raise _Aborted(f"stage {ndim} failed this call (see its error)")
        if code in (_END, _DONE):
            return _Mark(code)
        if code == _TUPLE:
            return _Count(ndim)
        if code == _NONE:
            return None
        out = torch.empty(dims[:ndim], dtype=_DTYPES[code], device=self._device)
        dist.irecv(out, peer, group=self.group).wait()
        return out

    def _tell_neighbours(self, origin: int, skip: Optional[int] = None) -> None:
        """Sends the neighbouring stages (but ``skip``) notice that stage ``origin`` failed
        this call. Best effort and not waited for: a neighbour may be gone."""
        for stage in (self.stage - 1, self.stage + 1):
            if 0 <= stage < self.stages and stage != skip:
                head = self._header(_ABORT, origin).to(self._device)
                try:
                    self._aborts.append((dist.isend(head, self._peer(stage), group=self.group),
                                         head))
                except Exception:  # the error being raised says more than this one
                    pass

    def _control(self, code: int, stage: int, pending: list) -> None:
        head = self._header(code, 0).to(self._device)
        pending.append((dist.isend(head, self._peer(stage), group=self.group), head))

    def _expect(self, code: int, stage: int) -> None:
        got = self._recv_one(stage)
        if not (isinstance(got, _Mark) and got.code == code):
            raise RuntimeError(f"{self._who}: stage {stage} sent more than this stage's "
                               "schedule takes from it; every stage must run the same "
                               "schedule")

    def _finish(self, pending: list) -> None:
        """Ends a call on every stage together (see _END), then waits for this stage's
        sends, which its neighbours have all taken by then."""
        if self.stage > 0:
            self._expect(_END, self.stage - 1)
        if self.stage < self.stages - 1:
            self._control(_END, self.stage + 1, pending)
            self._expect(_DONE, self.stage + 1)
        if self.stage > 0:
            self._control(_DONE, self.stage - 1, pending)
        for work, _ in pending:
            work.wait()

    def _run(self, what: str, body: Callable[..., Any], *args: Any) -> Any:
        """One call on every stage alike: refused after a failed one; a failure here tells
        the neighbours, and one there raises here."""
        if self._broken is not None:
            raise RuntimeError(f"{self._who}: {what} after a failed call ({self._broken}); "
                               "its messages may still be in flight, so this pipeline "
                               "cannot go on: make a new group and new PipelineStages")
        self._call += 1
        try:
            return body(*args)
        except _Aborted as e:
            self._broken = str(e)
            raise RuntimeError(f"{self._who}: {what} stopped: {e}; this stage's own part "
                               "was not finished") from None
        except BaseException as e:
            self._broken = f"on this stage: {type(e).__name__}"
            self._tell_neighbours(origin=self.stage)
            raise

    def evaluate(self, inputs: Optional[torch.Tensor] = None) -> Optional[torch.Tensor]:
        """The forward pass alone, microbatch by microbatch, in order: the model's output
        for the whole batch on the last stage (its module's, before any loss), None
        elsewhere. The first stage passes ``inputs``."""
        return self._run("evaluate()", self._evaluate, inputs)

    @torch.no_grad()
    def _evaluate(self, inputs: Optional[torch.Tensor]) -> Optional[torch.Tensor]:
        first, last = self.stage == 0, self.stage == self.stages - 1
        if first and inputs is None:
            raise ValueError(f"{self._who}: the first stage takes the batch: pass inputs")
        outs = []
        pending: list = []
        xs = _microbatches(inputs, self.schedule.microbatches) if first else None
        for mb in range(self.schedule.microbatches):
            out = self._forward(xs[mb] if first else self._recv(self.stage - 1))
            if last:
                outs.append(out)
            else:
                self._send(out, self.stage + 1, pending)
        self._finish(pending)
        if not last:
            return None
        if isinstance(outs[0], tuple):
            return tuple(torch.cat(parts) for parts in zip(*outs))
        return torch.cat(outs)

    def _forward(self, x: Tensors, params: Optional[dict] = None) -> Tensors:
        """The stage's module on one microbatch (on ``params`` in place of its own), its
        output checked: a tensor or a tuple of tensors."""
        if params is None:
            out = _call(self.module, x)
        else:
            out = torch.func.functional_call(self.module, params,
                                             x if isinstance(x, tuple) else (x,))
        if isinstance(out, list):
            out = tuple(out)
        if not (isinstance(out, torch.Tensor) or (
                isinstance(out, tuple) and out
                and all(isinstance(t, torch.Tensor) for t in out))):
            raise TypeError(f"{self._who}: the module returned {type(out).__name__}; a stage "
                            "passes a tensor or a non-empty tuple of tensors to the next")
        return out

    def _input_grads(self, got: Tensors, mb: int) -> Tensors:
        """What goes back at SG: the gradient of each received tensor (None where it has
        none); refused when no tensor got one."""
        if got is None or (isinstance(got, tuple) and all(g is None for g in got)):
            raise RuntimeError(f"{self._who}: microbatch {mb}'s input got no gradient; the "
                               "stage's output must depend on it")
        return got

    def step(self, inputs: Optional[torch.Tensor] = None,
             targets: Optional[torch.Tensor] = None) -> Optional[torch.Tensor]:
        """One training step's forward and backward passes (and, with pipedream or 2bw,
        the weight updates among them); the batch's loss on the last stage (detached),
        None elsewhere."""
        body = self._step_updating if self.config.schedule in _ASYNC else self._step_flushed
        return self._run("step()", body, inputs, targets)

    def _step_flushed(self, inputs: Optional[torch.Tensor],
                      targets: Optional[torch.Tensor]) -> Optional[torch.Tensor]:
        first, last = self.stage == 0, self.stage == self.stages - 1
        xs, ys = self._split(inputs, targets)
        total = _rows(targets) if last else 0
        received: dict[int, torch.Tensor] = {}  # activations in, until their forward
        kept: dict[int, tuple[Optional[torch.Tensor], torch.Tensor]] = {}  # until backward
        grads: dict[int, torch.Tensor] = {}  # output gradients in, until their backward
        back: dict[int, torch.Tensor] = {}  # inputs whose gradient goes back at SG
        pending: list = []
        loss_sum = torch.zeros((), dtype=torch.float64, device=self._device)
        for verb, mb in self._actions:
            if verb == "RA":
                received[mb] = _with_grad(self._recv(self.stage - 1))
            elif verb == "F":
                x = xs[mb] if first else received.pop(mb)
                out = self._forward(x)
                if last:
                    # Each microbatch's mean, weighted by its share: the whole batch's mean.
                    out = self.loss_fn(out, ys[mb]) * (_rows(ys[mb]) / total)
                    loss_sum += out.detach().double()  # on the device: no sync per microbatch
                kept[mb] = (None if first else x, out)
                self.max_kept = max(self.max_kept, len(kept))
            elif verb == "SA":
                self._send(kept[mb][1], self.stage + 1, pending)
            elif verb == "RG":
                grads[mb] = self._recv(self.stage + 1)
            elif verb == "B":
                x, out = kept.pop(mb)
                if last:
                    out.backward()
                else:
                    outs, outer = _with_gradients(out, grads.pop(mb))
                    if outs:  # else nothing here reached the loss
                        torch.autograd.backward(outs, outer)
                if x is not None:
                    back[mb] = x
            elif verb == "SG":
                x = back.pop(mb)
                got = (tuple(t.grad if t is not None else None for t in x)
                       if isinstance(x, tuple) else x.grad)
                self._send(self._input_grads(got, mb), self.stage - 1, pending)
        self._finish(pending)
        return loss_sum if last else None

    def _split(self, inputs: Optional[torch.Tensor], targets: Optional[torch.Tensor]):
        """The first stage's inputs and the last stage's targets cut into microbatches."""
        first, last = self.stage == 0, self.stage == self.stages - 1
        m = self.schedule.microbatches
        if first and inputs is None:
            raise ValueError(f"{self._who}: the first stage takes the batch: pass inputs")
        if last and targets is None:
            raise ValueError(f"{self._who}: the last stage computes the loss: pass targets")
        for what, batch, here in (("inputs", inputs, first), ("targets", targets, last)):
            if not here:
                continue
            lengths = {len(t) for t in _entries(batch)}
            if len(lengths) != 1:
                raise ValueError(f"{self._who}: the {what}' tensors hold {sorted(lengths)} "
                                 "rows; a batch's tensors must split alike along dimension 0")
            if lengths.pop() < m:
                raise ValueError(f"{self._who}: a batch of {_rows(batch)} cannot split into "
                                 f"{m} microbatches; pass a batch at least as large")
        xs = _microbatches(inputs, m) if first else None
        ys = _microbatches(targets, m) if last else None
        return xs, ys

    # ----- schedules that update the weights during a step (pipedream, 2bw)

    def _copy_live(self) -> dict[str, torch.Tensor]:
        return {n: p.detach().clone().requires_grad_(p.requires_grad)
                for n, p in self.module.named_parameters()}

    def _step_updating(self, inputs: Optional[torch.Tensor],
                       targets: Optional[torch.Tensor]) -> Optional[torch.Tensor]:
        first, last = self.stage == 0, self.stage == self.stages - 1
        xs, ys = self._split(inputs, targets)
        every = self.update_every
        plan = self._plan(self.stage, self.version)
        two_bw = self.config.schedule == "2bw"
        live = dict(self.module.named_parameters())
        trained = [n for n, p in live.items() if p.requires_grad]
        # Each microbatch's loss weight: its share of its batch (2bw), or 1 (pipedream:
        # every microbatch is a batch of its own).
        weight = [1.0] * self.schedule.microbatches
        if last and two_bw:
            for b0 in range(0, len(ys), every):
                rows = sum(_rows(y) for y in ys[b0:b0 + every])
                for mb in range(b0, b0 + every):
                    weight[mb] = _rows(ys[mb]) / rows
        total = _rows(targets) if last else 0
        acc: dict[str, torch.Tensor] = {}  # the batch's summed gradient, per parameter
        received: dict[int, torch.Tensor] = {}
        kept: dict[int, tuple[Optional[torch.Tensor], torch.Tensor, list]] = {}
        grads: dict[int, torch.Tensor] = {}
        back: dict[int, torch.Tensor] = {}
        pending: list = []
        in_flight: dict[int, int] = {}  # stashed microbatch -> its version
        loss_sum = torch.zeros((), dtype=torch.float64, device=self._device)
        for i, (verb, mb) in enumerate(self._actions):
            if verb == "RA":
                received[mb] = _with_grad(self._recv(self.stage - 1))
            elif verb == "F":
                x = xs[mb] if first else received.pop(mb)
                v = plan.version[mb]
                if plan.stashed[mb]:
                    if v not in self._copies:
                        assert v == self.version, (v, self.version)
                        self._copies[v] = self._copy_live()
                    params = self._copies[v]
                    in_flight[mb] = v
                    self.max_copies = max(self.max_copies, len(self._copies))
                    out = self._forward(x, params)
                else:
                    assert v == self.version, (v, self.version)
                    params = live
                    out = self._forward(x)
                if last:
                    out = self.loss_fn(out, ys[mb]) * weight[mb]
                    loss_sum += out.detach().double() * (_rows(ys[mb]) / total / weight[mb])
                kept[mb] = (None if first else x, out, [params[n] for n in trained])
                self.max_kept = max(self.max_kept, len(kept))
            elif verb == "SA":
                self._send(kept[mb][1], self.stage + 1, pending)
            elif verb == "RG":
                grads[mb] = self._recv(self.stage + 1)
            elif verb == "B":
                x, out, used = kept.pop(mb)
                ins = [t for t in (_entries(x) if x is not None else ())
                       if t is not None and t.requires_grad]
                if last:
                    outs, outer = [out], None
                else:
                    outs, outer = _with_gradients(out, grads.pop(mb))
                got = (torch.autograd.grad(outs, ins + used, outer, allow_unused=True)
                       if outs else [None] * (len(ins) + len(used)))
                if x is not None:
                    by_id = {id(t): g for t, g in zip(ins, got)}
                    back[mb] = (tuple(by_id.get(id(t)) for t in x) if isinstance(x, tuple)
                                else by_id.get(id(x)))
                got = got[len(ins):]
                for n, g in zip(trained, got):
                    if g is not None:
                        acc[n] = acc[n] + g if n in acc else g
                in_flight.pop(mb, None)
                if plan.update_after[i] >= 0:
                    self._update(live, acc, two_bw)
                    acc = {}
                    assert self.version == plan.update_after[i]
                keep = set(in_flight.values())
                if two_bw and self.version > 0:
                    keep.add(self.version - 1)
                self._copies = {v: c for v, c in self._copies.items() if v in keep}
            elif verb == "SG":
                self._send(self._input_grads(back.pop(mb, None), mb), self.stage - 1, pending)
        self._finish(pending)
        return loss_sum if last else None

    def _update(self, live: dict[str, torch.Tensor], acc: dict[str, torch.Tensor],
                two_bw: bool) -> None:
        """One optimizer step with the summed gradient; 2bw first keeps the version it
        replaces, on which the next batch runs."""
        if two_bw and self.version not in self._copies:
            self._copies[self.version] = self._copy_live()
            self.max_copies = max(self.max_copies, len(self._copies))
        for n, p in live.items():
            if p.requires_grad:
                p.grad = acc.get(n, torch.zeros_like(p))
        self.optimizer.step()
        self.optimizer.zero_grad(set_to_none=True)
        self.version += 1

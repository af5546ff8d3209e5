"""ZeRO stages 1, 2 and 3: an optimizer whose state, in stage 2 whose gradients too, and
in stage 3 whose parameters as well, are sharded across the ranks of a group.

Each rank keeps the optimizer state of 1/world of the parameters. The trainable
parameters of each optimizer group and dtype (and at stage 3 of each unit) are laid out in
one flat buffer (the parameters become views of it), cut into buckets that split evenly
across the ranks (``csrc/parallel/flat_layout.h``). Gradients are reduce-scattered bucket
by bucket, so each rank receives the averaged gradient of exactly the elements it owns;
the wrapped optimizer updates those, and an all_gather per bucket brings every rank's
parameters up to date.

- Stage 1 reduces the gradients in ``step()``, from ``param.grad``, which autograd fills as
  usual: optimizer state is sharded, gradients are not.
- Stage 2 reduces each bucket during the backward pass, as soon as its gradients (and those
  of every bucket before it) are in, and drops ``param.grad``: a rank holds only its
  shard of the gradients once a bucket has been sent.
- Stage 3 reduces as stage 2 does, and between uses frees the flat buffers themselves, so
  that a rank holds only its shard of the parameters. The model is cut into units
  (``zero_units.py``); a unit's buckets are all-gathered before its forward pass, freed
  after it (``reshard_after_forward``), gathered again before its backward pass and freed
  once its gradients are sent. ``step()`` updates the shards only.

Use it in place of DDP, not with it: the optimizer does the gradient averaging.
"""

from __future__ import annotations

import contextlib
import dataclasses
import math
import weakref
from collections import defaultdict
from typing import Any, Callable, Iterable, Iterator, Optional

import torch
import torch.distributed as dist
import torch.nn as nn
from torch.utils._pytree import tree_map

from .. import _C
from .. import compression as tc
from ._common import (all_gather_single, check_wrapper_args, group_as_list,
                      ranks_that_differ, reduce_scatter_single)
from .zero_units import Unit, UnitHooks, plan_units

__all__ = ["ZeroConfig", "ZeroOptimizer"]

# Buckets whose reduce_scatter may be in flight at once: enough to overlap one with the
# backward pass while the next fills, few enough that staged copies stay small.
_IN_FLIGHT = 2

# Each parameter starts 16 bytes into its buffer's alignment, which the CPU and CUDA
# kernels' vector loads like.
_ALIGN_BYTES = 16

# What mixed precision computes and reduces in: the dtypes every collective and kernel
# here takes (float8 has no arithmetic to train in).
_MIXED_DTYPES = (torch.bfloat16, torch.float16, torch.float32, torch.float64)


@dataclasses.dataclass(frozen=True)
class ZeroConfig:
    """How a :class:`ZeroOptimizer` shards and communicates.

    stage: 1 (optimizer state sharded), 2 (gradients too, reduced during backward) or 3
        (parameters too, gathered unit by unit for the forward and backward passes; the
        optimizer then needs the model, as ``module``).
    bucket_bytes: the largest bucket, in bytes; a parameter larger than that gets one of
        its own. Smaller buckets start communicating earlier in stage 2, larger ones make
        fewer collectives.
    broadcast_params: copy the group's first rank's parameters to every rank when the
        optimizer is made, so that replicas start equal (as DDP does).
    units: stage 3 only: module types (a transformer block, say) each of whose outermost
        instances is gathered and freed on its own; every other parameter is gathered for
        the model's whole forward pass. The default, none, gathers the model as one unit:
        parameters are whole from each forward pass until their gradients are sent, and
        sharded otherwise.
    reshard_after_forward: stage 3 only: free each unit (but the model's own) once its
        forward pass returns, and gather it again for its backward pass; off, a unit stays
        whole from its forward pass until its gradients are sent, one all_gather fewer
        per step for more memory.
    compression: reduce the gradients through this method of
        :mod:`torchdist_ext.compression` (``Int8()``, ``Sign()``, ``TopK(ratio)``), one
        compressed reduce_scatter per bucket, instead of exactly.
    error_feedback: with ``compression``, add what each rank's encoding lost to its next
        gradient of the same bucket, so that it is delayed rather than lost; the
        residuals take one gradient per rank (in float32 for float16 and bfloat16
        gradients, twice their size).
    prefetch: stage 3 only: as a unit is gathered, start gathering the unit that came
        after it in the last pass of the same direction, so that its collectives run
        while this one computes; off, each unit is gathered when it is about to run, one
        unit's parameters fewer held at a time.
    param_dtype: mixed precision: the dtype parameters are gathered in, and the model
        computes in (``torch.bfloat16``, say), while each rank's shard, which the wrapped
        optimizer updates, keeps the parameters' own dtype. The model's parameters, and
        the frozen ones passed here, take this dtype; given ``module``, floating inputs
        of the model's forward pass are cast to it. None: the parameters' own dtype.
    reduce_dtype: the dtype gradients are reduce-scattered in; in another dtype than the
        shard's, each rank's gradient is divided as it is copied in: by the world size, so
        that the sum cannot overflow where the average would not; in float16, by the
        square root of the world size (as FSDP does), between overflow of the sum and
        underflow of small gradients. The shard's gradient accumulates in the shard's
        dtype. None: ``param_dtype`` if given, else the parameters' own.
    """

    stage: int = 2
    bucket_bytes: int = 16 << 20
    broadcast_params: bool = True
    units: tuple[type, ...] = ()
    reshard_after_forward: bool = True
    prefetch: bool = True
    compression: Optional[tc.Method] = None
    error_feedback: bool = True
    param_dtype: Optional[torch.dtype] = None
    reduce_dtype: Optional[torch.dtype] = None

    def __post_init__(self) -> None:
        for name in ("param_dtype", "reduce_dtype"):
            v = getattr(self, name)
            if v is not None and v not in _MIXED_DTYPES:
                raise TypeError(f"ZeroConfig: {name} must be None, torch.bfloat16, "
                                f"torch.float16, torch.float32 or torch.float64, not {v!r}")
        if self.compression is not None and not isinstance(self.compression,
                                                           (tc.Int8, tc.Sign, tc.TopK)):
            raise TypeError(f"ZeroConfig: compression must be None, Int8(...), Sign(...) or "
                            f"TopK(...) of torchdist_ext.compression, not "
                            f"{self.compression!r}")
        if self.stage not in (1, 2, 3):
            raise ValueError(f"ZeroConfig: stage must be 1, 2 or 3, not {self.stage!r}")
        if not isinstance(self.bucket_bytes, int) or self.bucket_bytes < 1:
            raise ValueError(f"ZeroConfig: bucket_bytes must be a positive int, not "
                             f"{self.bucket_bytes!r}")
        if not isinstance(self.units, tuple) or not all(
                isinstance(t, type) and issubclass(t, nn.Module) for t in self.units):
            raise TypeError(f"ZeroConfig: units must be a tuple of nn.Module subclasses, "
                            f"such as (nn.TransformerEncoderLayer,), not {self.units!r}")
        if self.stage != 3 and (self.units or not self.reshard_after_forward
                                or not self.prefetch):
            raise ValueError(f"ZeroConfig: units, reshard_after_forward and prefetch apply "
                             f"at stage 3 only, not at stage {self.stage}")


def _weak_hook(ref: Any, method: str) -> Callable[..., Any]:
    """A hook that calls ``method`` of the object ``ref`` refers to while it lives: a
    model or parameter does not keep its optimizer alive through it."""
    def hook(*args: Any) -> Any:
        owner = ref()
        return None if owner is None else getattr(owner, method)(*args)
    return hook


class _Flat:
    """The trainable parameters of one optimizer group, dtype and device: their flat buffer,
    its layout, this rank's shard and the gradient of that shard."""

    def __init__(self, group_index: int, params: list[torch.Tensor], world: int, rank: int,
                 bucket_bytes: int, unit: int = 0,
                 param_dtype: Optional[torch.dtype] = None,
                 reduce_dtype: Optional[torch.dtype] = None) -> None:
        self.group_index = group_index
        self.unit = unit
        self.index = 0  # its place among the optimizer's flat buffers
        # Gradients arrive roughly in reverse order of registration: lay the buckets out
        # in that order so that the first ones fill first.
        self.params = list(reversed(params))
        first = self.params[0]
        # Buckets and alignment in the dtype the buffer computes and communicates in.
        itemsize = (param_dtype or first.dtype).itemsize
        self.layout = _C._FlatLayout([p.numel() for p in self.params], world,
                                     max(1, bucket_bytes // itemsize),
                                     max(1, _ALIGN_BYTES // min(itemsize,
                                                                first.dtype.itemsize)))
        self.flat = torch.zeros(self.layout.numel, dtype=first.dtype, device=first.device)
        self.slots = self.layout.params
        self.buckets = self.layout.buckets
        self.shapes = [p.shape for p in self.params]  # a stage 3 parameter is empty when freed
        with torch.no_grad():
            for p, s in zip(self.params, self.slots):
                view = self.flat[s.offset:s.offset + s.numel]
                view.copy_(p.detach().reshape(-1))
                p.data = view.view_as(p)
        self.rank = rank
        self.shard = torch.nn.Parameter(torch.empty(self.layout.shard_numel, dtype=first.dtype,
                                                    device=first.device))
        self.grad: Optional[torch.Tensor] = None  # this rank's shard of the summed gradient
        # What its gradients are reduce-scattered in.
        self.reduce_dtype = reduce_dtype or param_dtype or first.dtype

    @property
    def lowered(self) -> bool:
        """Mixed precision: the parameters are in another dtype than the shard."""
        return self.flat.dtype != self.shard.dtype

    def lower(self, dtype: torch.dtype) -> None:
        """Makes the flat buffer, and the parameters viewing it, ``dtype``; the shard
        keeps its own. A gradient of the old dtype would not accumulate into the new one:
        it is dropped."""
        if dtype == self.flat.dtype:
            return
        for p in self.params:
            p.grad = None
        self.flat = self.flat.to(dtype)
        self.attach()

    def attach(self, full: Optional[torch.Tensor] = None) -> None:
        """Makes the parameters views of the flat buffer again (or of ``full``, laid out
        as it)."""
        buf = self.flat if full is None else full
        for p, s, shape in zip(self.params, self.slots, self.shapes):
            p.data = buf[s.offset:s.offset + s.numel].view(shape)

    def detach(self) -> None:
        """Frees the flat buffer's storage; the parameters become empty tensors meanwhile,
        so that a stray read finds no elements rather than freed memory. What autograd
        saved of them keeps its version: it reads the storage again once refilled."""
        empty = self.flat.new_empty(0)
        for p in self.params:
            p.data = empty
        self.flat.untyped_storage().resize_(0)

    def owned(self, b: Any, full: Optional[torch.Tensor] = None) -> torch.Tensor:
        """This rank's shard of bucket b, as a view of the flat buffer (or of ``full``,
        laid out as it)."""
        lo = b.offset + self.rank * b.shard_numel
        return (self.flat if full is None else full)[lo:lo + b.shard_numel]

    def shard_view(self, t: torch.Tensor, b: Any) -> torch.Tensor:
        return t[b.shard_offset:b.shard_offset + b.shard_numel]

    def pull_shard(self, full: Optional[torch.Tensor] = None) -> None:
        """Copies this rank's part of the flat buffer (or of ``full``) into the shard. From
        a lowered flat buffer only the elements that differ from the shard's lowered
        values are copied: what was not written keeps the shard's precision."""
        with torch.no_grad():
            for b in self.buckets:
                new, dst = self.owned(b, full), self.shard_view(self.shard, b)
                if new.dtype == dst.dtype:
                    dst.copy_(new)
                else:
                    changed = new != dst.to(new.dtype)
                    dst[changed] = new[changed].to(dst.dtype)


class ZeroOptimizer(torch.optim.Optimizer):
    """Wraps ``optimizer_class`` so that each rank of ``group`` keeps 1/world of its state.

    ``params`` and ``defaults`` are what ``optimizer_class`` takes (an iterable of tensors,
    or of parameter-group dicts). Every rank must build it over the same parameters, in the
    same order, with the same shapes and dtypes, and run the same number of backward passes
    between steps, each reaching its parameters in the same order (as DDP requires).

    ``step()``, ``zero_grad()``, ``param_groups`` (learning-rate schedulers included),
    ``state_dict()`` of this rank's shard and ``consolidated_state_dict()``, the state of
    a plain ``optimizer_class`` over the same parameters, work as they do on torch's
    optimizers. ``clip_grad_norm_`` clips by the norm of the whole, averaged gradient.

    Stage 3 takes the model as ``module``: ``params`` must be parameters of it, and the
    model must be called as a whole, on every rank (each unit's gathering is a
    collective), so that its hooks gather each unit when it runs. Outside its forward
    and backward passes a parameter is an empty tensor; read parameters inside ``with
    optimizer.gathered():``. At every stage writes need ``gathered(writeback=True)`` to
    reach the optimizer's shard; given ``module``, ``model.load_state_dict`` is refused
    outside it, and at stage 3 so is ``model.state_dict``.
    """

    def __init__(self, params: Iterable[Any], optimizer_class: type, *,
                 group: Optional[dist.ProcessGroup] = None,
                 config: ZeroConfig = ZeroConfig(), module: Optional[nn.Module] = None,
                 **defaults: Any) -> None:
        check_wrapper_args("ZeroOptimizer", optimizer_class, config, ZeroConfig,
                           "torch.optim.AdamW")
        self._group = group if group is not None else dist.group.WORLD
        self._world = dist.get_world_size(self._group)
        self._rank = dist.get_rank(self._group)
        self._who = f"ZeroOptimizer (rank {self._rank} of {self._world})"
        self._config = config
        self._optimizer_class = optimizer_class
        # The groups carry every option of optimizer_class, defaults filled in, as its own
        # param_groups would: schedulers and state dicts see the same keys. The options are
        # read from an instance over a stand-in on the parameters' device (fused kernels,
        # for one, are not on every device).
        params = [group_as_list(x) if isinstance(x, dict) else x for x in params]
        tensors = [t for x in params for t in (x["params"] if isinstance(x, dict) else [x])
                   if isinstance(t, torch.Tensor)]
        device = tensors[0].device if tensors else torch.device("cpu")
        stand_in = torch.zeros(1, device=device, requires_grad=True)
        full = optimizer_class([stand_in], **defaults).defaults
        super().__init__(params, dict(full))
        self._check_params()
        self._units: list[Unit] = []
        owner: dict[int, int] = {}
        # A rank whose stage 3 set-up is refused still takes part in the layout check
        # below, so that the others raise too rather than wait for it.
        refused: Optional[ValueError] = None
        if config.stage == 3:
            try:
                self._units, owner = self._plan_units(module)
            except ValueError as e:
                refused = e

        self._flats: list[_Flat] = []
        for gi, g in enumerate(self.param_groups):
            by_kind: dict[tuple[torch.dtype, torch.device, int], list[torch.Tensor]] = {}
            for p in g["params"]:
                if p.requires_grad:
                    by_kind.setdefault((p.dtype, p.device, owner.get(id(p), 0)), []).append(p)
            for (_, _, u), kind_params in by_kind.items():
                self._flats.append(_Flat(gi, kind_params, self._world, self._rank,
                                         config.bucket_bytes, unit=u,
                                         param_dtype=config.param_dtype,
                                         reduce_dtype=config.reduce_dtype))
                self._flats[-1].index = len(self._flats) - 1
                if self._units:
                    self._units[u].flats.append(self._flats[-1])
                    self._units[u].buckets += len(self._flats[-1].buckets)
        self._order = self._release_order()
        try:
            self._check_same_layout(refused is not None)
        except ValueError:
            if refused is None:
                raise
        if refused is not None:
            raise refused

        if config.broadcast_params:
            self._broadcast_params()
        for f in self._flats:
            f.pull_shard()
            if config.param_dtype is not None:
                f.lower(config.param_dtype)
        if config.param_dtype is not None:
            self._lower_the_rest(module)
        self._unit_hooks: Optional[UnitHooks] = None
        if self._units:
            for f in self._flats:
                for p in f.params:
                    p.__dict__["_tdx_zero_sharded"] = True
            # The model's own unit is hooked even when it holds no parameter: its hooks
            # mark where a forward pass starts and ends.
            used = [u for u in self._units if u.flats or u.index == 0]
            for u in used:
                self._free(u)
            self._unit_hooks = UnitHooks(used, self._before_forward, self._before_backward,
                                         self._after_forward)
        # Stage 3: buckets of each unit sent in this backward pass, to free it after its last.
        self._sent: dict[int, int] = defaultdict(int)
        self._pinned = 0  # gathered() blocks open: nothing is freed meanwhile
        self._writeback = 0  # of which with writeback=True
        # Stage 3 prefetch: per direction, the unit gathered after each one in the last
        # pass, and the one gathered last in this pass.
        self._next: dict[str, dict[int, int]] = {"forward": {}, "backward": {}}
        self._prev: dict[str, Optional[int]] = {"forward": None, "backward": None}
        # Units whose forward output had no tensor to hook: they stay whole for their
        # backward pass, which nothing else would gather them for.
        self._held: set[int] = set()
        self._forward_depth = 0  # model forward passes running (autograd.grad inside one)
        self._masters = 0  # gathered(full_precision=True) blocks open
        # Inside them, each lowered flat buffer's parameters in the shards' dtype.
        self._fulls: dict[_Flat, torch.Tensor] = {}
        # The model's hooks and the gradient hooks hold the optimizer weakly and act only
        # for the latest ZeroOptimizer over that model or parameter, and only on the model
        # itself (a deepcopy of it carries the same hooks).
        self._ref = weakref.ref(self)
        self._module = weakref.ref(module) if module is not None else None
        if module is not None:
            module.__dict__["_tdx_zero_owner"] = self._ref
            module.register_state_dict_pre_hook(_weak_hook(self._ref, "_before_state_dict"))
            module.register_load_state_dict_pre_hook(
                _weak_hook(self._ref, "_before_load_state_dict"))
            if config.param_dtype is not None:
                module.register_forward_pre_hook(_weak_hook(self._ref, "_cast_inputs"),
                                                 with_kwargs=True)

        inner_groups = []
        for f in self._flats:
            hyper = {k: v for k, v in self.param_groups[f.group_index].items() if k != "params"}
            inner_groups.append({**hyper, "params": [f.shard]})
        # None when no parameter is trainable: step() then only keeps the collectives.
        self._inner = optimizer_class(inner_groups, **defaults) if inner_groups else None

        self._pending: list[tuple[_Flat, Any, torch.Tensor, Any]] = []
        self._feedback = tc.ErrorFeedback() \
            if config.compression is not None and config.error_feedback else None
        self._reduced = False  # stage 1: the gradients of this step have been reduced
        self._callback_queued = False
        self._hooks = []
        self._tracker: Optional[Any] = None  # stages 2 and 3, with a trainable parameter
        if config.stage >= 2 and self._flats:
            self._tracker = _C._BucketTracker(self._tracker_buckets())
            self._index = {id(p): i for i, p in enumerate(self._tracker_params)}
            for p in self._tracker_params:
                p.__dict__["_tdx_zero_owner"] = self._ref
                self._hooks.append(p.register_post_accumulate_grad_hook(
                    _weak_hook(self._ref, "_on_grad")))

    @property
    def shard_numel(self) -> int:
        """Elements of parameters whose optimizer state this rank keeps, padding included:
        about 1/world of the trainable parameters."""
        return sum(f.layout.shard_numel for f in self._flats)

    def memory(self) -> dict[str, int]:
        """Bytes this rank holds now for the trainable parameters it was given: ``state``
        (the wrapped optimizer's tensors: its shard of exp_avg, momentum and the like),
        ``grads`` (gradients: ``param.grad``, the reduced shard, and compression's
        residuals and buffers) and ``params`` (the flat buffers as allocated now, padding
        included, a prefetch's own, and the shards the optimizer updates). Frozen
        parameters, and those not given, are not counted."""
        def nbytes(t: Any) -> int:
            return t.numel() * t.element_size() if isinstance(t, torch.Tensor) else 0

        state = sum(nbytes(v) for st in (self._inner.state.values() if self._inner else ())
                    for v in st.values())
        grads = sum(nbytes(p.grad) for g in self.param_groups for p in g["params"])
        grads += sum(nbytes(f.grad) for f in self._flats)
        if self._feedback is not None:  # what compression has delayed, and its buffers
            grads += self._feedback.nbytes()
        staged = sum(nbytes(t) for u in self._units
                     for t in (u.staging or []) + (u.sources or []))
        staged += sum(nbytes(t) for t in self._fulls.values())  # full-precision copies
        return {"state": state, "grads": grads,
                "params": staged + sum(f.flat.untyped_storage().nbytes() + nbytes(f.shard)
                                       for f in self._flats)}

    # ----- set-up

    def _check_params(self) -> None:
        seen = set()
        for gi, g in enumerate(self.param_groups):
            for pi, p in enumerate(g["params"]):
                name = f"parameter {pi} of group {gi}"
                if id(p) in seen:
                    raise ValueError(f"{self._who}: {name} appears twice; pass each "
                                     "parameter once")
                seen.add(id(p))
                if p.is_sparse or p.layout != torch.strided:
                    raise ValueError(f"{self._who}: {name} is {p.layout}; ZeroOptimizer "
                                     "shards dense parameters only")
                if p.requires_grad and not (p.is_floating_point() or p.is_complex()):
                    raise ValueError(f"{self._who}: {name} is {p.dtype}, which has no "
                                     "gradient")
                if p.requires_grad and p.is_complex():
                    raise ValueError(f"{self._who}: {name} is {p.dtype}; view complex "
                                     "parameters as real (torch.view_as_real) to shard them")
                if p.__dict__.get("_tdx_zero_lowered"):
                    raise ValueError(f"{self._who}: {name} was lowered to {p.dtype} by "
                                     "another ZeroOptimizer's param_dtype (a trainable "
                                     "one's original values live in that optimizer's "
                                     "shards; a frozen one's are gone); build the model "
                                     "afresh and load its weights (saved inside "
                                     "gathered(full_precision=True))")

    @torch.no_grad()
    def _lower_the_rest(self, module: Optional[nn.Module]) -> None:
        """Mixed precision: what computes beside the trainable parameters, in their dtype:
        the frozen parameters passed, and given the model, its other frozen parameters and
        floating buffers (normalization layers' statistics among them). Every parameter
        lowered is marked, so that another optimizer cannot take the lowered values for
        the originals."""
        dtype = self._config.param_dtype
        for f in self._flats:
            if f.lowered:
                for p in f.params:
                    p.__dict__["_tdx_zero_lowered"] = True
        frozen = [p for g in self.param_groups for p in g["params"] if not p.requires_grad]
        if module is not None:
            frozen += [p for p in module.parameters() if not p.requires_grad]
            # In place, so that a buffer two modules share stays one tensor.
            for b in module.buffers():
                if b.is_floating_point() and b.dtype != dtype:
                    b.data = b.data.to(dtype)
        for p in frozen:
            if p.is_floating_point() and p.dtype != dtype:
                p.data = p.data.to(dtype)
                p.__dict__["_tdx_zero_lowered"] = True

    def _plan_units(self, module: Optional[nn.Module]) -> tuple[list[Unit], dict[int, int]]:
        if not isinstance(module, nn.Module):
            raise ValueError(f"{self._who}: stage 3 gathers parameters as the model runs, so "
                             "it needs the model: pass module=model (got "
                             f"{type(module).__name__})")
        units, owner = plan_units(module, self._config.units)
        if any(p.__dict__.get("_tdx_zero_sharded") for p in module.parameters()):
            raise ValueError(f"{self._who}: the model's parameters are sharded already, by "
                             "another stage 3 ZeroOptimizer; build one optimizer per model "
                             "(to start over, build the model afresh and load its weights)")
        if self._config.units and len(units) == 1:
            raise ValueError(f"{self._who}: the model has no module of the types in "
                             f"ZeroConfig.units {self._config.units}; name types it holds, or "
                             "leave units empty to gather the model as one unit")
        for gi, g in enumerate(self.param_groups):
            for pi, p in enumerate(g["params"]):
                if id(p) not in owner:
                    raise ValueError(f"{self._who}: parameter {pi} of group {gi} "
                                     f"({tuple(p.shape)}) is not a parameter of the module; "
                                     "at stage 3 pass the model whose parameters these are")
        return units, owner

    def _check_same_layout(self, refused: bool = False) -> None:
        """Ranks whose layouts differ would reduce buckets of different sizes into each
        other: compare a hash of each rank's, once, and name the ranks that differ
        (``refused``: this rank's set-up was refused, which the others must see)."""
        frozen = [tuple(p.shape) for g in self.param_groups for p in g["params"]
                  if not p.requires_grad]  # broadcast one by one below
        c = self._config
        text = (f"refused {refused}\n"
                f"stage {c.stage} reshard {c.reshard_after_forward} prefetch {c.prefetch} "
                f"compression {c.compression!r} {c.error_feedback}\n"
                f"param_dtype {c.param_dtype} reduce_dtype {c.reduce_dtype}\n"
                f"frozen {frozen}\n") + "\n".join(
            f"{s}\n" + ",".join(f"{tuple(p.shape)}" for p in f.params)
            for s, f in zip(self._fingerprint(), self._flats))
        device = self._flats[0].flat.device if self._flats else torch.device("cpu")
        others = ranks_that_differ(text, self._group, device)
        if others:
            raise ValueError(
                f"{self._who}: ranks {others} lay their parameters out otherwise than this "
                f"rank, which has {self.shard_numel * self._world} elements in "
                f"{len(self._flats)} flat buffer(s) at stage {self._config.stage}; every rank "
                "must pass the same parameters, in the same order, with the same shapes, "
                "dtypes, requires_grad and optimizer groups, and the same ZeroConfig")

    def _release_order(self) -> list[tuple[_Flat, Any]]:
        """Every bucket of every flat buffer, in the order the ranks reduce them: by when
        its last parameter's gradient is expected (reverse registration order overall)."""
        position = {}
        for gi, g in enumerate(self.param_groups):
            for p in g["params"]:
                position[id(p)] = len(position)
        keyed = []
        for f in self._flats:
            for b in f.buckets:
                # The bucket is complete once its earliest-registered parameter's gradient
                # is in: that one comes last in a backward pass.
                first = min(position[id(f.params[i])] for i in range(b.first_param, b.last_param))
                keyed.append((-first, len(keyed), f, b))
        keyed.sort(key=lambda k: (k[0], k[1]))
        return [(f, b) for _, _, f, b in keyed]

    def _tracker_buckets(self) -> list[int]:
        number = {(id(f), b.offset): n for n, (f, b) in enumerate(self._order)}
        self._tracker_params = []
        out = []
        for f in self._flats:
            for p, s in zip(f.params, f.slots):
                self._tracker_params.append(p)
                out.append(number[(id(f), f.buckets[s.bucket].offset)])
        return out

    def _broadcast_params(self) -> None:
        src = dist.get_global_rank(self._group, 0)
        for f in self._flats:
            dist.broadcast(f.flat, src=src, group=self._group)
        with torch.no_grad():
            for g in self.param_groups:
                for p in g["params"]:
                    if not p.requires_grad:
                        dist.broadcast(p.data, src=src, group=self._group)

    def add_param_group(self, param_group: dict[str, Any]) -> None:
        if hasattr(self, "_flats"):  # torch's __init__ adds the first groups through here
            raise NotImplementedError(
                f"{self._who}: parameter groups are laid out when the optimizer is made; "
                "build a new ZeroOptimizer with every group instead of add_param_group")
        super().add_param_group(param_group)

    # ----- stage 3: gathering parameters

    def _all_gather(self, flats: Iterable[_Flat]) -> None:
        """Every rank's shard of every bucket of ``flats`` into their flat buffers."""
        self._gather_into([(f, f.flat) for f in flats])

    def _gather_into(self, targets: list[tuple[_Flat, torch.Tensor]],
                     wait: bool = True) -> tuple[list[Any], list[torch.Tensor]]:
        """Starts the all_gathers of every bucket of each flat buffer's shard into its
        target (laid out as the flat buffer, in the target's dtype); waits for them unless
        ``wait`` is False. Returns the works and the cast copies they send, to keep until
        waited for."""
        # Every cast copy is made before the first collective starts: a copy that fails
        # (out of memory) then leaves none in flight.
        sources = [f.shard.detach() if f.shard.dtype == t.dtype else f.shard.detach().to(t.dtype)
                   for f, t in targets]
        sent = [s for s, (f, _) in zip(sources, targets) if s.dtype != f.shard.dtype]
        works = [all_gather_single(t[b.offset:b.offset + b.numel], f.shard_view(src, b),
                                   group=self._group, async_op=True)
                 for (f, t), src in zip(targets, sources) for b in f.buckets]
        if wait:
            for w in works:
                w.wait()
        return works, sent

    @torch.no_grad()
    def _start_gather(self, u: Unit, ahead: bool = False) -> None:
        """Starts u's all_gathers; ``_ready`` waits for them. ``ahead`` (a prefetch)
        gathers into buffers of its own, copied into the flat buffers when waited for:
        until then the flat buffers stay empty, so that a backward node that reads u's
        saved weights before u's hooks run (a side output of u's) fails rather than reads
        half-gathered ones."""
        targets = []
        for f in u.flats:
            if ahead:
                targets.append(torch.empty_like(f.flat))
            else:
                f.flat.untyped_storage().resize_(f.flat.numel() * f.flat.element_size())
                targets.append(f.flat)
        u.inflight, u.sources = self._gather_into(list(zip(u.flats, targets)), wait=False)
        u.staging = targets if ahead else None
        u.gathered = True

    @torch.no_grad()
    def _ready(self, u: Unit, use: bool = True) -> None:
        """Waits for u's all_gathers; unless ``use`` is False (u is about to be freed),
        fills the flat buffers from a prefetch's own and makes the parameters views."""
        if u.inflight is None:
            return
        for w in u.inflight:
            w.wait()
        u.inflight = u.sources = None
        staging, u.staging = u.staging, None
        if not use:
            return
        for i, f in enumerate(u.flats):
            if staging is not None:
                f.flat.untyped_storage().resize_(f.flat.numel() * f.flat.element_size())
                f.flat.copy_(staging[i])
            # The parameters keep their own version counters when their data is swapped,
            # and views saved for backward share the flat buffer's storage: refilling it
            # does not invalidate what autograd saved.
            f.attach()

    def _gather(self, u: Unit, direction: Optional[str] = None) -> None:
        """Makes u whole; in a pass (``direction``), records the order units run in and
        starts gathering the one that ran after u in the last such pass."""
        if not u.gathered:
            self._start_gather(u)
        if direction is not None and self._config.prefetch:
            prev = self._prev[direction]
            if prev is not None and prev != u.index:
                self._next[direction][prev] = u.index
            self._prev[direction] = u.index
            nxt = self._next[direction].get(u.index)
            # Every rank runs the same units in the same order, so every rank starts the
            # same collectives here.
            if nxt is not None and not self._units[nxt].gathered:
                self._start_gather(self._units[nxt], ahead=True)
        self._ready(u)

    def _free(self, u: Unit) -> None:
        self._ready(u, use=False)  # a prefetched unit's collectives end before its storage
        for f in u.flats:
            f.detach()
        u.gathered = False

    def _before_forward(self, u: Unit) -> None:
        if torch._C._current_graph_task_id() != -1:
            # Recomputed during backward (activation checkpointing): in backward's order.
            self._gather(u, "backward")
            return
        if u.index == 0:
            self._prev["forward"] = None  # a new forward pass
            self._forward_depth += 1
        self._gather(u, "forward")

    def _release(self, u: Unit) -> None:
        """Frees u unless a gathered() block holds every unit whole, or u is held for a
        backward pass to come (whose end, or u's gradients, un-hold it first)."""
        if u.gathered and not self._pinned and u.index not in self._held:
            self._free(u)

    def _before_backward(self, u: Unit) -> None:
        # The pass's end frees what it gathered, even when no gradient reaches a
        # parameter (torch.autograd.grad).
        self._queue_end_of_backward()
        self._gather(u, "backward")

    def _after_forward(self, u: Unit, hooked: bool) -> None:
        if torch._C._current_graph_task_id() != -1:
            return  # recomputed during backward (activation checkpointing): used next
        if u.index == 0:  # (the hook runs even when the forward pass, or its pre-hook, raised)
            self._forward_depth = max(0, self._forward_depth - 1)
        if not torch.is_grad_enabled():
            # No backward pass will need it; at the model's end, nor any unit prefetched.
            for v in (self._units if u.index == 0 else [u]):
                self._release(v)
        elif not hooked:
            # No output tensor to hook: nothing would gather it again before backward, so
            # it stays whole until its gradients are sent.
            self._held.add(u.index)
        elif self._config.reshard_after_forward and u.index != 0:
            # The model's own unit would be gathered again as soon as backward starts.
            self._release(u)

    @contextlib.contextmanager
    def gathered(self, writeback: bool = False, full_precision: bool = False) -> Iterator[None]:
        """Inside, every parameter is whole, forward and backward passes run inside
        included (at stages 1 and 2 it always is); a collective on entry at stage 3: every
        rank enters. ``writeback=True`` copies what the block wrote to the parameters
        (``model.load_state_dict``, say) into this rank's shard, which the optimizer steps
        from, unless the block raised; every rank must then write the same values.

        ``full_precision=True``, with ``ZeroConfig.param_dtype``: inside, the parameters
        are the shards' values in the shards' dtype (a collective at every stage), to save
        or load exactly what the optimizer steps from; after, they are in ``param_dtype``
        again. A block of one precision cannot open inside one of the other, and
        ``step()`` is refused inside."""
        masters = full_precision and any(f.lowered for f in self._flats)
        if self._pinned and masters != bool(self._masters):
            raise RuntimeError(f"{self._who}: gathered(full_precision={full_precision}) "
                               "inside a gathered() block of the other precision, whose "
                               "parameters this one would replace; close that block first")
        self._settle()
        held = [u for u in self._units if u.flats and not u.gathered]
        for u in self._units:
            self._gather(u)  # a prefetched unit is waited for
        if masters and not self._masters:
            try:
                fulls = [(f, torch.empty(f.flat.numel(), dtype=f.shard.dtype,
                                         device=f.flat.device))
                         for f in self._flats if f.lowered]
                self._gather_into(fulls)
            except BaseException:  # out of memory, say: what entry gathered is freed
                for u in held:
                    self._release(u)
                raise
            self._fulls = dict(fulls)
            for f, full in fulls:
                f.attach(full)
        self._pinned += 1
        self._masters += masters
        self._writeback += bool(writeback)
        raised = False
        try:
            yield
            if writeback:
                with torch.no_grad():
                    for f in self._flats:
                        full = self._fulls.get(f) if masters else None
                        f.pull_shard(full)
                        if full is not None:
                            f.flat.copy_(full)  # what the model computes with after the block
        except BaseException:
            raised = True
            raise
        finally:
            self._pinned -= 1
            self._masters -= masters
            self._writeback -= bool(writeback)
            if masters and not self._masters:
                for f in self._fulls:
                    f.attach()
                self._fulls = {}
            # After a write that did not reach the shards, no unit keeps it (but those held
            # for a backward pass to come, which nothing would gather again).
            for u in (self._units if raised and writeback else held):
                self._release(u)

    def _check_whole(self, what: str, fix: str) -> None:
        if self._units and not self._pinned:
            raise RuntimeError(f"{self._who}: {what} outside `with optimizer.{fix}:`, where "
                               "stage 3 parameters are empty between uses; call it inside")

    def _manages(self, module: nn.Module) -> bool:
        return (self._module is not None and module is self._module()
                and module.__dict__.get("_tdx_zero_owner") is self._ref)

    def _before_state_dict(self, module: nn.Module, prefix: str, keep_vars: bool) -> None:
        if self._manages(module):
            self._check_whole("model.state_dict() called", "gathered()")

    def _before_load_state_dict(self, module: nn.Module, *args: Any) -> None:
        # At every stage a write the shard never sees would be undone by the next step.
        if self._manages(module) and not self._writeback:
            raise RuntimeError(f"{self._who}: model.load_state_dict() called outside `with "
                               "optimizer.gathered(writeback=True):`; the optimizer steps "
                               "from its own shard of the parameters, which would undo the "
                               "load at the next step: load inside that block")

    def _cast_inputs(self, module: nn.Module, args: tuple[Any, ...],
                     kwargs: dict[str, Any]) -> Optional[tuple[Any, Any]]:
        """Mixed precision: the model's floating inputs in the parameters' dtype. Inside
        gathered(full_precision=True) the trainable parameters are not in it, and a
        forward pass is refused."""
        if not self._manages(module):
            return None
        if self._masters:
            raise RuntimeError(f"{self._who}: a forward pass inside `with optimizer.gathered("
                               "full_precision=True):`, where the trainable parameters are "
                               "in the shards' dtype and the rest in param_dtype; that block "
                               "is for saving and loading: run the model outside it")
        dtype = self._config.param_dtype

        def cast(x: Any) -> Any:
            if isinstance(x, torch.Tensor) and x.is_floating_point() and x.dtype != dtype:
                return x.to(dtype)
            return x
        return tree_map(cast, args), tree_map(cast, kwargs)

    # ----- gradients

    def _on_grad(self, p: torch.Tensor) -> None:
        if p.__dict__.get("_tdx_zero_owner") is not self._ref or id(p) not in self._index:
            return  # a later ZeroOptimizer reduces this parameter, or p is a copy of one
        self._queue_end_of_backward()
        try:
            released = self._tracker.mark(self._index[id(p)])
        except RuntimeError as e:
            raise RuntimeError(
                f"{self._who}: a {tuple(p.shape)} parameter's gradient arrived twice in one "
                f"backward pass (reentrant activation checkpointing does that to a weight used in "
                f"two checkpointed regions), which stage {self._config.stage} cannot reduce "
                "in order; checkpoint with use_reentrant=False, or use stage 1. After a "
                "backward pass that raised, call zero_grad() before the next") from e
        for n in released:
            self._launch(*self._order[n], drop=True)

    def _end_of_backward(self) -> None:
        outer = torch._C._current_autograd_node()
        if outer is not None:
            # The end of a backward pass run inside another one's node (reentrant
            # activation checkpointing): the pass goes on after that node, whose hook
            # queues this again in the enclosing pass.
            outer.register_hook(lambda *_: torch.autograd.Variable._execution_engine
                                .queue_callback(self._end_of_backward))
            return
        self._callback_queued = False
        # Else no gradient reached a parameter (or none is trainable).
        sent = self._tracker is not None and self._tracker.started
        if sent:
            for n in self._tracker.finish():
                self._launch(*self._order[n], drop=True)
        self._settle()
        self._sent.clear()
        self._prev["backward"] = None
        if self._forward_depth > 0 or (not sent and torch.is_grad_enabled()):
            # torch.autograd.grad inside the model's forward pass, or with
            # create_graph=True: the pass goes on, or a graph built on these weights
            # is yet to run backward. What is gathered stays for it.
            return
        self._prev["forward"] = None
        self._held.clear()
        for u in self._units:
            self._release(u)

    def _queue_end_of_backward(self) -> None:
        if not self._callback_queued:
            torch.autograd.Variable._execution_engine.queue_callback(self._end_of_backward)
            self._callback_queued = True

    def _abandon_pass(self) -> None:
        """Drops what a backward pass that raised left behind (autograd runs no end-of-pass
        callback then): its buckets in flight, its arrivals, the units it gathered."""
        if not self._callback_queued:
            return
        self._callback_queued = False
        if self._tracker is not None:
            self._tracker.finish()
        for _, _, _, work in self._pending:
            work.wait()
        self._pending.clear()
        self._sent.clear()
        self._prev = {"forward": None, "backward": None}
        self._held.clear()
        for u in self._units:
            self._release(u)

    def _launch(self, f: _Flat, b: Any, drop: bool) -> None:
        """Starts bucket b's reduce_scatter from its parameters' gradients (None counts as
        zero); ``drop`` frees them once copied."""
        staged = torch.zeros(b.numel, dtype=f.reduce_dtype, device=f.flat.device)
        pre = self._prescale(f)
        for i in range(b.first_param, b.last_param):
            p, s = f.params[i], f.slots[i]
            g = p.grad
            if g is None:
                continue
            if g.layout != torch.strided:
                raise RuntimeError(f"{self._who}: the gradient of a {tuple(p.shape)} "
                                   f"parameter is {g.layout}; ZeroOptimizer reduces dense "
                                   "gradients only (nn.Embedding(sparse=False))")
            lo = s.offset - b.offset
            # Divided before the cast, which could overflow where the share does not;
            # _settle_oldest scales the sum the rest of the way.
            staged[lo:lo + s.numel].copy_(g.reshape(-1) if pre == 1.0 else g.reshape(-1) / pre)
            if drop:
                p.grad = None
        out = torch.empty(b.shard_numel, dtype=staged.dtype, device=staged.device)
        if self._config.compression is None or self._world == 1:  # alone, exact for free
            work = reduce_scatter_single(out, staged, group=self._group, async_op=True)
        else:
            # A future, which settles as a work does; one error-feedback stream per bucket.
            work = tc.reduce_scatter(out, staged, self._config.compression,
                                     group=self._group, state=self._feedback,
                                     key=(f.index, b.offset), async_op=True)
        self._pending.append((f, b, out, work))
        if self._units and drop:
            self._sent[f.unit] += 1
            u = self._units[f.unit]
            if self._sent[f.unit] == u.buckets:
                self._held.discard(u.index)
                self._release(u)  # its gradients are staged: the backward pass is done with it
        # A work holds its staged bucket until it is waited for: without a bound, stage 2
        # would hold every bucket's copy of the gradients until the pass ends.
        while len(self._pending) > _IN_FLIGHT:
            self._settle_oldest()

    def _settle_oldest(self) -> None:
        f, b, out, work = self._pending.pop(0)
        work.wait()
        if f.grad is None:
            f.grad = torch.zeros_like(f.shard)
        f.shard_view(f.grad, b).add_(out, alpha=self._prescale(f) / self._world)

    def _prescale(self, f: _Flat) -> float:
        """What each rank's gradient is divided by before a reduction in another dtype
        than the shard's: the world size, so that the sum is the average and cannot
        overflow where it would not; in float16, whose smallest values are near, its
        square root, so that small gradients do not underflow either (a sum then
        overflows where the average is within sqrt(world) of float16's largest)."""
        if f.reduce_dtype == f.shard.dtype:
            return 1.0
        return math.sqrt(self._world) if f.reduce_dtype == torch.float16 else float(self._world)

    def _settle(self) -> None:
        """Waits for the reduce_scatters in flight and adds their averages to the shard
        gradients."""
        while self._pending:
            self._settle_oldest()

    def _reduce_gradients(self) -> None:
        if self._config.stage == 1 and not self._reduced:
            # param.grad holds everything since the last zero_grad (as with torch's
            # optimizers, steps without zero_grad between them see the sum), so the shard
            # gradient starts afresh; at stage 2 param.grad is dropped instead, and the
            # shard gradient is what accumulates.
            for f in self._flats:
                f.grad = None
            for f, b in self._order:
                self._launch(f, b, drop=False)
            self._settle()
            self._reduced = True

    @torch.no_grad()
    def clip_grad_norm_(self, max_norm: float, norm_type: float = 2.0) -> torch.Tensor:
        """Clips the averaged gradient, as ``torch.nn.utils.clip_grad_norm_`` would on one
        rank holding all of it; a collective: every rank calls it. Returns the total norm."""
        self._reduce_gradients()
        norm_type = float(norm_type)
        device = self._flats[0].shard.device if self._flats else torch.device("cpu")
        local = torch.zeros((), dtype=torch.float64, device=device)
        for f in self._flats:
            if f.grad is None:
                continue
            g = f.grad.to(device=device, dtype=torch.float64)
            if norm_type == float("inf"):
                local = torch.maximum(local, g.abs().max() if g.numel() else local)
            else:
                local += g.abs().pow(norm_type).sum()
        op = dist.ReduceOp.MAX if norm_type == float("inf") else dist.ReduceOp.SUM
        dist.all_reduce(local, op=op, group=self._group)
        total = local if norm_type == float("inf") else local.pow(1.0 / norm_type)
        coef = float(max_norm) / (float(total) + 1e-6)
        if coef < 1.0:
            for f in self._flats:
                if f.grad is not None:
                    f.grad.mul_(coef)
        return total

    # ----- the optimizer

    @torch.no_grad()
    def step(self, closure: Optional[Callable[[], Any]] = None) -> Any:
        if self._masters:
            raise RuntimeError(f"{self._who}: step() inside `with optimizer.gathered("
                               "full_precision=True):`, whose parameters are copies of the "
                               "shards; step after the block")
        loss = None
        if closure is not None:
            with torch.enable_grad():
                loss = closure()
        if self._pending:  # a backward whose end-of-pass callback never ran
            self._settle()
        self._reduce_gradients()
        if self._inner is not None:
            for f, inner_group in zip(self._flats, self._inner.param_groups):
                for k, v in self.param_groups[f.group_index].items():
                    if k != "params":
                        inner_group[k] = v
                f.shard.grad = f.grad
            self._inner.step()
        self._forward_depth = 0
        if self._units and not self._pinned:
            # The shards are the parameters now: each unit is gathered when it next runs.
            self._held.clear()
            for u in self._units:
                self._release(u)
        else:
            self._all_gather(self._flats)
        self._reduced = False
        return loss

    def zero_grad(self, set_to_none: bool = True) -> None:
        self._abandon_pass()
        self._forward_depth = 0  # a forward pass interrupted (KeyboardInterrupt) is over
        for g in self.param_groups:
            for p in g["params"]:
                if p.grad is not None:
                    if set_to_none:
                        p.grad = None
                    else:
                        p.grad.detach_().zero_()
        for f in self._flats:
            if set_to_none or f.grad is None:
                f.grad = None
            else:
                f.grad.zero_()
            f.shard.grad = None
        self._reduced = False

    # ----- state

    def _fingerprint(self) -> list[str]:
        unit = [f" {self._units[f.unit].describe()}" if self._units else "" for f in self._flats]
        return [f"group {f.group_index} {f.shard.dtype}{u} {f.layout.describe()}"
                for f, u in zip(self._flats, unit)]

    def state_dict(self) -> dict[str, Any]:
        """This rank's shard of the optimizer state; loadable only at the same rank, world
        size and layout (``consolidated_state_dict`` is portable). With mixed precision
        it holds this rank's shards of the parameters too (``masters``), which the model's
        lowered weights cannot give back."""
        hyper = [{k: v for k, v in g.items() if k != "params"} for g in self.param_groups]
        masters = [f.shard.detach() for f in self._flats] \
            if any(f.lowered for f in self._flats) else None
        return {"zero": {"rank": self._rank, "world_size": self._world,
                         "stage": self._config.stage, "layout": self._fingerprint()},
                "param_groups": hyper,
                "inner": self._inner.state_dict() if self._inner is not None else None,
                "masters": masters}

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        meta = state_dict.get("zero") if isinstance(state_dict, dict) else None
        if meta is None:
            raise ValueError(f"{self._who}: load_state_dict takes what state_dict() "
                             "returned; for a plain optimizer's state use "
                             "load_consolidated_state_dict")
        mine = {"rank": self._rank, "world_size": self._world, "layout": self._fingerprint()}
        for k, v in mine.items():
            if meta[k] != v:
                raise ValueError(f"{self._who}: the state was saved with {k} {meta[k]!r}, "
                                 f"not {v!r}; save consolidated_state_dict() to move state "
                                 "between world sizes or models")
        self._set_hyper(state_dict["param_groups"])
        if self._feedback is not None:
            self._feedback.clear()
        if self._inner is not None:
            self._inner.load_state_dict(state_dict["inner"])
        if state_dict.get("masters") is not None:
            self._load_masters(state_dict["masters"])

    @torch.no_grad()
    def _load_masters(self, masters: list[torch.Tensor]) -> None:
        """This rank's shards of the parameters, saved with mixed precision; then every
        parameter whole now takes the new values (a collective)."""
        self._settle()
        for u in self._units:
            self._ready(u)  # a prefetch in flight reads the shards: it lands first
        for f, m in zip(self._flats, masters):
            f.shard.copy_(m)
        whole = [f for u in self._units if u.gathered for f in u.flats] if self._units \
            else self._flats
        self._all_gather(whole)
        self._gather_into(list(self._fulls.items()))

    def _set_hyper(self, hyper: list[dict[str, Any]]) -> None:
        if len(hyper) != len(self.param_groups):
            raise ValueError(f"{self._who}: the state has {len(hyper)} parameter groups, "
                             f"this optimizer {len(self.param_groups)}")
        for g, h in zip(self.param_groups, hyper):
            g.update({k: v for k, v in h.items() if k != "params"})

    def _indices(self) -> dict[int, int]:
        out: dict[int, int] = {}
        for g in self.param_groups:
            for p in g["params"]:
                out[id(p)] = len(out)
        return out

    @torch.no_grad()
    def consolidated_state_dict(self) -> dict[str, Any]:
        """The state a plain ``optimizer_class`` over the same parameters would have, in its
        ``state_dict()`` form, on every rank; a collective: every rank calls it."""
        index = self._indices()
        state: dict[int, dict[str, Any]] = defaultdict(dict)
        inner_state = self._inner.state if self._inner is not None else {}
        keys = sorted({k for f in self._flats for k in inner_state.get(f.shard, {})})
        for f in self._flats:
            mine = inner_state.get(f.shard, {})
            for k in keys:
                v = mine.get(k)
                if isinstance(v, torch.Tensor) and v.shape == f.shard.shape:
                    full = torch.empty_like(f.flat, dtype=v.dtype)
                    works = [all_gather_single(full[b.offset:b.offset + b.numel],
                                                         f.shard_view(v, b), group=self._group,
                                                         async_op=True)
                             for b in f.buckets]
                    for w in works:
                        w.wait()
                    for p, s, shape in zip(f.params, f.slots, f.shapes):
                        state[index[id(p)]][k] = full[s.offset:s.offset + s.numel] \
                            .view(shape).clone()
                elif v is not None:
                    for p in f.params:
                        state[index[id(p)]][k] = v.clone() if isinstance(v, torch.Tensor) else v
        groups = []
        for g in self.param_groups:
            groups.append({**{k: v for k, v in g.items() if k != "params"},
                           "params": [index[id(p)] for p in g["params"]]})
        return {"state": dict(sorted(state.items())), "param_groups": groups}

    @torch.no_grad()
    def load_consolidated_state_dict(self, state_dict: dict[str, Any]) -> None:
        """Takes this rank's shard of a plain optimizer's ``state_dict()`` over the same
        parameters (or of ``consolidated_state_dict()``, at any world size); forgets what
        compression's error feedback held back."""
        self._set_hyper(state_dict["param_groups"])
        if self._feedback is not None:
            self._feedback.clear()
        if self._inner is None:
            return
        index = self._indices()
        full_state = state_dict["state"]
        for f in self._flats:
            per_param = [full_state.get(index[id(p)], {}) for p in f.params]
            keys = sorted({k for s in per_param for k in s})
            shard_state: dict[str, Any] = {}
            for k in keys:
                values = [s.get(k) for s in per_param]
                # Per element (exp_avg, momentum_buffer) when shaped as the parameters;
                # otherwise one value for all (step).
                if all(isinstance(v, torch.Tensor) and v.shape == shape
                       for v, shape in zip(values, f.shapes)) and any(len(sh) for sh in f.shapes):
                    full = torch.zeros_like(f.flat, dtype=values[0].dtype)
                    for v, s in zip(values, f.slots):
                        full[s.offset:s.offset + s.numel].copy_(v.reshape(-1))
                    # In the shard's dtype, as torch's optimizers cast what they load: a
                    # plain optimizer over the lowered parameters kept its state in theirs.
                    kind = f.shard.dtype if full.is_floating_point() else full.dtype
                    shard = torch.empty_like(f.shard, dtype=kind)
                    for b in f.buckets:
                        lo = b.offset + self._rank * b.shard_numel
                        f.shard_view(shard, b).copy_(full[lo:lo + b.shard_numel])
                    shard_state[k] = shard
                else:
                    present = [v for v in values if v is not None]
                    if present:
                        v = present[0]
                        shard_state[k] = v.clone().to(f.shard.device) \
                            if isinstance(v, torch.Tensor) else v
            self._inner.state[f.shard] = shard_state

    def __repr__(self) -> str:
        lines = [f"ZeroOptimizer(stage {self._config.stage}, {self._optimizer_class.__name__}, "
                 f"rank {self._rank} of {self._world})"]
        lines += ["  " + line for line in self._fingerprint()]
        return "\n".join(lines)

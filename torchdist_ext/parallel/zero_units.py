"""ZeRO stage 3's units: the parts of a model whose parameters are gathered together for
their forward and backward passes, and freed between them.

A unit is a module of one of the configured types (the outermost one, where they nest),
or the model itself for every parameter no such module holds. A parameter that two units
reach (tied weights) belongs to the model's unit, which stays gathered over the model's
whole forward pass, so that every use sees it.

The hooks here know nothing of how a unit is gathered: :class:`UnitHooks` calls
``gather(unit)`` before a unit's forward pass (ahead of any other forward pre-hook), and
``before_backward(unit)`` before its backward pass, from a hook on the tensors its
forward returned that require gradients. Once its forward pass returns it calls
``after_forward(unit, hooked)``, where ``hooked`` says whether any such tensor was
found; if none was (a tensor hidden in an object pytree does not flatten), nothing will
gather the unit again before its backward pass.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Callable, Optional

import torch
import torch.nn as nn
from torch.utils._pytree import tree_flatten

__all__ = ["Unit", "UnitHooks", "plan_units"]


@dataclass
class Unit:
    """One unit: its module, its name within the model ("" for the model) and the flat
    buffers its parameters live in (filled by the optimizer)."""

    index: int
    name: str
    module: nn.Module
    flats: list[Any] = field(default_factory=list)
    buckets: int = 0  # over all its flat buffers
    gathered: bool = True  # its storage is allocated, and filled or being filled
    inflight: Optional[list[Any]] = None  # the works filling it, until waited for
    staging: Optional[list[Any]] = None  # a prefetch's own buffers, one per flat
    sources: Optional[list[Any]] = None  # what the works send, kept until waited for

    def describe(self) -> str:
        return f"unit {self.index} ({self.name or 'the model'})"


def plan_units(model: nn.Module, unit_types: tuple[type, ...]) -> tuple[list[Unit],
                                                                        dict[int, int]]:
    """The units of ``model`` (the model's own first) and, by ``id``, the unit of each of
    its parameters."""
    units = [Unit(0, "", model)]
    if unit_types:
        for name, m in model.named_modules():
            if not name or not isinstance(m, unit_types):
                continue
            if any(name.startswith(u.name + ".") for u in units[1:]):
                continue  # inside an outer unit, whose parameters it shares
            units.append(Unit(len(units), name, m))
    owner: dict[int, int] = {}
    for pname, p in model.named_parameters(remove_duplicate=False):
        u = 0
        for unit in units[1:]:
            if pname.startswith(unit.name + "."):
                u = unit.index
                break
        # Reached from two units: only the model's unit is gathered over both uses.
        owner[id(p)] = u if owner.get(id(p), u) == u else 0
    return units, owner


class UnitHooks:
    """Forward and backward hooks on every unit's module that call ``gather`` and
    ``after_forward``; ``remove()`` takes them off."""

    def __init__(self, units: list[Unit], gather: Callable[[Unit], None],
                 before_backward: Callable[[Unit], None],
                 after_forward: Callable[[Unit, bool], None]) -> None:
        self._gather = gather
        self._before_backward = before_backward
        self._after_forward = after_forward
        self._handles = []
        for u in units:
            # First, so that the user's own pre-hooks (weight_norm's) see whole parameters.
            self._handles.append(u.module.register_forward_pre_hook(self._pre(u),
                                                                    prepend=True))
            # Also when the forward pass raises (output None), so that the optimizer knows
            # the pass is over.
            self._handles.append(u.module.register_forward_hook(self._post(u),
                                                                always_call=True))

    def _pre(self, u: Unit) -> Callable[..., None]:
        def hook(module: nn.Module, args: Any) -> None:
            if module is u.module:  # not a deepcopy of it, which carries the same hooks
                self._gather(u)
        return hook

    def _post(self, u: Unit) -> Callable[..., None]:
        def before_backward(grad: torch.Tensor) -> None:
            self._before_backward(u)

        def hook(module: nn.Module, args: Any, output: Any) -> None:
            if module is not u.module:
                return
            hooked = False
            if torch.is_grad_enabled():
                for t in tree_flatten(output)[0]:
                    if isinstance(t, torch.Tensor) and t.requires_grad:
                        t.register_hook(before_backward)
                        hooked = True
            self._after_forward(u, hooked)
        return hook

    def remove(self) -> None:
        for h in self._handles:
            h.remove()
        self._handles.clear()

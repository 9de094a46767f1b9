"""What a module passed to ``fully_shard`` gains (FSDP2's ``FSDPModule``): a dynamic subclass
mixing in :class:`OwnerShardedModule`.
"""

from __future__ import annotations

import dataclasses
import functools
import math
import types
from collections.abc import Callable
from typing import Any, NoReturn

import torch
from torch import nn
from torch.distributed.tensor import DTensor

from ..owner_dtensor import OwnerDTensor
from ..planning.catalog import CostSpec, resolve_cost
from ..planning.metadata import ShardingPlan, attach_matrix_shard, get_matrix_shard
from ..tensors import local_tensor
from .context import ShardingContext
from .fsdp_api import FSDP2Methods
from .state import OwnerShardState, PlanPhase, require_state, state_of
from .unit import ShardedUnit, TrainingState

__all__ = [
    "OwnerShardedModule",
    "UnshardHandle",
    "context_of",
    "register_fsdp_forward_method",
    "states_of",
    "units_of",
]


class UnshardHandle:
    """Returned by ``unshard(async_op=True)``: :meth:`wait` completes the all-gathers."""

    def __init__(self, units: list[ShardedUnit]) -> None:
        self._units = units

    def wait(self) -> None:
        for unit in self._units:
            if unit.held:  # not released by reshard() in between
                unit.hold()
        self._units = []


class OwnerShardedModule(FSDP2Methods, nn.Module):
    """Methods every module passed to :func:`fully_shard` gains (FSDP2's ``FSDPModule``)."""

    def fix_plan(self, preconditioner: CostSpec | None = None) -> ShardingPlan:
        """Fix the sharding plan of this module's tree now (collective: on every rank), else the
        first forward or the optimizer fixes it; ``preconditioner`` prices it unless a call named one."""
        cost = resolve_cost(preconditioner) if preconditioner is not None else None
        return require_state(self).fix_plan(cost).plan

    @property
    def sharding_plan(self) -> ShardingPlan:
        """The plan of this module's tree; it must be fixed (see :meth:`fix_plan`)."""
        tree = require_state(self).tree
        if tree.phase is PlanPhase.FAILED:
            tree.fix()  # raises with the reason
        if tree.context is None:
            raise RuntimeError(
                f"{type(self).__name__}: the sharding plan is not fixed yet; the first forward, "
                "unshard(), fix_plan() or building the optimizer fixes it"
            )
        return tree.context.plan

    def unshard(self, async_op: bool = False) -> UnshardHandle | None:
        """All-gather this module's unit and every unit nested in it: full tensors on every rank
        until :meth:`reshard` (``async_op=True``: ``wait()`` on the handle first)."""
        require_state(self).fix_plan()
        units = units_of(self)
        context = context_of(self)
        if context is not None:
            context.sync_replicas()  # HSDP: a step nobody synced reaches every replica first
        for unit in units:
            if not unit.held and unit.training_state is TrainingState.IDLE:
                unit.free()  # data a forward left behind may predate an optimizer step
            unit.issue_gather(for_user=True)
            if not unit.held:  # busy in a pass (already gathered): held from now on
                unit.hold()
        handle = UnshardHandle(units)
        if async_op:
            return handle
        handle.wait()
        return None

    def reshard(self) -> None:
        """Back to the owner layout: owners keep their tensors, others hold empty tensors."""
        if context_of(self) is None:
            return  # nothing was gathered: every rank still holds the replicated parameters
        for unit in units_of(self):
            unit.release()

    def set_requires_gradient_sync(self, requires_gradient_sync: bool, *, recurse: bool = True) -> None:
        """``False``: accumulate gradients locally (in ``reduce_dtype``) until a synced backward."""
        for st in states_of(self, recurse):
            st.options.requires_gradient_sync = bool(requires_gradient_sync)

    def set_reshard_after_forward(self, reshard_after_forward: bool, *, recurse: bool = True) -> None:
        """Free (``True``) or keep (``False``) non-owned tensors between forward and backward."""
        if not isinstance(reshard_after_forward, bool):
            raise ValueError(
                f"set_reshard_after_forward({reshard_after_forward!r}): takes True or False, as FSDP2's method (the "
                "int form, a smaller reshard group, is an argument of fully_shard); pass True to free, False to keep"
            )
        for st in states_of(self, recurse):
            st.options.reshard_after_forward = reshard_after_forward

    def set_reshard_after_backward(self, reshard_after_backward: bool, *, recurse: bool = True) -> None:
        """``False`` keeps the gathered tensors for the next micro-batch's forward, as in FSDP2."""
        for st in states_of(self, recurse):
            st.options.reshard_after_backward = bool(reshard_after_backward)

    def set_gradient_divide_factor(self, factor: float) -> None:
        """This unit's gradients become the sum over ranks divided by ``factor``, as FSDP2's."""
        factor = float(factor)
        if factor <= 0 or not math.isfinite(factor):
            raise ValueError(f"set_gradient_divide_factor: factor must be positive and finite, got {factor}")
        require_state(self).options.gradient_divide_factor = factor

    def set_is_last_backward(self, is_last_backward: bool) -> None:
        """FSDP2's micro-batching hint, accepted and unneeded: every reduction completes inside backward."""
        require_state(self)

    def set_modules_to_forward_prefetch(self, modules: list[OwnerShardedModule]) -> None:
        """After this module's all-gather in forward, issue those of ``modules``."""
        require_state(self).options.forward_prefetch = self._prefetch_targets(modules)

    def set_modules_to_backward_prefetch(self, modules: list[OwnerShardedModule]) -> None:
        """After this module's re-gather in backward, issue those of ``modules`` (async)."""
        require_state(self).options.backward_prefetch = self._prefetch_targets(modules)

    def _prefetch_targets(self, modules: list[OwnerShardedModule]) -> list[nn.Module]:
        ctx = context_of(self)
        for m in modules:
            if state_of(m) is None:
                raise ValueError(f"{type(m).__name__} was not passed to fully_shard")
            if ctx is not None and ctx.unit_of(m) is None:
                raise ValueError(f"{type(m).__name__} is not a fully_shard unit of this model")
        return list(modules)

    def set_auto_prefetch(self, enabled: bool) -> None:
        """Turn the automatic next-unit prefetch (on by default) on or off for the whole model."""
        require_state(self).tree.auto_prefetch = bool(enabled)  # its one home: the context reads it there

    def __deepcopy__(self, memo: dict[int, Any]) -> NoReturn:
        """Refused, as FSDP2 refuses it: the parameters are pieces spread over a process group."""
        raise RuntimeError(
            f"copy.deepcopy of a module passed to fully_shard ({type(self).__name__}) is not "
            "supported, as with FSDP2's fully_shard: its parameters are this rank's pieces of "
            "tensors sharded over a process group. Use the state dict instead: build a new model "
            "and load get_model_state_dict(model, options=StateDictOptions(full_state_dict=True)) "
            "(or model.state_dict() into a model sharded the same way), or deepcopy the model "
            "before calling fully_shard"
        )

    def _apply(self, fn: Callable[[torch.Tensor], torch.Tensor], recurse: bool = True) -> OwnerShardedModule:
        """``to_empty``, ``.to(...)``, ``half()`` keep the layout piece by piece (DESIGN.md, "Lazy sharding")."""
        state = require_state(self)
        if state.unit is None and _holds_meta(state):
            state.fix_plan()
        fn = _piecewise(fn)
        unit = state.unit
        if unit is None:  # pending: full tensors, nn.Module's own conversion
            result = super()._apply(fn, recurse)
            state.link_parameters()
            return result
        if unit.training_state is not TrainingState.IDLE or unit.held:
            raise RuntimeError(
                f"{type(self).__name__}: cannot convert parameters while the unit is "
                f"{'unsharded by unshard()' if unit.held else 'in ' + unit.training_state.value}; "
                "call reshard() first (or convert outside forward/backward)"
            )
        unit.free()
        result = super()._apply(fn, recurse)
        for h in unit.handles:
            now = h.registered()
            if not isinstance(now, nn.Parameter):
                raise RuntimeError(f"{h.shard.fqn}: nn.Module._apply left no parameter in place")
            shard = dataclasses.replace(h.shard, dtype=now.dtype)
            if now is not h.sharded:  # the conversion made a new parameter object
                h.sharded = now
                h.swap(now)
            h.shard = shard
            attach_matrix_shard(now, shard, unit.groups.rank)
        unit.rebuild_unsharded()
        return result


def context_of(module: nn.Module) -> ShardingContext | None:
    """The runtime of ``module``'s tree (None while pending)."""
    return require_state(module).tree.context


def units_of(module: nn.Module) -> list[ShardedUnit]:
    """``module``'s unit and every unit nested in it (call order); the plan must be fixed."""
    ctx = context_of(module)
    if ctx is None:
        raise RuntimeError(f"{type(module).__name__}: the sharding plan is not fixed yet (see fix_plan())")
    return ctx.units_in(module)


def states_of(module: nn.Module, recurse: bool) -> list[OwnerShardState]:
    """``module``'s state, and with ``recurse`` every state of a module inside it."""
    own = require_state(module)
    if not recurse:
        return [own]
    found: list[OwnerShardState] = []
    for m in module.modules():
        st = state_of(m)
        if st is not None and not any(f is st for f in found):
            found.append(st)
    return found


def _holds_meta(state: OwnerShardState) -> bool:
    """Whether a parameter of the call's modules is still on ``meta`` (waits for ``to_empty``)."""
    return any(p.is_meta for m in state.modules for p in m.parameters())


def _piecewise(fn: Callable[[torch.Tensor], torch.Tensor]) -> Callable[[torch.Tensor], torch.Tensor]:
    """``fn`` applied to an owner-layout tensor's local piece, the result laid out as before."""
    if isinstance(fn, _Piecewise):
        return fn  # a nested sharded module: already converting pieces
    return _Piecewise(fn)


class _Piecewise:
    """A function of ``nn.Module._apply`` made to convert owner-layout pieces (:func:`_piecewise`)."""

    def __init__(self, fn: Callable[[torch.Tensor], torch.Tensor]) -> None:
        self.fn = fn

    def __call__(self, t: torch.Tensor) -> torch.Tensor:
        fn = self.fn
        if not isinstance(t, OwnerDTensor):
            return fn(t)
        piece = local_tensor(t)
        out = fn(piece)
        if not isinstance(out, torch.Tensor) or isinstance(out, DTensor) or out.shape != piece.shape:
            shard = get_matrix_shard(t)
            what = f"parameter {shard.fqn!r}" if shard is not None else "parameter"
            raise ValueError(
                f"nn.Module._apply on a fully_shard module: the function maps this rank's piece "
                f"{tuple(piece.shape)} of the {tuple(t.shape)} {what} to "
                f"{tuple(out.shape) if isinstance(out, torch.Tensor) else type(out).__name__}; "
                "only shape-preserving conversions (to, to_empty, half, cuda, ...) keep the owner "
                "layout. Apply it to the model before fully_shard, or to a full state dict"
            )
        new = OwnerDTensor.make(out, t.device_mesh, t.placement, t.shape, t.stride(), holder=t.holder)
        new._tree = t._tree  # its link to its tree (HSDP's replicas) stays
        return new


def register_fsdp_forward_method(module: nn.Module, method_name: str) -> None:
    """``module.<method_name>`` gathers like ``forward`` (``torch.distributed.fsdp.register_fsdp_forward_method``)."""
    state = state_of(module)
    if state is None:
        raise ValueError(f"register_fsdp_forward_method: {type(module).__name__} was not passed to fully_shard")
    method = getattr(module, method_name, None)
    if method is None or not callable(method):
        raise ValueError(f"register_fsdp_forward_method: {type(module).__name__} has no method {method_name!r}")
    orig = getattr(type(module), method_name)

    @functools.wraps(orig)
    def wrapped(self: nn.Module, *args: Any, **kwargs: Any) -> Any:
        args, kwargs = state.pre_forward_hook(self, args, kwargs)
        ctx = state.fix_plan()
        ctx.method_depth += 1  # forwards inside the method belong to this pass
        try:
            out = orig(self, *args, **kwargs)
        finally:
            ctx.method_depth -= 1
        return state.post_forward_hook(self, args, kwargs, out)

    module.__dict__[method_name] = types.MethodType(wrapped, module)


# One dynamic subclass per user class (a cache, as FSDP2's ``FSDP<cls>``; it decides nothing).
_class_cache: dict[type, type] = {}


def swap_class(module: nn.Module) -> None:
    cls = type(module)
    if issubclass(cls, OwnerShardedModule):
        return
    new_cls = _class_cache.get(cls)
    if new_cls is None:
        new_cls = type(f"OwnerSharded{cls.__name__}", (OwnerShardedModule, cls), {})
        _class_cache[cls] = new_cls
    module.__class__ = new_cls

"""``fully_shard``: owner-shaped ZeRO-3 with FSDP2's call pattern and FSDP2's lazy initialisation.

A ``fully_shard`` call records a *unit* (the module's parameters not already in a child unit)
and installs its hooks; it moves no data. The plan balances the whole model, so it is fixed
lazily, as FSDP2 initialises lazily, at the first of:

* the first forward of any recorded unit,
* the first reader of the metadata: the optimizer (``OwnerRoutedOptimizer`` calls
  :func:`~matrix_owner_optim.planning.metadata.ensure_sharded`), ``unshard()``,
  ``sharding_plan``. (``state_dict()`` before that holds the replicated parameters.)

All units recorded on the same mesh and not sharded yet are planned together then, in call
order (FSDP2's order: blocks first, the root last), so it does not matter who holds the model
or whether there is a root call at all; nothing guesses the root. The parameter objects never
change: sharding only replaces their data (the whole tensor on the owner, a numel-0 tensor
elsewhere, row blocks for ``sharded``), so an optimizer or any reference taken after the
``fully_shard`` calls stays valid, and meta-device initialisation works (build on ``meta``,
``fully_shard``, ``to_empty``, run the model's own init on full tensors, then train: non-owners
drop what they do not own when the plan is fixed).

A sharded module's class is swapped to a dynamic subclass that mixes in
:class:`OwnerShardedModule` (FSDP2's ``FSDPModule``): ``unshard``, ``reshard``, the ``set_*``
methods, and an ``nn.Module._apply`` that keeps the layout through ``to_empty``/``.to``.
"""

from __future__ import annotations

import dataclasses
import functools
import gc
import itertools
import math
import types
import weakref
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import torch
import torch.distributed as dist
from torch import nn
from torch.utils._pytree import tree_flatten, tree_map, tree_unflatten

from .. import comm
from ..agreement import check_plan_agreement
from ..owner_dtensor import OwnerDTensor, mesh_of_group
from ..pieces import placement_of
from ..planning.cost import get_cost_model
from ..planning.metadata import (
    MatrixShard,
    ShardingPlan,
    attach_matrix_shard,
    mark_awaiting_shard,
    peek_matrix_shard,
    record_unit_prefixes,
)
from ..planning.planner import plan_tensors
from ..planning.roles import TensorSpec, specs_from_module
from ..tensors import local_tensor
from .context import ShardingContext
from .unit import ParamHandle, ShardedUnit, TrainingState, in_backward

__all__ = ["fully_shard", "OwnerShardedModule", "UnshardHandle", "register_fsdp_forward_method"]

_STATE_ATTR = "_moo_state"


@dataclass(eq=False)
class OwnerShardState:
    """Everything ``fully_shard`` knows about one module (one per sharded module)."""

    group: Any  # shard process group
    replicate_group: Any  # HSDP replicate group, or None
    reshard_after_forward: bool
    mp_policy: Any
    plan: ShardingPlan | None  # given by the user, or None: planned at sharding time
    call_index: int  # position in fully_shard call order (process-wide, same on every rank)
    unit: ShardedUnit | None = None  # set when the plan is fixed
    failed: str | None = None  # why sharding failed, if it did
    forward_methods: list[str] = field(default_factory=list)
    preconditioner: Any = None  # prices the plan's matrices (None: the optimizer's, else Muon)


# Modules passed to fully_shard whose plan is not fixed yet, in call order. Weak: a model the
# user dropped must not stay pending (nor be kept alive).
_pending: list[weakref.ref[nn.Module]] = []
_calls = 0


def _state(module: nn.Module) -> OwnerShardState | None:
    return module.__dict__.get(_STATE_ATTR)


def _require_state(module: nn.Module) -> OwnerShardState:
    state = _state(module)
    if state is None:
        raise RuntimeError(f"{type(module).__name__} was not passed to fully_shard")
    return state


def _unit(module: nn.Module) -> ShardedUnit:
    """The unit of ``module``, fixing the plan now if it is still pending."""
    state = _require_state(module)
    _ensure_sharded(module)
    assert state.unit is not None
    return state.unit


class UnshardHandle:
    """Returned by ``unshard(async_op=True)``: :meth:`wait` completes the all-gathers."""

    def __init__(self, units: list[ShardedUnit]) -> None:
        self._units = units

    def wait(self) -> None:
        for unit in self._units:
            if unit.user_held:
                unit.unshard()
        self._units = []


class OwnerShardedModule(nn.Module):
    """Methods every module passed to :func:`fully_shard` gains (FSDP2's ``FSDPModule``)."""

    def _moo_units(self) -> list[ShardedUnit]:
        """This module's unit and every unit nested in it (call order)."""
        unit = _unit(self)
        inside = {id(m) for m in self.modules()}
        return [u for u in unit.ctx.units if id(u.module) in inside]

    def unshard(self, async_op: bool = False) -> UnshardHandle | None:
        """All-gather this module's unit and every unit nested in it; until :meth:`reshard`,
        ``named_parameters()`` yields the full tensors on every rank.

        ``async_op=True`` issues the all-gathers and returns a handle; call its ``wait()``
        before reading the parameters (a forward waits by itself)."""
        units = self._moo_units()
        for unit in units:
            if not unit.user_held and unit.training_state is TrainingState.IDLE:
                unit.free()  # data a forward left behind may predate an optimizer step
            unit.user_held = True
            unit.issue_gather()
        handle = UnshardHandle(units)
        if async_op:
            return handle
        handle.wait()
        return None

    def reshard(self) -> None:
        """Back to the owner layout: owners keep their tensors, others hold empty tensors."""
        for unit in self._moo_units():
            unit.user_held = False
            unit.free()

    def set_requires_gradient_sync(self, requires_gradient_sync: bool, *, recurse: bool = True) -> None:
        """``False``: accumulate gradients locally (in ``reduce_dtype``, no collective) until a
        backward with sync enabled, which reduces the accumulated sum once (DDP ``no_sync``)."""
        for unit in self._targets(recurse):
            unit.requires_gradient_sync = bool(requires_gradient_sync)

    def set_reshard_after_forward(self, reshard_after_forward: bool, *, recurse: bool = True) -> None:
        """Free (``True``) or keep (``False``) non-owned tensors between forward and backward."""
        value = _check_reshard_after_forward(reshard_after_forward)
        for unit in self._targets(recurse):
            unit.reshard_after_forward = value

    def set_reshard_after_backward(self, reshard_after_backward: bool, *, recurse: bool = True) -> None:
        """``False`` keeps the gathered tensors after backward for the next micro-batch's forward
        (no all-gather). As in FSDP2, set it back to ``True`` before the last micro-batch: the
        kept tensors do not see an optimizer step."""
        for unit in self._targets(recurse):
            unit.reshard_after_backward = bool(reshard_after_backward)

    def set_gradient_divide_factor(self, factor: float) -> None:
        """Gradients become the sum over ranks divided by ``factor`` instead of the average
        for this module's own unit, as FSDP2's method of the same name (call it on every sharded
        module to change them all). In float16 the division is split around the sum (see
        ``gradient_divide_factors``)."""
        factor = float(factor)
        if factor <= 0 or not math.isfinite(factor):
            raise ValueError(f"set_gradient_divide_factor: factor must be positive and finite, got {factor}")
        _unit(self).gradient_divide_factor = factor

    def set_is_last_backward(self, is_last_backward: bool) -> None:
        """FSDP2's micro-batching hint. Here every reduction completes inside backward, so the
        end of any backward leaves nothing in flight; the flag is recorded for scripts that
        read it back (``is_last_backward``)."""
        self._moo_is_last_backward = bool(is_last_backward)

    @property
    def is_last_backward(self) -> bool:
        return bool(self.__dict__.get("_moo_is_last_backward", True))

    def set_modules_to_forward_prefetch(self, modules: list[OwnerShardedModule]) -> None:
        """After this module's all-gather in forward, issue those of ``modules`` (async), as
        FSDP2's method of the same name; replaces the automatic next-unit prefetch here."""
        _unit(self).forward_prefetch = self._units_of(modules)

    def set_modules_to_backward_prefetch(self, modules: list[OwnerShardedModule]) -> None:
        """After this module's re-gather in backward, issue those of ``modules`` (async)."""
        _unit(self).backward_prefetch = self._units_of(modules)

    def set_auto_prefetch(self, enabled: bool) -> None:
        """Turn the automatic next-unit prefetch (on by default) on or off for the whole model."""
        _unit(self).ctx.auto_prefetch = bool(enabled)

    @property
    def sharding_plan(self) -> ShardingPlan:
        return _unit(self).ctx.plan

    def _targets(self, recurse: bool) -> list[ShardedUnit]:
        return self._moo_units() if recurse else [_unit(self)]

    def _units_of(self, modules: list[OwnerShardedModule]) -> list[ShardedUnit]:
        ctx = _unit(self).ctx
        units = []
        for m in modules:
            state = _state(m)
            if state is None:
                raise ValueError(f"{type(m).__name__} was not passed to fully_shard")
            unit = _unit(m)
            if unit.ctx is not ctx:
                raise ValueError(f"{type(m).__name__} is not a fully_shard unit of this model")
            units.append(unit)
        return units

    def _apply(self, fn: Callable[[torch.Tensor], torch.Tensor], recurse: bool = True) -> OwnerShardedModule:
        """``to_empty``, ``.to(device)``, ``.to(dtype)`` ... keep the layout (FSDP2's
        ``FSDPModule`` does the same): the sharded parameters are converted, then the unit's
        unsharded tensors, aliases and dtypes are rebuilt from them."""
        state = _require_state(self)
        unit = state.unit
        if unit is None:  # pending: full tensors, nn.Module's own conversion
            result = super()._apply(fn, recurse)
            _mark_pending_params(self)
            return result
        if unit.training_state is not TrainingState.IDLE or unit.user_held:
            raise RuntimeError(
                f"{type(self).__name__}: cannot convert parameters while the unit is "
                f"{'unsharded by unshard()' if unit.user_held else 'in ' + unit.training_state.value}; "
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
            attach_matrix_shard(now, shard, unit.ctx.rank, unit.ctx.group)
        unit.rebuild_unsharded()
        return result


def register_fsdp_forward_method(module: nn.Module, method_name: str) -> None:
    """Make ``module.<method_name>`` (e.g. ``generate``) gather and release the unit like
    ``forward`` does, as ``torch.distributed.fsdp.register_fsdp_forward_method``."""
    state = _state(module)
    if state is None:
        raise ValueError(f"register_fsdp_forward_method: {type(module).__name__} was not passed to fully_shard")
    method = getattr(module, method_name, None)
    if method is None or not callable(method):
        raise ValueError(f"register_fsdp_forward_method: {type(module).__name__} has no method {method_name!r}")
    orig = getattr(type(module), method_name)

    @functools.wraps(orig)
    def wrapped(self: nn.Module, *args: Any, **kwargs: Any) -> Any:
        args, kwargs = _pre_forward_hook(self, args, kwargs)
        ctx = _unit(self).ctx
        ctx.method_depth += 1  # forwards inside the method belong to this pass
        try:
            out = orig(self, *args, **kwargs)
        finally:
            ctx.method_depth -= 1
        return _post_forward_hook(self, args, kwargs, out)

    module.__dict__[method_name] = types.MethodType(wrapped, module)
    state.forward_methods.append(method_name)


_class_cache: dict[type, type] = {}


def _swap_class(module: nn.Module) -> None:
    cls = type(module)
    if issubclass(cls, OwnerShardedModule):
        return
    new_cls = _class_cache.get(cls)
    if new_cls is None:
        new_cls = type(f"OwnerSharded{cls.__name__}", (OwnerShardedModule, cls), {})
        _class_cache[cls] = new_cls
    module.__class__ = new_cls


def _resolve_group(mesh: Any) -> tuple[Any, Any]:
    """(shard group, replicate group or None) of ``mesh``; a 2D mesh is (replicate, shard)."""
    if not dist.is_available() or not dist.is_initialized():
        raise RuntimeError("fully_shard needs an initialized process group (torch.distributed.init_process_group)")
    if mesh is None:
        return dist.group.WORLD, None
    if isinstance(mesh, dist.ProcessGroup):
        return mesh, None
    ndim = getattr(mesh, "ndim", None)
    if ndim is None or not hasattr(mesh, "get_group"):
        raise TypeError(f"mesh must be a 1D or 2D DeviceMesh, a ProcessGroup or None, got {type(mesh).__name__}")
    if ndim == 1:
        return mesh.get_group(), None
    if ndim == 2:  # HSDP: owner-shaped inside dim 1, replicated (all-reduced) across dim 0
        return mesh.get_group(1), mesh.get_group(0)
    raise NotImplementedError(f"fully_shard got a {ndim}D DeviceMesh; use a 1D mesh or a 2D (replicate, shard) mesh")


def mesh_device(mesh: Any, group: Any) -> torch.device:
    """The device ``fully_shard`` keeps a unit's tensors on, as FSDP2 picks it: a
    ``DeviceMesh``'s device type; for ``None`` or a ``ProcessGroup``, the current CUDA device
    when CUDA is available and the group's backend runs NCCL, else the CPU."""
    device_type = getattr(mesh, "device_type", None)
    if device_type is None:
        return comm.object_device(group)
    if device_type == "cuda":
        return torch.device("cuda", torch.cuda.current_device())
    return torch.device(device_type)


def move_states_to_device(module: nn.Module, device: torch.device) -> None:
    """Move ``module``'s parameters and buffers to ``device`` in place (``.data`` replaced, the
    objects kept), as FSDP2 moves a CPU-built model to its mesh's device. Tensors on ``meta``
    stay there (``to_empty`` materialises them later), and so do tensors already on ``device``
    (a child unit's, moved by its own ``fully_shard`` call)."""
    for t in itertools.chain(module.parameters(), module.buffers()):
        if t.device.type == "meta" or t.device == device:
            continue
        t.data = t.data.to(device)


def _check_reshard_after_forward(value: Any) -> bool:
    if isinstance(value, bool):
        return value
    raise ValueError(
        f"reshard_after_forward={value!r}: the owner layout takes True or False. FSDP2's int form "
        "(reshard to a smaller world size after forward) has no owner-shaped equivalent: every "
        "tensor already lives whole on one rank; pass True to free, False to keep"
    )


class _ShardNow:
    """The callback a pending parameter carries (weak: a dropped model must not stay alive)."""

    def __init__(self, module: nn.Module) -> None:
        self._module = weakref.ref(module)

    def __call__(self, preconditioner: Any = None) -> None:
        module = self._module()
        if module is not None:
            _ensure_sharded(module, preconditioner)


def _mark_pending_params(module: nn.Module) -> None:
    shard_now = _ShardNow(module)
    for param in module.parameters():
        if peek_matrix_shard(param) is None:
            mark_awaiting_shard(param, shard_now)


def fully_shard(
    module: nn.Module | list[nn.Module],
    *,
    mesh: Any = None,
    reshard_after_forward: bool = True,
    mp_policy: Any = None,
    plan: ShardingPlan | None = None,
    preconditioner: Any = None,
) -> Any:
    """Owner-shaped sharding of ``module``'s parameters not already in a child unit.

    Args:
        module: a block (call these first) or the root model (call last); or a list of modules
            that form one unit together (FSDP2's list form, e.g. embedding, final norm and head:
            one all-gather and one reduce-scatter for all of them).
        mesh: ``None`` (default process group), a 1D ``DeviceMesh``, a ``ProcessGroup``, or a
            2D ``DeviceMesh`` of shape (replicate, shard) for HSDP: owner-shaped inside the
            shard dim, gradients all-reduced across the replicate dim and averaged over both.
        reshard_after_forward: free non-owned tensors after forward and gather them again
            before backward (the root unit keeps its tensors, as in FSDP2). A bool: FSDP2's
            int form is refused with an explanation.
        mp_policy: ``torch.distributed.fsdp.MixedPrecisionPolicy``: ``param_dtype`` (compute
            and all-gather dtype), ``reduce_dtype`` (gradient reduction and accumulation
            dtype), ``output_dtype``, ``cast_forward_inputs``. Sharded parameters keep their dtype.
        plan: a :class:`ShardingPlan` to apply instead of planning (must cover exactly the
            model's parameters, for the mesh size; only owners and roles are taken from it,
            units and segments follow the ``fully_shard`` calls).
        preconditioner: the matrix optimizer whose cost model balances the plan (a name such as
            ``"shampoo"``, a ``CostModel`` or an optimizer class). Default: the optimizer that
            fixes the plan (``OwnerRoutedOptimizer`` built before the first forward passes its
            own), else Muon's.

    Returns ``module``. Nothing moves until the plan is fixed (module docstring); build the
    optimizer after the ``fully_shard`` calls.
    """
    global _calls
    modules = list(module) if isinstance(module, (list, tuple)) else [module]
    if not modules:
        raise ValueError("fully_shard got an empty list of modules")
    for m in modules:
        if not isinstance(m, nn.Module):
            raise TypeError(f"fully_shard expects an nn.Module, got {type(m).__name__} (or a list of modules)")
        if _state(m) is not None:
            raise ValueError(f"fully_shard was already called on this {type(m).__name__}")
    if len({id(m) for m in modules}) != len(modules):
        raise ValueError("fully_shard: a module appears twice in the list")
    for m in modules:
        if any(o is not m and any(s is m for s in o.modules()) for o in modules):
            raise ValueError(
                f"fully_shard: {type(m).__name__} in the list is inside another module of the "
                "list; list modules that do not contain each other"
            )
    rsf = _check_reshard_after_forward(reshard_after_forward)
    _check_mp_policy(mp_policy)
    if preconditioner is not None:
        get_cost_model(preconditioner)  # an unknown name fails here, before anything is recorded
    group, replicate_group = _resolve_group(mesh)
    if plan is not None:
        _check_plan_world_size(plan, dist.get_world_size(group))
    for m in modules:
        _check_submodules(m, group, replicate_group)
    device = mesh_device(mesh, group)
    for m in modules:
        move_states_to_device(m, device)
        as_owner_dtensors(m, mesh_of_group(group, device.type))
        _swap_class(m)
        m.__dict__[_STATE_ATTR] = OwnerShardState(
            group, replicate_group, rsf, mp_policy, plan, _calls, preconditioner=preconditioner
        )
        _pending.append(weakref.ref(m))
        _mark_pending_params(m)
        m.register_forward_pre_hook(_pre_forward_hook, with_kwargs=True)
        m.register_forward_hook(_post_forward_hook, with_kwargs=True)
    _calls += 1
    return module


def _check_submodules(module: nn.Module, group: Any, replicate_group: Any) -> None:
    """Refuse a submodule sharded over another mesh, or already planned."""
    for name, sub in module.named_modules():
        sub_state = _state(sub)
        sub_mesh = None if sub_state is None else (sub_state.group, sub_state.replicate_group)
        if sub_state is not None and sub_mesh != (group, replicate_group):
            raise ValueError(
                f"fully_shard({type(module).__name__}): its submodule {name!r} "
                f"({type(sub).__name__}) was passed to fully_shard with another mesh "
                f"({_mesh_words(sub_state.group, sub_state.replicate_group)}) than this call "
                f"({_mesh_words(group, replicate_group)}); one model is planned over one mesh, "
                "so pass the same mesh to every fully_shard call of the model"
            )
        if sub_state is not None and sub_state.unit is not None:
            raise ValueError(
                f"fully_shard({type(module).__name__}): its submodule {name!r} "
                f"({type(sub).__name__}) is already sharded (its plan was fixed by a forward or "
                "by building the optimizer); call fully_shard on the blocks first, then on the "
                "root, and only then run forward or build the optimizer"
            )


def _mesh_words(group: Any, replicate_group: Any) -> str:
    shard = f"{dist.get_world_size(group)} ranks"
    if replicate_group is None:
        return shard
    return f"{dist.get_world_size(replicate_group)} replicas x {shard}"


def _check_mp_policy(mp_policy: Any) -> None:
    """Refuse a mixed-precision policy the owner layout cannot honour, before anything is
    recorded: anything but FSDP2's ``MixedPrecisionPolicy`` (FSDP1's ``MixedPrecision`` has
    ``buffer_dtype`` / ``keep_low_precision_grads``, which have no meaning here and would be
    ignored silently), and dtypes that are not floating point (the unsharded parameters must
    require gradients)."""
    if mp_policy is None:
        return
    from torch.distributed.fsdp import MixedPrecisionPolicy

    if not isinstance(mp_policy, MixedPrecisionPolicy):
        raise TypeError(
            f"fully_shard(mp_policy=...) takes torch.distributed.fsdp.MixedPrecisionPolicy "
            f"(param_dtype, reduce_dtype, output_dtype, cast_forward_inputs), got "
            f"{type(mp_policy).__name__}; FSDP1's MixedPrecision fields (buffer_dtype, "
            "keep_low_precision_grads, ...) have no equivalent here. Build "
            "MixedPrecisionPolicy(param_dtype=..., reduce_dtype=...) instead"
        )
    for field_name in ("param_dtype", "reduce_dtype", "output_dtype"):
        dtype = getattr(mp_policy, field_name)
        floating = isinstance(dtype, torch.dtype) and dtype.is_floating_point
        if dtype is not None and not floating:
            raise ValueError(
                f"fully_shard: mp_policy.{field_name}={dtype!r} is not a floating-point dtype; "
                "the owner layout computes, reduces and returns in floating point. Use "
                "torch.bfloat16, torch.float16 or torch.float32 (or None to keep the "
                "parameters' dtype)"
            )


def _check_registrations(unit: ShardedUnit) -> None:
    """Refuse parameters registered in ``unit``'s subtree after its plan was fixed: a new
    parameter (or a new tensor assigned over a sharded one, or a sharded one registered at a
    new place) has no owner and no segment, so no collective would gather it or average its
    gradient and every rank would train its own copy. Checked at the start of every forward
    pass of an outermost unit, on every rank alike (same model, same answer)."""
    expected = unit.ctx.registrations()
    for mod in (m for member in unit.members for m in member.modules()):  # no fqn strings unless wrong
        for name, p in mod._parameters.items():
            if p is None:
                continue
            known = expected.get((id(mod), name))
            if known is not None and (p is known.sharded or p is known._unsharded):
                continue
            mod_name = next(n for member in unit.members for n, m in member.named_modules() if m is mod)
            fqn = f"{mod_name}.{name}" if mod_name else name
            what = "a new tensor was assigned to" if known is not None else "was registered on"
            raise ValueError(
                f"fully_shard: parameter {fqn!r} (shape {tuple(p.shape)}) {what} "
                f"{type(unit.module).__name__} after its sharding plan was fixed (by the first "
                "forward, unshard() or building the optimizer); the plan has no "
                "owner for it, so its gradient would never be averaged across ranks. Register "
                "every parameter before that point (sharding is lazy: fully_shard itself fixes nothing), "
                "or change values in place (load_state_dict / set_model_state_dict)"
            )


def _check_plan_world_size(plan: ShardingPlan, world_size: int) -> None:
    if not isinstance(plan, ShardingPlan):
        raise TypeError(f"plan must be a ShardingPlan, got {type(plan).__name__}")
    if plan.world_size != world_size:
        raise ValueError(
            f"fully_shard: the plan was made for world size {plan.world_size} but the mesh has "
            f"{world_size} ranks; build it with plan_model(model, {world_size}, ...)"
        )


# -- hooks ---------------------------------------------------------------------------------------
class _PostBackward(torch.autograd.Function):
    """Identity on a unit's inputs; its backward runs once every node of this forward of the
    unit has produced its input gradients (FSDP2's ``RegisterPostBackwardFunction``)."""

    @staticmethod
    def forward(ctx: Any, unit: ShardedUnit, *inputs: torch.Tensor) -> Any:  # type: ignore[override]
        ctx.unit = unit
        return inputs if len(inputs) > 1 else inputs[0]

    @staticmethod
    def backward(ctx: Any, *grads: torch.Tensor) -> Any:  # type: ignore[override]
        ctx.unit.post_backward()
        return (None, *grads)


def _register_post_backward(unit: ShardedUnit, args: tuple, kwargs: dict) -> tuple[tuple, dict]:
    flat, spec = tree_flatten((args, kwargs))
    where = [i for i, t in enumerate(flat) if isinstance(t, torch.Tensor) and t.requires_grad]
    if not where:  # nothing to hang it on: the end-of-backward callback reduces this unit
        return args, kwargs
    out = _PostBackward.apply(unit, *[flat[i] for i in where])
    out = out if isinstance(out, tuple) else (out,)
    for i, t in zip(where, out, strict=True):
        flat[i] = t
    return tree_unflatten(flat, spec)


def _cast_floating(tree: Any, dtype: torch.dtype) -> Any:
    return tree_map(lambda t: t.to(dtype) if isinstance(t, torch.Tensor) and t.is_floating_point() else t, tree)


def _pre_forward_hook(module: nn.Module, args: tuple, kwargs: dict) -> tuple[tuple, dict]:
    unit = _unit(module)
    backward = in_backward()
    parent = unit.parent
    outermost = parent is None or parent.training_state is not TrainingState.FORWARD
    if not backward and outermost and unit.ctx.method_depth == 0:
        _check_registrations(unit)  # input validation: nothing registered since the plan
        unit.ctx.begin_forward_pass()  # an outermost forward: a new iteration starts clean
    unit.pre_forward()
    mp = unit.mp_policy
    param_dtype = getattr(mp, "param_dtype", None)
    if param_dtype is not None and getattr(mp, "cast_forward_inputs", False):
        args, kwargs = _cast_floating(args, param_dtype), _cast_floating(kwargs, param_dtype)
    if not backward and torch.is_grad_enabled():
        args, kwargs = _register_post_backward(unit, args, kwargs)
    return args, kwargs


def _post_forward_hook(module: nn.Module, args: tuple, kwargs: dict, output: Any) -> Any:
    unit = _unit(module)
    unit.post_forward()
    if torch.is_grad_enabled() and not in_backward():
        tensors = [t for t in tree_flatten(output)[0] if isinstance(t, torch.Tensor) and t.requires_grad]
        if tensors:
            torch.autograd.graph.register_multi_grad_hook(tensors, lambda _g: unit.pre_backward(), mode="any")
    output_dtype = getattr(unit.mp_policy, "output_dtype", None)
    if output_dtype is not None:
        output = _cast_floating(output, output_dtype)
    return output


# -- lazy sharding -------------------------------------------------------------------------------
def _ensure_sharded(module: nn.Module, preconditioner: Any = None) -> None:
    """Fix the plan and shard every pending unit on ``module``'s mesh (no-op once sharded);
    ``preconditioner`` prices it unless a ``fully_shard`` call named one (default: Muon)."""
    state = _require_state(module)
    if state.unit is not None:
        return
    if state.failed is not None:
        raise RuntimeError(
            f"sharding of this {type(module).__name__} failed earlier ({state.failed}); build the "
            "model again and call fully_shard on it"
        )
    gc.collect()  # once per plan: a model dropped while pending may sit in a reference cycle
    live = [m for m in (ref() for ref in _pending) if m is not None]
    _pending[:] = [weakref.ref(m) for m in live]
    key = (state.group, state.replicate_group)
    modules = [m for m in live if (_require_state(m).group, _require_state(m).replicate_group) == key]
    modules.sort(key=lambda m: _require_state(m).call_index)
    if not any(m is module for m in modules):
        modules.append(module)
    try:
        _shard(modules, preconditioner)
    except BaseException as exc:
        for m in modules:
            _require_state(m).failed = f"{type(exc).__name__}: {exc}"
        raise
    finally:
        done = {id(m) for m in modules}
        _pending[:] = [ref for ref in _pending if ref() is not None and id(ref()) not in done]


def _planning_root(modules: list[nn.Module]) -> tuple[nn.Module, bool]:
    """The module the plan's fqns are relative to: the one unit module containing all others,
    or a container over the outermost ones (blocks without a root call, several models)."""
    inside: dict[int, set[int]] = {id(m): {id(s) for s in m.modules()} for m in modules}
    outermost = [m for m in modules if not any(o is not m and id(m) in inside[id(o)] for o in modules)]
    if len(outermost) == 1:
        return outermost[0], False
    return nn.ModuleDict({f"unit{i}": m for i, m in enumerate(outermost)}), True


def _unit_of_modules(modules: list[nn.Module]) -> dict[int, int]:
    """Module id -> index (in ``modules``) of the innermost unit containing it."""
    owner: dict[int, int] = {}
    size: dict[int, int] = {}
    for i, m in enumerate(modules):
        subtree = list(m.modules())
        for s in subtree:
            if id(s) not in owner or len(subtree) < size[id(s)]:
                owner[id(s)] = i
                size[id(s)] = len(subtree)
    return owner


def _locations(
    root: nn.Module, unit_of_module: dict[int, int], modules: list[nn.Module], fqn_of: dict[int, str]
) -> dict[int, list[tuple[nn.Module, str]]]:
    """Parameter id -> every (module, name) it is registered under; refuses a parameter
    registered in two units (each unit gathers its own parameters: a shared one has no home)."""
    found: dict[int, list[tuple[nn.Module, str]]] = {}
    unit_seen: dict[int, int] = {}
    seen: set[tuple[int, str]] = set()
    for _, mod in root.named_modules(remove_duplicate=False):
        for name, p in mod._parameters.items():
            if p is None or (id(mod), name) in seen:
                continue
            seen.add((id(mod), name))
            p = _current(p)
            found.setdefault(id(p), []).append((mod, name))
            u = unit_of_module[id(mod)]
            if unit_seen.setdefault(id(p), u) != u:
                a, b = modules[unit_seen[id(p)]], modules[u]
                raise ValueError(
                    f"fully_shard: parameter {fqn_of.get(id(p), name)!r} is registered in two "
                    f"fully_shard units ({type(a).__name__} and {type(b).__name__}); a unit "
                    "gathers only its own parameters. Call fully_shard on a module containing "
                    "both uses (or untie the parameter)"
                )
    return found


def _validate_plan(plan: ShardingPlan, specs: list[TensorSpec], world_size: int) -> None:
    _check_plan_world_size(plan, world_size)
    model_names = {n for s in specs for n in (s.fqn, *s.aliases)}
    plan_names = {n for s in plan for n in (s.fqn, *s.aliases)}
    missing = [s.fqn for s in specs if s.fqn not in plan]
    if missing:
        raise ValueError(
            f"fully_shard: the plan does not cover parameter {missing[0]!r} of the model; "
            "build the plan from this model with plan_model"
        )
    extra = sorted(plan_names - model_names)
    if extra:
        raise ValueError(f"fully_shard: the plan names {extra[0]!r}, which is not a parameter of the model")
    for s in specs:
        shard = plan[s.fqn]
        if tuple(shard.shape) != tuple(s.shape) or shard.dtype != s.dtype:
            raise ValueError(
                f"fully_shard: parameter {s.fqn!r} is {tuple(s.shape)} {s.dtype} in the model but "
                f"{tuple(shard.shape)} {shard.dtype} in the plan"
            )
        if not shard.holds_rows and (shard.owner is None or not 0 <= shard.owner < world_size):
            raise ValueError(f"fully_shard: parameter {s.fqn!r} has no valid owner in the plan ({shard.owner!r})")


def _normalize(plan: ShardingPlan, specs: list[TensorSpec]) -> dict[str, MatrixShard]:
    """The plan's owners and roles with units and segment offsets of these fully_shard calls."""
    cursor: dict[tuple[int, int | None], int] = {}
    out: dict[str, MatrixShard] = {}
    for s in specs:
        shard = plan[s.fqn]
        if shard.holds_rows:
            offset = length = 0
        else:
            length = shard.numel
            offset = cursor.get((s.unit, shard.owner), 0)
            cursor[(s.unit, shard.owner)] = offset + length
        out[s.fqn] = dataclasses.replace(
            shard,
            fqn=s.fqn,
            unit=s.unit,
            segment_offset=offset,
            segment_length=length,
            aliases=tuple(s.aliases),
            requires_grad=s.requires_grad,
        )
    return out


def _local_piece(full: torch.Tensor, shard: MatrixShard, rank: int) -> torch.Tensor:
    """This rank's data of a parameter: whole on its owner, row block, or an empty piece (no
    rows; a 0-dim placeholder zero for a scalar)."""
    if shard.holds_rows:
        start, stop = shard.row_range(rank)
        return full.detach()[start:stop].clone()
    if shard.is_owned_by(rank):
        return full.detach()
    if full.dim() == 0:
        return torch.zeros((), dtype=full.dtype, device=full.device)
    return full.new_empty((0, *full.shape[1:]))


_REPLACED_BY = "_moo_replaced_by"


def _current(p: torch.Tensor) -> torch.Tensor:
    """``p``, or the owner-layout DTensor ``fully_shard`` registered in its place elsewhere."""
    ref = p.__dict__.get(_REPLACED_BY)
    new = ref() if ref is not None else None
    return new if new is not None else p


def as_owner_dtensors(module: nn.Module, mesh: Any) -> None:
    """Register every parameter of ``module`` not yet an owner-layout DTensor as one, replicated
    (each rank holds the whole tensor until the plan is fixed; then the same objects become this
    rank's pieces in place). A tied parameter stays one object at every place it is registered."""
    new: dict[int, nn.Parameter] = {}
    for _, mod in module.named_modules(remove_duplicate=False):
        for name, p in list(mod._parameters.items()):
            if p is None or isinstance(p, OwnerDTensor):
                continue
            replaced = _current(p)
            if replaced is not p:  # tied to a parameter an earlier call registered: the same object
                mod._parameters[name] = replaced  # type: ignore[assignment]
                continue
            if id(p) not in new:
                new[id(p)] = nn.Parameter(OwnerDTensor.replicated(p.detach(), mesh), requires_grad=p.requires_grad)
                # the old object may stay registered outside ``module`` (a parameter tied across
                # two fully_shard calls): the plan finds its replacement through it and refuses it
                p.__dict__[_REPLACED_BY] = weakref.ref(new[id(p)])
            mod._parameters[name] = new[id(p)]


def _shard(modules: list[nn.Module], preconditioner: Any = None) -> None:
    """Plan ``modules`` (units in call order) as one model and shard every unit."""
    states = [_require_state(m) for m in modules]
    group, replicate_group = states[0].group, states[0].replicate_group
    W, rank = dist.get_world_size(group), dist.get_rank(group)
    root, is_container = _planning_root(modules)
    names = {id(m): n for n, m in root.named_modules()}
    prefixes = [names[id(m)] for m in modules]
    if not is_container:
        record_unit_prefixes(root, prefixes)  # so plan_model(root, W) agrees
    # one unit per fully_shard call: the modules of one call (FSDP2's list form) share it
    first_of_call: dict[int, int] = {}
    unit_index = [first_of_call.setdefault(st.call_index, len(first_of_call)) for st in states]
    members: list[list[int]] = [[] for _ in first_of_call]
    for i, u in enumerate(unit_index):
        members[u].append(i)
    specs = [
        dataclasses.replace(sp, unit=unit_index[sp.unit])
        if sp.unit < len(modules)
        else dataclasses.replace(sp, unit=len(members))
        for sp in specs_from_module(root, unit_prefixes=prefixes)
    ]
    fqn_of = {id(p): n for n, p in root.named_parameters()}
    unit_of_module = {k: unit_index[v] for k, v in _unit_of_modules(modules).items()}
    locations = _locations(root, unit_of_module, [modules[m[0]] for m in members], fqn_of)
    states = [states[m[0]] for m in members]
    given = next((s.plan for s in reversed(states) if s.plan is not None), None)
    if given is not None:
        _validate_plan(given, specs, W)
        plan = given
    else:
        named = next((s.preconditioner for s in reversed(states) if s.preconditioner is not None), None)
        plan = plan_tensors(specs, W, preconditioner=named if named is not None else preconditioner)
    _check_unit_dtypes(specs, states)  # every rank alike, before anything changes
    check_plan_agreement(  # the first collective, before any data moves
        plan,
        group,
        who="fully_shard",
        what="sharding plan",
        remedy="Every rank must build the plan from the same model, roles and world size "
        "(pass the same plan= / roles on all ranks).",
    )
    shards = _normalize(plan, specs)
    by_fqn = dict(root.named_parameters())

    ctx = ShardingContext(group, rank, W, plan, replicate_group=replicate_group)
    handles_of: list[list[ParamHandle]] = [[] for _ in members]
    for s in specs:
        if s.unit >= len(members):  # the container's own (empty) root unit
            raise RuntimeError(f"parameter {s.fqn!r} is in no fully_shard unit")
        shard = shards[s.fqn]
        param = by_fqn[s.fqn]
        if not isinstance(param, nn.Parameter):
            raise TypeError(f"fully_shard: {s.fqn!r} is a {type(param).__name__}, not an nn.Parameter")
        if not isinstance(param, OwnerDTensor):
            raise TypeError(
                f"fully_shard: {s.fqn!r} was registered after fully_shard was called on its module; "
                "register every parameter before calling fully_shard"
            )
        with torch.no_grad():
            param.grad = None
            piece = _local_piece(local_tensor(param), shard, rank)
            param.relayout(piece, placement_of(shard))
        attach_matrix_shard(param, shard, rank, group)
        handles_of[s.unit].append(ParamHandle(shard, locations[id(param)], param, rank, param.dtype))

    units: list[ShardedUnit] = []
    root_index = -1 if is_container else unit_index[len(modules) - 1]
    for u, (ms, st) in enumerate(zip(members, states, strict=True)):
        units.append(
            ShardedUnit(
                ctx,
                u,
                modules[ms[0]],
                handles_of[u],
                reshard_after_forward=st.reshard_after_forward,
                mp_policy=st.mp_policy,
                is_root=(u == root_index),
                members=[modules[i] for i in ms],
            )
        )
    for u, (unit, ms) in enumerate(zip(units, members, strict=True)):
        parents = {unit_index[p] for p in (_parent_unit(i, modules) for i in ms) if p is not None} - {u}
        parent = min(parents, key=lambda q: len(list(units[q].module.modules()))) if parents else None
        unit.parent = units[parent] if parent is not None else None
        for i in ms:
            _require_state(modules[i]).unit = unit
    ctx.units.extend(units)


def _check_unit_dtypes(specs: list[TensorSpec], states: list[OwnerShardState]) -> None:
    """One compute dtype per unit (one all-gather buffer): refuse a mix before any data moves."""
    by_unit: dict[int, dict[str, torch.dtype]] = {}
    for s in specs:
        if s.unit >= len(states):
            continue
        param_dtype = getattr(states[s.unit].mp_policy, "param_dtype", None)
        compute = param_dtype if (param_dtype is not None and s.dtype.is_floating_point) else s.dtype
        by_unit.setdefault(s.unit, {})[s.fqn] = compute
    for unit, dtypes in by_unit.items():
        if len(set(dtypes.values())) > 1:
            names = ", ".join(f"{fqn}: {dt}" for fqn, dt in dtypes.items())
            raise NotImplementedError(
                f"fully_shard unit {unit} mixes parameter dtypes ({names}); give the unit one "
                "dtype or set MixedPrecisionPolicy(param_dtype=...) so all compute in one dtype"
            )


def _parent_unit(i: int, modules: list[nn.Module]) -> int | None:
    """Index of the nearest unit module enclosing ``modules[i]`` (None: outermost)."""
    best: int | None = None
    best_size = None
    target = modules[i]
    for j, m in enumerate(modules):
        if j == i:
            continue
        subtree = list(m.modules())
        if any(s is target for s in subtree) and (best_size is None or len(subtree) < best_size):
            best, best_size = j, len(subtree)
    return best

"""``fully_shard``: owner-shaped ZeRO-3 with FSDP2's call pattern (blocks first, then the root).

Planning balances the whole model, so sharding waits until the model is known:

* A call on a module that contains earlier, still pending units is the **root call**: it
  plans the whole module (units in call order, the root last) and shards every unit now.
* A call on a module with no parent module and no pending units inside (``fully_shard(model)``
  alone) is a root call too.
* Any other call (a block) is **pending**. If the root is never called, pending units are
  planned together and sharded at the first forward of any of them.

Construct the optimizer after the root call: only then does ``model.parameters()`` return the
sharded parameters. A sharded module's class is swapped to a dynamic subclass that mixes in
:class:`OwnerShardedModule` (``unshard``, ``reshard``, ``set_requires_gradient_sync``), as FSDP2
does with ``FSDPModule``.
"""

from __future__ import annotations

import dataclasses
import gc
import weakref
from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist
from torch import nn

from ..planning.metadata import MatrixShard, Role, ShardingPlan, attach_matrix_shard, mark_awaiting_shard
from ..planning.planner import plan_tensors
from ..planning.roles import specs_from_module
from .agreement import check_plan_agreement
from .unit import ParamHandle, ShardedUnit, ShardingContext

__all__ = ["fully_shard", "OwnerShardedModule"]

_UNIT_ATTR = "_moo_unit"
_PENDING_ATTR = "_moo_pending"
GROUP_ATTR = "_moo_process_group"


@dataclass(eq=False)
class _Pending:
    module_ref: "weakref.ref[nn.Module]"  # a model the user dropped must not stay pending
    group: Any
    replicate_group: Any
    reshard_after_forward: bool
    mp_policy: Any
    plan: ShardingPlan | None

    @property
    def module(self) -> nn.Module | None:
        return self.module_ref()


_pending: list[_Pending] = []


def _live_pending() -> list[_Pending]:
    _pending[:] = [p for p in _pending if p.module is not None]
    return list(_pending)


class OwnerShardedModule(nn.Module):
    """Methods every module passed to :func:`fully_shard` gains (FSDP2's ``FSDPModule`` analogue)."""

    def _moo_units(self) -> list[ShardedUnit]:
        _ensure_sharded(self)
        unit = getattr(self, _UNIT_ATTR)
        inside = {id(m) for m in self.modules()}
        return [u for u in unit.ctx.units if id(u.module) in inside]

    def unshard(self, async_op: bool = False) -> "_DoneHandle | None":
        """All-gather this module's unit and every unit nested in it; until :meth:`reshard`,
        ``named_parameters()`` yields the full tensors on every rank."""
        for unit in self._moo_units():
            unit.user_unshard()
        return _DoneHandle() if async_op else None

    def reshard(self) -> None:
        """Back to the owner layout: owners keep their tensors, others hold empty tensors."""
        for unit in self._moo_units():
            unit.user_reshard()

    def set_requires_gradient_sync(self, requires_gradient_sync: bool, *, recurse: bool = True) -> None:
        """``False``: keep accumulating unsharded gradients locally (no reduce-scatter) until a
        backward with sync enabled, which reduces the accumulated sum once (DDP ``no_sync``)."""
        units = self._moo_units() if recurse else [getattr(self, _UNIT_ATTR)]
        for unit in units:
            unit.requires_gradient_sync = bool(requires_gradient_sync)

    def set_reshard_after_forward(self, reshard_after_forward: bool, *, recurse: bool = True) -> None:
        units = self._moo_units() if recurse else [getattr(self, _UNIT_ATTR)]
        for unit in units:
            unit.reshard_after_forward = bool(reshard_after_forward)

    def set_modules_to_forward_prefetch(self, modules: "list[OwnerShardedModule]") -> None:
        """After this module's all-gather in forward, issue those of ``modules`` (async), as
        FSDP2's method of the same name; replaces the automatic next-unit prefetch here."""
        getattr(self, _UNIT_ATTR).forward_prefetch = self._units_of(modules)

    def set_modules_to_backward_prefetch(self, modules: "list[OwnerShardedModule]") -> None:
        """After this module's re-gather in backward, issue those of ``modules`` (async)."""
        getattr(self, _UNIT_ATTR).backward_prefetch = self._units_of(modules)

    def set_auto_prefetch(self, enabled: bool) -> None:
        """Turn the automatic next-unit prefetch (on by default) on or off for the whole model."""
        _ensure_sharded(self)
        getattr(self, _UNIT_ATTR).ctx.auto_prefetch = bool(enabled)

    def _units_of(self, modules: "list[OwnerShardedModule]") -> list[ShardedUnit]:
        _ensure_sharded(self)
        ctx = getattr(self, _UNIT_ATTR).ctx
        units = []
        for m in modules:
            unit = getattr(m, _UNIT_ATTR, None)
            if unit is None or unit.ctx is not ctx:
                raise ValueError(f"{type(m).__name__} is not a fully_shard unit of this model")
            units.append(unit)
        return units

    @property
    def sharding_plan(self) -> ShardingPlan:
        _ensure_sharded(self)
        return getattr(self, _UNIT_ATTR).ctx.plan


class _DoneHandle:
    def wait(self) -> None:
        return None


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


def _has_parent_module(module: nn.Module) -> bool:
    """Whether some nn.Module holds ``module`` as a child (found through the gc referrers)."""
    for ref in gc.get_referrers(module):
        if isinstance(ref, dict):
            for holder in gc.get_referrers(ref):
                if isinstance(holder, nn.Module) and holder.__dict__.get("_modules") is ref:
                    return True
                if isinstance(holder, dict) and holder.get("_modules") is ref:
                    return True
    return False


def fully_shard(
    module: nn.Module,
    *,
    mesh: Any = None,
    reshard_after_forward: bool = True,
    mp_policy: Any = None,
    plan: ShardingPlan | None = None,
) -> nn.Module:
    """Owner-shaped sharding of ``module``'s parameters not already in a child unit.

    Args:
        module: a block (call these first) or the root model (call last).
        mesh: ``None`` (default process group), a 1D ``DeviceMesh``, a ``ProcessGroup``, or a
            2D ``DeviceMesh`` of shape (replicate, shard) for HSDP: owner-shaped inside the
            shard dim, gradients all-reduced across the replicate dim and averaged over both.
        reshard_after_forward: free non-owned tensors after forward and gather them again
            before backward (the root unit keeps its tensors, as in FSDP2).
        mp_policy: ``torch.distributed.fsdp.MixedPrecisionPolicy``: ``param_dtype`` (compute
            and all-gather dtype), ``reduce_dtype`` (gradient reduction dtype),
            ``output_dtype``, ``cast_forward_inputs``. Sharded parameters stay in their dtype.
        plan: a :class:`ShardingPlan` to apply instead of planning (must cover exactly the
            model's parameters, for the mesh size; only owners and roles are taken from it,
            units and segments follow the ``fully_shard`` calls).

    Returns ``module``; build the optimizer after the root call.
    """
    if not isinstance(module, nn.Module):
        raise TypeError(f"fully_shard expects an nn.Module, got {type(module).__name__}")
    if getattr(module, _UNIT_ATTR, None) is not None or getattr(module, _PENDING_ATTR, False):
        raise ValueError(f"fully_shard was already called on this {type(module).__name__}")
    group, replicate_group = _resolve_group(mesh)
    if plan is not None:
        _check_plan_world_size(plan, dist.get_world_size(group))
    for sub in module.modules():
        if getattr(sub, _UNIT_ATTR, None) is not None:
            raise ValueError(
                f"fully_shard({type(module).__name__}): a submodule ({type(sub).__name__}) is already "
                "sharded as part of another model; call fully_shard on the blocks first, then once "
                "on the root"
            )
    _swap_class(module)
    entry = _Pending(weakref.ref(module), group, replicate_group, reshard_after_forward, mp_policy, plan)
    setattr(module, _PENDING_ATTR, True)
    for param in module.parameters():
        mark_awaiting_shard(param)
    module.register_forward_pre_hook(_pre_forward_hook, with_kwargs=True)
    module.register_forward_hook(_post_forward_hook, with_kwargs=True)

    inside = {id(m) for m in module.modules()}
    live = _live_pending()
    inner = [p for p in live if id(p.module) in inside]
    # A block of the same class as one already pending is another block (FSDP2's blocks-first
    # order): no need for the referrer scan, which costs a pass over the heap per call.
    sibling = any(type(p.module) is type(module) for p in live)
    _pending.append(entry)
    if inner or (not sibling and not _has_parent_module(module)):
        _shard_or_forget(module, inner + [entry], is_container=False)
    return module


def _shard_or_forget(root: nn.Module, entries: list[_Pending], *, is_container: bool) -> None:
    try:
        _shard(root, entries, is_container=is_container)
    finally:
        # sharded or failed (plan mismatch, bad plan): these calls are no longer pending
        _pending[:] = [p for p in _pending if all(p is not e for e in entries)]
        for e in entries:
            setattr(e.module, _PENDING_ATTR, False)


def _check_plan_world_size(plan: ShardingPlan, world_size: int) -> None:
    if not isinstance(plan, ShardingPlan):
        raise TypeError(f"plan must be a ShardingPlan, got {type(plan).__name__}")
    if plan.world_size != world_size:
        raise ValueError(
            f"fully_shard: the plan was made for world size {plan.world_size} but the mesh has "
            f"{world_size} ranks; build it with plan_model(model, {world_size}, ...)"
        )


# -- hooks dispatching to the unit (registered at call time, so lazy sharding can happen) --------
def _pre_forward_hook(module: nn.Module, args: tuple, kwargs: dict) -> tuple[tuple, dict]:
    _ensure_sharded(module)
    return getattr(module, _UNIT_ATTR).pre_forward(args, kwargs)


def _post_forward_hook(module: nn.Module, args: tuple, kwargs: dict, output: Any) -> Any:
    return getattr(module, _UNIT_ATTR).post_forward(output)


def _ensure_sharded(module: nn.Module) -> None:
    """Shard pending units lazily (the root was never passed to ``fully_shard``)."""
    if getattr(module, _UNIT_ATTR, None) is not None:
        return
    if not getattr(module, _PENDING_ATTR, False):
        raise RuntimeError(
            "this module was passed to fully_shard but is not sharded (its sharding failed); "
            "build the model again and call fully_shard on it"
        )
    live = _live_pending()
    group = next(p.group for p in live if p.module is module)
    entries = [p for p in live if p.group is group]
    ids = {id(p.module) for p in entries}
    # outermost pending modules become children of a container that stands in for the root
    nested: set[int] = set()
    for p in entries:
        for sub in p.module.modules():
            if sub is not p.module and id(sub) in ids:
                nested.add(id(sub))
    container = nn.ModuleDict({f"unit{i}": p.module for i, p in enumerate(entries) if id(p.module) not in nested})
    _shard_or_forget(container, entries, is_container=True)


def _locations(root: nn.Module) -> dict[int, list[tuple[nn.Module, str]]]:
    found: dict[int, list[tuple[nn.Module, str]]] = {}
    seen: set[tuple[int, str]] = set()
    for _, mod in root.named_modules(remove_duplicate=False):
        for name, p in mod._parameters.items():
            if p is None or (id(mod), name) in seen:
                continue
            seen.add((id(mod), name))
            found.setdefault(id(p), []).append((mod, name))
    return found


def _validate_plan(plan: ShardingPlan, specs: list, world_size: int) -> None:
    _check_plan_world_size(plan, world_size)
    model_names = {n for s in specs for n in (s.fqn, *s.aliases)}
    plan_names = {n for s in plan for n in (s.fqn, *s.aliases)}
    missing = [n for s in specs for n in (s.fqn,) if n not in plan]
    if missing:
        raise ValueError(f"fully_shard: the plan does not cover parameter {missing[0]!r} of the model; "
                         "build the plan from this model with plan_model")
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
        if shard.role is not Role.SHARDED and (shard.owner is None or not 0 <= shard.owner < world_size):
            raise ValueError(f"fully_shard: parameter {s.fqn!r} has no valid owner in the plan ({shard.owner!r})")


def _normalize(plan: ShardingPlan, specs: list) -> dict[str, MatrixShard]:
    """The plan's owners and roles with units and segment offsets of these fully_shard calls."""
    cursor: dict[tuple[int, int], int] = {}
    out: dict[str, MatrixShard] = {}
    for s in specs:
        shard = plan[s.fqn]
        if shard.role is Role.SHARDED:
            offset = length = 0
        else:
            length = shard.numel
            offset = cursor.get((s.unit, shard.owner), 0)
            cursor[(s.unit, shard.owner)] = offset + length
        out[s.fqn] = dataclasses.replace(
            shard, fqn=s.fqn, unit=s.unit, segment_offset=offset, segment_length=length,
            aliases=tuple(s.aliases), requires_grad=s.requires_grad,
        )
    return out


def _shard(root: nn.Module, entries: list[_Pending], *, is_container: bool) -> None:
    """Plan ``root`` with ``entries`` as units (call order) and shard every unit."""
    group = entries[-1].group
    replicate_group = entries[-1].replicate_group
    for p in entries:
        if p.group is not group or p.replicate_group is not replicate_group:
            raise ValueError("fully_shard: every unit of one model must use the same mesh / process group")
    W, rank = dist.get_world_size(group), dist.get_rank(group)
    names = {id(m): n for n, m in root.named_modules()}
    prefixes = [names[id(p.module)] for p in entries]
    if not is_container:
        root._moo_unit_prefixes = list(prefixes)  # so planning.plan_model(root, W) agrees
    specs = specs_from_module(root, unit_prefixes=prefixes)
    given = next((p.plan for p in reversed(entries) if p.plan is not None), None)
    if given is not None:
        _validate_plan(given, specs, W)
        plan = given
    else:
        plan = plan_tensors(specs, W)
    check_plan_agreement(plan, rank, group)  # the first collective, before any data moves
    shards = _normalize(plan, specs)
    locations = _locations(root)
    by_fqn = dict(root.named_parameters())

    ctx = ShardingContext(group, rank, W, plan, replicate_group=replicate_group)
    root_unit = len(prefixes) - 1 if not is_container else -1
    handles_of: list[list[ParamHandle]] = [[] for _ in entries]
    for s in specs:
        if s.unit >= len(entries):  # the container's own (empty) root unit
            raise RuntimeError(f"parameter {s.fqn!r} is in no fully_shard unit")
        entry = entries[s.unit]
        shard = shards[s.fqn]
        full = by_fqn[s.fqn]
        with torch.no_grad():
            if shard.role is Role.SHARDED:
                start, stop = shard.row_range(rank)
                data = full.detach()[start:stop].clone()
            elif shard.is_owned_by(rank):
                data = full.detach()
            else:
                data = torch.empty(0, dtype=full.dtype, device=full.device)
        sharded = nn.Parameter(data, requires_grad=full.requires_grad)
        attach_matrix_shard(sharded, shard, rank)
        setattr(sharded, GROUP_ATTR, group)
        mp = entry.mp_policy
        param_dtype = getattr(mp, "param_dtype", None) if mp is not None else None
        compute = param_dtype if (param_dtype is not None and full.is_floating_point()) else full.dtype
        handle = ParamHandle(shard, locations[id(full)], sharded, rank, compute)
        handle.swap(sharded)
        handles_of[s.unit].append(handle)

    for i, entry in enumerate(entries):
        unit = ShardedUnit(
            ctx, i, entry.module, handles_of[i], reshard_after_forward=entry.reshard_after_forward,
            mp_policy=entry.mp_policy, is_root=(i == root_unit),
        )
        ctx.units.append(unit)
        setattr(entry.module, _UNIT_ATTR, unit)

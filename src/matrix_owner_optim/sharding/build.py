"""Fixing a tree's plan (``ShardTree.fix``, once): plan or validate, agree (the plan digest's
all-gather is the first collective), re-point the parameters, build the units and their
:class:`~.context.ShardingContext`.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence
from typing import Any, Protocol

import torch
import torch.distributed as dist
from torch import nn

from ..agreement import check_sharding_agreement
from ..lazy_plan import unlink_lazy_plan
from ..owner_dtensor import OwnerDTensor
from ..pieces import placement_of
from ..planning.cost import CostModel
from ..planning.metadata import MatrixShard, Role, ShardingPlan, attach_matrix_shard, record_unit_prefixes
from ..planning.planner import plan_tensors
from ..planning.replicas import assign_step_replicas
from ..planning.roles import TensorSpec, specs_from_module
from ..replica_sync import ReplicaSync
from ..tensors import TreeLink, local_tensor
from .context import ShardingContext, TreeSettings
from .handle import ParamHandle
from .ignored import is_ignored
from .nested import foreign_modules, foreign_parameters
from .replicated import current_parameter
from .unit import ShardedUnit
from .unit_options import ShardGroups, UnitOptions, compute_dtype, one_compute_dtype

__all__ = ["PlannedCall", "build_context", "check_plan_world_size"]


class PlannedCall(Protocol):
    """What fixing a plan reads of one ``fully_shard`` call (``state.OwnerShardState`` is one)."""

    modules: list[nn.Module]
    group: Any
    replicate_group: Any
    mp_policy: Any
    options: UnitOptions


def check_plan_world_size(plan: ShardingPlan, world_size: int) -> None:
    if not isinstance(plan, ShardingPlan):
        raise TypeError(f"plan must be a ShardingPlan, got {type(plan).__name__}")
    if plan.world_size != world_size:
        raise ValueError(
            f"fully_shard: the plan was made for world size {plan.world_size} but the mesh has "
            f"{world_size} ranks; build it with plan_model(model, {world_size}, ...)"
        )


def build_context(
    states: Sequence[PlannedCall], *, plan: ShardingPlan | None, cost: CostModel, settings: TreeSettings
) -> ShardingContext:
    """Plan the tree of ``states`` (or apply ``plan``), shard every parameter in place and build
    the units (``units[i]`` is call ``i``'s)."""
    group, replicate_group = states[0].group, states[0].replicate_group
    W, rank = dist.get_world_size(group), dist.get_rank(group)
    modules = [m for st in states for m in st.modules]
    unit_index = [u for u, st in enumerate(states) for _ in st.modules]
    root, is_container = _planning_root(modules)
    names = {id(m): n for n, m in root.named_modules()}
    prefixes = [names[id(m)] for m in modules]
    if not is_container:
        record_unit_prefixes(root, prefixes)  # so plan_model(root, W) agrees
    by_name = dict(root.named_parameters())
    # a nested tree's parameters (expert parallel's experts, nested.py) are its own to plan
    nested_modules = foreign_modules(modules, states)
    nested_params = foreign_parameters(modules, states)
    specs = [
        dataclasses.replace(sp, unit=unit_index[sp.unit])
        if sp.unit < len(modules)
        else dataclasses.replace(sp, unit=len(states))
        for sp in specs_from_module(root, unit_prefixes=prefixes)
        # fully_shard(ignored_params=...) and a nested tree's parameters: left as they are
        if not is_ignored(by_name[sp.fqn]) and id(by_name[sp.fqn]) not in nested_params
    ]
    rows_as_tail = {sp.fqn for sp in specs if _tp_rows_as_tail(sp, by_name[sp.fqn]) is not sp}
    specs = [_whole_slices(_tp_rows_as_tail(sp, by_name[sp.fqn]), by_name[sp.fqn]) for sp in specs]
    fqn_of = {id(p): n for n, p in root.named_parameters()}
    unit_of_module = {k: unit_index[v] for k, v in _unit_of_modules(modules).items()}
    locations = _locations(root, unit_of_module, [st.modules[0] for st in states], fqn_of, nested_modules)
    replicate_size = 1 if replicate_group is None else dist.get_world_size(replicate_group)
    replica_rank = 0 if replicate_group is None else dist.get_rank(replicate_group)
    replicas = None if replicate_group is None else ReplicaSync(replica_rank, replicate_size, replicate_group)
    link = TreeLink.to(settings)  # every parameter's link to its tree (tree.py), shared
    given = plan
    if plan is not None:
        _validate_plan(plan, specs, W, replicate_size)
    else:
        plan = plan_tensors(specs, W, cost=cost)
    if given is None and replicate_size > 1:  # HSDP: one global owner per matrix (planning/replicas.py)
        plan = assign_step_replicas(plan, specs, replicate_size, cost=cost)
    # (a plan given without step replicas keeps every replica stepping what it holds)
    _check_unit_dtypes(specs, states)  # every rank alike, before anything changes
    check_sharding_agreement(  # the first collective (mesh, optimizer, plan), before any data moves
        plan,
        group,
        replicate_group,
        remedy="Every rank must build the plan from the same model, roles and world size "
        "(pass the same plan= / roles on all ranks).",
    )
    shards = _normalize(plan, specs, rows_as_tail)
    by_fqn = dict(root.named_parameters())

    handles_of: list[list[ParamHandle]] = [[] for _ in states]
    for s in specs:
        if s.unit >= len(states):  # the container's own (empty) root unit
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
        tp_slice = _check_tensor_parallel(param, shard, replicate_size)
        with torch.no_grad():
            param.grad = None
            full = local_tensor(param)  # the whole tensor, or its TP slice (a 2D (dp, tp) mesh)
            piece = _resident_piece(full, shard, rank)
            if tp_slice is None:
                param.relayout(piece, placement_of(shard))
            else:  # the TP slice whole on its dp owner; TP's placement stays on tp
                param.relayout(piece, (placement_of(shard), tp_slice))
        attach_matrix_shard(param, shard, rank)
        param._tree = link
        unlink_lazy_plan(param)
        # a TP slice moves over dp as a tensor of the slice's shape; the plan keeps the global one
        unit_shard = shard if tp_slice is None else dataclasses.replace(shard, shape=tuple(full.shape))
        handles_of[s.unit].append(
            ParamHandle(unit_shard, locations[id(param)], param, rank, param.dtype, tp=tp_slice is not None)
        )

    groups = ShardGroups(group, rank, W, replicate_group, replicate_size, replica_rank, replicas)
    root_index = -1 if is_container else len(states) - 1
    units = [
        ShardedUnit(
            groups,
            u,
            st.modules,
            handles_of[u],
            options=st.options,
            mp_policy=st.mp_policy,
            is_root=(u == root_index),
        )
        for u, st in enumerate(states)
    ]
    enclosing = _parent_units(modules)
    unit_size = [len(list(unit.module.modules())) for unit in units]
    for u, unit in enumerate(units):
        ms = [i for i, v in enumerate(unit_index) if v == u]
        parents = {unit_index[p] for p in (enclosing[i] for i in ms) if p is not None} - {u}
        parent = min(parents, key=lambda q: unit_size[q]) if parents else None
        unit.parent = units[parent] if parent is not None else None
    ctx = ShardingContext(groups, plan, units, settings, nested_modules=nested_modules)
    for st in states:
        _check_prefetch_targets(st, ctx)
    return ctx


def _check_prefetch_targets(state: PlannedCall, ctx: ShardingContext) -> None:
    """Prefetch targets set before the plan must be units of this tree."""
    for what, targets in (("forward", state.options.forward_prefetch), ("backward", state.options.backward_prefetch)):
        for m in targets or []:
            if ctx.unit_of(m) is None:
                raise ValueError(
                    f"set_modules_to_{what}_prefetch: {type(m).__name__} is not a fully_shard unit of this model"
                )


def _planning_root(modules: list[nn.Module]) -> tuple[nn.Module, bool]:
    """The module the plan's fqns are relative to (a container over several outermost ones)."""
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
    root: nn.Module,
    unit_of_module: dict[int, int],
    modules: list[nn.Module],
    fqn_of: dict[int, str],
    nested_modules: set[int],
) -> dict[int, list[tuple[nn.Module, str]]]:
    """Parameter id -> every (module, name) it is registered under; refuses one in two units."""
    found: dict[int, list[tuple[nn.Module, str]]] = {}
    unit_seen: dict[int, int] = {}
    seen: set[tuple[int, str]] = set()
    for _, mod in root.named_modules(remove_duplicate=False):
        if id(mod) in nested_modules:
            continue
        for name, p in mod._parameters.items():
            if p is None or (id(mod), name) in seen:
                continue
            seen.add((id(mod), name))
            p = current_parameter(p)
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


def _validate_plan(plan: ShardingPlan, specs: list[TensorSpec], world_size: int, replicate_size: int) -> None:
    check_plan_world_size(plan, world_size)
    if plan.replicate_size not in (1, replicate_size):
        raise ValueError(
            f"fully_shard: the plan spreads the matrices' steps over {plan.replicate_size} replicas but "
            f"the mesh has {replicate_size}; build it for this mesh (plan_mesh, or plan_model without replicas)"
        )
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


def _normalize(plan: ShardingPlan, specs: list[TensorSpec], rows_as_tail: set[str]) -> dict[str, MatrixShard]:
    """The plan's owners and roles with these calls' units, names and flags."""
    return {
        s.fqn: dataclasses.replace(
            plan[s.fqn],
            fqn=s.fqn,
            unit=s.unit,
            aliases=tuple(s.aliases),
            requires_grad=s.requires_grad,
            group_role=Role.ROWS if s.fqn in rows_as_tail else None,
        )
        for s in specs
    }


def _tp_rows_as_tail(spec: TensorSpec, param: torch.Tensor) -> TensorSpec:
    """A tensor-parallel ``rows`` tensor is planned as ``tail`` (row blocks of a TP slice would
    split dim 0 twice); it is still grouped as ``rows``."""
    if spec.role is Role.ROWS and isinstance(param, OwnerDTensor) and param.device_mesh.ndim == 2:
        return dataclasses.replace(spec, role=Role.TAIL)
    return spec


def _whole_slices(spec: TensorSpec, param: torch.Tensor) -> TensorSpec:
    """A parameter on a 2D mesh is planned whole: its TP or EP slice held whole by one dp owner."""
    if isinstance(param, OwnerDTensor) and param.device_mesh.ndim == 2:
        return dataclasses.replace(spec, whole=True)
    return spec


def _check_tensor_parallel(param: OwnerDTensor, shard: MatrixShard, replicate_size: int) -> Any:
    """The TP placement of a parameter on a 2D mesh (else None); refuses what is not built."""
    if param.device_mesh.ndim != 2:
        return None
    what = f"fully_shard: tensor-parallel parameter {shard.fqn!r} ({tuple(param.placements)})"
    if replicate_size > 1:
        raise NotImplementedError(f"{what}: HSDP x tensor parallel is not supported; shard over the dp mesh alone")
    if shard.holds_rows:
        raise NotImplementedError(
            f"{what} has the 'rows' role in the given plan (split by rows over dp); on a (dp, tp) mesh the "
            "owner layout holds TP slices whole: plan it as 'tail' (fully_shard plans it so without plan=)"
        )
    return param.placements[1]


def _resident_piece(full: torch.Tensor, shard: MatrixShard, rank: int) -> torch.Tensor:
    """This rank's data of a parameter: whole on its owner, its row block, or an empty piece."""
    if shard.holds_rows:
        start, stop = shard.row_range(rank)
        return full.detach()[start:stop].clone()
    if shard.is_owned_by(rank):
        return full.detach()
    if full.dim() == 0:
        return torch.zeros((), dtype=full.dtype, device=full.device)
    return full.new_empty((0, *full.shape[1:]))


def _check_unit_dtypes(specs: list[TensorSpec], states: Sequence[PlannedCall]) -> None:
    """One compute dtype per unit (one all-gather buffer): refuse a mix before any data moves."""
    by_unit: dict[int, dict[str, torch.dtype]] = {}
    for s in specs:
        if s.unit < len(states):
            by_unit.setdefault(s.unit, {})[s.fqn] = compute_dtype(states[s.unit].mp_policy, s.dtype)
    for unit, dtypes in by_unit.items():
        one_compute_dtype(unit, dtypes)


def _parent_units(modules: list[nn.Module]) -> list[int | None]:
    """Per unit module, the index of the nearest unit module enclosing it (None: outermost)."""
    subtrees = [{id(s) for s in m.modules()} for m in modules]
    found: list[int | None] = []
    for i, target in enumerate(modules):
        best: int | None = None
        for j, subtree in enumerate(subtrees):
            if j != i and id(target) in subtree and (best is None or len(subtree) < len(subtrees[best])):
                best = j
        found.append(best)
    return found

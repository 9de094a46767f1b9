"""``fully_shard``: owner-shaped ZeRO-3 with FSDP2's call pattern and lazy initialisation.

A call records one state for its module (or list of modules: one unit), converts the parameters
to replicated owner-layout DTensors, adopts the calls made before inside it and installs the
hooks; no data moves until the tree's plan is fixed (DESIGN.md, "Lazy sharding").
"""

from __future__ import annotations

import itertools
from typing import Any

import torch
import torch.distributed as dist
from torch import nn

from .. import comm
from ..owner_dtensor import mesh_of_group
from ..planning.catalog import CostSpec, resolve_cost
from ..planning.metadata import ShardingPlan
from .adopt import adoption_hook, replica_sync_hook
from .build import check_plan_world_size
from .fsdp_api import check_reshard_after_forward_type, check_unsupported_arguments, resolve_reshard_after_forward
from .ignored import is_ignored, mark_ignored
from .module import swap_class
from .nested import nested_trees, why_not_nested
from .replicated import as_owner_dtensors, check_plain_parameters
from .state import OwnerShardState, PlanPhase, ShardTree, state_of, trees_inside

__all__ = ["fully_shard", "mesh_device", "move_states_to_device"]


def fully_shard(
    module: nn.Module | list[nn.Module],
    *,
    mesh: Any = None,
    reshard_after_forward: bool | int | None = True,
    shard_placement_fn: Any = None,
    mp_policy: Any = None,
    offload_policy: Any = None,
    ignored_params: set[nn.Parameter] | None = None,
    dp_mesh_dims: Any = None,
    plan: ShardingPlan | None = None,
    preconditioner: CostSpec | None = None,
) -> Any:
    """Owner-shaped sharding of ``module``'s parameters not already in a child unit.

    Args:
        module: a block (call these first) or the root model (call last); or a list of modules
            that form one unit together (FSDP2's list form).
        mesh: ``None`` (default process group), a 1D ``DeviceMesh``, a ``ProcessGroup``, or a
            2D ``DeviceMesh`` of shape (replicate, shard) for HSDP (DESIGN.md, "HSDP: one global
            owner per matrix").
        reshard_after_forward: free non-owned tensors after forward, as in FSDP2 (``None`` is
            True; an int N: True for N == shard size, else False).
        shard_placement_fn: FSDP2's per-parameter ``Shard(dim)``; only None (the plan places).
        mp_policy: ``torch.distributed.fsdp.MixedPrecisionPolicy``; sharded parameters keep
            their dtype.
        offload_policy: only ``OffloadPolicy()`` (no offload); ``CPUOffloadPolicy`` is refused.
        ignored_params: parameters left as they are (not sharded, moved or reduced), as FSDP2.
        dp_mesh_dims: only None.
        plan: a :class:`ShardingPlan` to apply instead of planning (covering exactly the model's
            parameters, for the mesh size; with step replicas, ``plan_mesh``, for HSDP).
        preconditioner: the cost model that balances the plan (a name such as ``"shampoo"``, a
            ``CostModel`` or an optimizer class: ``planning.catalog.resolve_cost``). Default:
            the optimizer that fixes the plan offers its own.

    ``plan`` and ``preconditioner`` are tree-wide: give them on one call (the root's); a call
    inside naming others is refused. Returns ``module``; nothing moves until the plan is fixed.
    """
    modules = list(module) if isinstance(module, (list, tuple)) else [module]
    if not modules:
        raise ValueError("fully_shard got an empty list of modules")
    for m in modules:
        if not isinstance(m, nn.Module):
            raise TypeError(f"fully_shard expects an nn.Module, got {type(m).__name__} (or a list of modules)")
        if state_of(m) is not None:
            raise ValueError(f"fully_shard was already called on this {type(m).__name__}")
    if len({id(m) for m in modules}) != len(modules):
        raise ValueError("fully_shard: a module appears twice in the list")
    for m in modules:
        if any(o is not m and any(s is m for s in o.modules()) for o in modules):
            raise ValueError(
                f"fully_shard: {type(m).__name__} in the list is inside another module of the "
                "list; list modules that do not contain each other"
            )
    check_unsupported_arguments(shard_placement_fn, offload_policy, dp_mesh_dims)
    check_reshard_after_forward_type(reshard_after_forward)
    _check_mp_policy(mp_policy)
    # the one resolution of the cost, at this edge: an unknown name fails before anything is recorded
    cost = resolve_cost(preconditioner) if preconditioner is not None else None
    group, replicate_group = _resolve_group(mesh)
    rsf = resolve_reshard_after_forward(reshard_after_forward, dist.get_world_size(group))
    if plan is not None:
        check_plan_world_size(plan, dist.get_world_size(group))
    inside = trees_inside(modules)
    nested = nested_trees(inside, group, replicate_group)  # expert parallel's experts: trees of their own
    for m in modules:
        _check_submodules(m, group, replicate_group, nested)
    check_plain_parameters(modules, ignored_params, mesh)
    names = {id(sub): name for m in modules for name, sub in m.named_modules()}
    tree = ShardTree.join(  # refuses a call inside naming another plan or cost, before anything changes
        [t for t in inside if not any(t is n for n in nested)],
        module=modules[0],
        plan=plan,
        cost=cost,
        name_of=lambda m: names.get(id(m), "?"),
    )
    device = mesh_device(mesh, group)
    device_mesh = mesh_of_group(group, device.type)
    mark_ignored(modules, ignored_params)  # the last check: nothing is recorded if it refuses
    for m in modules:
        move_states_to_device(m, device)
        as_owner_dtensors(m, device_mesh, mesh)
        swap_class(m)
    state = OwnerShardState(
        modules,
        group=group,
        replicate_group=replicate_group,
        reshard_after_forward=rsf,
        mp_policy=mp_policy,
        tree=tree,
    )
    state.register()
    for m in modules:
        m.register_load_state_dict_post_hook(adoption_hook(state))  # load_state_dict(assign=True)
        # HSDP, broadcast deferred to the next forward: state dicts read and write synced pieces
        m.register_state_dict_pre_hook(replica_sync_hook(state))
        m.register_load_state_dict_pre_hook(replica_sync_hook(state))
    return module


def _check_submodules(module: nn.Module, group: Any, replicate_group: Any, nested: list[ShardTree]) -> None:
    """Refuse a submodule sharded over another mesh (but a ``nested`` tree's) or already planned."""
    for name, sub in module.named_modules():
        sub_state = state_of(sub)
        if sub_state is None or any(sub_state.tree is t for t in nested):
            continue
        if (sub_state.group, sub_state.replicate_group) != (group, replicate_group):
            why = why_not_nested(sub_state.tree, group, replicate_group)
            raise ValueError(
                f"fully_shard({type(module).__name__}): its submodule {name!r} "
                f"({type(sub).__name__}) was passed to fully_shard with another mesh "
                f"({_mesh_words(sub_state.group, sub_state.replicate_group)}) than this call "
                f"({_mesh_words(group, replicate_group)}); one model is planned over one mesh, "
                "so pass the same mesh to every fully_shard call of the model. The one exception: "
                "expert-parallel experts (DTensors on an ep mesh) sharded over the mesh beside it, "
                f"which covers this call's ranks with it (torchtitan's efsdp); here {why}"
            )
        if sub_state.tree.phase is not PlanPhase.PENDING:
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
    """Refuse anything but FSDP2's ``MixedPrecisionPolicy`` with floating-point dtypes."""
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
    """The device ``fully_shard`` keeps a unit's tensors on, as FSDP2 picks it."""
    device_type = getattr(mesh, "device_type", None)
    if device_type is None:
        return comm.object_device(group)
    if device_type == "cuda":
        return torch.device("cuda", torch.cuda.current_device())
    return torch.device(device_type)


def move_states_to_device(module: nn.Module, device: torch.device) -> None:
    """Move ``module``'s parameters and buffers to ``device`` in place, as FSDP2."""
    for t in itertools.chain(module.parameters(), module.buffers()):
        if t.device.type == "meta" or t.device == device or is_ignored(t):
            continue
        t.data = t.data.to(device)

"""``OwnerRoutedOptimizer``: each matrix to a matrix optimizer on its owner, the rest to AdamW.

A ``torch.optim.Optimizer`` whose ``param_groups`` list every parameter on every rank (split
per role: a user group becomes a ``matrix`` group and a ``tail`` group), so learning-rate
schedulers, ``add_param_group`` and ``state_dict`` work as with any torch optimizer. Under the
hood two ordinary optimizers (the *children*) update only what this rank updates: on the
owner-shaped layout that is the matrices and tail it owns plus its rows of ``sharded``
tensors, and the step moves zero bytes. Hyperparameters flow from the parent groups to the
children at every step, and values the children set themselves (Prodigy's ``d``, schedule-free
``k``) flow back to the parent groups; optimizer state is shared between the two. ``state_dict``
is keyed like any torch optimizer's and holds pieces of global tensors where the state is
partitioned, so ``get_optimizer_state_dict`` / DCP reshard it across world sizes and layouts.

Bad input fails loudly and names what to fix: an option the inner optimizer does not take, a
non-finite hyperparameter (checked at construction and before every step, so a scheduler that
produces ``lr=inf`` stops the run before any parameter changes), two parameters with the same
name (two models in one optimizer), and plain tensors mixed with owner-sharded ones (a module
added after the plan was fixed: nothing would average its gradient). With
``skip_nonfinite_grads=True`` a step whose gradients hold a NaN or an infinity anywhere is
skipped on every rank together (one scalar all-reduce) and counted in ``skipped_steps``.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Mapping
from copy import deepcopy
from typing import Any

import torch
import torch.distributed as dist
from torch.distributed.tensor import DTensor, Shard

from .. import comm
from ..comm import comm_phase
from ..owner_dtensor import OwnerDTensor, is_owner_dtensor, mesh_of_group
from ..pieces import placement_of
from ..planning.metadata import Role
from ..planning.roles import RoleOverrides, conv_params
from ..planning.views import MatrixView, ViewOverrides
from ..tensors import is_dtensor, local_tensor
from . import report
from .placements import NOT_HELD, Placement, RouterConfig, is_multi_rank, placement_for
from .registry import OptimizerFactory, resolve_optimizer
from .replicated_placement import ReplicatedPlacement
from .routing import (
    RoutedParam,
    UserGroup,
    check_matrix_views,
    declare_matrix_views,
    normalize_params,
    priced_by,
    resolve_roles,
    swapped_in,
)

__all__ = ["OwnerRoutedOptimizer", "push_group_values"]

_ROLE_OPTIMIZER = {Role.MATRIX: Role.MATRIX, Role.TAIL: Role.TAIL, Role.SHARDED: Role.TAIL}


def _probe_defaults(factory: OptimizerFactory, options: Mapping[str, Any], what: str) -> dict[str, Any]:
    """The hyperparameters ``factory`` fills into a group, found by building it on a probe."""
    probe_param = torch.nn.Parameter(torch.zeros(2, 2))
    try:
        probe = factory([probe_param], **options)
    except (TypeError, ValueError) as exc:  # an unknown keyword, or a value the optimizer refuses
        raise ValueError(
            f"{what}_options {dict(options)!r} are not accepted by {factory!r}: {exc}. Pass only "
            f"the keyword arguments that optimizer takes, with values it accepts"
        ) from exc
    if not isinstance(probe, torch.optim.Optimizer):
        raise TypeError(f"{what} factory {factory!r} returned {type(probe).__name__}, not a torch.optim.Optimizer")
    group = probe.param_groups[0]
    return {k: v for k, v in group.items() if k not in ("params", "param_names")}


def push_group_values(parent: Mapping[str, Any], child: dict[str, Any]) -> dict[str, Any]:
    """Set every hyperparameter of ``child`` (an inner optimizer's param group) that ``parent``
    (the wrapping optimizer's group, which users and lr schedulers write) also has; return the
    child's values after the push, ``params`` excluded, so that a caller can tell afterwards
    which values the inner optimizer changed itself (Prodigy's ``d``, schedule-free ``k``)."""
    for key in child:
        if key != "params" and key in parent:
            child[key] = parent[key]
    return {k: v for k, v in child.items() if k != "params"}


def _first_nonfinite(value: Any, *, allow_inf: bool) -> Any:
    """The first non-finite number in a hyperparameter value (a number, a CPU scalar tensor,
    or a tuple/list of them such as ``betas``), or None."""
    if isinstance(value, bool):
        return None
    if isinstance(value, (int, float)):
        number = float(value)
        if math.isnan(number) or (math.isinf(number) and not allow_inf):
            return value
        return None
    if isinstance(value, torch.Tensor):
        if value.numel() == 1 and value.device.type == "cpu" and value.is_floating_point():
            return _first_nonfinite(float(value), allow_inf=allow_inf)
        return None
    if isinstance(value, (tuple, list)):
        for v in value:
            bad = _first_nonfinite(v, allow_inf=allow_inf)
            if bad is not None:
                return bad
    return None


class OwnerRoutedOptimizer(torch.optim.Optimizer):
    """Route each matrix to a matrix optimizer on its owner and everything else to AdamW.

    Args:
        params: the model (roles by module type), ``model.named_parameters()`` (roles by
            name), ``model.parameters()`` (roles from the sharding plan, else by shape), or
            param-group dicts of any of those. A group may carry ``"role"`` to force a role,
            and any hyperparameter of the matrix or tail optimizer to override it.
        matrix: registered name (``"muon"``, ``"shampoo"``, ``"soap"``, ...) or optimizer class
            for the ``matrix`` role. Any per-tensor optimizer works.
        matrix_options: keyword arguments of the matrix optimizer (its defaults otherwise).
        tail: name or class for ``tail`` and ``sharded`` parameters (default AdamW).
        tail_options: keyword arguments of the tail optimizer.
        roles: ``{"fqn-glob": "matrix" | "tail" | "sharded"}``; the last matching glob wins.
            A glob that matches nothing is an error.
        matrix_views: ``{"fqn-glob": "stack" | "conv" | MatrixView(...)}``: how a matrix is read
            as the matrices its optimizer steps (:mod:`matrix_owner_optim.planning.views`;
            default: fused experts are stacks, conv kernels one ``(out, rest)`` matrix), e.g.
            ``MatrixView(row_blocks=(d, d, d))`` steps a fused ``wqkv`` as q, k and v.
        replicated: for parameters replicated on every rank of a multi-rank job (DDP),
            ``"owner"`` updates each matrix on one owner and shares the result;
            ``"redundant"`` updates every matrix on every rank and moves nothing.
        skip_nonfinite_grads: check before every step whether any gradient this rank updates
            holds a NaN or an infinity; one scalar all-reduce (max) over ``process_group`` makes
            every rank agree, and if any rank found one the step is skipped on every rank (no
            parameter, state or step count changes; gradients are left for ``zero_grad``).
            Skips are counted in ``skipped_steps``; ``last_step_skipped`` tells about the last
            call. Off by default: the check costs that all-reduce and one host sync per step.
        process_group: the ranks that step this optimizer together (default: the default
            process group); only the non-finite check communicates over it.

    The layout decides what a step moves: zero bytes for owner-shaped parameters and in one
    process; see :mod:`matrix_owner_optim.optim.placements` for the others.

    Raises ``ValueError`` for a non-finite hyperparameter (NaN anywhere; an infinity where the
    inner optimizer's own default is finite), at construction and before each step, naming the
    param group and the key; nothing is updated then.
    """

    def __init__(
        self,
        params: Any,
        *,
        matrix: str | OptimizerFactory = "muon",
        matrix_options: Mapping[str, Any] | None = None,
        tail: str | OptimizerFactory = "adamw",
        tail_options: Mapping[str, Any] | None = None,
        roles: Mapping[str, str] | None = None,
        matrix_views: Mapping[str, str | MatrixView] | None = None,
        replicated: str = "owner",
        skip_nonfinite_grads: bool = False,
        process_group: Any = None,
    ) -> None:
        if replicated not in ("owner", "redundant"):
            raise ValueError(f"replicated must be 'owner' or 'redundant', got {replicated!r}")
        if not isinstance(skip_nonfinite_grads, bool):
            raise TypeError(f"skip_nonfinite_grads must be True or False, got {skip_nonfinite_grads!r}")
        self.skip_nonfinite_grads = skip_nonfinite_grads
        self.skipped_steps = 0  # steps skipped for non-finite gradients (this process's run)
        self.last_step_skipped = False
        self._process_group = process_group
        self._factories: dict[Role, OptimizerFactory] = {
            Role.MATRIX: resolve_optimizer(matrix, what="matrix"),
            Role.TAIL: resolve_optimizer(tail, what="tail"),
        }
        self._options: dict[Role, dict[str, Any]] = {
            Role.MATRIX: dict(matrix_options or {}),
            Role.TAIL: dict(tail_options or {}),
        }
        self._role_defaults: dict[Role, dict[str, Any]] = {
            role: _probe_defaults(self._factories[role], self._options[role], role.value)
            for role in (Role.MATRIX, Role.TAIL)
        }
        # keys whose inner optimizer itself defaults to an infinity (a threshold that is off)
        self._infinite_ok = {
            k
            for role, d in self._role_defaults.items()
            for k, v in d.items()
            if isinstance(v, float) and math.isinf(v) and k not in self._options[role]
        }
        # what prices a plan this optimizer fixes: its matrix optimizer as configured (block size)
        self._pricing = priced_by(self._factories[Role.MATRIX], self._options[Role.MATRIX])
        self._names = {
            Role.MATRIX: matrix if isinstance(matrix, str) else getattr(matrix, "__name__", str(matrix)),
            Role.TAIL: tail if isinstance(tail, str) else getattr(tail, "__name__", str(tail)),
        }
        self._overrides = RoleOverrides(roles)
        self._views = ViewOverrides(matrix_views)
        self._config = RouterConfig(matrix_factory=self._factories[Role.MATRIX], replicated=replicated)
        self._children: dict[Role, torch.optim.Optimizer | None] = {Role.MATRIX: None, Role.TAIL: None}
        # per child: (index of the parent group, the child's group dict)
        self._child_groups: dict[Role, list[tuple[int, dict[str, Any]]]] = {Role.MATRIX: [], Role.TAIL: []}
        self._placements: dict[type[Placement], Placement] = {}
        self._routed: list[RoutedParam] = []
        self._pushed: list[dict[str, Any]] = []
        self._consolidated: dict[int, Any] | int | None = None  # consolidate_state_dict()'s result
        self._has_state = False  # whether any rank holds state (a step was taken, or state loaded)
        # per parent group: ids of the parameters it was routed with (to see a framework's swap)
        self._group_param_ids: list[list[int]] = []
        user_groups, self._type_roles = normalize_params(params)
        # roles for all groups at once: one warning lists every matrix routed by shape alone
        resolve_roles(
            user_groups,
            self._type_roles,
            self._overrides,
            check_globs=False,
            views=self._views,
            preconditioner=self._pricing,
            convs=conv_params(params) if isinstance(params, torch.nn.Module) else None,
        )
        self._pending: list[UserGroup] = user_groups
        # torch's constructor calls add_param_group once per group; we hand it our groups.
        super().__init__([{"params": [rp.param for rp in g.params], "_moo_group": g} for g in user_groups], {})
        self._overrides.check_all_used()
        self._views.check_all_used()
        del self._pending
        self._check_hyperparameters("OwnerRoutedOptimizer(...)")

    # -- construction -------------------------------------------------------------------------
    def add_param_group(self, param_group: dict[str, Any]) -> None:
        """Add a group (tensors or ``(name, tensor)`` pairs); it is split by role like the others."""
        user_group: UserGroup | None = param_group.get("_moo_group")
        resolved = user_group is not None  # a constructor group: roles resolved already
        if user_group is None:
            groups, type_roles = normalize_params([param_group], start_index=len(self._routed))
            user_group = groups[0]
        known = {id(rp.param) for rp in self._routed}
        for rp in user_group.params:
            if id(rp.param) in known:
                raise ValueError(f"parameter {rp.label!r} is already in another param group")
        if not resolved:
            resolve_roles(
                [user_group],
                type_roles,
                self._overrides,
                check_globs=False,
                views=self._views,
                preconditioner=self._pricing,
            )
        if self.param_groups and ("param_names" in self.param_groups[0]) != user_group.named:
            have = "with" if "param_names" in self.param_groups[0] else "without"
            raise ValueError(
                f"OwnerRoutedOptimizer.add_param_group: the optimizer's param groups are {have} "
                "param_names, this one is not; as with torch.optim, give every group names "
                "((name, tensor) pairs or 'param_names') or none"
            )
        for key in user_group.options:
            if not any(key in self._role_defaults[r] for r in (Role.MATRIX, Role.TAIL)):
                raise ValueError(
                    f"param group option {key!r} is accepted by neither the matrix optimizer "
                    f"({self._names[Role.MATRIX]}) nor the tail optimizer ({self._names[Role.TAIL]})"
                )
        by_optimizer: dict[Role, list[RoutedParam]] = {Role.MATRIX: [], Role.TAIL: []}
        for rp in user_group.params:
            by_optimizer[_ROLE_OPTIMIZER[rp.role]].append(rp)

        self._route(user_group.params)

        for role, rps in by_optimizer.items():
            if not rps:
                continue
            defaults = self._role_defaults[role]
            group = {"params": [rp.param for rp in rps], "role": role.value, **defaults}
            group.update({k: v for k, v in user_group.options.items() if k in defaults})
            if user_group.named:  # as torch.optim records the names of (name, tensor) pairs
                group["param_names"] = [rp.name for rp in rps]
            super().add_param_group(group)
            self._group_param_ids.append([id(p) for p in group["params"]])
            self._attach_child_group(len(self.param_groups) - 1, role, rps)

    def _route(self, rps: list[RoutedParam]) -> None:
        """Give ``rps`` to the placements of their layouts (which set each one's proxy and owner)."""
        new_entries: dict[type[Placement], list[RoutedParam]] = {}
        for rp in rps:
            new_entries.setdefault(placement_for(rp.param, rp.label), []).append(rp)
        self._check_names(rps)
        self._check_one_layout(rps, new_entries)
        check_matrix_views(rps, self._factories[Role.MATRIX], self._names[Role.MATRIX])
        for cls, entries in new_entries.items():
            if cls not in self._placements:
                self._placements[cls] = cls(self._config)
            self._placements[cls].add(entries)
        declare_matrix_views(rps)  # how the matrix optimizer reads each proxy
        self._routed.extend(rps)

    def _follow_param_swaps(self) -> None:
        """Re-route the parameters a framework put into ``param_groups`` after construction.

        Accelerate's FSDP2 ``prepare`` shards the model after the optimizer exists and sets each
        group's ``"params"`` to the new (DTensor) parameters; torch's optimizers simply step
        whatever the groups hold. Here the children hold the old tensors, so the groups are
        compared with what was routed (by identity, once per step) and, where they differ, every
        parameter is routed again: same names, indices and roles, the new tensors' layouts,
        hyperparameters from the groups. Refused (``RuntimeError``) once state exists, since
        the state of the old tensors has the old layout, and when a group changed its length
        or groups were appended without ``add_param_group``.
        """
        groups = self.param_groups
        if len(groups) == len(self._group_param_ids) and all(
            len(g["params"]) == len(ids) and all(id(p) == i for p, i in zip(g["params"], ids, strict=True))
            for g, ids in zip(groups, self._group_param_ids, strict=True)
        ):
            return
        what = (
            "OwnerRoutedOptimizer: the parameters in param_groups are not the ones it was built "
            "with (a framework swapped them, e.g. Accelerate's FSDP2 prepare)"
        )
        if len(groups) != len(self._group_param_ids):
            raise RuntimeError(
                f"{what}: it has {len(groups)} param groups, {len(self._group_param_ids)} were routed; add "
                "groups with optimizer.add_param_group(...), not by appending to param_groups"
            )
        for i, (g, ids) in enumerate(zip(groups, self._group_param_ids, strict=True)):
            if len(g["params"]) != len(ids):
                raise RuntimeError(
                    f"{what}: param group {i} holds {len(g['params'])} parameters, {len(ids)} were routed; "
                    "replace parameters one for one (or build the optimizer after sharding the model)"
                )
        if self.state or any(c is not None and c.state for c in self._children.values()):
            raise RuntimeError(
                f"{what}, after optimizer state exists; that state belongs to the old tensors and "
                "their layout. Swap parameters before the first step, or build the optimizer on "
                "the sharded model (and load state through get/set_optimizer_state_dict)"
            )
        previous = {id(rp.param): rp for rp in self._routed}
        regrouped = [
            (i, Role(g["role"]), [swapped_in(previous[pid], p) for p, pid in zip(g["params"], ids, strict=True)])
            for i, (g, ids) in enumerate(zip(groups, self._group_param_ids, strict=True))
        ]
        self._routed = []
        self._placements = {}
        self._children = {Role.MATRIX: None, Role.TAIL: None}
        self._child_groups = {Role.MATRIX: [], Role.TAIL: []}
        self._consolidated = None
        for i, role, rps in regrouped:
            self._route(rps)
            self._attach_child_group(i, role, rps)
        self._group_param_ids = [[id(p) for p in g["params"]] for g in groups]

    def _check_names(self, new: list[RoutedParam]) -> None:
        """Refuse two owner-sharded parameters with one fqn: the parameters of two separately
        sharded models (or parts of one) in one optimizer. Their state-dict pieces are keyed by
        fqn, so one would silently take the other's state. Plain tensors keep torch's semantics
        (any parameters, names may repeat)."""
        seen = {self._label(rp): rp for rp in self._routed if rp.shard is not None}
        for rp in new:
            if rp.shard is None:
                continue
            label = self._label(rp)
            other = seen.get(label)
            if other is not None:
                raise ValueError(
                    f"OwnerRoutedOptimizer: two parameters are named {label!r} (parameter "
                    f"#{other.index}, shape {tuple(other.param.shape)}, and #{rp.index}, shape "
                    f"{tuple(rp.param.shape)}): they come from two different models, or from two "
                    "separately sharded parts of one. State dicts and checkpoints key the state by "
                    "these names, so one would overwrite the other; build one optimizer per model"
                )
            seen[label] = rp

    def _check_one_layout(self, new: list[RoutedParam], new_entries: dict[type[Placement], list[RoutedParam]]) -> None:
        """Refuse plain tensors next to owner-sharded ones in a multi-rank job: no one averages
        a plain tensor's gradient there (it was added after ``fully_shard`` fixed the plan, or
        its module is outside every ``fully_shard`` call), so each rank would drift apart."""
        everything = self._routed + new
        sharded = [
            rp
            for rp in everything
            if rp.shard is not None
            and rp.shard.world_size > 1
            and (not is_dtensor(rp.param) or is_owner_dtensor(rp.param))
        ]
        existing = self._placements.get(ReplicatedPlacement)
        replicated = (existing.entries if existing is not None else []) + new_entries.get(ReplicatedPlacement, [])
        plain = [rp for rp in replicated if rp.param.requires_grad]
        if sharded and plain:
            rp = plain[0]
            raise ValueError(
                f"OwnerRoutedOptimizer: parameter {self._label(rp)!r} (shape "
                f"{tuple(rp.param.shape)}) is a plain tensor, while {self._label(sharded[0])!r} "
                "and others are owner-sharded by fully_shard; nothing averages the plain one's "
                "gradient across ranks. It was registered after the sharding plan was fixed (the "
                "first forward, state_dict() or optimizer construction), or its module is outside "
                "every fully_shard call, or it belongs to another model. Call fully_shard on a "
                "module containing it before the plan is fixed, freeze it "
                "(requires_grad_(False)), or give it its own optimizer"
            )

    def _check_hyperparameters(self, where: str) -> None:
        """Refuse a NaN anywhere, or an infinity where the inner optimizer's own default is
        finite (``lr=inf`` from a scheduler), in any param group, before anything is updated.
        Python numbers and CPU scalar tensors are checked; a device tensor is left alone (its
        check would cost a host sync per step)."""
        for i, group in enumerate(self.param_groups):
            for key, value in group.items():
                if key in ("params", "param_names", "role"):
                    continue
                bad = _first_nonfinite(value, allow_inf=key in self._infinite_ok)
                if bad is not None:
                    raise ValueError(
                        f"{where}: param group {i} (role {group.get('role', '?')!r}) has "
                        f"{key}={value!r}, which is not finite ({bad!r}); nothing was updated. "
                        f"Fix the value (or the learning-rate schedule that produced it) and set "
                        f"optimizer.param_groups[{i}][{key!r}] to a finite number"
                    )

    def _attach_child_group(self, parent_index: int, role: Role, rps: list[RoutedParam]) -> None:
        local = [rp for rp in rps if rp.proxy is not None]
        if not local:
            return
        parent = self.param_groups[parent_index]
        group = {"params": [rp.proxy for rp in local], **{k: parent[k] for k in self._role_defaults[role]}}
        child = self._children[role]
        if child is None:
            child = self._factories[role]([group], **self._options[role])
            self._children[role] = child
        else:
            child.add_param_group(group)
        self._child_groups[role].append((parent_index, child.param_groups[-1]))

    # -- the step --------------------------------------------------------------------------------
    def _sync_hyperparameters(self) -> None:
        """Parent groups -> child groups (the user's and schedulers' values); remember what was
        pushed so that :meth:`_pull_child_values` sees what the child itself changed."""
        self._pushed = []
        for pairs in self._child_groups.values():
            for parent_index, child_group in pairs:
                self._pushed.append(push_group_values(self.param_groups[parent_index], child_group))

    def _pull_child_values(self) -> None:
        """Child groups -> parent groups, for the values the child optimizer set in its step
        (Prodigy's ``d``, schedule-free ``k``, ...), so that they persist and are saved."""
        pushed = iter(self._pushed)
        for pairs in self._child_groups.values():
            for parent_index, child_group in pairs:
                before = next(pushed, {})
                parent = self.param_groups[parent_index]
                for key, value in child_group.items():
                    if key != "params" and (key not in before or before[key] is not value):
                        parent[key] = value

    def _link_state(self) -> None:
        """Share each child's per-parameter state dict with ``self.state``. Linked after the
        child's step creates it, so a fresh optimizer has empty ``state`` as torch's do (which
        ``get_optimizer_state_dict`` relies on to initialise it)."""
        for rp in self._routed:
            if rp.proxy is None:
                continue
            child = self._children[_ROLE_OPTIMIZER[rp.role]]
            st = child.state.get(rp.proxy) if child is not None else None
            if st is not None and self.state.get(rp.param) is not st:
                self.state[rp.param] = st

    def step(self, closure: Callable[[], Any] | None = None) -> Any:  # type: ignore[override]
        """One update of every parameter this rank updates; returns ``closure()`` if given."""
        loss = None
        if closure is not None:
            with torch.enable_grad():
                loss = closure()
        self._check_hyperparameters("OwnerRoutedOptimizer.step()")
        self._follow_param_swaps()
        report.log_once(self)  # what went where, on rank 0 at the first step (logging)
        with comm_phase("optimizer"), torch.no_grad():
            self.last_step_skipped = self.skip_nonfinite_grads and self._any_nonfinite_grad()
            if self.last_step_skipped:
                self.skipped_steps += 1
                return loss
            self._sync_hyperparameters()
            for placement in self._placements.values():
                placement.before_step()
            for child in self._children.values():
                if child is not None:
                    child.step()
            self._has_state = True
            self._pull_child_values()
            for placement in self._placements.values():
                placement.after_step()
            self._link_state()
        self._consolidated = None  # a consolidated state dict holds the state before this step
        return loss

    def _any_nonfinite_grad(self) -> bool:
        """Whether any rank holds a NaN or infinite gradient of a parameter it updates: a local
        max-abs per tensor (NaN propagates; no overflow, unlike a sum of squares), then one
        scalar all-reduce (max) over ``process_group`` in a multi-rank job, so every rank
        returns the same answer."""
        grads: list[torch.Tensor] = []
        for rp in self._routed:
            g = rp.param.grad
            if g is None:
                continue
            g = local_tensor(g)
            if g.numel():
                grads.append(g.detach())
        device = grads[0].device if grads else self._routed[0].param.device
        flag = torch.zeros((), dtype=torch.float32, device=device)
        if grads:
            by_dtype: dict[tuple[torch.device, torch.dtype], list[torch.Tensor]] = {}
            for g in grads:
                by_dtype.setdefault((g.device, g.dtype), []).append(g)
            for gs in by_dtype.values():
                peak = torch.stack(torch._foreach_norm(gs, math.inf)).float().max().to(device)
                flag = torch.maximum(flag, (~torch.isfinite(peak)).float())
        group = self._process_group
        if dist.is_available() and dist.is_initialized() and dist.get_world_size(group) > 1:
            comm.all_reduce(flag, op=dist.ReduceOp.MAX, group=group, name="nonfinite_check")
        return bool(flag.item())

    def zero_grad(self, set_to_none: bool = True) -> None:
        super().zero_grad(set_to_none=set_to_none)
        for placement in self._placements.values():
            placement.zero_grad(set_to_none)

    # -- state -------------------------------------------------------------------------------------
    def _ordered(self) -> list[RoutedParam]:
        """Routed parameters in param-group order: the integer keys of ``state_dict()``."""
        by_id = {id(rp.param): rp for rp in self._routed}
        return [by_id[id(p)] for g in self.param_groups for p in g["params"]]

    def _placement_of(self) -> dict[int, Placement]:
        return {id(rp): pl for pl in self._placements.values() for rp in pl.entries}

    def _partitioned_replicas(self) -> bool:
        from .replicated_placement import ReplicatedPlacement

        pl = self._placements.get(ReplicatedPlacement)
        return isinstance(pl, ReplicatedPlacement) and pl.partitioned

    @staticmethod
    def _label(rp: RoutedParam) -> str:
        if rp.name is not None:
            return rp.name
        return rp.shard.fqn if rp.shard is not None else rp.label

    def state_dict(self) -> dict[str, Any]:
        """torch's layout (``state`` by parameter index, ``param_groups``), in pieces where the
        state is partitioned, so that ``get_optimizer_state_dict`` and DCP reshard it.

        * one process, and DDP with ``replicated="redundant"``: plain tensors, as torch's.
        * owner layout: owner-held state as ``OwnedTensor`` (whole on the owner), row-block
          state of ``sharded`` tensors as ``Shard(0)`` DTensors; only what this rank holds.
        * stock FSDP2: matrices' state as ``OwnedTensor`` over the shard group, shard-local
          state as DTensors with the parameter's placements.
        * DDP with owners (``replicated="owner"``, several ranks): the whole state in plain
          tensors after :meth:`consolidate_state_dict`; an error before it.

        Param groups carry the inner optimizers' own values (Prodigy's ``d``, ...), and
        ``param_names`` where the parameters were given with names, as torch's do. Before any
        step (and any load) there is no state to consolidate, so under DDP it is torch's empty
        state dict then (Accelerate calls ``state_dict()`` while wrapping the optimizer).
        """
        self._follow_param_swaps()
        if self._partitioned_replicas() and self._has_state:
            return self._consolidated_state_dict()
        sd = super().state_dict()
        placement = self._placement_of()
        ordered = self._ordered()
        for idx, st in list(sd["state"].items()):
            rp = ordered[idx]
            pl = placement[id(rp)]
            sd["state"][idx] = {k: pl.state_entry(rp, k, v) for k, v in st.items()}
        self._list_held_elsewhere(sd["state"], ordered, placement)
        for idx in range(len(ordered)):  # stateless: an empty entry, so every rank's keys cover
            sd["state"].setdefault(idx, {})  # every parameter (DSD needs that)
        sd["state"] = dict(sorted(sd["state"].items()))  # one order on every rank, whoever holds what
        return sd

    @staticmethod
    def _whole_where_cut_elsewhere(
        saved: dict[Any, Any], keyed: list[tuple[Any, RoutedParam]], placement: dict[int, Placement]
    ) -> dict[Any, Any]:
        """State of owner-held tensors that arrives cut as ``torch.chunk`` rows (torch's
        ``set_optimizer_state_dict(full_state_dict=True)`` re-distributes full tensors with
        ``distribute_tensor``, which splits every ``Shard`` placement that way) made whole again:
        every rank gathers each such piece, in the state dict's order (collective, symmetric:
        every rank holds the same keys), and keeps its own part later as from a full tensor."""
        out = dict(saved)
        for key, rp in keyed:
            entry = saved.get(key)
            if not entry or placement[id(rp)].state_holder(rp) is None:
                continue
            fixed = dict(entry)
            for k, v in entry.items():
                if isinstance(v, DTensor) and not is_owner_dtensor(v) and any(type(p) is Shard for p in v.placements):
                    fixed[k] = v.full_tensor()
            out[key] = fixed
        return out

    def _list_held_elsewhere(
        self, state: dict[int, Any], ordered: list[RoutedParam], placement: dict[int, Placement]
    ) -> None:
        """Give this rank an entry, of empty pieces, for every state its owner alone holds, so
        that every rank's state dict has the same keys and shapes (torch's full_state_dict and
        DCP go through them in the same order on every rank). Collective when any state is
        held by one rank: one all-gather of the (key, shape, dtype) lists."""
        holders = {idx: placement[id(rp)].state_holder(rp) for idx, rp in enumerate(ordered)}
        if not is_multi_rank() or all(h is None for h in holders.values()):
            return

        def spec(v: Any) -> tuple:
            if not isinstance(v, torch.Tensor):
                return ("value", v)
            if v.dim() == 0 and not is_dtensor(v):  # a split stack's own step: the same everywhere
                return ("value", v.detach().cpu().clone())
            holder = v.holder if is_owner_dtensor(v) else None  # a band's block: held by one rank
            return (tuple(v.shape), str(v.dtype).removeprefix("torch."), v.device.type, holder)

        mine = {
            idx: {k: spec(v) for k, v in state[idx].items()}
            for idx, h in holders.items()
            if h is not None and state.get(idx)
        }
        for theirs in comm.all_gather_object(mine, name="optimizer_state_keys"):
            for idx, keys in theirs.items():
                held = holders[idx]
                shard = ordered[idx].shard
                # a matrix cut into bands: each owner holds its blocks' keys, so every rank lists all
                banded = shard is not None and shard.is_split and len(shard.shape) == 2
                if (state.get(idx) and not banded) or held is None:
                    continue
                owner, group = held
                entry: dict[str, Any] = dict(state.get(idx) or {})
                for k, s in keys.items():
                    if k in entry:
                        continue
                    if s[0] == "value":
                        entry[k] = s[1]
                        continue
                    shape, dtype, device, holder = s
                    empty = torch.empty((0, *shape[1:]) if shape else (), dtype=getattr(torch, dtype), device=device)
                    mesh = mesh_of_group(group, device)
                    if banded and holder is not None:  # another owner's block
                        entry[k] = OwnerDTensor.owned(empty, holder, mesh, shape)
                    elif shard is not None and shard.is_split:  # no experts here: an empty row range
                        entry[k] = OwnerDTensor.make(empty, mesh, placement_of(shard), shape)
                    else:
                        entry[k] = OwnerDTensor.owned(empty if shape else empty.zero_(), owner, mesh, shape)
                state[idx] = dict(sorted(entry.items())) if banded else entry

    def consolidate_state_dict(self, to: int | None = 0) -> None:
        """Collective (every rank): gather the owners' matrix state of a DDP job
        (``replicated="owner"``) on rank ``to`` (every rank with ``None``), so that
        :meth:`state_dict` there returns the whole state, as
        ``ZeroRedundancyOptimizer.consolidate_state_dict`` does. Valid until the next step.
        A no-op on layouts whose ``state_dict`` needs no consolidation."""
        self._follow_param_swaps()
        self._consolidated = None
        if not self._partitioned_replicas():
            return
        ordered = self._ordered()
        mine = {
            i: {k: (v.detach().cpu() if isinstance(v, torch.Tensor) else v) for k, v in self.state[rp.param].items()}
            for i, rp in enumerate(ordered)
            if rp.owner is not None and rp.proxy is not None and self.state.get(rp.param)
        }
        gathered = (
            comm.all_gather_object(mine, name="consolidate_state_dict")
            if to is None
            else comm.gather_object(mine, to, name="consolidate_state_dict")
        )
        if gathered is not None:
            merged: dict[int, Any] = {}
            for part in gathered:
                merged.update(part)
            self._consolidated = merged
        else:
            self._consolidated = to

    def _consolidated_state_dict(self) -> dict[str, Any]:
        if self._consolidated is None:
            raise RuntimeError(
                "OwnerRoutedOptimizer.state_dict(): under DDP with replicated='owner' each rank keeps "
                "the matrix state of the matrices it owns only; call optimizer.consolidate_state_dict() "
                "on every rank first (to=0 for a rank-0 torch.save, to=None for every rank, e.g. "
                "before get_optimizer_state_dict), as with ZeroRedundancyOptimizer"
            )
        if isinstance(self._consolidated, int):
            raise RuntimeError(
                f"OwnerRoutedOptimizer.state_dict(): the state was consolidated on rank "
                f"{self._consolidated}, not on this rank; call it there, or consolidate_state_dict(to=None)"
            )
        sd = super().state_dict()
        for idx, st in self._consolidated.items():
            if not sd["state"].get(idx):
                sd["state"][idx] = st
        return sd

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        """Load a state dict of this optimizer saved on any layout and world size.

        Accepts :meth:`state_dict`'s forms (pieces, or plain tensors), full tensors (one
        process, consolidated DDP, ``full_state_dict=True``) and fqn-keyed state
        (``set_optimizer_state_dict``). Each rank keeps what it updates. State keeps its dtype
        (fp32 Shampoo/SOAP factors of a bf16 model stay fp32) and moves to the parameter's
        device (``step`` stays where it is). Raises ``KeyError`` naming the trainable parameters
        this rank updates whose state is missing while others of their param group have state.
        """
        self._follow_param_swaps()
        state_dict = state_dict.copy()
        for pre_hook in self._optimizer_load_state_dict_pre_hooks.values():
            result = pre_hook(self, state_dict)
            if result is not None:
                state_dict = result
        groups = self.param_groups
        saved_groups = deepcopy(state_dict["param_groups"])
        if len(groups) != len(saved_groups):
            raise ValueError(
                f"loaded state dict has {len(saved_groups)} parameter groups, the optimizer "
                f"{len(groups)}; build OwnerRoutedOptimizer with the same param groups and roles"
            )
        for i, (g, sg) in enumerate(zip(groups, saved_groups, strict=True)):
            if len(g["params"]) != len(sg["params"]):
                raise ValueError(
                    f"loaded state dict's parameter group {i} has {len(sg['params'])} "
                    f"parameters, the optimizer's {len(g['params'])}"
                )
            if "role" in sg and sg["role"] != g.get("role"):
                raise ValueError(
                    f"loaded state dict's parameter group {i} has role {sg['role']!r}, "
                    f"the optimizer's {g.get('role')!r}"
                )
        saved_state = state_dict["state"]
        by_param = {id(rp.param): rp for rp in self._routed}
        placement = self._placement_of()
        loaded: dict[int, dict[str, Any]] = {}
        missing: list[str] = []
        pairs = [
            (key, param, any(saved_state.get(k) for k in sg["params"]))
            for sg, g in zip(saved_groups, groups, strict=True)
            for key, param in zip(sg["params"], g["params"], strict=True)
        ]
        saved_state = self._whole_where_cut_elsewhere(
            saved_state, [(k, by_param[id(p)]) for k, p, _ in pairs], placement
        )
        for key, param, group_has_state in pairs:
            rp = by_param[id(param)]
            if rp.proxy is None:
                continue
            st = saved_state.get(key)
            if not st:
                if param.requires_grad and group_has_state:
                    missing.append(key if isinstance(key, str) else self._label(rp))
                continue
            current = self.state.get(param, {})
            here = {k: self._load_value(rp, placement[id(rp)], k, v, current.get(k)) for k, v in st.items()}
            loaded[id(rp)] = {k: v for k, v in here.items() if v is not NOT_HELD}  # another owner's block
        if missing:
            raise KeyError(
                f"optimizer state dict has no state for {', '.join(repr(m) for m in missing)} "
                f"(which this rank updates) but has state for others of its param group; load a state dict "
                "saved from the whole optimizer (under DDP, after consolidate_state_dict())"
            )
        for g, sg in zip(groups, saved_groups, strict=True):
            params_, names = g["params"], g.get("param_names")
            g.clear()
            g.update(sg)
            g["params"] = params_
            if names is not None and "param_names" not in sg:  # saved names win, as in torch
                g["param_names"] = names
        for rp in self._routed:
            child = self._children[_ROLE_OPTIMIZER[rp.role]]
            values = loaded.get(id(rp))
            if rp.proxy is None or values is None:
                self.state.pop(rp.param, None)
                if rp.proxy is not None and child is not None:
                    child.state.pop(rp.proxy, None)
                continue
            assert child is not None
            entry: dict[str, Any] = dict(values)
            child.state[rp.proxy] = entry
            self.state[rp.param] = entry
        self._consolidated = None
        self._has_state = any(bool(st) for st in saved_state.values())
        self._sync_hyperparameters()
        for post_hook in self._optimizer_load_state_dict_post_hooks.values():
            post_hook(self)

    @staticmethod
    def _load_value(rp: RoutedParam, placement: Placement, key: str, value: Any, current: Any) -> Any:
        """This rank's copy of one saved state value (no copy when DCP already wrote it in place)."""
        local = placement.state_local(rp, key, value)
        if not isinstance(local, torch.Tensor):
            return deepcopy(local)
        local = local.detach()
        if (
            isinstance(current, torch.Tensor)
            and current.dtype == local.dtype
            and current.shape == local.shape
            and current.device == local.device
            and (current.numel() == 0 or current.data_ptr() == local.data_ptr())
        ):
            return current  # read in place through a piece of this optimizer's own state_dict()
        assert rp.proxy is not None
        device = local.device if key == "step" else rp.proxy.device
        return local.to(device=device, copy=True)

    # -- introspection ------------------------------------------------------------------------------
    @property
    def matrix_optimizer(self) -> torch.optim.Optimizer | None:
        """The optimizer updating this rank's matrices (None if it updates none)."""
        return self._children[Role.MATRIX]

    @property
    def tail_optimizer(self) -> torch.optim.Optimizer | None:
        """The optimizer updating this rank's tail and ``sharded`` rows (None if none)."""
        return self._children[Role.TAIL]

    def extra_resident_bytes(self) -> int:
        """Bytes the layouts keep beyond params, grads and state (e.g. owners' full copies)."""
        return sum(p.extra_resident_bytes() for p in self._placements.values())

    def routes(self) -> list[dict[str, Any]]:
        """Per parameter: name, role, owner, whether this rank updates it, and the layout."""
        self._follow_param_swaps()
        layout_of = {id(rp): cls.name for cls, pl in self._placements.items() for rp in pl.entries}
        return [
            {
                "name": rp.label,
                "role": rp.role.value,
                "owner": rp.owner,
                "local": rp.proxy is not None,
                "layout": layout_of.get(id(rp), "?"),
            }
            for rp in self._routed
        ]

    def routing_report(self, large_numel: int = report.LARGE_NUMEL) -> report.RoutingReport:
        """What went where: counts and bytes per optimizer and role, and every >2D or large 2D
        tensor left to the tail optimizer, named (see :mod:`.report`)."""
        return report.report_of_routes(self._routed, self._names[Role.MATRIX], self._names[Role.TAIL], large_numel)

    def __repr__(self) -> str:
        counts = {r.value: sum(1 for rp in self._routed if rp.role is r) for r in Role}
        local = sum(1 for rp in self._routed if rp.proxy is not None)
        return (
            f"OwnerRoutedOptimizer(matrix={self._names[Role.MATRIX]}, tail={self._names[Role.TAIL]}, "
            f"roles={counts}, local={local}/{len(self._routed)})"
        )

"""``OwnerRoutedOptimizer``: each matrix to a matrix optimizer on its owner, the rest to AdamW.

A ``torch.optim.Optimizer`` with one param group per tensor role on every rank; each group's two
optimizers (:class:`~.role_optimizer.RoleOptimizer`) step only what this rank updates (DESIGN.md,
"The optimizer").
"""

from __future__ import annotations

import math
from collections.abc import Callable, Iterable, Mapping
from typing import Any

import torch

from ..agreement import agree_before_planning, agree_nonfinite, agree_steps, optimizer_fields, watch_steps
from ..checkpoint import is_initialisation_step
from ..comm import comm_phase
from ..lazy_plan import fix_lazy_plans
from ..owner_dtensor import is_owner_dtensor
from ..planning.metadata import Role
from ..planning.roles import RoleOverrides, conv_params
from ..planning.views import MatrixView, ViewOverrides
from ..replica_sync import BROADCAST_PLACEMENTS, DEFAULT_REPLICA_BROADCAST
from ..tensors import is_dtensor, local_tensor
from . import report
from . import state_dict as sd_
from .layout_of import layout_of
from .layouts import LayoutConfig, UpdateLayout
from .registry import OptimizerFactory, choose_optimizer
from .replicated_layout import ReplicatedLayout
from .role_optimizer import ChildState, RoleOptimizer, first_nonfinite
from .routing import (
    OptimizerKind,
    RoutedParam,
    UserGroup,
    check_matrix_views,
    declare_matrix_views,
    normalize_params,
    optimizer_kind,
    resolve_roles,
    swapped_in,
)
from .state_place import StatePlace

__all__ = ["OwnerRoutedOptimizer"]

MATRIX, TAIL = OptimizerKind.MATRIX, OptimizerKind.TAIL


class OwnerRoutedOptimizer(torch.optim.Optimizer):
    """Route each matrix to a matrix optimizer on its owner and everything else to AdamW.

    Args:
        params: the model (roles by module type), ``model.named_parameters()`` (roles by
            name), ``model.parameters()`` (roles from the sharding plan, else by shape), or
            param-group dicts of any of those (a group's ``"role"`` forces its tensors' role).
            The optimizer's own groups hold one ``"role"`` each and the ``"optimizer"`` that
            steps them, so ``OwnerRoutedOptimizer(opt.param_groups)`` routes as ``opt`` did.
        matrix: registered name (``"muon"``, ``"shampoo"``, ...) or optimizer class for the
            ``matrix`` role; its cost model (``planning.catalog.resolve_cost``) prices the plan.
        matrix_options: keyword arguments of the matrix optimizer (its defaults otherwise).
        tail: name or class for ``tail`` and ``rows`` parameters (default AdamW).
        tail_options: keyword arguments of the tail optimizer.
        roles: ``{"fqn-glob": "matrix" | "tail" | "rows"}``; the last matching glob wins.
            A glob that matches nothing is an error.
        matrix_views: ``{"fqn-glob": "stack" | "conv" | MatrixView(...)}``: how a tensor is read
            as matrices (:mod:`matrix_owner_optim.planning.views`).
        replicated: DDP: ``"owner"`` updates each matrix on one owner and shares the result;
            ``"redundant"`` updates every matrix on every rank and moves nothing.
        replica_broadcast: HSDP: when global owners send updated matrices to the other replicas:
            ``"step"`` or ``"forward"`` (DESIGN.md, "HSDP: one global owner per matrix").
        skip_nonfinite_grads: skip a step on every rank when any gradient is not finite
            (counted in ``skipped_steps``; ``last_step_skipped`` tells about the last call).
        process_group: the ranks that step this optimizer together (default: the default
            process group); only the non-finite check communicates over it.

    Construction is collective (every rank, same parameters, same order): agree and fix the
    plans, route, then :meth:`~.layouts.UpdateLayout.agree` (DESIGN.md, "The optimizer").
    A non-finite hyperparameter raises ``ValueError`` at construction and before each step.
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
        replica_broadcast: str = DEFAULT_REPLICA_BROADCAST,
        skip_nonfinite_grads: bool = False,
        process_group: Any = None,
    ) -> None:
        if replicated not in ("owner", "redundant"):
            raise ValueError(f"replicated must be 'owner' or 'redundant', got {replicated!r}")
        if replica_broadcast not in BROADCAST_PLACEMENTS:
            raise ValueError(
                f"replica_broadcast must be one of {BROADCAST_PLACEMENTS} (when HSDP's global owners send "
                f"the updated matrices to the other replicas), got {replica_broadcast!r}"
            )
        if not isinstance(skip_nonfinite_grads, bool):
            raise TypeError(f"skip_nonfinite_grads must be True or False, got {skip_nonfinite_grads!r}")
        self.skip_nonfinite_grads = skip_nonfinite_grads
        self.skipped_steps = 0  # steps skipped for non-finite gradients (this process's run)
        self.last_step_skipped = False
        self._checked_steps: int | None = None  # step() calls since the first checked one (agree_nonfinite)
        self._process_group = process_group
        self._report_logged = False  # the routing report is logged once, at the first step
        chosen = (choose_optimizer(matrix, what="matrix"), choose_optimizer(tail, what="tail"))
        self._kinds: dict[OptimizerKind, RoleOptimizer] = {
            MATRIX: RoleOptimizer(MATRIX.value, chosen[0], matrix_options),
            TAIL: RoleOptimizer(TAIL.value, chosen[1], tail_options),
        }
        # keys whose inner optimizer itself defaults to an infinity (a threshold that is off)
        self._infinite_ok = set().union(*(r.infinite_ok for r in self._kinds.values()))
        self._overrides = RoleOverrides(roles)
        self._views = ViewOverrides(matrix_views)
        self._config = LayoutConfig(
            matrix_cost=self._kinds[MATRIX].cost, replicated=replicated, replica_broadcast=replica_broadcast
        )
        self._routed: list[RoutedParam] = []
        self._slots: dict[int, tuple[RoutedParam, RoleOptimizer]] = {}  # id(param) -> routing, optimizer
        self._consolidated: dict[int, Any] | int | None = None  # consolidate_state_dict()'s result
        self._has_state = False  # whether any rank holds state (a step was taken, or state loaded)
        self._fresh_at_init = False  # the last step() was torch's initialisation of a fresh optimizer
        # per parent group: ids of the parameters it was routed with (to see a framework's swap)
        self._group_param_ids: list[list[int]] = []
        self._group_user: list[int] = []  # per parent group: which user group it was split from
        user_groups, self._type_roles = normalize_params(params)
        # Step 1, collective: every rank agrees on this configuration (agreement.py), and every
        # pending fully_shard tree of these parameters fixes its plan, priced by the matrix cost
        agree_before_planning(optimizer_fields(self, user_groups), user_groups, process_group, self._fix_plans)
        # roles for all groups at once (pure): one warning lists every matrix routed by shape alone
        resolve_roles(
            user_groups,
            self._type_roles,
            self._overrides,
            views=self._views,
            convs=conv_params(params) if isinstance(params, torch.nn.Module) else None,
        )
        groups = [{"params": [rp.param for rp in g.params]} for g in user_groups]  # roles resolved above
        self._resolved_groups = {id(d): g for d, g in zip(groups, user_groups, strict=True)}  # add_param_group's
        super().__init__(groups, {})
        self.state = ChildState(self._slots)  # type: ignore[assignment]  # the children's state, by param
        self._overrides.check_all_used()
        self._views.check_all_used()
        self._check_hyperparameters("OwnerRoutedOptimizer(...)")

    # -- construction -------------------------------------------------------------------------
    def _fix_plans(self, params: Iterable[torch.Tensor]) -> None:
        """Collective: fix the plans of the pending ``fully_shard`` trees of ``params``."""
        fix_lazy_plans(params, self._config.matrix_cost)

    def add_param_group(self, param_group: dict[str, Any]) -> None:
        """Add a group (tensors or ``(name, tensor)`` pairs); it is split by role like the others."""
        user_group: UserGroup | None = self.__dict__.get("_resolved_groups", {}).pop(id(param_group), None)
        resolved = user_group is not None  # a constructor group (torch's __init__ adds each): roles resolved
        if user_group is None:
            groups, type_roles = normalize_params([param_group], start_index=len(self._routed))
            user_group = groups[0]
        known = {id(rp.param) for rp in self._routed}
        for rp in user_group.params:
            if id(rp.param) in known:
                raise ValueError(f"parameter {rp.label!r} is already in another param group")
        if not resolved:
            self._fix_plans(rp.param for rp in user_group.params)  # collective, as in the constructor
            resolve_roles([user_group], type_roles, self._overrides, views=self._views)
        if self.param_groups and ("param_names" in self.param_groups[0]) != user_group.named:
            have = "with" if "param_names" in self.param_groups[0] else "without"
            raise ValueError(
                f"OwnerRoutedOptimizer.add_param_group: the optimizer's param groups are {have} "
                "param_names, this one is not; as with torch.optim, give every group names "
                "((name, tensor) pairs or 'param_names') or none"
            )
        for key in user_group.options:
            if not any(key in r.defaults for r in self._kinds.values()):
                raise ValueError(
                    f"param group option {key!r} is accepted by neither the matrix optimizer "
                    f"({self._kinds[MATRIX].name}) nor the tail optimizer ({self._kinds[TAIL].name})"
                )
        self._route(user_group.params)
        user = self._group_user[-1] + 1 if self._group_user else 0
        for role in Role:  # one parent group per tensor role: "role" is the tensors' role
            rps = [rp for rp in user_group.params if rp.role is role]
            if not rps:
                continue
            kind = optimizer_kind(role)
            ropt = self._kinds[kind]
            group = {"params": [rp.param for rp in rps], "role": role.value, "optimizer": kind.value, **ropt.defaults}
            group.update({k: v for k, v in user_group.options.items() if k in ropt.defaults})
            if user_group.named:  # as torch.optim records the names of (name, tensor) pairs
                group["param_names"] = [rp.name for rp in rps]
            super().add_param_group(group)
            self._group_param_ids.append([id(p) for p in group["params"]])
            self._group_user.append(user)
            ropt.attach(self, len(self.param_groups) - 1, rps)

    def _route(self, rps: list[RoutedParam]) -> None:
        """Give ``rps`` to their roles' layouts (which set each one's proxy and owner)."""
        self._check_names(rps)
        self._check_one_layout(rps)
        matrix = self._kinds[MATRIX]
        check_matrix_views(rps, matrix.factory, matrix.name)
        for kind, ropt in self._kinds.items():
            ropt.route([rp for rp in rps if optimizer_kind(rp.role) is kind], self._config)
        for layout in self.layouts():  # collective: the layouts' owner plans checked across ranks
            layout.agree()
        declare_matrix_views(rps)  # how the matrix optimizer reads each proxy
        self._routed.extend(rps)
        self._slots.update((id(rp.param), (rp, self._kinds[optimizer_kind(rp.role)])) for rp in rps)

    def _follow_param_swaps(self) -> None:
        """Re-route parameters a framework swapped into ``param_groups`` (Accelerate's FSDP2
        ``prepare``); ``RuntimeError`` once state exists or when the groups changed shape."""
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
        if self.state or any(r.child is not None and r.child.state for r in self._kinds.values()):
            raise RuntimeError(
                f"{what}, after optimizer state exists; that state belongs to the old tensors and "
                "their layout. Swap parameters before the first step, or build the optimizer on "
                "the sharded model (and load state through get/set_optimizer_state_dict)"
            )
        previous = {id(rp.param): rp for rp in self._routed}
        self._fix_plans(p for g in groups for p in g["params"])  # collective; priced as at construction
        regrouped = [
            (
                i,
                OptimizerKind(g["optimizer"]),
                [swapped_in(previous[pid], p) for p, pid in zip(g["params"], ids, strict=True)],
            )
            for i, (g, ids) in enumerate(zip(groups, self._group_param_ids, strict=True))
        ]
        self._routed = []
        self._slots.clear()
        for ropt in self._kinds.values():
            ropt.reset()
        self._consolidated = None
        for i, kind, rps in regrouped:
            self._route(rps)
            self._kinds[kind].attach(self, i, rps)
        self._group_param_ids = [[id(p) for p in g["params"]] for g in groups]

    def _check_names(self, new: list[RoutedParam]) -> None:
        """Refuse two owner-sharded parameters with one fqn (state dicts key pieces by fqn)."""
        seen = {rp.fqn: rp for rp in self._routed if rp.shard is not None}
        for rp in new:
            if rp.shard is None:
                continue
            label = rp.fqn
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

    def _check_one_layout(self, new: list[RoutedParam]) -> None:
        """Refuse plain tensors next to owner-sharded ones in a multi-rank job (nothing averages them)."""
        everything = self._routed + new
        sharded = [
            rp
            for rp in everything
            if rp.shard is not None
            and rp.shard.world_size > 1
            and (not is_dtensor(rp.param) or is_owner_dtensor(rp.param))
        ]
        replicated = [
            rp
            for r in self._kinds.values()
            for cls, lay in r.layouts.items()
            if cls is ReplicatedLayout
            for rp in lay.entries
        ] + [rp for rp in new if layout_of(rp.param) is ReplicatedLayout]
        plain = [rp for rp in replicated if rp.param.requires_grad]
        if sharded and plain:
            rp = plain[0]
            raise ValueError(
                f"OwnerRoutedOptimizer: parameter {rp.fqn!r} (shape "
                f"{tuple(rp.param.shape)}) is a plain tensor, while {sharded[0].fqn!r} "
                "and others are owner-sharded by fully_shard; nothing averages the plain one's "
                "gradient across ranks. It was registered after the sharding plan was fixed (the "
                "first forward, state_dict() or optimizer construction), or its module is outside "
                "every fully_shard call, or it belongs to another model. Call fully_shard on a "
                "module containing it before the plan is fixed, freeze it "
                "(requires_grad_(False)), or give it its own optimizer"
            )

    def _check_hyperparameters(self, where: str) -> None:
        """Refuse a NaN, or an infinity where the inner optimizer's default is finite, in any
        group (numbers and CPU scalars; a device tensor would cost a host sync)."""
        for i, group in enumerate(self.param_groups):
            for key, value in group.items():
                if key in ("params", "param_names", "role", "optimizer"):
                    continue
                bad = first_nonfinite(value, allow_inf=key in self._infinite_ok)
                if bad is not None:
                    raise ValueError(
                        f"{where}: param group {i} (role {group.get('role', '?')!r}) has "
                        f"{key}={value!r}, which is not finite ({bad!r}); nothing was updated. "
                        f"Fix the value (or the learning-rate schedule that produced it) and set "
                        f"optimizer.param_groups[{i}][{key!r}] to a finite number"
                    )

    # -- the step --------------------------------------------------------------------------------
    def step(self, closure: Callable[[], Any] | None = None) -> Any:  # type: ignore[override]
        """One update of every parameter this rank updates; returns ``closure()`` if given."""
        with torch.enable_grad():
            loss = closure() if closure is not None else None
        self._fresh_at_init = is_initialisation_step(self)  # then a load it refuses leaves it fresh
        checked = self.step_check_groups()
        if self._checked_steps is not None:  # every call counts from the first checked one on
            self._checked_steps += 1
        elif checked:  # the first: the trees' forwards carry the count from now on
            watch_steps([rp.param for rp in self._routed], self)
            self._checked_steps = 1
        self._check_hyperparameters("OwnerRoutedOptimizer.step()")
        self._follow_param_swaps()
        if not self._report_logged:  # what went where, on rank 0 at the first step (logging)
            self._report_logged = True
            report.log_report(self)
        with comm_phase("optimizer"), torch.no_grad():
            self.last_step_skipped = self.skip_nonfinite_grads and self._any_nonfinite_grad()
            for among, group in checked[1 if self.skip_nonfinite_grads else 0 :]:  # before the layouts' collectives
                agree_steps(self._checked_steps, among, group, self._routed[0].param.device)  # type: ignore[arg-type]
            if self.last_step_skipped:
                self.skipped_steps += 1
                return loss
            for layout in self.layouts():
                layout.before_step()
            for child in (r.child for r in self._kinds.values() if r.child is not None):
                child.step()  # the children read the parent groups' values (ChildGroup)
            self._has_state = True
            for layout in self.layouts():
                layout.after_step()
        self._consolidated = None  # a consolidated state dict holds the state before this step
        return loss

    def _any_nonfinite_grad(self) -> bool:
        """Whether any rank holds a non-finite gradient (one all-reduce, carrying the step count)."""
        grads = [local_tensor(rp.param.grad).detach() for rp in self._routed if rp.param.grad is not None]
        grads = [g for g in grads if g.numel()]
        device = grads[0].device if grads else self._routed[0].param.device
        flag = torch.zeros((), dtype=torch.float32, device=device)
        if grads:
            by_dtype: dict[tuple[torch.device, torch.dtype], list[torch.Tensor]] = {}
            for g in grads:
                by_dtype.setdefault((g.device, g.dtype), []).append(g)
            for gs in by_dtype.values():
                peak = torch.stack(torch._foreach_norm(gs, math.inf)).float().max().to(device)
                flag = torch.maximum(flag, (~torch.isfinite(peak)).float())
        assert self._checked_steps is not None  # step() counted this one
        return agree_nonfinite(self._checked_steps, flag, self._process_group)  # the step count rides along

    def step_check_groups(self) -> list[tuple[str, Any]]:
        """The groups whose ranks must be at the same step when this rank's ``step()`` issues a
        collective: ``process_group`` when it all-reduces its non-finite flag, then each group the
        layouts' step collectives use (a TP assembly, HSDP's broadcasts at the step). The step
        opens with its step count over each (24 bytes), and so does the next forward of each
        ``fully_shard`` tree, so a rank that steps once more or once less than the others meets
        their check and every rank fails by name (DESIGN.md, "Ranks at different steps")."""
        groups = [("process_group", self._process_group)] if self.skip_nonfinite_grads else []
        for layout in self.layouts():
            groups += [(n, g) for n, g in layout.step_groups() if not any(g is h for _, h in groups)]
        return groups

    def zero_grad(self, set_to_none: bool = True) -> None:
        """torch's ``zero_grad``, and the gradients the layouts gave their proxies."""
        super().zero_grad(set_to_none=set_to_none)
        for layout in self.layouts():
            layout.zero_grad(set_to_none)

    # -- state -------------------------------------------------------------------------------------
    def _ordered(self) -> list[RoutedParam]:
        """Routed parameters in param-group order: the integer keys of ``state_dict()``."""
        by_id = {id(rp.param): rp for rp in self._routed}
        return [by_id[id(p)] for g in self.param_groups for p in g["params"]]

    def _layout_of(self) -> dict[int, UpdateLayout]:
        return {id(rp): lay for lay in self.layouts() for rp in lay.entries}

    def _places(self) -> dict[int, StatePlace | None]:
        return {id(rp): lay.state_place(rp) for lay in self.layouts() for rp in lay.entries}

    def _partitioned_replicas(self) -> bool:
        return any(isinstance(lay, ReplicatedLayout) and lay.partitioned for lay in self.layouts())

    def state_dict(self) -> dict[str, Any]:
        """torch's layout, each partitioned value a piece of a global tensor (:mod:`.state_place`)
        so DCP reshards it; under DDP with owners, the whole state after
        :meth:`consolidate_state_dict` (DESIGN.md, "State dicts and checkpoints")."""
        self._follow_param_swaps()
        if self._partitioned_replicas() and self._has_state:
            return sd_.merge_consolidated(super().state_dict(), self._consolidated)
        return sd_.as_pieces(super().state_dict(), self._ordered(), self._places(), self._process_group)

    def consolidate_state_dict(self, to: int | None = 0) -> None:
        """Collective: gather a DDP job's owner-held state on rank ``to`` (every rank with
        ``None``), as ``ZeroRedundancyOptimizer.consolidate_state_dict``; valid until the next step."""
        self._follow_param_swaps()
        self._consolidated = None
        if self._partitioned_replicas():
            self._consolidated = sd_.gather_owner_state(self._ordered(), self.state, to)

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        """Load a state dict saved on any layout and world size (pieces, full tensors, fqn keys,
        0.1.0's groups); each rank keeps what it updates. ``KeyError`` names missing state."""
        self._follow_param_swaps()
        state_dict = state_dict.copy()
        for pre_hook in self._optimizer_load_state_dict_pre_hooks.values():
            result = pre_hook(self, state_dict)
            if result is not None:
                state_dict = result
        groups, fresh, self._fresh_at_init = self.param_groups, self._fresh_at_init, False
        try:
            saved_groups, loaded = sd_.agreed_local_state(  # every rank's checks agreed, then changes
                state_dict,
                groups,
                self._routed,
                self._group_user,
                self._places(),
                self.state,
                self._process_group,
            )
        except Exception:
            if fresh:  # refused (on every rank) after torch's initialisation step: no state again
                self.load_state_dict({**torch.optim.Optimizer.state_dict(self), "state": {}})
            raise
        saved_state = state_dict["state"]
        needed = [set(self._kinds[OptimizerKind(g["optimizer"])].defaults) for g in groups]
        sd_.restore_groups(groups, saved_groups, needed)  # in place: the child groups read them there
        for rp in self._routed:
            values = loaded.get(id(rp))
            if rp.proxy is None or values is None:
                self.state.pop(rp.param, None)
            else:
                self.state[rp.param] = dict(values)
        self._consolidated = None
        self._has_state = any(bool(st) for st in saved_state.values())
        for post_hook in self._optimizer_load_state_dict_post_hooks.values():
            post_hook(self)

    # -- introspection ------------------------------------------------------------------------------
    @property
    def matrix_optimizer(self) -> torch.optim.Optimizer | None:
        """The optimizer updating this rank's matrices (None if it updates none)."""
        return self._kinds[MATRIX].child

    @property
    def tail_optimizer(self) -> torch.optim.Optimizer | None:
        """The optimizer updating this rank's tail and ``rows`` rows (None if none)."""
        return self._kinds[TAIL].child

    def layouts(self) -> list[UpdateLayout]:
        """Every update layout of this optimizer, the matrix role's first (see :mod:`.layouts`)."""
        return [lay for ropt in self._kinds.values() for lay in ropt.layouts.values()]

    def extra_resident_bytes(self) -> int:
        """Bytes the layouts keep beyond params, grads and state (e.g. owners' full copies)."""
        return sum(lay.extra_resident_bytes() for lay in self.layouts())

    def routes(self) -> list[dict[str, Any]]:
        """Per stepped (not frozen) parameter: name, role, owner, whether local, layout."""
        self._follow_param_swaps()
        layout_of = self._layout_of()
        return [
            {
                "name": rp.label,
                "role": rp.role.value,
                "owner": rp.owner,
                "local": rp.proxy is not None,
                "layout": layout_of[id(rp)].name if id(rp) in layout_of else "?",
            }
            for rp in self._routed
            if rp.param.requires_grad
        ]

    def routing_report(self, large_numel: int = report.LARGE_NUMEL) -> report.RoutingReport:
        """What went where, per optimizer and role (see :mod:`.report`)."""
        return report.report_of_routes(
            [rp for rp in self._routed if rp.param.requires_grad],  # what is stepped
            self._kinds[MATRIX].name,
            self._kinds[TAIL].name,
            large_numel,
        )

    def __repr__(self) -> str:
        counts = {r.value: sum(1 for rp in self._routed if rp.role is r) for r in Role}
        local = sum(1 for rp in self._routed if rp.proxy is not None)
        return (
            f"OwnerRoutedOptimizer(matrix={self._kinds[MATRIX].name}, tail={self._kinds[TAIL].name}, "
            f"roles={counts}, local={local}/{len(self._routed)})"
        )

"""``OwnerRoutedOptimizer``: each matrix to a matrix optimizer on its owner, the rest to AdamW.

A ``torch.optim.Optimizer`` whose ``param_groups`` list every parameter on every rank (split
per role: a user group becomes a ``matrix`` group and a ``tail`` group), so learning-rate
schedulers, ``add_param_group`` and ``state_dict`` work as with any torch optimizer. Under the
hood two ordinary optimizers (the *children*) update only what this rank updates: on the
owner-shaped layout that is the matrices and tail it owns plus its rows of ``sharded``
tensors, and the step moves zero bytes. Hyperparameters flow from the parent groups to the
children at every step; optimizer state is shared between the two, so ``state_dict`` holds
exactly this rank's state keyed like any torch optimizer's.
"""

from __future__ import annotations

from typing import Any, Callable, Mapping

import torch

from ..comm import comm_phase
from ..planning.metadata import Role
from ..planning.roles import RoleOverrides
from .placements import Placement, RouterConfig, placement_for
from .registry import OptimizerFactory, resolve_optimizer
from .routing import RoutedParam, UserGroup, normalize_params, resolve_roles

__all__ = ["OwnerRoutedOptimizer"]

_ROLE_OPTIMIZER = {Role.MATRIX: Role.MATRIX, Role.TAIL: Role.TAIL, Role.SHARDED: Role.TAIL}


def _probe_defaults(factory: OptimizerFactory, options: Mapping[str, Any], what: str) -> dict[str, Any]:
    """The hyperparameters ``factory`` fills into a group, found by building it on a probe."""
    probe_param = torch.nn.Parameter(torch.zeros(2, 2))
    try:
        probe = factory([probe_param], **options)
    except TypeError as exc:
        raise ValueError(f"{what}_options {dict(options)!r} are not accepted by {factory!r}: {exc}") from exc
    if not isinstance(probe, torch.optim.Optimizer):
        raise TypeError(f"{what} factory {factory!r} returned {type(probe).__name__}, not a torch.optim.Optimizer")
    group = probe.param_groups[0]
    return {k: v for k, v in group.items() if k not in ("params", "param_names")}


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
        replicated: for parameters replicated on every rank of a multi-rank job (DDP),
            ``"owner"`` updates each matrix on one owner and shares the result;
            ``"redundant"`` updates every matrix on every rank and moves nothing.

    The layout decides what a step moves: zero bytes for owner-shaped parameters and in one
    process; see :mod:`matrix_owner_optim.optim.placements` for the others.
    """

    def __init__(
        self,
        params: Any,
        *,
        matrix: "str | OptimizerFactory" = "muon",
        matrix_options: Mapping[str, Any] | None = None,
        tail: "str | OptimizerFactory" = "adamw",
        tail_options: Mapping[str, Any] | None = None,
        roles: Mapping[str, str] | None = None,
        replicated: str = "owner",
    ) -> None:
        if replicated not in ("owner", "redundant"):
            raise ValueError(f"replicated must be 'owner' or 'redundant', got {replicated!r}")
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
        self._names = {Role.MATRIX: matrix if isinstance(matrix, str) else getattr(matrix, "__name__", str(matrix)),
                       Role.TAIL: tail if isinstance(tail, str) else getattr(tail, "__name__", str(tail))}
        self._overrides = RoleOverrides(roles)
        self._config = RouterConfig(matrix_factory=self._factories[Role.MATRIX], replicated=replicated)
        self._children: dict[Role, torch.optim.Optimizer | None] = {Role.MATRIX: None, Role.TAIL: None}
        # per child: (index of the parent group, the child's group dict)
        self._child_groups: dict[Role, list[tuple[int, dict[str, Any]]]] = {Role.MATRIX: [], Role.TAIL: []}
        self._placements: dict[type[Placement], Placement] = {}
        self._routed: list[RoutedParam] = []
        user_groups, self._type_roles = normalize_params(params)
        self._pending: list[UserGroup] = user_groups
        # torch's constructor calls add_param_group once per group; we hand it our groups.
        super().__init__([{"params": [rp.param for rp in g.params], "_moo_group": g} for g in user_groups], {})
        self._overrides.check_all_used()
        del self._pending

    # -- construction -------------------------------------------------------------------------
    def add_param_group(self, param_group: dict[str, Any]) -> None:
        """Add a group (tensors or ``(name, tensor)`` pairs); it is split by role like the others."""
        user_group: UserGroup | None = param_group.get("_moo_group")
        if user_group is None:
            groups, type_roles = normalize_params([param_group], start_index=len(self._routed))
            user_group = groups[0]
        else:
            type_roles = self._type_roles
        known = {id(rp.param) for rp in self._routed}
        for rp in user_group.params:
            if id(rp.param) in known:
                raise ValueError(f"parameter {rp.label!r} is already in another param group")
        resolve_roles([user_group], type_roles, self._overrides, check_globs=False)
        for key in user_group.options:
            if not any(key in self._role_defaults[r] for r in (Role.MATRIX, Role.TAIL)):
                raise ValueError(
                    f"param group option {key!r} is accepted by neither the matrix optimizer "
                    f"({self._names[Role.MATRIX]}) nor the tail optimizer ({self._names[Role.TAIL]})"
                )
        by_optimizer: dict[Role, list[RoutedParam]] = {Role.MATRIX: [], Role.TAIL: []}
        for rp in user_group.params:
            by_optimizer[_ROLE_OPTIMIZER[rp.role]].append(rp)

        new_entries: dict[type[Placement], list[RoutedParam]] = {}
        for rp in user_group.params:
            new_entries.setdefault(placement_for(rp.param, rp.label), []).append(rp)
        for cls, entries in new_entries.items():
            if cls not in self._placements:
                self._placements[cls] = cls(self._config)
            self._placements[cls].add(entries)
        self._routed.extend(user_group.params)

        for role, rps in by_optimizer.items():
            if not rps:
                continue
            defaults = self._role_defaults[role]
            group = {"params": [rp.param for rp in rps], "role": role.value, **defaults}
            group.update({k: v for k, v in user_group.options.items() if k in defaults})
            super().add_param_group(group)
            self._attach_child_group(len(self.param_groups) - 1, role, rps)

    def _attach_child_group(self, parent_index: int, role: Role, rps: list[RoutedParam]) -> None:
        local = [rp for rp in rps if rp.proxy is not None]
        if not local:
            return
        parent = self.param_groups[parent_index]
        group = {"params": [rp.proxy for rp in local],
                 **{k: parent[k] for k in self._role_defaults[role]}}
        child = self._children[role]
        if child is None:
            child = self._factories[role]([group], **self._options[role])
            self._children[role] = child
        else:
            child.add_param_group(group)
        self._child_groups[role].append((parent_index, child.param_groups[-1]))
        for rp in local:
            assert rp.proxy is not None
            self.state[rp.param] = child.state[rp.proxy]

    # -- the step --------------------------------------------------------------------------------
    def _sync_hyperparameters(self) -> None:
        for role, pairs in self._child_groups.items():
            for parent_index, child_group in pairs:
                parent = self.param_groups[parent_index]
                for key in child_group:
                    if key != "params" and key in parent:
                        child_group[key] = parent[key]

    def step(self, closure: Callable[[], Any] | None = None) -> Any:  # type: ignore[override]
        """One update of every parameter this rank updates; returns ``closure()`` if given."""
        loss = None
        if closure is not None:
            with torch.enable_grad():
                loss = closure()
        with comm_phase("optimizer"), torch.no_grad():
            self._sync_hyperparameters()
            for placement in self._placements.values():
                placement.before_step()
            for child in self._children.values():
                if child is not None:
                    child.step()
            for placement in self._placements.values():
                placement.after_step()
        return loss

    def zero_grad(self, set_to_none: bool = True) -> None:
        super().zero_grad(set_to_none=set_to_none)
        for placement in self._placements.values():
            placement.zero_grad(set_to_none)

    # -- state -------------------------------------------------------------------------------------
    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        """Load as torch does, then hand the loaded state to the child optimizers."""
        super().load_state_dict(state_dict)
        for rp in self._routed:
            if rp.proxy is None:
                self.state.pop(rp.param, None)
                continue
            child = self._children[_ROLE_OPTIMIZER[rp.role]]
            assert child is not None
            child.state[rp.proxy] = self.state[rp.param]
        self._sync_hyperparameters()

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
        layout_of = {id(rp): cls.name for cls, pl in self._placements.items() for rp in pl.entries}
        return [
            {"name": rp.label, "role": rp.role.value, "owner": rp.owner, "local": rp.proxy is not None,
             "layout": layout_of.get(id(rp), "?")}
            for rp in self._routed
        ]

    def __repr__(self) -> str:
        counts = {r.value: sum(1 for rp in self._routed if rp.role is r) for r in Role}
        local = sum(1 for rp in self._routed if rp.proxy is not None)
        return (f"OwnerRoutedOptimizer(matrix={self._names[Role.MATRIX]}, tail={self._names[Role.TAIL]}, "
                f"roles={counts}, local={local}/{len(self._routed)})")

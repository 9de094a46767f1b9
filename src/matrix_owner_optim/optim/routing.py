"""Which optimizer updates which parameter: normalising ``params`` and resolving roles.

``OwnerRoutedOptimizer`` accepts what ``torch.optim`` optimizers accept, and a module. Roles
come, in order of precedence, from a ``"role"`` key of a param group, from ``roles=`` globs
(wherever names are known), from the parameter's :class:`MatrixShard` (after ``fully_shard``),
from the module types (when a module is given), from the name, and finally from the shape.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Iterable, Mapping

import torch
from torch import nn

from ..planning.metadata import MatrixShard, Role, get_matrix_shard, is_awaiting_shard, parse_role
from ..planning.roles import RoleOverrides, module_roles, role_from_name, validate_role

__all__ = ["RoutedParam", "UserGroup", "normalize_params", "resolve_roles"]


@dataclass(eq=False)
class RoutedParam:
    """One parameter as the router sees it.

    ``proxy`` is the tensor the matrix or tail optimizer updates on this rank (the parameter
    itself, a 2D view of a conv kernel, or an owner's full working copy), or ``None`` when
    another rank updates it.
    """

    param: torch.Tensor
    name: str | None
    index: int
    role: Role = Role.TAIL
    shard: MatrixShard | None = None
    proxy: torch.Tensor | None = None
    owner: int | None = None

    @property
    def label(self) -> str:
        return self.name if self.name is not None else f"parameter #{self.index} {tuple(self.param.shape)}"


@dataclass
class UserGroup:
    """A param group as the user gave it: its parameters and its option overrides."""

    params: list[RoutedParam]
    options: dict[str, Any] = field(default_factory=dict)
    role: Role | None = None


def _named(items: Iterable[Any]) -> list[tuple[str | None, torch.Tensor]]:
    out: list[tuple[str | None, torch.Tensor]] = []
    for item in items:
        if isinstance(item, tuple) and len(item) == 2 and isinstance(item[0], str):
            out.append((item[0], item[1]))
        elif isinstance(item, torch.Tensor):
            out.append((None, item))
        else:
            raise TypeError(
                "params must be a module, tensors, (name, tensor) pairs or param-group dicts; "
                f"got an element of type {type(item).__name__}"
            )
    return out


def normalize_params(params: Any, start_index: int = 0) -> tuple[list[UserGroup], dict[int, Role]]:
    """Turn ``params`` into user groups; also return module-type roles when a module is given."""
    type_roles: dict[int, Role] = {}
    if isinstance(params, nn.Module):
        type_roles = module_roles(params)
        params = list(params.named_parameters())
    elif isinstance(params, torch.Tensor):
        raise TypeError(
            "params argument given to the optimizer should be an iterable of Tensors or dicts, "
            f"but got {torch.typename(params)}"
        )
    items = list(params)
    if not items:
        raise ValueError("optimizer got an empty parameter list")
    raw_groups = items if isinstance(items[0], dict) else [{"params": items}]
    groups: list[UserGroup] = []
    index = start_index
    seen: set[int] = set()
    for g in raw_groups:
        if not isinstance(g, dict):
            raise TypeError("param groups must all be dicts when the first one is")
        if "params" not in g:
            raise ValueError("a param group needs a 'params' entry")
        ps = g["params"]
        ps = [ps] if isinstance(ps, torch.Tensor) else list(ps)
        routed = []
        for name, p in _named(ps):
            if id(p) in seen:
                raise ValueError(f"parameter {name or tuple(p.shape)} appears in more than one group")
            seen.add(id(p))
            routed.append(RoutedParam(p, name, index))
            index += 1
        options = {k: v for k, v in g.items() if k not in ("params", "role")}
        role = parse_role(g["role"], where="param group 'role'") if "role" in g else None
        groups.append(UserGroup(routed, options, role))
    return groups, type_roles


def resolve_roles(
    groups: list[UserGroup],
    type_roles: Mapping[int, Role],
    overrides: RoleOverrides,
    *,
    check_globs: bool = True,
) -> None:
    """Fill ``role`` (and ``shard``) of every :class:`RoutedParam`, validating matrix shapes."""
    for g in groups:
        for rp in g.params:
            if is_awaiting_shard(rp.param):
                raise ValueError(
                    f"parameter {rp.label!r} belongs to a module passed to fully_shard that is not "
                    "sharded yet: call fully_shard on the root model (after the blocks) before "
                    "building the optimizer, so it receives the sharded parameters"
                )
            rp.shard = get_matrix_shard(rp.param)
            names = []
            if rp.name is not None:
                names.append(rp.name)
            if rp.shard is not None:
                names.extend([rp.shard.fqn, *rp.shard.aliases])
            shape = tuple(rp.shard.shape) if rp.shard is not None else tuple(rp.param.shape)
            override = overrides.lookup(names) if names else None
            if g.role is not None:
                role = g.role
            elif override is not None:
                role = override
            elif rp.shard is not None:
                role = rp.shard.role
            elif id(rp.param) in type_roles:
                role = type_roles[id(rp.param)]
            elif rp.name is not None:
                role = role_from_name(rp.name, shape)
            else:
                role = Role.MATRIX if len(shape) == 2 else Role.TAIL
            validate_role(rp.label, shape, role)
            if rp.shard is not None and rp.shard.role is Role.SHARDED and role is Role.MATRIX:
                raise ValueError(
                    f"parameter {rp.label!r} is sharded by rows ({rp.shard.role.value}) and cannot be "
                    "routed to the matrix optimizer; re-plan with roles={...: 'matrix'} in fully_shard"
                )
            rp.role = role
    if check_globs:
        overrides.check_all_used()

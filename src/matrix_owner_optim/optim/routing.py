"""Which optimizer updates which parameter: normalising ``params`` and resolving roles.

A tensor's role comes from a group's ``"role"``, ``roles=`` globs, its :class:`MatrixShard`, the
module types, the name, or the shape, in that order; which optimizer steps it
(:class:`OptimizerKind`) follows from the role. Pure: the optimizer fixes pending plans first.
"""

from __future__ import annotations

import enum
import warnings
from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field
from typing import Any, cast

import torch
from torch import nn

from ..planning.bands import declare_row_band
from ..planning.metadata import MatrixShard, Role, get_matrix_shard, get_shard_rank, parse_role
from ..planning.roles import RoleOverrides, module_roles, role_from_name, router_fqns, validate_role
from ..planning.views import MatrixView, ViewOverrides, declare_matrix_view
from ..tensors import is_dtensor

__all__ = [
    "OptimizerKind",
    "RoutedParam",
    "UserGroup",
    "normalize_params",
    "resolve_roles",
    "check_matrix_views",
    "declare_matrix_views",
    "optimizer_kind",
    "swapped_in",
]


class OptimizerKind(str, enum.Enum):
    """Which of the two optimizers steps a tensor: a param group's ``"optimizer"`` key."""

    MATRIX = "matrix"
    TAIL = "tail"


def optimizer_kind(role: Role) -> OptimizerKind:
    """The optimizer that steps a tensor of ``role`` (``tail`` and ``rows`` tensors: the tail's)."""
    return OptimizerKind.MATRIX if role is Role.MATRIX else OptimizerKind.TAIL


@dataclass(eq=False)
class RoutedParam:
    """One parameter as the router sees it; ``proxy``: what its optimizer updates here (or None)."""

    param: torch.Tensor
    name: str | None
    index: int
    role: Role = Role.TAIL
    shard: MatrixShard | None = None
    proxy: torch.Tensor | None = None
    owner: int | None = None
    view: MatrixView | None = None  # how the matrix optimizer reads it (matrix role only)
    # the shape its owner steps where that is not the global one (an expert parallel slice)
    step_shape: tuple[int, ...] | None = None

    @property
    def global_shape(self) -> tuple[int, ...]:
        """The parameter's shape in the model (its plan's, where owner-sharded)."""
        return tuple(self.shard.shape) if self.shard is not None else tuple(self.param.shape)

    @property
    def label(self) -> str:
        if self.name is not None:
            return self.name
        return f"parameter #{self.index} {tuple(self.param.shape)}"

    @property
    def fqn(self) -> str:
        """Its name, else its plan's fqn, else :attr:`label`: the key of its state and reports."""
        return self.name or (self.shard.fqn if self.shard is not None else self.label)


@dataclass
class UserGroup:
    """A param group as the user gave it: its parameters and its option overrides."""

    params: list[RoutedParam]
    options: dict[str, Any] = field(default_factory=dict)
    role: Role | None = None
    kind: OptimizerKind | None = None  # a recorded "optimizer" key (a param_groups round trip)
    names_given: bool = True  # False: names read off a module (routing only, not recorded)

    @property
    def named(self) -> bool:
        """Whether the user named every parameter (then the groups record ``param_names``)."""
        return self.names_given and bool(self.params) and all(rp.name is not None for rp in self.params)


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


def _param_names(names: Any, count: int) -> list[str]:
    """A group's ``"param_names"``, checked: one string per parameter."""
    if isinstance(names, str) or not all(isinstance(n, str) for n in names):
        raise TypeError(f"param group 'param_names' must be a list of strings, got {names!r}")
    names = list(names)
    if len(names) != count:
        raise ValueError(
            f"param group 'param_names' has {len(names)} names for {count} parameters; give one "
            "name per parameter, in the order of 'params'"
        )
    return names


def normalize_params(params: Any, start_index: int = 0) -> tuple[list[UserGroup], dict[int, Role]]:
    """Turn ``params`` into user groups; also return module-type roles when a module is given."""
    type_roles: dict[int, Role] = {}
    from_module = isinstance(params, nn.Module)
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
        named = _named(ps)
        given_names = g.get("param_names")
        if given_names is not None and all(name is None for name, _ in named):
            named = list(zip(_param_names(given_names, len(named)), (p for _, p in named), strict=True))
        routed = []
        for name, p in named:
            if id(p) in seen:
                raise ValueError(f"parameter {name or tuple(p.shape)} appears in more than one group")
            seen.add(id(p))
            routed.append(RoutedParam(p, name, index))
            index += 1
        options = {k: v for k, v in g.items() if k not in ("params", "param_names", "role", "optimizer")}
        role = parse_role(cast("str | Role", g["role"]), where="param group 'role'") if "role" in g else None
        groups.append(UserGroup(routed, options, role, _parse_kind(g), names_given=not from_module))
    return groups, type_roles


def _parse_kind(group: Mapping[str, Any]) -> OptimizerKind | None:
    """A group's recorded ``"optimizer"`` (``"matrix"`` or ``"tail"``), checked."""
    if "optimizer" not in group:
        return None
    try:
        return OptimizerKind(group["optimizer"])
    except ValueError:
        raise ValueError(
            f"param group 'optimizer' is {group['optimizer']!r}; OwnerRoutedOptimizer records 'matrix' "
            "or 'tail' there (which optimizer steps the group). To choose a tensor's role, set "
            "'role' ('matrix', 'tail' or 'rows')"
        ) from None


def check_recorded_kind(group: UserGroup) -> None:
    """Refuse a group whose recorded ``"optimizer"`` disagrees with its tensors' roles."""
    for rp in group.params:
        if group.kind is not None and optimizer_kind(rp.role) is not group.kind:
            raise ValueError(
                f"param group 'optimizer' is {group.kind.value!r}, but parameter {rp.label!r} has role "
                f"{rp.role.value!r}, which the {optimizer_kind(rp.role).value} optimizer steps. "
                "'optimizer' is recorded by OwnerRoutedOptimizer; choose a role with 'role' instead"
            )


def resolve_roles(
    groups: list[UserGroup],
    type_roles: Mapping[int, Role],
    overrides: RoleOverrides,
    *,
    views: ViewOverrides | None = None,
    convs: Mapping[int, bool] | None = None,
) -> None:
    """Fill ``role``, ``shard`` and (matrices) ``view`` of every :class:`RoutedParam`; ``convs``:
    per parameter, whether its module is a convolution. Warns once, naming every matrix routed
    by shape alone."""
    by_shape: list[str] = []
    views = views if views is not None else ViewOverrides(None)
    for g in groups:
        for rp in g.params:
            rp.shard = get_matrix_shard(rp.param)
    routers = router_fqns(
        n
        for g in groups
        for rp in g.params
        for n in ([rp.name] if rp.name else []) + ([rp.shard.fqn] if rp.shard else [])
    )
    for g in groups:
        for rp in g.params:
            names = ([rp.name] if rp.name is not None else []) + (
                [rp.shard.fqn, *rp.shard.aliases] if rp.shard is not None else []
            )
            shape = rp.global_shape
            override = overrides.lookup(names) if names else None
            if g.role is not None:
                role = g.role
            elif override is not None:
                role = override
            elif rp.shard is not None:
                role = rp.shard.routed_role
            elif id(rp.param) in type_roles:
                role = type_roles[id(rp.param)]
            elif rp.name is not None:
                role = role_from_name(rp.name, shape, router=rp.name in routers)
            else:
                role = Role.MATRIX if len(shape) == 2 else Role.TAIL
                if role is Role.MATRIX:
                    by_shape.append(rp.label)
            validate_role(rp.label, shape, role)
            if role is Role.MATRIX:
                _require_matrix_view(rp)
                rp.view = views.view_for(names or [rp.label], shape, (convs or {}).get(id(rp.param)))
                rp.view.resolve(shape, rp.label)  # a view that does not fit fails here, naming it
            if rp.shard is not None and rp.shard.role is Role.ROWS and role is Role.MATRIX:
                raise ValueError(
                    f"parameter {rp.label!r} is sharded by rows ({rp.shard.role.value}) and cannot "
                    "be routed to the matrix optimizer; re-plan with "
                    "fully_shard(..., plan=plan_model(model, W, roles={...: 'matrix'}))"
                )
            rp.role = role
        check_recorded_kind(g)
    if by_shape:
        warnings.warn(
            f"{len(by_shape)} parameter(s) without names were routed by shape alone to the "
            f"matrix optimizer: {', '.join(by_shape)}. An embedding table or an output head "
            "among them gets the matrix optimizer. Pass the model itself or "
            "model.named_parameters() (roles by module type or name), or param groups "
            "with a 'role'.",
            UserWarning,
            stacklevel=3,  # the caller of OwnerRoutedOptimizer(...) or of add_param_group
        )


def check_matrix_views(rps: Iterable[RoutedParam], factory: Any, name: str) -> None:
    """Refuse stacks and bands for a matrix optimizer that does not step them."""
    if not getattr(factory, "accepts_row_bands", False):
        for rp in rps:
            if rp.role is Role.MATRIX and _is_band(rp):
                raise ValueError(
                    f"parameter {rp.label!r} is cut into bands of rows between owners (a plan priced for "
                    f"blocked Shampoo), but the matrix optimizer {name!r} steps whole matrices; plan with "
                    "its own cost model (fully_shard(preconditioner=...)) or use matrix='shampoo'"
                )
    if getattr(factory, "accepts_matrix_views", False):
        return
    for rp in rps:
        if rp.role is not Role.MATRIX or rp.view is None:
            continue
        layout = rp.view.resolve(rp.global_shape, rp.label)
        if not layout.single:
            raise ValueError(
                f"parameter {rp.label!r} (shape {rp.global_shape}) is {layout.num_matrices} matrices "
                f"({rp.view.label}), but the matrix optimizer {name!r} steps whole 2D tensors only. "
                "Use matrix='muon', 'shampoo' or 'soap' (they step each matrix alone), route it "
                f"to the tail (roles={{{rp.label!r}: 'tail'}}), or read it as one (out, rest) "
                f"matrix (matrix_views={{{rp.label!r}: 'conv'}})"
            )


def _is_band(rp: RoutedParam) -> bool:
    """A 2D matrix whose rows a plan split between owners (blocked Shampoo's bands)."""
    return rp.shard is not None and rp.shard.is_split and len(rp.shard.shape) == 2


def declare_matrix_views(rps: Iterable[RoutedParam]) -> None:
    """Record every matrix's view (and band rows) on its ``proxy``."""
    for rp in rps:
        if rp.role is Role.MATRIX and rp.view is not None and rp.proxy is not None:
            shape = tuple(rp.global_shape) if rp.step_shape is None else rp.step_shape
            if rp.shard is not None and rp.shard.is_split:  # this rank's experts (or band) only
                start, stop = rp.shard.row_range(get_shard_rank(rp.param) or 0)
                shape = (stop - start, *shape[1:])
                if _is_band(rp):
                    declare_row_band(rp.proxy, start, stop, int(rp.shard.shape[0]))
            declare_matrix_view(rp.proxy, rp.view, shape=shape, name=rp.label)


def _require_matrix_view(rp: RoutedParam) -> None:
    """Refuse a >2D matrix whose storage has no ``(out, rest)`` view (e.g. channels-last)."""
    param = rp.param
    if param.dim() <= 2 or param.numel() == 0 or is_dtensor(param):
        return
    try:
        param.detach().view(param.shape[0], -1)
    except RuntimeError:
        layout = (
            "channels_last"
            if param.is_contiguous(memory_format=torch.channels_last)
            else f"strides {tuple(param.stride())}"
        )
        raise ValueError(
            f"parameter {rp.label!r} (shape {tuple(param.shape)}, {layout}) takes role 'matrix' "
            "but its memory has no 2D (out, rest) view, so the matrix optimizer would update a "
            "copy. Make it contiguous (model.to(memory_format=torch.contiguous_format)) or "
            f"route it to the tail (roles={{{rp.label!r}: 'tail'}})."
        ) from None


def swapped_in(previous: RoutedParam, param: Any) -> RoutedParam:
    """The routing of ``param``, swapped into ``param_groups`` for ``previous.param``: same name,
    index and role, the new tensor's sharding metadata, checked as :func:`resolve_roles` does."""
    if not isinstance(param, torch.Tensor):
        raise TypeError(f"param_groups entry in place of {previous.label!r} is a {type(param).__name__}, not a tensor")
    rp = RoutedParam(param, previous.name, previous.index, role=previous.role)
    rp.shard = get_matrix_shard(param)
    if rp.shard is not None and rp.shard.role is Role.ROWS and rp.role is Role.MATRIX:
        raise ValueError(
            f"parameter {rp.label!r} was routed to the matrix optimizer, but the tensor swapped into "
            "param_groups in its place is sharded by rows; re-plan with "
            "fully_shard(..., plan=plan_model(model, W, roles={...: 'matrix'}))"
        )
    if rp.role is Role.MATRIX:
        _require_matrix_view(rp)
    return rp

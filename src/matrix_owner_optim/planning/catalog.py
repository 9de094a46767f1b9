"""The optimizer registry: one entry per name, holding the optimizer's factory and its cost, and
:func:`resolve_cost`, the one rule that turns what a user names into the cost that prices a plan.

Every name ``OwnerRoutedOptimizer(matrix=..., tail=...)``, ``plan_model(preconditioner=...)`` and
``fully_shard(preconditioner=...)`` accept is one :class:`OptimizerEntry`, read by the router
(the factory, ``optim.registry.resolve_optimizer``) and the planner (the cost) alike, so a name
cannot mean two optimizers. It lives in ``planning`` because imports point downward; the table
imports no optimizer until one is resolved. Names come from three sources, none of which can
silently replace another: the built-ins (:data:`BUILTINS`, ``"module:attribute"`` targets
imported on first use), :func:`register_optimizer` in code (``register_preconditioner``, its
first name), and the entry points of installed distributions (:data:`ENTRY_POINT_GROUP`, or
:data:`PRECONDITIONER_ENTRY_POINT_GROUP`, its first name); a collision raises when the name is
resolved, naming both sides. A factory is called as ``factory(param_groups, **options)``; its
cost is the one registered with it, else its ``cost_model``, else :data:`DEFAULT_COST`. The
resolution order is DESIGN.md's ("Experts as ownable units and the plan's price").
"""

from __future__ import annotations

import importlib
import importlib.metadata
import os
import sys
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from types import MappingProxyType
from typing import Any, TypeAlias

from .cost import (
    ADAMW_COST,
    MUON_COST,
    SGD_COST,
    SHAMPOO_COST,
    SOAP_COST,
    TORCH_OPTIMIZER_SHAMPOO_COST,
    CostModel,
)

__all__ = [
    "BUILTINS",
    "DEFAULT_COST",
    "ENTRY_POINT_GROUP",
    "PRECONDITIONER_ENTRY_POINT_GROUP",
    "CostSpec",
    "OptimizerEntry",
    "OptimizerFactory",
    "available_cost_models",
    "available_optimizers",
    "lookup",
    "register_cost_model",
    "register_optimizer",
    "register_preconditioner",
    "resolve_cost",
]

ENTRY_POINT_GROUP = "matrix_owner_optim.optimizers"
# The group's first name, read alike: plugins declared there keep working.
PRECONDITIONER_ENTRY_POINT_GROUP = "matrix_owner_optim.preconditioners"
_GROUPS = (ENTRY_POINT_GROUP, PRECONDITIONER_ENTRY_POINT_GROUP)

# The one default cost: a plan no one priced is priced as Muon (one state buffer of the
# parameter's size plus an orthogonalisation: conservative, never zero).
DEFAULT_COST: CostModel = MUON_COST

# ``factory(param_groups, **options) -> torch.optim.Optimizer``
OptimizerFactory = Callable[..., Any]

# What the edges accept for a cost: a registered name, a cost model, or an optimizer class /
# factory (its ``cost_model``, else the cost registered with it). Below the edges: ``CostModel``.
CostSpec: TypeAlias = "str | CostModel | OptimizerFactory"


@dataclass(eq=False)
class OptimizerEntry:
    """One registered name: where its optimizer comes from, the optimizer, and its cost.

    ``target`` is a ``"module:attribute"`` imported by :meth:`load` on first use (built-ins,
    entry points); ``factory`` the optimizer class or factory once known; ``cost`` the cost
    model registered with it (``None``: the factory's own ``cost_model``, else
    :data:`DEFAULT_COST`). An entry made by :func:`register_cost_model` alone has a cost and no
    factory.
    """

    name: str
    source: str  # "built-in", "code" or "entry point of '<distribution>'", for error messages
    target: str | None = None
    factory: OptimizerFactory | None = None
    cost: CostModel | None = None

    def load(self, what: str = "matrix", spelled: str | None = None) -> OptimizerFactory:
        """The factory, importing ``target`` the first time; ``what`` and ``spelled`` (the name as
        the user wrote it) word the errors."""
        if self.factory is None:
            if self.target is None:
                raise ValueError(
                    f"{what} optimizer {spelled or self.name!r} has a cost model (register_cost_model) "
                    "but no optimizer; register one with matrix_owner_optim.register_optimizer"
                )
            self.factory = _import_target(self.target, spelled or self.name, what, self.source)
        return self.factory


def _builtin(name: str, target: str, cost: CostModel) -> OptimizerEntry:
    return OptimizerEntry(name, "built-in", target=target, cost=cost)


_BUILTIN_ENTRIES: dict[str, OptimizerEntry] = {
    e.name: e
    for e in (
        _builtin("muon", "matrix_owner_optim.preconditioners:Muon", MUON_COST),
        _builtin("shampoo", "matrix_owner_optim.preconditioners:Shampoo", SHAMPOO_COST),
        _builtin("soap", "matrix_owner_optim.preconditioners:SOAP", SOAP_COST),
        _builtin("adamw", "torch.optim:AdamW", ADAMW_COST),
        _builtin("adam", "torch.optim:Adam", ADAMW_COST),
        _builtin("sgd", "torch.optim:SGD", SGD_COST),
        _builtin("torch_muon", "torch.optim:Muon", MUON_COST),
        _builtin("torch_optimizer_shampoo", "torch_optimizer:Shampoo", TORCH_OPTIMIZER_SHAMPOO_COST),
    )
}

# name -> "module:attribute" of every built-in (read-only; the entries above are the source).
BUILTINS: Mapping[str, str] = MappingProxyType({n: e.target for n, e in _BUILTIN_ENTRIES.items() if e.target})

# Every name known so far: the built-ins, code registrations, and entry points once looked up.
_entries: dict[str, OptimizerEntry] = dict(_BUILTIN_ENTRIES)


def _normalize(name: str) -> str:
    if not isinstance(name, str) or not name.strip():
        raise ValueError(f"optimizer name must be a non-empty string, got {name!r}")
    return name.strip().lower()


def _same_target(a: str, b: str) -> bool:
    return a.replace(" ", "") == b.replace(" ", "")


def _stated_cost(obj: Any) -> CostModel | None:
    """The ``cost_model`` an optimizer class, factory or built optimizer carries, if it is one."""
    cost = getattr(obj, "cost_model", None)
    return cost if isinstance(cost, CostModel) else None


def _import_target(target: str, name: str, what: str, source: str) -> OptimizerFactory:
    module_name, _, attr = target.partition(":")
    try:
        obj: Any = importlib.import_module(module_name.strip())
        for part in attr.strip().split(".") if attr.strip() else []:
            obj = getattr(obj, part)
    except (ImportError, AttributeError) as exc:
        raise ValueError(
            f"{what} optimizer {name!r} comes from {source} {target!r}, which cannot be "
            f"imported ({exc}); install the package that provides it"
        ) from exc
    if not callable(obj):
        raise TypeError(f"{what} optimizer {name!r} ({source} {target!r}) is not callable: {obj!r}")
    return obj


def _is_code(entry: OptimizerEntry | None) -> bool:
    return entry is not None and entry.source == "code"


def register_optimizer(
    name: str, factory: OptimizerFactory, *, cost_model: CostModel | None = None, overwrite: bool = False
) -> None:
    """Make ``name`` usable as ``matrix=`` or ``tail=`` of ``OwnerRoutedOptimizer`` and as
    ``preconditioner=`` of the planner (``register_preconditioner`` is this function).

    Args:
        name: case-insensitive name.
        factory: an optimizer class, or any callable ``factory(params, **options)``.
        cost_model: what the planner charges per tensor; default: ``factory.cost_model`` where
            it has one, else :data:`DEFAULT_COST`.
        overwrite: replace a built-in or an existing registration instead of raising.
    """
    key = _normalize(name)
    if not callable(factory):
        raise TypeError(f"register_optimizer({name!r}): factory must be callable, got {factory!r}")
    if cost_model is not None and not isinstance(cost_model, CostModel):
        raise TypeError(
            f"register_optimizer({name!r}): cost_model must have name, state_bytes(shape, dtype) "
            f"and flops(shape), got {cost_model!r}"
        )
    existing = _entries.get(key)
    if not overwrite and existing is not None and (existing.factory is not None or existing.target is not None):
        if existing.source == "built-in" and existing.load(spelled=name) is not factory:
            raise ValueError(
                f"{key!r} is a built-in optimizer ({existing.target}); pick another name or pass "
                "overwrite=True to replace it"
            )
        if _is_code(existing) and existing.factory is not factory:
            raise ValueError(
                f"an optimizer named {key!r} is already registered ({existing.factory!r}); "
                "pass overwrite=True to replace it"
            )
        if cost_model is None:
            return  # the same factory again: nothing changes
    kept_cost = existing.cost if existing is not None and existing.factory is None and existing.target is None else None
    _entries[key] = OptimizerEntry(key, "code", factory=factory, cost=cost_model or _stated_cost(factory) or kept_cost)


register_preconditioner = register_optimizer  # the first name, kept: users' code calls it


def register_cost_model(name: str, model: CostModel) -> None:
    """Make ``plan_model(..., preconditioner=name)`` use ``model``: the cost of the entry
    ``name`` (a new entry with a cost and no optimizer if the name is unknown)."""
    if not isinstance(model, CostModel):
        raise TypeError(f"cost model for {name!r} must have name, state_bytes(shape, dtype) and flops(shape)")
    key = _normalize(name)
    entry = lookup(key)
    if entry is None:
        _entries[key] = OptimizerEntry(key, "code", cost=model)
    else:
        entry.cost = model


def _dist_name(ep: importlib.metadata.EntryPoint) -> str:
    dist = getattr(ep, "dist", None)
    return dist.name if dist is not None else "an unknown distribution"


_scans: dict[tuple[tuple[str, int | None], ...], dict[str, list[importlib.metadata.EntryPoint]]] = {}


def _path_stamp() -> tuple[tuple[str, int | None], ...]:
    """Each ``sys.path`` directory and its modification time: what installing or removing a
    distribution changes (``importlib.metadata`` keys its own path cache on the same)."""
    stamp: list[tuple[str, int | None]] = []
    for entry in sys.path:
        where = os.path.abspath(entry or os.curdir)
        try:
            stamp.append((where, os.stat(where).st_mtime_ns))
        except OSError:
            stamp.append((where, None))
    return tuple(stamp)


def _entry_points() -> dict[str, list[importlib.metadata.EntryPoint]]:
    """Every entry point of both groups, by normalised name; scanned again when
    :func:`_path_stamp` changed. A scan reads every installed distribution's metadata (0.1 s and
    more in a full environment), and every optimizer lookup asks."""
    stamp = _path_stamp()
    if stamp not in _scans:
        out: dict[str, list[importlib.metadata.EntryPoint]] = {}
        for group in _GROUPS:
            for ep in importlib.metadata.entry_points(group=group):
                out.setdefault(ep.name.strip().lower(), []).append(ep)
        _scans.clear()
        _scans[stamp] = out
    return _scans[stamp]


def _entry_point_for(key: str) -> importlib.metadata.EntryPoint | None:
    """The one entry point providing ``key``, or None; raises on any collision, naming both."""
    eps = _entry_points().get(key, [])
    if key in BUILTINS:
        # This package's own (possibly stale) metadata may restate a built-in: not a collision.
        others = [ep for ep in eps if not _same_target(ep.value, BUILTINS[key])]
        if others:
            ep = others[0]
            raise ValueError(
                f"optimizer name {key!r} is a built-in ({BUILTINS[key]}), and distribution "
                f"{_dist_name(ep)!r} also declares it in the entry-point group "
                f"{ep.group!r} ({ep.value}). Refusing to choose: rename the entry point "
                f"in {_dist_name(ep)!r} or uninstall it."
            )
        return None
    distinct: list[importlib.metadata.EntryPoint] = []
    for ep in eps:
        if not any(_same_target(ep.value, d.value) for d in distinct):
            distinct.append(ep)
    if len(distinct) > 1:
        a, b = distinct[0], distinct[1]
        raise ValueError(
            f"optimizer name {key!r} is declared by distribution {_dist_name(a)!r} ({a.value}, "
            f"entry-point group {a.group!r}) and by distribution {_dist_name(b)!r} ({b.value}, "
            f"group {b.group!r}). Refusing to choose: rename one or uninstall one."
        )
    registered = _entries.get(key)
    if distinct and _is_code(registered):
        ep = distinct[0]
        assert registered is not None
        raise ValueError(
            f"optimizer name {key!r} is registered in code ({registered.factory or registered.cost!r}) and "
            f"declared by distribution {_dist_name(ep)!r} ({ep.value}) in {ep.group!r}. "
            "Refusing to choose: register under another name."
        )
    return distinct[0] if distinct else None


def lookup(name: str) -> OptimizerEntry | None:
    """The entry of ``name`` (case-insensitive), or None if no source provides it. Raises
    ``ValueError`` when two sources provide it (naming both), before anything is imported."""
    key = _normalize(name)
    ep = _entry_point_for(key)
    entry = _entries.get(key)
    if entry is None and ep is not None:
        entry = OptimizerEntry(key, f"entry point of {_dist_name(ep)!r}", target=ep.value)
        _entries[key] = entry
    return entry


def available_optimizers() -> list[str]:
    """Every name that ``resolve_optimizer`` may accept (built-in, registered and installed)."""
    with_optimizer = {n for n, e in _entries.items() if e.factory is not None or e.target is not None}
    return sorted(with_optimizer | set(_entry_points()))


def available_cost_models() -> list[str]:
    """Every name the planner can price (each registered optimizer, and costs registered alone)."""
    return sorted(set(_entries) | set(_entry_points()))


def resolve_cost(spec: CostSpec | None, *, built: object | None = None) -> CostModel:
    """The cost model that prices a plan for ``spec``: the one rule, used by every edge.

    In order: a :class:`~.cost.CostModel` is itself; ``built`` (an optimizer as configured,
    e.g. ``Shampoo(..., max_preconditioner_dim=32)``) prices by the ``cost_model`` it states;
    ``None`` is :data:`DEFAULT_COST`; a name is its registry entry's cost (registered with the
    name, else its factory's ``cost_model``); an optimizer class or factory is its own
    ``cost_model``, else the cost registered in code with it. What states no cost is priced as
    :data:`DEFAULT_COST`.

    Raises:
        ValueError: for an unknown name (listing the known ones) or a name two sources provide.
        TypeError: for anything else (naming what was given).
    """
    if isinstance(spec, CostModel):
        return spec
    stated = _stated_cost(built)
    if stated is not None:
        return stated
    if spec is None:
        return DEFAULT_COST
    if isinstance(spec, str):
        entry = lookup(spec)
        if entry is None:
            raise ValueError(
                f"no cost model for preconditioner {spec!r}; known: "
                f"{', '.join(available_cost_models())}. Register one with "
                "matrix_owner_optim.register_optimizer(name, factory, cost_model=...) or "
                "planning.register_cost_model."
            )
        return entry.cost or _stated_cost(entry.load()) or DEFAULT_COST
    if callable(spec):
        stated = _stated_cost(spec)
        if stated is not None:
            return stated
        for entry in _entries.values():  # a factory registered in code with a cost, passed as itself
            if _is_code(entry) and entry.factory is spec and entry.cost is not None:
                return entry.cost
        return DEFAULT_COST
    raise TypeError(
        f"preconditioner= must be a registered name, a CostModel or an optimizer class, got "
        f"{type(spec).__name__} {spec!r}"
    )

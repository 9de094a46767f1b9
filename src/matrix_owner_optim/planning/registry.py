"""The preconditioner registry: one entry per name, holding the optimizer's factory and its cost.

Every name ``OwnerRoutedOptimizer(matrix=..., tail=...)``, ``plan_model(preconditioner=...)``
and ``fully_shard(preconditioner=...)`` accept is one :class:`PreconditionerEntry`: the factory
that builds the optimizer (an object, or a ``"module:attribute"`` target imported on first use)
and the :class:`~.cost.CostModel` the planner prices its tensors with. The optimizer layer reads
the factory (``optim.registry.resolve_optimizer``), the planner the cost
(:func:`get_cost_model`); both read this one table, so a name cannot mean one optimizer
to the router and another to the planner. It lives in ``planning`` because imports point
downward (``optim`` reads ``planning``): the table imports no optimizer until one is resolved.

Three sources of names, none of which can silently replace another:

* **Built-ins** (:data:`BUILTINS`), registered here in code as ``"module:attribute"`` targets
  with their cost models and imported only when first resolved (so ``torch_optimizer`` is
  imported only for ``torch_optimizer_shampoo``). They exist whether or not this package's
  metadata is installed.
* **Code**: :func:`register_preconditioner` (a name already taken raises unless
  ``overwrite=True``).
* **Entry points** of installed distributions in the group :data:`ENTRY_POINT_GROUP`
  (``name = "pkg.module:Factory"``), loaded lazily on first use. An entry point whose name is a
  built-in's (pointing elsewhere), a code registration's, or another distribution's raises
  when that name is resolved, naming both sides; other names keep working.

A factory is anything called as ``factory(param_groups, **options)`` that returns a
``torch.optim.Optimizer`` over whole tensors. Its cost is the one registered with it, else the
``cost_model`` attribute it carries, else Muon's (a conservative estimate, never zero).
"""

from __future__ import annotations

import importlib
import importlib.metadata
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from types import MappingProxyType
from typing import Any

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
    "ENTRY_POINT_GROUP",
    "OptimizerFactory",
    "PreconditionerEntry",
    "available_cost_models",
    "available_preconditioners",
    "get_cost_model",
    "lookup",
    "register_cost_model",
    "register_preconditioner",
]

ENTRY_POINT_GROUP = "matrix_owner_optim.preconditioners"

# ``factory(param_groups, **options) -> torch.optim.Optimizer``
OptimizerFactory = Callable[..., Any]


@dataclass(eq=False)
class PreconditionerEntry:
    """One registered name: where its optimizer comes from, the optimizer, and its cost.

    ``target`` is a ``"module:attribute"`` imported by :meth:`load` on first use (built-ins,
    entry points); ``factory`` the optimizer class or factory once known; ``cost`` the cost
    model registered with it (``None``: the factory's own ``cost_model``, else Muon's).
    An entry made by :func:`register_cost_model` alone has a cost and no factory.
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
                    "but no optimizer; register one with matrix_owner_optim.register_preconditioner"
                )
            self.factory = _import_target(self.target, spelled or self.name, what, self.source)
        return self.factory

    def cost_model(self) -> CostModel:
        """The cost the planner prices this optimizer's tensors with (imports the factory only
        when no cost was registered with the name: an entry point's own ``cost_model``)."""
        if self.cost is not None:
            return self.cost
        return _stated_cost(self.load()) or MUON_COST


def _builtin(name: str, target: str, cost: CostModel) -> PreconditionerEntry:
    return PreconditionerEntry(name, "built-in", target=target, cost=cost)


_BUILTIN_ENTRIES: dict[str, PreconditionerEntry] = {
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
_entries: dict[str, PreconditionerEntry] = dict(_BUILTIN_ENTRIES)


def _normalize(name: str) -> str:
    if not isinstance(name, str) or not name.strip():
        raise ValueError(f"optimizer name must be a non-empty string, got {name!r}")
    return name.strip().lower()


def _same_target(a: str, b: str) -> bool:
    return a.replace(" ", "") == b.replace(" ", "")


def _stated_cost(factory: Any) -> CostModel | None:
    cost = getattr(factory, "cost_model", None)
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


def _is_code(entry: PreconditionerEntry | None) -> bool:
    return entry is not None and entry.source == "code"


def register_preconditioner(
    name: str, factory: OptimizerFactory, *, cost_model: CostModel | None = None, overwrite: bool = False
) -> None:
    """Make ``name`` usable as ``matrix=`` or ``tail=`` of ``OwnerRoutedOptimizer`` and as
    ``preconditioner=`` of the planner.

    Args:
        name: case-insensitive name.
        factory: an optimizer class, or any callable ``factory(params, **options)``.
        cost_model: what the planner charges per tensor; default: ``factory.cost_model`` where
            it has one, else Muon's cost.
        overwrite: replace a built-in or an existing registration instead of raising.
    """
    key = _normalize(name)
    if not callable(factory):
        raise TypeError(f"register_preconditioner({name!r}): factory must be callable, got {factory!r}")
    if cost_model is not None and not isinstance(cost_model, CostModel):
        raise TypeError(
            f"register_preconditioner({name!r}): cost_model must have name, state_bytes(shape, dtype) "
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
    _entries[key] = PreconditionerEntry(
        key, "code", factory=factory, cost=cost_model or _stated_cost(factory) or kept_cost
    )


def register_cost_model(name: str, model: CostModel) -> None:
    """Make ``plan_model(..., preconditioner=name)`` use ``model``: the cost of the entry
    ``name`` (a new entry with a cost and no optimizer if the name is unknown)."""
    if not isinstance(model, CostModel):
        raise TypeError(f"cost model for {name!r} must have name, state_bytes(shape, dtype) and flops(shape)")
    key = _normalize(name)
    entry = lookup(key)
    if entry is None:
        _entries[key] = PreconditionerEntry(key, "code", cost=model)
    else:
        entry.cost = model


def _dist_name(ep: importlib.metadata.EntryPoint) -> str:
    dist = getattr(ep, "dist", None)
    return dist.name if dist is not None else "an unknown distribution"


def _entry_points() -> dict[str, list[importlib.metadata.EntryPoint]]:
    out: dict[str, list[importlib.metadata.EntryPoint]] = {}
    for ep in importlib.metadata.entry_points(group=ENTRY_POINT_GROUP):
        out.setdefault(ep.name.strip().lower(), []).append(ep)
    return out


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
                f"{ENTRY_POINT_GROUP!r} ({ep.value}). Refusing to choose: rename the entry point "
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
            f"optimizer name {key!r} is declared in the entry-point group {ENTRY_POINT_GROUP!r} "
            f"by distribution {_dist_name(a)!r} ({a.value}) and by distribution "
            f"{_dist_name(b)!r} ({b.value}). Refusing to choose: rename one or uninstall one."
        )
    registered = _entries.get(key)
    if distinct and _is_code(registered):
        ep = distinct[0]
        assert registered is not None
        raise ValueError(
            f"optimizer name {key!r} is registered in code ({registered.factory or registered.cost!r}) and "
            f"declared by distribution {_dist_name(ep)!r} ({ep.value}) in {ENTRY_POINT_GROUP!r}. "
            "Refusing to choose: register under another name."
        )
    return distinct[0] if distinct else None


def lookup(name: str) -> PreconditionerEntry | None:
    """The entry of ``name`` (case-insensitive), or None if no source provides it. Raises
    ``ValueError`` when two sources provide it (naming both), before anything is imported."""
    key = _normalize(name)
    ep = _entry_point_for(key)
    entry = _entries.get(key)
    if entry is None and ep is not None:
        entry = PreconditionerEntry(key, f"entry point of {_dist_name(ep)!r}", target=ep.value)
        _entries[key] = entry
    return entry


def available_preconditioners() -> list[str]:
    """Every name that ``resolve_optimizer`` may accept (built-in, registered and installed)."""
    with_optimizer = {n for n, e in _entries.items() if e.factory is not None or e.target is not None}
    return sorted(with_optimizer | set(_entry_points()))


def available_cost_models() -> list[str]:
    """Every name the planner can price (each registered optimizer, and costs registered alone)."""
    return sorted(set(_entries) | set(_entry_points()))


def get_cost_model(preconditioner: str | CostModel | Callable[..., Any] | None) -> CostModel:
    """Resolve a registered name (the cost of its registry entry), a :class:`CostModel`, or an
    optimizer class carrying ``cost_model`` (or registered in code with one); None is Muon's.

    An optimizer without a stated cost is charged like Muon (one state buffer of the
    parameter's size plus an orthogonalisation): a conservative estimate, never zero. An unknown
    name raises ``ValueError`` listing the known ones.
    """
    if preconditioner is None:
        return MUON_COST
    if isinstance(preconditioner, str):
        entry = lookup(preconditioner)
        if entry is None:
            raise ValueError(
                f"no cost model for preconditioner {preconditioner!r}; known: "
                f"{', '.join(available_cost_models())}. Register one with "
                "matrix_owner_optim.register_preconditioner(name, factory, cost_model=...) or "
                "planning.register_cost_model."
            )
        return entry.cost_model()
    if isinstance(preconditioner, CostModel):
        return preconditioner
    stated = _stated_cost(preconditioner)
    if stated is not None:
        return stated
    for entry in _entries.values():  # a factory registered in code with a cost, passed as itself
        if _is_code(entry) and entry.factory is preconditioner and entry.cost is not None:
            return entry.cost
    return MUON_COST

"""Matrix and tail optimizers by name: built-ins, ``register_preconditioner`` and entry points.

Three sources of names, none of which can silently replace another:

* **Built-ins** (:data:`BUILTINS`), registered here in code as ``"module:attribute"`` targets
  and imported only when first resolved (so ``torch_optimizer`` is imported only for
  ``torch_optimizer_shampoo``). They exist whether or not this package's metadata is installed.
* **Code**: :func:`register_preconditioner` (a name already taken raises unless
  ``overwrite=True``).
* **Entry points** of installed distributions in the group ``matrix_owner_optim.preconditioners``
  (``name = "pkg.module:Factory"``), loaded lazily on first use. An entry point whose name is a
  built-in's (pointing elsewhere), a code registration's, or another distribution's raises
  when that name is resolved, naming both sides; other names keep working.

A factory is anything called as ``factory(param_groups, **options)`` that returns a
``torch.optim.Optimizer`` over whole tensors. A factory that carries a ``cost_model`` attribute
also prices its tensors for the planner under the same name.
"""

from __future__ import annotations

import importlib
import importlib.metadata
from collections.abc import Callable
from typing import Any

import torch

from ..planning.cost import CostModel, register_cost_model

__all__ = [
    "BUILTINS",
    "ENTRY_POINT_GROUP",
    "OptimizerFactory",
    "register_preconditioner",
    "resolve_optimizer",
    "available_preconditioners",
]

ENTRY_POINT_GROUP = "matrix_owner_optim.preconditioners"

OptimizerFactory = Callable[..., torch.optim.Optimizer]

# name -> "module:attribute", imported on first use.
BUILTINS: dict[str, str] = {
    "muon": "matrix_owner_optim.preconditioners:Muon",
    "shampoo": "matrix_owner_optim.preconditioners:Shampoo",
    "soap": "matrix_owner_optim.preconditioners:SOAP",
    "adamw": "torch.optim:AdamW",
    "adam": "torch.optim:Adam",
    "sgd": "torch.optim:SGD",
    "torch_muon": "torch.optim:Muon",
    "torch_optimizer_shampoo": "torch_optimizer:Shampoo",
}

_registered: dict[str, OptimizerFactory] = {}  # code registrations
_loaded: dict[str, OptimizerFactory] = {}  # built-ins and entry points, once imported


def _normalize(name: str) -> str:
    if not isinstance(name, str) or not name.strip():
        raise ValueError(f"optimizer name must be a non-empty string, got {name!r}")
    return name.strip().lower()


def _same_target(a: str, b: str) -> bool:
    return a.replace(" ", "") == b.replace(" ", "")


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


def register_preconditioner(name: str, factory: OptimizerFactory, *, overwrite: bool = False) -> None:
    """Make ``name`` usable as ``matrix=`` or ``tail=`` of ``OwnerRoutedOptimizer``.

    Args:
        name: case-insensitive name.
        factory: an optimizer class, or any callable ``factory(params, **options)``.
        overwrite: replace a built-in or an existing registration instead of raising.
    """
    key = _normalize(name)
    if not callable(factory):
        raise TypeError(f"register_preconditioner({name!r}): factory must be callable, got {factory!r}")
    if not overwrite:
        if key in BUILTINS and _builtin(key, name) is not factory:
            raise ValueError(
                f"{key!r} is a built-in optimizer ({BUILTINS[key]}); pick another name or pass "
                "overwrite=True to replace it"
            )
        if key in _registered and _registered[key] is not factory:
            raise ValueError(
                f"an optimizer named {key!r} is already registered ({_registered[key]!r}); "
                "pass overwrite=True to replace it"
            )
    _registered[key] = factory
    _register_cost(key, factory)


def _builtin(key: str, name: str, what: str = "matrix") -> OptimizerFactory:
    if key not in _loaded:
        _loaded[key] = _import_target(BUILTINS[key], name, what, "built-in")
        _register_cost(key, _loaded[key])
    return _loaded[key]


def _register_cost(key: str, factory: OptimizerFactory) -> None:
    cost = getattr(factory, "cost_model", None)
    if isinstance(cost, CostModel):
        register_cost_model(key, cost)


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
    if distinct and key in _registered:
        ep = distinct[0]
        raise ValueError(
            f"optimizer name {key!r} is registered in code ({_registered[key]!r}) and declared "
            f"by distribution {_dist_name(ep)!r} ({ep.value}) in {ENTRY_POINT_GROUP!r}. "
            "Refusing to choose: register under another name."
        )
    return distinct[0] if distinct else None


def available_preconditioners() -> list[str]:
    """Every name that ``resolve_optimizer`` may accept (built-in, registered and installed)."""
    return sorted(set(BUILTINS) | set(_registered) | set(_entry_points()))


def resolve_optimizer(spec: str | OptimizerFactory, *, what: str = "matrix") -> OptimizerFactory:
    """A built-in, registered or entry-point name, or an optimizer class / factory as is.

    Raises:
        ValueError: for an unknown name (listing the known ones), a name two sources provide
            (naming both), or a target that cannot be imported.
    """
    if not isinstance(spec, str):
        if callable(spec):
            return spec
        raise TypeError(f"{what}= must be an optimizer name or class, got {spec!r}")
    key = _normalize(spec)
    ep = _entry_point_for(key)  # raises on a collision before anything is imported
    if key in _registered:
        return _registered[key]
    if key in BUILTINS:
        return _builtin(key, spec, what)
    if key in _loaded:
        return _loaded[key]
    if ep is not None:
        factory = _import_target(ep.value, spec, what, f"entry point of {_dist_name(ep)!r}")
    else:
        names = ", ".join(available_preconditioners())
        raise ValueError(
            f"unknown {what} optimizer {spec!r}; available: {names}. Register one with "
            "matrix_owner_optim.register_preconditioner or the entry-point group "
            f"{ENTRY_POINT_GROUP!r}."
        )
    _loaded[key] = factory
    _register_cost(key, factory)
    return factory

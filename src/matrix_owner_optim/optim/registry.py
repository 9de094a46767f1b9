"""Matrix and tail optimizers by name: ``register_preconditioner`` and entry points.

Installed packages add optimizers through the entry-point group
``matrix_owner_optim.preconditioners`` (``name = "pkg.module:Factory"``); the built-ins are
registered that way in this package's own ``pyproject.toml``. A factory is anything called as
``factory(param_groups, **options)`` that returns a ``torch.optim.Optimizer`` over whole
tensors. A factory that carries a ``cost_model`` attribute also prices its tensors for the
planner under the same name.
"""

from __future__ import annotations

import importlib.metadata
from typing import Any, Callable

import torch

from ..planning.cost import CostModel, register_cost_model

__all__ = [
    "ENTRY_POINT_GROUP",
    "OptimizerFactory",
    "register_preconditioner",
    "resolve_optimizer",
    "available_preconditioners",
]

ENTRY_POINT_GROUP = "matrix_owner_optim.preconditioners"

OptimizerFactory = Callable[..., torch.optim.Optimizer]

_registered: dict[str, OptimizerFactory] = {}


def _normalize(name: str) -> str:
    if not isinstance(name, str) or not name.strip():
        raise ValueError(f"optimizer name must be a non-empty string, got {name!r}")
    return name.strip().lower()


def register_preconditioner(name: str, factory: OptimizerFactory, *, overwrite: bool = False) -> None:
    """Make ``name`` usable as ``matrix=`` or ``tail=`` of ``OwnerRoutedOptimizer``.

    Args:
        name: case-insensitive name.
        factory: an optimizer class, or any callable ``factory(params, **options)``.
        overwrite: replace an existing registration instead of raising.
    """
    key = _normalize(name)
    if not callable(factory):
        raise TypeError(f"register_preconditioner({name!r}): factory must be callable, got {factory!r}")
    if key in _registered and not overwrite and _registered[key] is not factory:
        raise ValueError(
            f"an optimizer named {key!r} is already registered ({_registered[key]!r}); "
            "pass overwrite=True to replace it"
        )
    _registered[key] = factory
    cost = getattr(factory, "cost_model", None)
    if isinstance(cost, CostModel):
        register_cost_model(key, cost)


def _entry_points() -> dict[str, importlib.metadata.EntryPoint]:
    return {ep.name.lower(): ep for ep in importlib.metadata.entry_points(group=ENTRY_POINT_GROUP)}


def available_preconditioners() -> list[str]:
    """Every name that ``resolve_optimizer`` accepts (registered and installed)."""
    return sorted(set(_registered) | set(_entry_points()))


def resolve_optimizer(spec: "str | OptimizerFactory", *, what: str = "matrix") -> OptimizerFactory:
    """A registered name, an entry-point name, or an optimizer class / factory as is."""
    if not isinstance(spec, str):
        if callable(spec):
            return spec
        raise TypeError(f"{what}= must be an optimizer name or class, got {spec!r}")
    key = _normalize(spec)
    if key in _registered:
        return _registered[key]
    eps = _entry_points()
    if key not in eps:
        names = ", ".join(available_preconditioners()) or "(none: is matrix_owner_optim installed?)"
        raise ValueError(
            f"unknown {what} optimizer {spec!r}; available: {names}. Register one with "
            f"matrix_owner_optim.register_preconditioner or the entry-point group {ENTRY_POINT_GROUP!r}."
        )
    try:
        factory: Any = eps[key].load()
    except ImportError as exc:
        raise ValueError(
            f"{what} optimizer {spec!r} comes from entry point {eps[key].value!r}, which cannot be "
            f"imported ({exc}); install the package that provides it"
        ) from exc
    register_preconditioner(key, factory, overwrite=True)
    return factory

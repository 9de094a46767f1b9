"""Matrix and tail optimizers by name: the optimizer side of the optimizer registry.

The registry itself, one entry per name holding the factory and its cost model, is
:mod:`matrix_owner_optim.planning.catalog` (built-ins in code, ``register_optimizer``, alias
``register_preconditioner``, the entry-point groups ``matrix_owner_optim.optimizers`` and
``matrix_owner_optim.preconditioners``; collisions raise naming both sides). This module resolves
what ``OwnerRoutedOptimizer(matrix=..., tail=...)`` was given, a name or a factory, into a
:class:`ChosenOptimizer`: the factory to build, the name to report, and what was given (from
which ``planning.catalog.resolve_cost`` prices the plan).
"""

from __future__ import annotations

from dataclasses import dataclass

from ..planning.catalog import (
    BUILTINS,
    ENTRY_POINT_GROUP,
    PRECONDITIONER_ENTRY_POINT_GROUP,
    OptimizerFactory,
    available_optimizers,
    lookup,
    register_optimizer,
    register_preconditioner,
)

__all__ = [
    "BUILTINS",
    "ENTRY_POINT_GROUP",
    "PRECONDITIONER_ENTRY_POINT_GROUP",
    "ChosenOptimizer",
    "OptimizerFactory",
    "available_optimizers",
    "choose_optimizer",
    "register_optimizer",
    "register_preconditioner",
    "resolve_optimizer",
]


@dataclass(frozen=True)
class ChosenOptimizer:
    """What ``matrix=`` or ``tail=`` named: its name for reports, the factory, and ``spec``, the
    name or factory exactly as given (``resolve_cost(spec, built=...)`` prices it)."""

    name: str
    factory: OptimizerFactory
    spec: str | OptimizerFactory


def choose_optimizer(spec: str | OptimizerFactory, *, what: str = "matrix") -> ChosenOptimizer:
    """A built-in, registered or entry-point name (its registry entry's factory), or an optimizer
    class / factory as is.

    Raises:
        ValueError: for an unknown name (listing the known ones), a name two sources provide
            (naming both), or a target that cannot be imported.
    """
    if not isinstance(spec, str):
        if callable(spec):
            return ChosenOptimizer(getattr(spec, "__name__", str(spec)), spec, spec)
        raise TypeError(f"{what}= must be an optimizer name or class, got {spec!r}")
    entry = lookup(spec)  # raises on a collision before anything is imported
    if entry is None:
        names = ", ".join(available_optimizers())
        raise ValueError(
            f"unknown {what} optimizer {spec!r}; available: {names}. Register one with "
            "matrix_owner_optim.register_optimizer or the entry-point group "
            f"{ENTRY_POINT_GROUP!r}."
        )
    return ChosenOptimizer(spec, entry.load(what, spec), spec)


def resolve_optimizer(spec: str | OptimizerFactory, *, what: str = "matrix") -> OptimizerFactory:
    """The factory :func:`choose_optimizer` finds for ``spec``."""
    return choose_optimizer(spec, what=what).factory

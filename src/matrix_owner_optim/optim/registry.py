"""Matrix and tail optimizers by name: the optimizer side of the registry
(:mod:`matrix_owner_optim.planning.catalog` holds the entries). :func:`choose_optimizer` turns
what ``matrix=`` / ``tail=`` was given, a name or a factory, into a :class:`ChosenOptimizer`.
"""

from __future__ import annotations

import importlib.metadata
from collections.abc import Mapping
from dataclasses import dataclass
from types import MappingProxyType
from typing import Any

from ..planning.catalog import (
    BUILTINS,
    ENTRY_POINT_GROUP,
    PRECONDITIONER_ENTRY_POINT_GROUP,
    OptimizerEntry,
    OptimizerFactory,
    available_optimizers,
    lookup,
    register_optimizer,
    register_preconditioner,
)

__all__ = [
    "BUILTINS",
    "ENTRY_POINT_GROUP",
    "GROUP_FLAGS",
    "PRECONDITIONER_ENTRY_POINT_GROUP",
    "ChosenOptimizer",
    "OptimizerFactory",
    "available_optimizers",
    "choose_optimizer",
    "group_flags",
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
    """A built-in, registered or entry-point name (its entry's factory), or a factory as is;
    ``ValueError`` for an unknown name, a name two sources provide, or a failed import."""
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
    return ChosenOptimizer(spec, _load(entry, what, spec), spec)


def _load(entry: OptimizerEntry, what: str, spec: str) -> OptimizerFactory:
    """``entry``'s factory; an exception its import raised is re-raised as ``ImportError`` naming
    the entry point and its distribution (the registry's own errors pass as they are)."""
    try:
        return entry.load(what, spec)
    except (ValueError, TypeError) as exc:
        if entry.source in str(exc):
            raise
        cause: Exception = exc
    except Exception as exc:  # a plug-in's module may raise anything while it is imported
        cause = exc
    where = ", ".join([repr(entry.target), *(f"entry-point group {g!r}" for g in _groups_declaring(entry.target))])
    raise ImportError(
        f"{what} optimizer {spec!r} comes from {entry.source} ({where}), whose import raised "
        f"{type(cause).__name__}: {cause}. The error is in that distribution (or what it imports): fix or "
        "upgrade it, or uninstall it to drop the name"
    ) from cause


def _groups_declaring(target: str | None) -> list[str]:
    """The entry-point groups of this package holding an entry point for ``target``."""
    want = (target or "").replace(" ", "")
    return [
        group
        for group in (ENTRY_POINT_GROUP, PRECONDITIONER_ENTRY_POINT_GROUP)
        if any(ep.value.replace(" ", "") == want for ep in importlib.metadata.entry_points(group=group))
    ]


# Optimizers whose param groups must carry a flag, per role: pytorch-optimizer's Muon family steps
# a group with ``use_muon=True`` as Muon and one with ``use_muon=False`` as AdamW.
_MUON_FAMILY = MappingProxyType({"matrix": MappingProxyType({"use_muon": True}), "tail": {"use_muon": False}})
GROUP_FLAGS: Mapping[str, Mapping[str, Mapping[str, Any]]] = MappingProxyType(
    {
        "pytorch_optimizer.optimizer.muon.muon.Muon": _MUON_FAMILY,
        "pytorch_optimizer.optimizer.muon.adamuon.AdaMuon": _MUON_FAMILY,
        "pytorch_optimizer.optimizer.muon.normuon.NorMuon": _MUON_FAMILY,
    }
)


def group_flags(factory: OptimizerFactory, role: str) -> dict[str, Any]:
    """The flags every param group of ``role`` gets for ``factory`` (:data:`GROUP_FLAGS`)."""
    for cls in getattr(factory, "__mro__", (factory,)):
        flags = GROUP_FLAGS.get(f"{getattr(cls, '__module__', '')}.{getattr(cls, '__qualname__', '')}")
        if flags is not None:
            return dict(flags.get(role, {}))
    return {}


def resolve_optimizer(spec: str | OptimizerFactory, *, what: str = "matrix") -> OptimizerFactory:
    """The factory :func:`choose_optimizer` finds for ``spec``."""
    return choose_optimizer(spec, what=what).factory

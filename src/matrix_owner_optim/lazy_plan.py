"""Which lazy plan a parameter waits for, so that the optimizer can fix it, explicitly.

``fully_shard`` fixes a tree's plan lazily (the plan balances the whole tree). The first
forward, ``unshard()`` and ``to_empty`` of parameters still on ``meta`` reach the tree through
the module; the optimizer has only parameters, so each parameter of a pending tree records its
``fully_shard`` state here (a weak reference: a dropped model leaves nothing alive), and :func:`fix_lazy_plans` is the one call that follows it. Reading
metadata (``get_matrix_shard``) never does; the link is removed when the plan is fixed.

This module sits below both ``sharding`` (which links) and ``optim`` (which fixes), so neither
imports the other.
"""

from __future__ import annotations

import weakref
from collections.abc import Iterable
from typing import TYPE_CHECKING, Any, Protocol

import torch

if TYPE_CHECKING:
    from .planning.cost import CostModel

__all__ = ["LazyPlan", "fix_lazy_plans", "link_lazy_plan", "unlink_lazy_plan"]

_ATTR = "_moo_lazy_plan"


class LazyPlan(Protocol):
    """A tree of ``fully_shard`` calls whose plan is not fixed yet (``sharding.state``)."""

    def fix_plan(self, cost: CostModel | None = None) -> Any: ...


def link_lazy_plan(param: torch.Tensor, owner: LazyPlan) -> None:
    setattr(param, _ATTR, weakref.ref(owner))


def unlink_lazy_plan(param: torch.Tensor) -> None:
    if _ATTR in param.__dict__:
        delattr(param, _ATTR)


def _owner(param: Any) -> LazyPlan | None:
    ref = getattr(param, _ATTR, None)
    return ref() if ref is not None else None


def fix_lazy_plans(params: Iterable[Any], cost: CostModel | None = None) -> None:
    """Fix the plan of every pending ``fully_shard`` tree ``params`` belong to, in the order the
    parameters come (the same on every rank: fixing a plan is collective). ``cost`` (resolved by
    the caller: ``planning.catalog.resolve_cost``) prices the matrices unless a ``fully_shard``
    call of the tree named one. Parameters of no pending tree are skipped."""
    seen: set[int] = set()
    for p in params:
        owner = _owner(p)
        if owner is not None and id(owner) not in seen:
            seen.add(id(owner))
            owner.fix_plan(cost)

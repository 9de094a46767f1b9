"""Which lazy plan a parameter waits for, so that the optimizer (which has only parameters) can
fix it: a weak link from each parameter of a pending tree to its ``fully_shard`` state, removed
when the plan is fixed. Below ``sharding`` (which links) and ``optim`` (which fixes).
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
    """Fix the plan of every pending tree of ``params`` (collective, parameter order)."""
    seen: set[int] = set()
    for p in params:
        owner = _owner(p)
        if owner is not None and id(owner) not in seen:
            seen.add(id(owner))
            owner.fix_plan(cost)

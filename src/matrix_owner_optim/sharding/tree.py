"""One tree of ``fully_shard`` calls: the facts its calls share (its plan, cost and ``PlanPhase``), in
one object they all point to, formed by ``ShardTree.join`` (as FSDP2's ``FSDPStateContext``).
"""

from __future__ import annotations

import enum
import logging
import weakref
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any, Protocol

import torch
from torch import nn

from ..planning.catalog import DEFAULT_COST
from ..planning.cost import CostModel
from ..planning.metadata import ShardingPlan
from ..replica_sync import ReplicaSync
from .build import PlannedCall, build_context
from .context import ShardingContext
from .unit import ShardedUnit

__all__ = ["PlanPhase", "ShardTree", "TreeMember"]

_log = logging.getLogger(__name__)


class PlanPhase(enum.Enum):
    """Where a tree's plan is: recorded, fixed (units built), or failed."""

    PENDING = "pending"
    PLANNED = "planned"
    FAILED = "failed"


class TreeMember(PlannedCall, Protocol):
    """What the tree reads and sets of one call's state (``state.OwnerShardState`` is one)."""

    unit: ShardedUnit | None  # set when the plan is fixed
    tree: ShardTree  # the tree it belongs to: this object


@dataclass(eq=False)
class ShardTree:
    """The facts of one tree of ``fully_shard`` calls; every state of the tree points to it."""

    states: list[TreeMember] = field(default_factory=list)  # planning order, the root last
    plan: ShardingPlan | None = None  # given by a call (plan=), else planned when fixed
    plan_from: nn.Module | None = None  # the module of the call that gave it
    cost: CostModel | None = None  # named by a call; once fixed, the cost that priced the plan
    cost_from: nn.Module | None = None  # the module of the call that named it (None: not named)
    auto_prefetch: bool = True  # the next-unit prefetch, for the whole tree
    phase: PlanPhase = PlanPhase.PENDING
    failure: str | None = None  # why planning failed
    context: ShardingContext | None = None  # the runtime, once the plan is fixed
    replicas: ReplicaSync | None = None  # HSDP: the replicas' state, once the plan is fixed
    step_watchers: list[weakref.ref[Any]] = field(default_factory=list)  # optimizers whose step all-reduces

    def watch_steps(self, optimizer: Any) -> None:
        """``optimizer``'s step count rides on the tree's forwards too (``ShardingContext.check_steps``)."""
        if not any(ref() is optimizer for ref in self.step_watchers):
            self.step_watchers.append(weakref.ref(optimizer))

    def land_replicas(self) -> None:
        """HSDP: land every broadcast the tree has due (reads outside a forward call this first)."""
        if self.context is not None and self.replicas is not None and self.replicas.size > 1:
            self.context.sync_replicas()

    def replicas_stepped(self, params: Sequence[torch.Tensor], *, deferred: bool) -> None:
        """HSDP: an optimizer's global owners stepped ``params`` (see ``replica_sync.py``)."""
        if self.context is not None:
            self.context.replicas_stepped(params, deferred=deferred)

    @property
    def root(self) -> TreeMember:
        """The outermost call's state."""
        return self.states[-1]

    @classmethod
    def join(
        cls,
        trees: Sequence[ShardTree],
        *,
        module: nn.Module,
        plan: ShardingPlan | None,
        cost: CostModel | None,
        name_of: Callable[[nn.Module], str],
    ) -> ShardTree:
        """The tree a call on ``module`` forms of the ``trees`` inside it and its own ``plan`` and
        ``cost``; changes nothing, and refuses two plans or cost models, naming both calls."""
        tree = cls(plan=plan, plan_from=module if plan is not None else None)
        tree.cost, tree.cost_from = cost, module if cost is not None else None
        for t in trees:
            tree.states.extend(t.states)
            tree.auto_prefetch = tree.auto_prefetch and t.auto_prefetch
            if t.plan is not None:
                if tree.plan is not None and tree.plan is not t.plan and tree.plan.digest() != t.plan.digest():
                    raise _conflict(
                        module,
                        f"{_call(tree.plan_from, module, name_of)} was given plan {tree.plan.digest()[:12]} and "
                        f"{_call(t.plan_from, module, name_of)} plan {t.plan.digest()[:12]}",
                        "planned from one plan. Give plan= on one call (the root's), or the same plan to every call",
                    )
                if tree.plan is None:
                    tree.plan, tree.plan_from = t.plan, t.plan_from
            if t.cost is not None:
                if tree.cost is not None and tree.cost is not t.cost and tree.cost != t.cost:
                    raise _conflict(
                        module,
                        f"{_call(tree.cost_from, module, name_of)} named cost model {tree.cost.name!r} "
                        f"({tree.cost!r}) and {_call(t.cost_from, module, name_of)} named {t.cost.name!r} ({t.cost!r})",
                        "priced by one cost model. Pass preconditioner= to one call (the root's), or the same to "
                        "every call",
                    )
                if tree.cost is None:
                    tree.cost, tree.cost_from = t.cost, t.cost_from
        return tree

    def fix(self, offered: CostModel | None = None) -> ShardingContext:
        """Fix the tree's plan once (collective) and return its runtime; ``offered`` prices it
        unless a call named a cost. A failure leaves the tree FAILED."""
        if self.phase is PlanPhase.PLANNED:
            assert self.context is not None
            return self.context
        if self.phase is PlanPhase.FAILED:
            raise RuntimeError(
                f"sharding of this {_class_name(self.root.modules[0])} failed earlier ({self.failure}); "
                "build the model again and call fully_shard on it"
            )
        if self.cost is not None:
            cost, why = self.cost, f"named by fully_shard({_class_name(self.cost_from)}, preconditioner=...)"
        elif offered is not None:
            cost, why = offered, "offered when the plan was fixed (the optimizer's matrix optimizer, or fix_plan())"
        else:
            cost, why = DEFAULT_COST, "the default: no fully_shard call named one and none was offered"
        try:
            context = build_context(self.states, plan=self.plan, cost=cost, settings=self)
        except BaseException as exc:
            self.phase = PlanPhase.FAILED
            self.failure = f"{type(exc).__name__}: {exc}"
            raise
        for st, unit in zip(self.states, context.units, strict=True):
            st.unit = unit
        self.context, self.phase = context, PlanPhase.PLANNED
        self.replicas = context.replicas
        what = _class_name(self.root.modules[0])
        if self.plan is not None:
            _log.info(
                "sharding plan of %s fixed over %d ranks: the plan given to fully_shard(%s, plan=...), "
                "priced by %s when it was made",
                what,
                context.groups.world_size,
                _class_name(self.plan_from),
                self.plan.preconditioner,
            )
        else:
            self.cost = cost  # the cost that priced the plan, for whatever fixes this tree's tensors later
            _log.info(
                "sharding plan of %s fixed over %d ranks: priced by %s (%s)",
                what,
                context.groups.world_size,
                cost.name,
                why,
            )
        return context


def _conflict(top: nn.Module, which: str, rule: str) -> ValueError:
    """The error for two calls of one tree that name different plans or cost models."""
    return ValueError(f"fully_shard({_class_name(top)}): {which}; one tree is {rule}")


def _call(module: nn.Module | None, top: nn.Module, name_of: Callable[[nn.Module], str]) -> str:
    """Words for the ``fully_shard`` call on ``module`` (``top``: the call being made)."""
    if module is None or module is top:
        return "this call"
    return f"the call on its submodule {name_of(module)!r} ({_class_name(module)})"


def _class_name(module: nn.Module | None) -> str:
    """The user's class name of ``module`` (not its dynamic ``OwnerSharded<Class>``)."""
    cls = type(module)
    if cls.__name__.startswith("OwnerSharded") and len(cls.__bases__) == 2:
        return cls.__bases__[1].__name__
    return cls.__name__

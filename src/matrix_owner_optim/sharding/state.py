"""One state object per ``fully_shard`` call (FSDP2's ``FSDPState``): options, hooks, lazy init;
every state of a tree points to its :class:`~.tree.ShardTree` (DESIGN.md, "Lazy sharding").
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import torch
from torch import nn
from torch.utils._pytree import tree_flatten, tree_map, tree_unflatten

from ..lazy_plan import link_lazy_plan
from ..planning.cost import CostModel
from ..planning.metadata import get_matrix_shard
from .context import ShardingContext
from .nested import STATE_ATTR, foreign_parameters
from .outputs import grad_tensors
from .tree import PlanPhase, ShardTree
from .unit import ShardedUnit, in_backward
from .unit_options import UnitOptions

__all__ = ["OwnerShardState", "PlanPhase", "ShardTree", "require_state", "state_of", "trees_inside"]


def state_of(module: nn.Module) -> OwnerShardState | None:
    """The state of a module passed to ``fully_shard`` (None: not passed)."""
    return module.__dict__.get(STATE_ATTR)


def require_state(module: nn.Module) -> OwnerShardState:
    """The state of a module passed to ``fully_shard``; refused for any other module."""
    state = state_of(module)
    if state is None:
        raise RuntimeError(f"{type(module).__name__} was not passed to fully_shard")
    return state


def trees_inside(modules: Sequence[nn.Module]) -> list[ShardTree]:
    """The trees of the calls made before on modules inside ``modules`` (what a call adopts)."""
    trees: list[ShardTree] = []
    for m in modules:
        for sub in m.modules():
            st = state_of(sub)
            if st is not None and not any(t is st.tree for t in trees):
                trees.append(st.tree)
    return trees


class OwnerShardState:
    """Everything one ``fully_shard`` call knows; what its whole tree knows is ``tree``."""

    modules: list[nn.Module]  # the call's modules (several in FSDP2's list form)
    group: Any  # shard process group
    replicate_group: Any  # HSDP replicate group, or None
    mp_policy: Any
    options: UnitOptions  # what the set_* methods record
    tree: ShardTree  # this call's tree: the one object every state of the tree points to
    unit: ShardedUnit | None  # set when the plan is fixed

    def __init__(
        self,
        modules: list[nn.Module],
        *,
        group: Any,
        replicate_group: Any,
        reshard_after_forward: bool,
        mp_policy: Any,
        tree: ShardTree,
    ) -> None:
        self.modules = modules
        self.group = group
        self.replicate_group = replicate_group
        self.mp_policy = mp_policy
        self.options = UnitOptions(reshard_after_forward=reshard_after_forward)
        self.tree = tree
        self.unit = None

    @property
    def root(self) -> OwnerShardState:
        """The outermost call of this call's tree (itself until a call around it adopts it)."""
        root = self.tree.root
        assert isinstance(root, OwnerShardState)
        return root

    # -- the tree --------------------------------------------------------------------------------
    def register(self) -> None:
        """Become the root of ``tree``, record this state on its modules and install the hooks."""
        self.tree.states.append(self)
        for st in self.tree.states:
            st.tree = self.tree
        for m in self.modules:
            m.__dict__[STATE_ATTR] = self
            m.register_forward_pre_hook(self.pre_forward_hook, with_kwargs=True)
            m.register_forward_hook(self.post_forward_hook, with_kwargs=True)
        self.link_parameters()

    def link_parameters(self) -> None:
        """Link the call's parameters that wait for the plan to this state (again after ``_apply``)."""
        foreign = foreign_parameters(self.modules, self.tree.states)
        for m in self.modules:
            for p in m.parameters():
                if get_matrix_shard(p) is None and id(p) not in foreign:
                    link_lazy_plan(p, self)

    def fix_plan(self, cost: CostModel | None = None) -> ShardingContext:
        """Fix this call's tree's plan now (collective); ``cost`` prices it unless a call named one."""
        return self.root.lazy_init(cost)

    def lazy_init(self, cost: CostModel | None = None) -> ShardingContext:
        """On a root: plan the tree and build its units (once; :meth:`ShardTree.fix`)."""
        assert self.tree.root is self, "lazy_init runs on a tree's root"
        return self.tree.fix(cost)

    def require_unit(self) -> tuple[ShardingContext, ShardedUnit]:
        """The tree's context and this call's unit, fixing the plan if it is pending."""
        tree, unit = self.tree, self.unit
        if unit is not None and tree.phase is PlanPhase.PLANNED and tree.context is not None:
            return tree.context, unit  # fixed (every hook asks): no call down to the tree
        ctx = self.fix_plan()
        assert self.unit is not None
        return ctx, self.unit

    # -- hooks -----------------------------------------------------------------------------------
    def pre_forward_hook(self, module: nn.Module, args: tuple, kwargs: dict) -> tuple[tuple, dict]:
        ctx, unit = self.require_unit()
        backward = in_backward()
        ctx.pre_forward(unit, backward)
        param_dtype = getattr(self.mp_policy, "param_dtype", None)
        if param_dtype is not None and getattr(self.mp_policy, "cast_forward_inputs", False):
            args, kwargs = _cast_floating(args, param_dtype), _cast_floating(kwargs, param_dtype)
        if not backward and torch.is_grad_enabled() and not unit.local_only:  # local-only: landed at the end
            args, kwargs = _register_post_backward(ctx, unit, args, kwargs)
        return args, kwargs

    def post_forward_hook(self, module: nn.Module, args: tuple, kwargs: dict, output: Any) -> Any:
        ctx, unit = self.require_unit()
        backward, grad = in_backward(), torch.is_grad_enabled()
        ctx.post_forward(unit, backward, grad)
        if grad and not backward:
            tensors = grad_tensors(output)  # dataclasses too, as FSDP2 (outputs.py)
            if len(tensors) == 1:  # one output (the common case): its own hook fires once per backward
                tensors[0].register_hook(lambda _g: ctx.pre_backward(unit))
            elif tensors:
                torch.autograd.graph.register_multi_grad_hook(tensors, lambda _g: ctx.pre_backward(unit), mode="any")
        output_dtype = getattr(self.mp_policy, "output_dtype", None)
        if output_dtype is not None:
            output = _cast_floating(output, output_dtype)
        return output


class _PostBackward(torch.autograd.Function):
    """Identity on a unit's inputs, whose backward ends the unit's (FSDP2's ``RegisterPostBackwardFunction``)."""

    @staticmethod
    def forward(ctx: Any, context: ShardingContext, unit: ShardedUnit, *inputs: torch.Tensor) -> Any:  # type: ignore[override]
        ctx.context, ctx.unit = context, unit
        return inputs if len(inputs) > 1 else inputs[0]

    @staticmethod
    def backward(ctx: Any, *grads: torch.Tensor) -> Any:  # type: ignore[override]
        ctx.context.post_backward(ctx.unit)
        return (None, None, *grads)


def _register_post_backward(
    context: ShardingContext, unit: ShardedUnit, args: tuple, kwargs: dict
) -> tuple[tuple, dict]:
    flat, spec = tree_flatten((args, kwargs))
    where = [i for i, t in enumerate(flat) if isinstance(t, torch.Tensor) and t.requires_grad]
    if not where:  # nothing to hang it on: the end-of-backward callback reduces this unit
        return args, kwargs
    out = _PostBackward.apply(context, unit, *[flat[i] for i in where])
    out = out if isinstance(out, tuple) else (out,)
    for i, t in zip(where, out, strict=True):
        flat[i] = t
    return tree_unflatten(flat, spec)


def _cast_floating(tree: Any, dtype: torch.dtype) -> Any:
    return tree_map(lambda t: t.to(dtype) if isinstance(t, torch.Tensor) and t.is_floating_point() else t, tree)

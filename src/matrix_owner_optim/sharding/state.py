"""One state object per ``fully_shard`` call (FSDP2's ``FSDPState``): options, hooks, lazy init.

What is planned together is found through the module tree, as FSDP2 finds the states its root
initialises: a ``fully_shard`` call *adopts* the states of the calls made before on modules
inside it (blocks first, the root last), so the outermost call is the *root* of a tree. The
tree's facts (its states in planning order, the plan given to it, the cost that prices it, its
:class:`PlanPhase`, its context, the automatic prefetch) live in one
:class:`~.tree.ShardTree` that every state of the tree points to (``OwnerShardState.tree``):
adoption re-points the adopted states to the new tree, never copies a fact. Modules sharded
without a common root call are separate trees, planned separately, as FSDP2 treats every module
without an enclosing ``fully_shard`` as its own root.

A tree is planned once, lazily (the plan balances the whole tree), by the root's
:meth:`OwnerShardState.lazy_init` at the first of: the first forward of any unit of the tree,
``unshard()`` / ``fix_plan()`` on one of its modules, or the optimizer's construction (through
:func:`~matrix_owner_optim.lazy_plan.fix_lazy_plans`, the parameters' link to their state).
Setters only record :class:`~.unit.UnitOptions`.

The hooks are this object's methods: they fix the plan if needed and hand the unit to the
tree's :class:`~.context.ShardingContext`, which drives it.
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
from .unit import ShardedUnit, UnitOptions, in_backward

__all__ = ["OwnerShardState", "PlanPhase", "ShardTree", "state_of", "trees_inside"]


def state_of(module: nn.Module) -> OwnerShardState | None:
    """The state of a module passed to ``fully_shard`` (None: not passed)."""
    return module.__dict__.get(STATE_ATTR)


def trees_inside(modules: Sequence[nn.Module]) -> list[ShardTree]:
    """The trees of the ``fully_shard`` calls made before on modules inside ``modules`` (what a
    call on them adopts), in module order."""
    trees: list[ShardTree] = []
    for m in modules:
        for sub in m.modules():
            st = state_of(sub)
            if st is not None and not any(t is st.tree for t in trees):
                trees.append(st.tree)
    return trees


class OwnerShardState:
    """Everything one ``fully_shard`` call knows (one object, registered on each of its modules);
    what its whole tree knows is ``tree``."""

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
        """``tree``: the tree this call forms (``ShardTree.join`` of the trees inside its modules);
        :meth:`register` makes this state its root."""
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
        """Become the root of ``tree`` and re-point every state in it to that one object, record
        this state on its modules, install the hooks and link the parameters that wait for the
        plan (``fully_shard``'s last step)."""
        self.tree.states.append(self)
        for st in self.tree.states:
            st.tree = self.tree
        for m in self.modules:
            m.__dict__[STATE_ATTR] = self
            m.register_forward_pre_hook(self.pre_forward_hook, with_kwargs=True)
            m.register_forward_hook(self.post_forward_hook, with_kwargs=True)
        self.link_parameters()

    def link_parameters(self) -> None:
        """Link every parameter of the call's modules that waits for the plan to this state
        (again after ``nn.Module._apply`` may have made new parameter objects); a nested tree's
        (``nested.py``) keep their own."""
        foreign = foreign_parameters(self.modules, self.tree.states)
        for m in self.modules:
            for p in m.parameters():
                if get_matrix_shard(p) is None and id(p) not in foreign:
                    link_lazy_plan(p, self)

    def fix_plan(self, cost: CostModel | None = None) -> ShardingContext:
        """Fix this call's tree's plan now (collective: every rank fixes it alike); the tree's
        :class:`ShardingContext`. ``cost`` prices it unless a call of the tree named one."""
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
        ctx.pre_forward(unit)
        param_dtype = getattr(self.mp_policy, "param_dtype", None)
        if param_dtype is not None and getattr(self.mp_policy, "cast_forward_inputs", False):
            args, kwargs = _cast_floating(args, param_dtype), _cast_floating(kwargs, param_dtype)
        if not in_backward() and torch.is_grad_enabled() and not unit.local_only:
            # a local-only unit has nothing to reduce early and nothing to free: the
            # end-of-backward callback lands its gradients (and runs their hooks)
            args, kwargs = _register_post_backward(ctx, unit, args, kwargs)
        return args, kwargs

    def post_forward_hook(self, module: nn.Module, args: tuple, kwargs: dict, output: Any) -> Any:
        ctx, unit = self.require_unit()
        ctx.post_forward(unit)
        if torch.is_grad_enabled() and not in_backward():
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
    """Identity on a unit's inputs; its backward runs once every node of this forward of the
    unit has produced its input gradients (FSDP2's ``RegisterPostBackwardFunction``)."""

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

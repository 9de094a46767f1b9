"""One state object per ``fully_shard`` call (FSDP2's ``FSDPState``): options, hooks, lazy init.

What is planned together is found through the module tree, as FSDP2 finds the states its root
initialises: a ``fully_shard`` call *adopts* the states of the calls made before on modules
inside it (blocks first, the root last), so the outermost call is the *root* of a tree and its
state holds the tree (call order within each adopted tree, adopted trees in module order,
itself last). Modules sharded without a common root call are separate trees, planned
separately, as FSDP2 treats every module without an enclosing ``fully_shard`` as its own root.

A tree is planned once, lazily (the plan balances the whole tree), by the root's
:meth:`OwnerShardState.lazy_init` at the first of: the first forward of any unit of the tree,
``unshard()`` / ``fix_plan()`` on one of its modules, or the optimizer's construction (through
:func:`~matrix_owner_optim.lazy_plan.fix_lazy_plans`, the parameters' link to their state).
Its :class:`PlanPhase` goes PENDING -> PLANNED (or FAILED, with the reason, if planning
raised: a rebuilt model is the way on). Setters only record :class:`~.unit.UnitOptions`.

The hooks are this object's methods: they fix the plan if needed and hand the unit to the
tree's :class:`~.context.ShardingContext`, which drives it.
"""

from __future__ import annotations

import enum
from typing import Any

import torch
from torch import nn
from torch.utils._pytree import tree_flatten, tree_map, tree_unflatten

from ..lazy_plan import link_lazy_plan
from ..planning.metadata import ShardingPlan, get_matrix_shard
from .build import build_context
from .context import ShardingContext
from .outputs import grad_tensors
from .unit import ShardedUnit, UnitOptions, in_backward

__all__ = ["OwnerShardState", "PlanPhase", "state_of"]

_STATE_ATTR = "_moo_state"


class PlanPhase(enum.Enum):
    """Where a tree's plan is: recorded, fixed (units built), or failed."""

    PENDING = "pending"
    PLANNED = "planned"
    FAILED = "failed"


def state_of(module: nn.Module) -> OwnerShardState | None:
    """The state of a module passed to ``fully_shard`` (None: not passed)."""
    return module.__dict__.get(_STATE_ATTR)


class OwnerShardState:
    """Everything one ``fully_shard`` call knows (one object, registered on each of its modules)."""

    modules: list[nn.Module]  # the call's modules (several in FSDP2's list form)
    group: Any  # shard process group
    replicate_group: Any  # HSDP replicate group, or None
    mp_policy: Any
    plan: ShardingPlan | None  # given by the user, or None: planned at lazy init
    preconditioner: Any  # prices the plan's matrices (None: the optimizer's, else Muon)
    options: UnitOptions  # what the set_* methods record
    root: OwnerShardState  # the outermost call of this call's tree (itself until adopted)
    tree: list[OwnerShardState]  # on a root: every state of the tree, planning order
    auto_prefetch: bool  # on a root: the next-unit prefetch for the whole tree
    phase: PlanPhase  # on a root
    failure: str | None  # on a root: why planning failed
    unit: ShardedUnit | None  # set when the plan is fixed
    context: ShardingContext | None  # on a root: set when the plan is fixed

    def __init__(
        self,
        modules: list[nn.Module],
        *,
        group: Any,
        replicate_group: Any,
        reshard_after_forward: bool,
        mp_policy: Any,
        plan: ShardingPlan | None,
        preconditioner: Any,
    ) -> None:
        self.modules = modules
        self.group = group
        self.replicate_group = replicate_group
        self.mp_policy = mp_policy
        self.plan = plan
        self.preconditioner = preconditioner
        self.options = UnitOptions(reshard_after_forward=reshard_after_forward)
        self.root = self
        self.tree = [self]
        self.auto_prefetch = True
        self.phase = PlanPhase.PENDING
        self.failure = None
        self.unit = None
        self.context = None

    # -- the tree --------------------------------------------------------------------------------
    def register(self) -> None:
        """Record this state on its modules, adopt the trees inside them, install the hooks and
        link the parameters that wait for the plan (``fully_shard``'s last step)."""
        roots: list[OwnerShardState] = []
        for m in self.modules:
            for sub in m.modules():
                st = state_of(sub)
                if st is not None and st.root is st and not any(r is st for r in roots):
                    roots.append(st)
        tree: list[OwnerShardState] = []
        for r in roots:
            tree.extend(r.tree)
            self.auto_prefetch = self.auto_prefetch and r.auto_prefetch
        for st in tree:
            st.root = self
            st.tree = [st]
        self.tree = [*tree, self]
        for m in self.modules:
            m.__dict__[_STATE_ATTR] = self
            m.register_forward_pre_hook(self.pre_forward_hook, with_kwargs=True)
            m.register_forward_hook(self.post_forward_hook, with_kwargs=True)
        self.link_parameters()

    def link_parameters(self) -> None:
        """Link every parameter of the call's modules that waits for the plan to this state
        (again after ``nn.Module._apply`` may have made new parameter objects)."""
        for m in self.modules:
            for p in m.parameters():
                if get_matrix_shard(p) is None:
                    link_lazy_plan(p, self)

    def fix_plan(self, preconditioner: Any = None) -> ShardingContext:
        """Fix this call's tree's plan now (collective: every rank fixes it alike); the tree's
        :class:`ShardingContext`. ``preconditioner`` prices it unless a call named one."""
        return self.root.lazy_init(preconditioner)

    def lazy_init(self, preconditioner: Any = None) -> ShardingContext:
        """On a root: plan the tree and build its units (once)."""
        assert self.root is self, "lazy_init runs on a tree's root"
        if self.phase is PlanPhase.PLANNED:
            assert self.context is not None
            return self.context
        if self.phase is PlanPhase.FAILED:
            raise RuntimeError(
                f"sharding of this {type(self.modules[0]).__name__} failed earlier ({self.failure}); "
                "build the model again and call fully_shard on it"
            )
        try:
            self.context = build_context(self.tree, preconditioner)
        except BaseException as exc:
            self.phase = PlanPhase.FAILED
            self.failure = f"{type(exc).__name__}: {exc}"
            raise
        for st, unit in zip(self.tree, self.context.units, strict=True):
            st.unit = unit
        self.context.auto_prefetch = self.auto_prefetch
        self.phase = PlanPhase.PLANNED
        return self.context

    def require_unit(self) -> tuple[ShardingContext, ShardedUnit]:
        """The tree's context and this call's unit, fixing the plan if it is pending."""
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
        if not in_backward() and torch.is_grad_enabled():
            args, kwargs = _register_post_backward(ctx, unit, args, kwargs)
        return args, kwargs

    def post_forward_hook(self, module: nn.Module, args: tuple, kwargs: dict, output: Any) -> Any:
        ctx, unit = self.require_unit()
        ctx.post_forward(unit)
        if torch.is_grad_enabled() and not in_backward():
            tensors = grad_tensors(output)  # dataclasses too, as FSDP2 (outputs.py)
            if tensors:
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

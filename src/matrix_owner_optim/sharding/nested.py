"""Trees nested inside another tree over another mesh: expert parallel's experts.

torchtitan shards an MoE block in two meshes (its ``apply_fsdp`` before per-parameter meshes:
``fully_shard(experts, mesh=efsdp_mesh)``, then ``fully_shard(block, mesh=fsdp_mesh)`` and the
root over ``fsdp``): expert parallelism cut the routed experts' stacks ``Shard(0)`` over the
``ep`` mesh, so the experts are sharded over ``efsdp`` (the ranks holding the same experts)
while everything else is sharded over all the data-parallel ranks. One tree plans over one mesh
(its units share the process groups and the plan), so the experts' call stays a tree of its own,
*nested* in the enclosing tree: planned, gathered and reduced over its own mesh, its parameters
left alone by the enclosing calls (not adopted, planned, linked or checked by them), as a
parameter in ``ignored_params`` is.

Only what is exact is accepted (:func:`nested_trees`): every parameter of the nested tree is an
owner-layout tensor on a 2D mesh (``efsdp`` x ``ep``, the expert-parallel slice whole on its
``efsdp`` owner) whose ranks are exactly the enclosing call's. Then the ep dim accounts for the
rest of the data-parallel ranks: each ep rank's experts received the tokens of its whole ep group
(the dispatch's all-to-all), so reducing their gradient over ``efsdp`` sums every rank's. A
plain parameter sharded over a sub-mesh would miss the other ranks' gradients and is refused, as
before, naming the mesh.

Kept apart from ``state.py`` (which imports the tree and the runtime) so that fixing a plan
(``build.py``) can ask which modules belong to a nested tree; it reads calls and trees through
the two protocols below, so it imports neither (``state.py`` and ``tree.py`` import it).
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from typing import Any, Protocol, TypeVar

import torch.distributed as dist
from torch import nn

from ..owner_dtensor import OwnerDTensor
from .ignored import is_ignored

__all__ = [
    "STATE_ATTR",
    "ShardCall",
    "CallTree",
    "foreign_modules",
    "foreign_parameters",
    "nested_trees",
    "why_not_nested",
]

STATE_ATTR = "_moo_state"  # where a module passed to fully_shard keeps its call's state


class ShardCall(Protocol):
    """What this module reads of one ``fully_shard`` call (``state.OwnerShardState``)."""

    group: Any
    replicate_group: Any
    modules: list[nn.Module]


class CallTree(Protocol):
    """What this module reads of a tree of calls (``tree.ShardTree``)."""

    @property
    def states(self) -> Sequence[ShardCall]: ...


TreeT = TypeVar("TreeT", bound=CallTree)


def _call_of(module: nn.Module) -> ShardCall | None:
    return module.__dict__.get(STATE_ATTR)


def _ranks(group: Any) -> list[int]:
    return sorted(dist.get_process_group_ranks(group))


def why_not_nested(tree: CallTree, group: Any, replicate_group: Any) -> str | None:
    """None when ``tree`` (over another mesh than ``group``) stays a tree nested in a call over
    ``group`` (no HSDP on either side, every parameter of its calls an owner-layout tensor on a
    2D mesh whose ranks are exactly ``group``'s: module docstring); else why not, naming the
    parameter."""
    if replicate_group is not None or any(st.replicate_group is not None for st in tree.states):
        return "HSDP (a 2D shard mesh) is not nested"
    if any(st.group is group for st in tree.states):
        return "it is sharded over this call's mesh"
    want = _ranks(group)
    for st in tree.states:
        for m in st.modules:
            for name, p in m.named_parameters():
                if is_ignored(p):
                    continue
                if not (isinstance(p, OwnerDTensor) and p.device_mesh.ndim == 2):
                    return f"its parameter {name!r} is not an expert-parallel slice (a DTensor on an ep mesh)"
                if sorted(int(r) for r in p.device_mesh.mesh.flatten().tolist()) != want:
                    return f"its parameter {name!r} lies on a mesh of other ranks than this call's"
    return None


def nested_trees(trees: Iterable[TreeT], group: Any, replicate_group: Any) -> list[TreeT]:
    """Of the ``trees`` inside a ``fully_shard`` call over ``group``, the ones over another
    mesh that stay trees of their own, nested in the call's (module docstring); the others are
    adopted (same mesh) or refused (``api._check_submodules``)."""
    return [t for t in trees if why_not_nested(t, group, replicate_group) is None]


def foreign_modules(modules: Sequence[nn.Module], states: Sequence[Any]) -> set[int]:
    """Ids of the modules inside ``modules`` that belong to a ``fully_shard`` call not among
    ``states`` (a nested tree's, and everything inside those modules): a tree of ``states``
    leaves their parameters alone."""
    mine = {id(st) for st in states}
    out: set[int] = set()
    for m in modules:
        for sub in m.modules():
            st = _call_of(sub)
            if st is not None and id(st) not in mine and id(sub) not in out:
                out.update(id(s) for s in sub.modules())
    return out


def foreign_parameters(modules: Sequence[nn.Module], states: Sequence[Any]) -> set[int]:
    """Ids of the parameters registered on :func:`foreign_modules` of ``modules``."""
    foreign = foreign_modules(modules, states)
    return {
        id(p)
        for m in modules
        for sub in m.modules()
        if id(sub) in foreign
        for p in sub._parameters.values()
        if p is not None
    }

"""Trees nested inside another tree over another mesh: expert parallel's experts (torchtitan's
``fully_shard(experts, mesh=efsdp_mesh)``), left alone by the enclosing tree as ``ignored_params``.

Accepted only where exact (:func:`nested_trees`): every parameter on an (``efsdp``, ``ep``) mesh
covering exactly the enclosing call's ranks. Reads calls and trees through two protocols.
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
    """None when ``tree`` stays a tree nested in a call over ``group``; else why not."""
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
    """Of the ``trees`` inside a call over ``group``, the ones that stay nested trees of their own."""
    return [t for t in trees if why_not_nested(t, group, replicate_group) is None]


def foreign_modules(modules: Sequence[nn.Module], states: Sequence[Any]) -> set[int]:
    """Ids of the modules inside ``modules`` of a call not among ``states`` (a nested tree's)."""
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

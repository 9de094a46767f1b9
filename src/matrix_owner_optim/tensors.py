"""Small facts about tensors that several layers need (no process group, no state)."""

from __future__ import annotations

import weakref
from dataclasses import dataclass
from typing import Any

import torch

__all__ = ["TreeLink", "is_dtensor", "itemsize", "local_tensor", "tree_link"]


def is_dtensor(t: Any) -> bool:
    """Whether ``t`` is a ``torch.distributed.tensor.DTensor`` (False where torch lacks it)."""
    try:
        from torch.distributed.tensor import DTensor
    except ImportError:  # pragma: no cover - torch built without distributed
        return False
    return isinstance(t, DTensor)


def local_tensor(t: torch.Tensor) -> torch.Tensor:
    """This rank's tensor of a ``DTensor`` (its local shard, outside autograd), or ``t`` itself.

    The one way the package reaches a DTensor's storage: optimizer and state-dict code work on
    the raw local tensor, never through ``to_local()``'s autograd view.
    """
    return t._local_tensor if is_dtensor(t) else t  # type: ignore[attr-defined]


def itemsize(dtype: torch.dtype) -> int:
    """Bytes per element of ``dtype``."""
    return torch.empty((), dtype=dtype, device="meta").element_size()


@dataclass(frozen=True, eq=False)
class TreeLink:
    """An owner-layout tensor's one link to the tree of ``fully_shard`` calls it belongs to
    (``OwnerDTensor._tree``): the parameters of a fixed tree, their gradients and ``detach()``
    aliases share the tree's link; an HSDP optimizer-state entry in a state dict links with
    ``held_on``, the one replica holding it (its step replica). ``tree`` is the
    ``sharding.tree.ShardTree`` (``replica_sync.ReplicaTree`` says what is read of it: its
    replicas' record and the landing of their due broadcasts). The link is weak: a tensor that
    outlives its model (a state-dict value kept somewhere) does not keep the tree, its runtime
    and their process groups alive; its tree is then None."""

    _tree: weakref.ref[Any]
    held_on: int | None = None

    @classmethod
    def to(cls, tree: Any, held_on: int | None = None) -> TreeLink:
        """A link to ``tree`` (held on ``held_on`` only, or on every replica)."""
        return cls(weakref.ref(tree), held_on)

    @property
    def tree(self) -> Any:
        """The tree (None once it is gone)."""
        return self._tree()

    def __deepcopy__(self, memo: dict[int, Any]) -> TreeLink:
        """A deep copy of a tensor links to the same tree (a tree is never copied)."""
        return self


def tree_link(t: Any) -> TreeLink | None:
    """The :class:`TreeLink` of ``t`` (None: not a tensor of a fixed tree)."""
    link = getattr(t, "_tree", None) if is_dtensor(t) else None
    return link if isinstance(link, TreeLink) else None

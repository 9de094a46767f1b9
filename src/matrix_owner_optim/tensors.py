"""Small facts about tensors that several layers need (no process group, no state)."""

from __future__ import annotations

import weakref
from dataclasses import dataclass
from typing import Any

import torch
from torch.distributed.tensor import DTensor

__all__ = ["TreeLink", "is_dtensor", "itemsize", "local_tensor", "tree_link"]


def is_dtensor(t: Any) -> bool:
    """Whether ``t`` is a ``torch.distributed.tensor.DTensor``."""
    return isinstance(t, DTensor)


def local_tensor(t: torch.Tensor) -> torch.Tensor:
    """This rank's tensor of a ``DTensor`` (its local shard, outside autograd), or ``t`` itself."""
    return t._local_tensor if is_dtensor(t) else t  # type: ignore[attr-defined]


def itemsize(dtype: torch.dtype) -> int:
    """Bytes per element of ``dtype``."""
    return torch.empty((), dtype=dtype, device="meta").element_size()


@dataclass(frozen=True, eq=False)
class TreeLink:
    """An owner-layout tensor's one weak link to its tree of ``fully_shard`` calls
    (``OwnerDTensor._tree``; what is read of it: ``replica_sync.ReplicaTree``); an HSDP state
    entry links with ``held_on``, the one replica holding it."""

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

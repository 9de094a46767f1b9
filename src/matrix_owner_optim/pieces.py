"""The placement of a tensor laid out like a :class:`MatrixShard` (its parameter, and the state
of its rows): the one place the plan's record is read as a DTensor placement.
"""

from __future__ import annotations

from typing import Any

from torch.distributed.tensor import Partial, Shard

from .owner_dtensor import OwnerShard, owned_ranges
from .planning.metadata import MatrixShard, Role

__all__ = ["placement_of"]


def placement_of(shard: MatrixShard) -> Any:
    """Planned row ranges of a split stack, ``Shard(0)`` row blocks, or held whole by the owner
    (a scalar: ``Partial`` with zeros elsewhere)."""
    if shard.is_split:
        return OwnerShard(0, shard.row_ranges())
    if shard.role is Role.ROWS:
        return Shard(0)
    assert shard.owner is not None
    if not shard.shape:
        return Partial("sum")
    return OwnerShard(0, owned_ranges(int(shard.shape[0]), shard.owner, shard.world_size))

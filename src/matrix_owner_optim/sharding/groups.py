"""The process groups one tree of units runs on, as one value every unit of the tree shares.

A unit never reaches for a process group itself: what it needs (the shard group and this rank's
place in it, HSDP's replicate group and this process's replica, the tree's replica sync) is a
:class:`ShardGroups` value built once when the tree's plan is fixed (``build.py``).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from ..planning.metadata import MatrixShard
from ..replica_sync import ReplicaSync, steps_here

__all__ = ["ShardGroups"]


@dataclass(frozen=True)
class ShardGroups:
    """The process groups a tree of units runs on (the same for all its units)."""

    group: Any  # the shard group: owners, all-gather-v and reduce-scatter-v
    rank: int
    world_size: int
    replicate_group: Any = None  # HSDP: the replicas of this shard group
    replicate_size: int = 1
    replicate_rank: int = 0  # HSDP: this process's replica
    replica_sync: ReplicaSync | None = None  # HSDP: the tree's replica record (replica_sync.py)

    def steps_here(self, shard: MatrixShard) -> bool:
        """Whether this replica's holder of ``shard`` gets its averaged gradient and steps it
        (HSDP gives each matrix one global owner: ``MatrixShard.step_replica``)."""
        return steps_here(shard, self.replica_sync)

    @property
    def dp_size(self) -> int:
        """Gradients are averaged over shard x replicate ranks."""
        return self.world_size * self.replicate_size

    @property
    def moves_nothing(self) -> bool:
        """One rank and no replicas: no collective has anyone to reach."""
        return self.world_size == 1 and self.replicate_size == 1

"""What a unit is given: its tree's process groups (``ShardGroups``), the options the user sets on
its module (``UnitOptions``), and the one dtype it gathers and computes in.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch
from torch import nn

from ..planning.metadata import MatrixShard
from ..replica_sync import ReplicaSync, steps_here

__all__ = ["ShardGroups", "UnitOptions", "compute_dtype", "one_compute_dtype"]


def compute_dtype(mp_policy: Any, dtype: torch.dtype) -> torch.dtype:
    """The dtype a parameter of ``dtype`` computes and is gathered in."""
    param_dtype = getattr(mp_policy, "param_dtype", None)
    return param_dtype if (param_dtype is not None and dtype.is_floating_point) else dtype


def one_compute_dtype(unit: int, dtypes: dict[str, torch.dtype]) -> torch.dtype | None:
    """The one compute dtype of a unit's parameters (None without any); a mix is refused."""
    if len(set(dtypes.values())) > 1:
        names = ", ".join(f"{fqn}: {dt}" for fqn, dt in dtypes.items())
        raise NotImplementedError(
            f"fully_shard unit {unit} mixes parameter dtypes ({names}); give the unit one "
            "dtype or set MixedPrecisionPolicy(param_dtype=...) so all compute in one dtype"
        )
    return next(iter(dtypes.values()), None)


@dataclass(eq=False)
class UnitOptions:
    """What the user set on a ``fully_shard`` module (its ``set_*`` methods record here)."""

    reshard_after_forward: bool
    requires_gradient_sync: bool = True
    reshard_after_backward: bool = True
    gradient_divide_factor: float | None = None  # None: the data-parallel size (the average)
    forward_prefetch: list[nn.Module] | None = None  # explicit targets; None: automatic
    backward_prefetch: list[nn.Module] | None = None


@dataclass(frozen=True)
class ShardGroups:
    """The process groups a tree of units runs on, one value all its units share."""

    group: Any  # the shard group: owners, all-gather-v and reduce-scatter-v
    rank: int
    world_size: int
    replicate_group: Any = None  # HSDP: the replicas of this shard group
    replicate_size: int = 1
    replicate_rank: int = 0  # HSDP: this process's replica
    replica_sync: ReplicaSync | None = None  # HSDP: the tree's replica record (replica_sync.py)

    def steps_here(self, shard: MatrixShard) -> bool:
        """Whether this replica's holder of ``shard`` gets its averaged gradient and steps it (HSDP)."""
        return steps_here(shard, self.replica_sync)

    @property
    def dp_size(self) -> int:
        """Gradients are averaged over shard x replicate ranks."""
        return self.world_size * self.replicate_size

    @property
    def moves_nothing(self) -> bool:
        """One rank and no replicas: no collective has anyone to reach."""
        return self.world_size == 1 and self.replicate_size == 1

"""The parameters one rank would hold under a plan, without processes or memory: meta tensors of
the shapes ``fully_shard`` leaves on ``rank``, each with its :class:`MatrixShard` (routing at W=1024).
"""

from __future__ import annotations

import torch

from ..planning.metadata import ShardingPlan, attach_matrix_shard

__all__ = ["simulated_parameters"]


def simulated_parameters(plan: ShardingPlan, rank: int) -> list[tuple[str, torch.nn.Parameter]]:
    if not 0 <= rank < plan.world_size:
        raise ValueError(f"rank {rank} is outside the plan's world size {plan.world_size}")
    out = []
    for shard in plan:
        p = torch.nn.Parameter(
            torch.empty(shard.local_shape(rank), dtype=shard.dtype, device="meta"),
            requires_grad=shard.requires_grad,
        )
        attach_matrix_shard(p, shard, rank)
        out.append((shard.fqn, p))
    return out

"""Plan agreement: every rank must shard with the same plan, checked once before any data moves.

Ranks all-gather the plan digest (one small object). On a mismatch they all-gather the
canonical plans and every rank raises the same ``ValueError`` naming the first parameter that
differs, so no rank is left waiting in a collective the others never issue.
"""

from __future__ import annotations

from typing import Any

from .. import comm
from ..planning.metadata import MatrixShard, Role, ShardingPlan

__all__ = ["check_plan_agreement"]


def _plan_from_canonical(world_size: int, rows: list[dict[str, Any]]) -> ShardingPlan:
    import torch

    shards = {}
    for row in rows:
        shards[row["fqn"]] = MatrixShard(
            fqn=row["fqn"], shape=tuple(row["shape"]), dtype=getattr(torch, row["dtype"]),
            role=Role(row["role"]), owner=row["owner"], unit=row["unit"],
            segment_offset=row["segment_offset"], segment_length=row["segment_length"],
            aliases=tuple(row["aliases"]), requires_grad=row["requires_grad"], world_size=world_size,
        )
    return ShardingPlan(world_size=world_size, shards=shards, loads=[])


def check_plan_agreement(plan: ShardingPlan, rank: int, group: Any = None) -> None:
    """Raise ``ValueError`` on every rank unless all ranks of ``group`` hold the same plan."""
    if plan.world_size == 1:  # one rank agrees with itself: no collective
        return
    digests = comm.all_gather_object(plan.digest(), group=group, name="plan_digest")
    if all(d == digests[0] for d in digests):
        return
    plans = comm.all_gather_object((plan.world_size, plan.canonical()), group=group, name="plan_canonical")
    reference = _plan_from_canonical(*plans[0])
    for other_rank in range(1, len(plans)):
        if digests[other_rank] == digests[0]:
            continue
        difference = reference.first_difference(_plan_from_canonical(*plans[other_rank]))
        raise ValueError(
            f"fully_shard: ranks disagree on the sharding plan (rank 0 vs rank {other_rank}): "
            f"{difference or 'digests differ'}. Every rank must build the plan from the same model, "
            "roles and world size (pass the same plan= / roles on all ranks)."
        )

"""Plan agreement: every rank must act on the same plan, checked once before any data moves.

One home for the check that both the owner-shaped runtime (``fully_shard``) and the optimizer's
replicated placement (DDP owners) make. Ranks all-gather the plan digest (one small object); on
a mismatch they all-gather the plans and every rank raises the same ``ValueError`` naming the
first parameter that differs, so no rank is left waiting in a collective the others never
issue.
"""

from __future__ import annotations

from typing import Any

import torch.distributed as dist

from . import comm
from .planning.metadata import ShardingPlan

__all__ = ["check_plan_agreement"]


def check_plan_agreement(plan: ShardingPlan, group: Any = None, *, who: str, what: str, remedy: str) -> None:
    """Raise ``ValueError`` on every rank of ``group`` unless all hold the same ``plan``.

    ``who`` names the caller and ``what`` the plan in the message; ``remedy`` says what to do.
    A group of one rank (or no process group) agrees with itself: no collective.
    """
    if not (dist.is_available() and dist.is_initialized()) or dist.get_world_size(group) == 1:
        return
    digests = comm.all_gather_object(plan.digest(), group=group, name="plan_digest")
    if all(d == digests[0] for d in digests):
        return
    plans = comm.all_gather_object(plan, group=group, name="plan_all_gather")
    for other in range(1, len(plans)):  # every rank names the same pair
        if digests[other] != digests[0]:
            detail = plans[0].first_difference(plans[other]) or "digests differ"
            raise ValueError(f"{who}: ranks disagree on the {what} (rank 0 vs rank {other}): {detail}. {remedy}")

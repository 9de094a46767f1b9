"""One global owner per matrix under HSDP: which replica steps each matrix.

On a (replicate, shard) mesh every replica holds the whole model split over its shard group by
the same plan, so a matrix has one *holder* per replica (its ``owner`` in the shard dim). Only
one of them needs the averaged gradient, the optimizer state and the step: the holder in the
matrix's :attr:`~.metadata.MatrixShard.step_replica`, its *global owner*. The others receive
the updated matrix after the step. This module picks that replica per matrix, balancing the
matrix optimizer's FLOPs and state bytes over all ``replicate x shard`` ranks, and reports the
load of every global rank.

The shard plan itself is unchanged (it balances what every replica holds: parameters and
gradients, whole on their holders), so the global plan is two-level: each shard column's
matrices are spread over the replicas, largest first, onto the replica whose holders are least
loaded (split stacks and bands: the busiest of their holders), ties by replica index, so every
rank computes the same assignment. Tail and ``rows`` tensors keep their all-reduced gradients
and their redundant AdamW step on every replica (README, "HSDP": measured, small, and no
broadcast to wait for).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence

from ..tensors import itemsize
from .cost import ADAMW_COST, CostModel, matrix_flops, matrix_state_bytes, numel
from .metadata import MatrixShard, RankLoad, Role, ShardingPlan
from .roles import TensorSpec

__all__ = ["assign_step_replicas", "holder_fractions", "steps_globally"]


def steps_globally(shard: MatrixShard) -> bool:
    """Whether HSDP gives ``shard`` one global owner: trainable matrices (every piece of a
    split stack or band too); tail and ``rows`` tensors and frozen matrices do not."""
    return shard.role is Role.MATRIX and shard.requires_grad


def holder_fractions(shard: MatrixShard) -> dict[int, float]:
    """Shard rank -> fraction of ``shard``'s rows it holds (one rank with 1.0 when whole)."""
    rows = float(shard.shape[0]) if shard.shape and shard.shape[0] else 1.0
    if shard.holds_rows:
        out = {}
        for r in range(shard.world_size):
            start, stop = shard.row_range(r)
            if stop > start:
                out[r] = (stop - start) / rows
        return out
    assert shard.owner is not None
    return {shard.owner: 1.0}


def assign_step_replicas(
    plan: ShardingPlan,
    specs: Sequence[TensorSpec],
    replicate_size: int,
    *,
    cost: CostModel,
    tail_cost: CostModel = ADAMW_COST,
) -> ShardingPlan:
    """``plan`` (a shard-dim plan) with a ``step_replica`` for every trainable matrix over
    ``replicate_size`` replicas, and ``replica_loads`` for every global rank ``r * W + s``.

    ``specs`` are the tensors the plan was made from (their views price the matrices), ``cost``
    the matrix optimizer's cost model, ``tail_cost`` the tail's. ``replicate_size == 1`` returns
    the plan unchanged."""
    if not isinstance(replicate_size, int) or replicate_size < 1:
        raise ValueError(f"replicate_size must be a positive int, got {replicate_size!r}")
    if replicate_size == 1:
        return plan
    R, S = replicate_size, plan.world_size
    spec_of = {s.fqn: s for s in specs}
    missing = [s.fqn for s in plan if s.fqn not in spec_of]
    if missing:
        raise ValueError(f"assign_step_replicas: no TensorSpec for parameter {missing[0]!r} of the plan")

    def price(shard: MatrixShard) -> tuple[float, float]:
        sp = spec_of[shard.fqn]
        return float(matrix_state_bytes(cost, sp.shape, sp.dtype, sp.view)), float(
            matrix_flops(cost, sp.shape, sp.view)
        )

    matrices = [s for s in plan if steps_globally(s)]
    priced = {s.fqn: price(s) for s in matrices}
    bt = sum(b for b, _ in priced.values()) / (R * S) or 1.0
    ft = sum(f for _, f in priced.values()) / (R * S) or 1.0
    state = [[0.0] * S for _ in range(R)]
    flops = [[0.0] * S for _ in range(R)]

    def level(r: int, fracs: dict[int, float], b: float, f: float) -> tuple[float, float]:
        worst = max(max((state[r][s] + b * x) / bt, (flops[r][s] + f * x) / ft) for s, x in fracs.items())
        total = sum((state[r][s] + b * x) / bt + (flops[r][s] + f * x) / ft for s, x in fracs.items())
        return worst, total

    order = sorted(
        range(len(matrices)), key=lambda i: (-(priced[matrices[i].fqn][0] / bt + priced[matrices[i].fqn][1] / ft), i)
    )
    step_replica: dict[str, int] = {}
    for i in order:
        shard = matrices[i]
        b, f = priced[shard.fqn]
        fracs = holder_fractions(shard)
        best = min(range(R), key=lambda r: (level(r, fracs, b, f), r))
        step_replica[shard.fqn] = best
        for s, x in fracs.items():
            state[best][s] += b * x
            flops[best][s] += f * x

    shards = {
        fqn: dataclasses.replace(s, step_replica=step_replica.get(fqn)) if fqn in step_replica else s
        for fqn, s in plan.shards.items()
    }
    return dataclasses.replace(
        plan,
        shards=shards,
        replicate_size=R,
        replica_loads=_global_loads(list(shards.values()), spec_of, R, S, state, flops, tail_cost),
    )


def _global_loads(
    shards: list[MatrixShard],
    spec_of: dict[str, TensorSpec],
    R: int,
    S: int,
    state: list[list[float]],
    flops: list[list[float]],
    tail_cost: CostModel,
) -> list[RankLoad]:
    """Per global rank ``r * S + s``: parameters and gradients its holder keeps (the same on
    every replica), the tail's state and FLOPs (redundant on every replica), and the state and
    FLOPs of the matrices its replica steps."""
    held = [0.0] * S
    tail_flops = [0.0] * S
    matrices = [[0] * S for _ in range(R)]
    tensors = [0] * S
    for shard in shards:
        sp = spec_of[shard.fqn]
        param = numel(sp.shape) * itemsize(sp.dtype)
        for s, x in holder_fractions(shard).items():
            held[s] += (2 * param if shard.requires_grad else param) * x
            if not shard.holds_rows:
                tensors[s] += 1
            if shard.requires_grad and shard.role is not Role.MATRIX:
                held[s] += tail_cost.state_bytes(sp.shape, sp.dtype) * x
                tail_flops[s] += tail_cost.flops(sp.shape) * x
            if shard.step_replica is not None and not shard.holds_rows:
                matrices[shard.step_replica][s] += 1
    return [
        RankLoad(
            rank=r * S + s,
            resident_bytes=int(round(held[s] + state[r][s])),
            optimizer_flops=float(tail_flops[s] + flops[r][s]),
            owned_matrices=matrices[r][s],
            owned_tensors=tensors[s],
        )
        for r in range(R)
        for s in range(S)
    ]

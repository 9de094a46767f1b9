"""HSDP's second stage of a unit's gradient reduction: this rank's summed segment across the
replicas.

After the reduce-scatter-v over the shard group each rank holds the sum of its segment over
its shard group; the replicas of that segment then finish the average. A matrix HSDP gives one
global owner (``MatrixShard.step_replica``) is reduce-scattered to that replica only (the others
never read it); what every replica steps (the tail, ``rows`` tensors, frozen parameters) is
all-reduced. Which ranges go where is a :class:`ReplicaSplit`, built once per reduce layout.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch

from .. import comm
from ..planning.metadata import MatrixShard
from .collectives import SegmentLayout, reduce_scatter_v
from .groups import ShardGroups

__all__ = ["ReplicaSplit", "reduce_across_replicas"]


@dataclass(frozen=True)
class ReplicaSplit:
    """How one rank's reduced segment crosses the replicas (HSDP): the ranges each replica's
    holders step (``step_replica``: reduce-scattered, each to its replica) and the ranges every
    replica steps (tail, ``rows``, frozen: all-reduced). Ranges are (offset, length) in the segment."""

    by_replica: tuple[tuple[tuple[int, int], ...], ...]
    everywhere: tuple[tuple[int, int], ...]

    @classmethod
    def build(cls, layout: SegmentLayout, rank: int, shards: list[MatrixShard], replicas: int) -> ReplicaSplit:
        by: list[list[tuple[int, int]]] = [[] for _ in range(replicas)]
        everywhere: list[tuple[int, int]] = []
        for e in layout.entries[rank]:
            r = shards[e.index].step_replica
            (everywhere if r is None else by[r]).append((e.offset, e.length))
        return cls(tuple(tuple(b) for b in by), tuple(everywhere))


def _cat(total: torch.Tensor, ranges: Sequence[tuple[int, int]]) -> torch.Tensor:
    return torch.cat([total[o : o + n] for o, n in ranges]) if ranges else total.new_empty(0)


def _scatter_back(total: torch.Tensor, ranges: Sequence[tuple[int, int]], flat: torch.Tensor) -> None:
    at = 0
    for o, n in ranges:
        total[o : o + n].copy_(flat[at : at + n])
        at += n


def reduce_across_replicas(total: torch.Tensor, split: ReplicaSplit, groups: ShardGroups) -> None:
    """The second stage of HSDP's gradient reduction, in place on this rank's summed segment:
    each replica's ranges are reduce-scattered to it (one reduce-scatter-v over the replicate
    group: the step owner gets the sum, the others keep partial values they never read), the
    ranges every replica steps are all-reduced. Bytes: those of one all-reduce of the segment
    (its reduce-scatter half here, the all-gather half is the updated matrices' broadcast)."""
    R, me = groups.replicate_size, groups.replicate_rank
    sizes = [sum(n for _, n in ranges) for ranges in split.by_replica]
    if sum(sizes):
        order = [r for r in range(R) if r != me] + [me]
        flat = torch.cat([_cat(total, split.by_replica[r]) for r in order])
        mine = reduce_scatter_v(flat, sizes, me, groups.replicate_group, op="replicate_reduce_scatter_v")
        assert isinstance(mine, torch.Tensor)
        _scatter_back(total, split.by_replica[me], mine)
        if groups.replica_sync is not None:  # the global owners will step: sync before the next gather
            groups.replica_sync.pending = True
    if split.everywhere:
        rest = _cat(total, split.everywhere)
        comm.all_reduce(rest, group=groups.replicate_group, name="replicate_all_reduce")
        _scatter_back(total, split.everywhere, rest)

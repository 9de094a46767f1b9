"""HSDP's second stage of a unit's gradient reduction: this rank's summed segment across the
replicas (DESIGN.md, "HSDP: one global owner per matrix"): a matrix's range reduce-scattered to
its step replica, the rest all-reduced, as a :class:`ReplicaSplit` built once per reduce layout.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch

from .. import comm
from ..planning.metadata import MatrixShard
from .collectives import SegmentLayout, reduce_scatter_v
from .unit_options import ShardGroups

__all__ = ["ReplicaSplit", "reduce_across_replicas"]


@dataclass(frozen=True)
class ReplicaSplit:
    """How one rank's reduced segment crosses the replicas: (offset, length) ranges per step
    replica (reduce-scattered to it) and the ranges every replica steps (all-reduced)."""

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
    """HSDP's second stage, in place: a reduce-scatter-v over the replicate group to each step
    replica, then an all-reduce of the ranges every replica steps."""
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

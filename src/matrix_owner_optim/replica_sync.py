"""HSDP's last stage: each matrix's global owner sends the updated matrix to the other replicas.

Under HSDP a matrix has one holder per replica (its owner in the shard dim) but one *global
owner*, the holder in its ``step_replica`` (``planning/replicas.py``): only that rank gets the
averaged gradient, keeps the optimizer state and steps it. The other replicas' holders need the
new values for their forward gathers, so :func:`sync_replicas` sends them: per step replica (and
dtype), one broadcast over the replicate group of every piece that replica stepped, in plan
order. Every rank of a replicate group is the same shard rank, so all of them list the same
pieces and issue the same broadcasts. Bytes: the all-gather half of the all-reduce the gradients
no longer take (the reduce-scatter half is the gradients' second stage).

When: ``OwnerRoutedOptimizer.step()`` syncs at its end (so the parameters are equal on every
replica when ``step()`` returns). A :class:`ReplicaSync` records, per tree, that gradients
landed since the last sync; the sharding runtime syncs at the next forward pass and at
``unshard()`` if nothing did and no ``OwnerRoutedOptimizer`` steps the tree (a plain
``torch.optim`` optimizer stepping the local pieces: then a synced micro-batch that no step
follows also sends its matrices, unchanged; accumulate with gradient sync off).
This module sits below both ``sharding`` and ``optim`` (they never import each other).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

import torch

from . import comm
from .planning.metadata import get_matrix_shard, get_shard_rank
from .tensors import local_tensor

__all__ = [
    "ReplicaPlace",
    "ReplicaSync",
    "attach_replica",
    "claim_sync",
    "get_replica",
    "steps_here",
    "sync_replicas",
]

_REPLICA_ATTR = "_moo_replica"


@dataclass(eq=False)
class ReplicaSync:
    """One tree's record that its global owners may have stepped since the last sync: set when a
    backward lands gradients of matrices one replica steps, cleared by :func:`sync_replicas`.
    The same on every rank of a replicate group (they land the same units). ``by_optimizer``:
    an ``OwnerRoutedOptimizer`` steps the tree's matrices and syncs at every step, so the
    runtime never needs to (a synced micro-batch without a step then sends nothing)."""

    pending: bool = False
    by_optimizer: bool = False


@dataclass(frozen=True)
class ReplicaPlace:
    """Where this process sits across HSDP replicas: its index in the replicate group (the
    mesh's dim 0), the group's size and the group, and its tree's :class:`ReplicaSync`."""

    rank: int
    size: int
    group: Any
    sync: ReplicaSync = field(default_factory=ReplicaSync)


def attach_replica(param: torch.Tensor, place: ReplicaPlace) -> None:
    """Record on ``param`` this process's place across HSDP replicas."""
    setattr(param, _REPLICA_ATTR, place)


def get_replica(param: torch.Tensor) -> ReplicaPlace | None:
    """This process's place across HSDP replicas for ``param`` (None: no replicas)."""
    return getattr(param, _REPLICA_ATTR, None)


def steps_here(param: torch.Tensor) -> bool:
    """Whether this rank's holder of ``param`` steps it: always, unless an HSDP plan gave the
    matrix to another replica (``MatrixShard.step_replica``)."""
    shard, place = get_matrix_shard(param), get_replica(param)
    if shard is None or shard.step_replica is None or place is None:
        return True
    return shard.step_replica == place.rank


def claim_sync(params: Sequence[torch.Tensor]) -> None:
    """An optimizer that calls :func:`sync_replicas` at every step takes over the sync of the
    trees ``params`` belong to (the runtime's sync at the next forward is then skipped)."""
    for p in params:
        place, shard = get_replica(p), get_matrix_shard(p)
        if place is not None and shard is not None and shard.step_replica is not None:
            place.sync.by_optimizer = True


def _held_pieces(params: Sequence[torch.Tensor]) -> list[tuple[torch.Tensor, int]]:
    """(this rank's piece, its step replica) of every parameter one replica steps for all and
    this rank holds a piece of, in the order given."""
    out = []
    for p in params:
        shard, place, rank = get_matrix_shard(p), get_replica(p), get_shard_rank(p)
        if shard is None or shard.step_replica is None or place is None or place.size <= 1 or rank is None:
            continue
        piece = local_tensor(p)
        if piece.numel() and (shard.holds_rows or shard.owner == rank):
            out.append((piece, shard.step_replica))
    return out


def sync_replicas(params: Sequence[torch.Tensor], *, only_pending: bool = False) -> bool:
    """Send every piece of ``params`` that its step replica updates to the other replicas (in
    place): per tree, one broadcast per (step replica, dtype), in that order on every rank of the
    group. ``only_pending``: only trees whose backward landed gradients since their last sync.
    Returns whether anything was synced."""
    trees: dict[int, tuple[ReplicaPlace, list[torch.Tensor]]] = {}
    for p in params:
        pl = get_replica(p)
        if pl is not None and pl.size > 1:
            trees.setdefault(id(pl.sync), (pl, []))[1].append(p)
    synced = False
    for place, members in trees.values():
        if only_pending and (place.sync.by_optimizer or not place.sync.pending):
            continue
        place.sync.pending = False
        _broadcast(place, _held_pieces(members))
        synced = True
    return synced


def _broadcast(place: ReplicaPlace, pieces: list[tuple[torch.Tensor, int]]) -> None:
    batches: dict[tuple[int, torch.dtype], list[torch.Tensor]] = {}
    for t, r in sorted(pieces, key=lambda x: x[1]):  # stable: plan order per replica
        batches.setdefault((r, t.dtype), []).append(t)
    with torch.no_grad():
        for (r, dtype), mine in batches.items():
            sizes = [t.numel() for t in mine]
            if place.rank == r:
                flat = torch.cat([t.reshape(-1) for t in mine])
            else:
                flat = torch.empty(sum(sizes), dtype=dtype, device=mine[0].device)
            comm.broadcast(flat, group_src=r, group=place.group, name="replicate_broadcast")
            if place.rank != r:
                torch._foreach_copy_(mine, [f.view(t.shape) for f, t in zip(flat.split(sizes), mine, strict=True)])

"""HSDP's last stage: each matrix's global owner sends the updated matrix to the other replicas.

Under HSDP a matrix has one holder per replica (its owner in the shard dim) but one *global
owner*, the holder in its ``step_replica`` (``planning/replicas.py``): only that rank gets the
averaged gradient, keeps the optimizer state and steps it. The other replicas' holders need the
new values for their forward gathers, so the global owners broadcast them over the replicate
group: per step replica (and dtype) one broadcast of every piece that replica stepped, in plan
order. Every rank of a replicate group is the same shard rank, so all of them list the same
pieces and issue the same broadcasts. Bytes: the all-gather half of the all-reduce the gradients
no longer take (the reduce-scatter half is the gradients' second stage).

When (``OwnerRoutedOptimizer(replica_broadcast=...)``, measured in DESIGN.md):

* ``"step"``: :func:`sync_replicas` at the end of ``step()``, one broadcast per (step replica,
  dtype) for the whole tree; the parameters are equal on every replica when ``step()`` returns.
* ``"forward"``: :func:`defer_replicas` only marks the tree (``ReplicaSync.generation``); each
  unit of the sharding runtime then has a broadcast due (its pending-sync state), issued
  asynchronously for every unit at the next forward pass and landed by the unit before its
  all-gather reads its pieces, so later units' broadcasts overlap earlier units' compute. Reads
  outside a forward land every due broadcast first: ``unshard()``, ``state_dict()`` /
  ``load_state_dict()`` (hence DCP and torch's get/set_*_state_dict) and ``full_tensor()`` of a
  parameter or its ``detach()`` (``land_deferred``; the runtime sets ``ReplicaSync.land_all``).
  A piece read directly (``to_local()``), or a value computed from one, before the next forward
  holds the previous step's values on the replicas that did not step it.

A plain ``torch.optim`` optimizer stepping the local pieces claims nothing: a tree whose
gradients landed since the last sync (``ReplicaSync.pending``) gets its broadcasts due at the
next forward pass or ``unshard()`` (then a synced micro-batch that no step follows also sends its
matrices, unchanged; accumulate with gradient sync off). This module sits below both
``sharding`` and ``optim`` (they never import each other).
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

import torch

from . import comm
from .planning.metadata import get_matrix_shard, get_shard_rank
from .tensors import local_tensor

__all__ = [
    "BROADCAST_PLACEMENTS",
    "DEFAULT_REPLICA_BROADCAST",
    "PendingBroadcast",
    "ReplicaPlace",
    "ReplicaSync",
    "attach_replica",
    "claim_sync",
    "defer_replicas",
    "get_replica",
    "held_pieces",
    "issue_broadcast",
    "keep_replica_place",
    "mark_replica_state",
    "replica_state_source",
    "land_deferred",
    "steps_here",
    "sync_replicas",
]

BROADCAST_PLACEMENTS = ("step", "forward")  # OwnerRoutedOptimizer(replica_broadcast=...)
DEFAULT_REPLICA_BROADCAST = "step"  # the faster one in bench on a (2, 2) mesh (DESIGN.md)

_REPLICA_ATTR = "_moo_replica"


@dataclass(eq=False)
class ReplicaSync:
    """One tree's record of what its replicas still have to exchange. The same on every rank of
    a replicate group (they land the same units and step alike).

    ``pending``: a backward landed gradients of matrices one replica steps since the last sync
    (cleared when the runtime makes the broadcasts due). ``by_optimizer``: an
    ``OwnerRoutedOptimizer`` steps the tree's matrices and sends (or defers) them at every step,
    so ``pending`` is never turned into broadcasts (a synced micro-batch without a step then
    sends nothing). ``generation``: bumped by :func:`defer_replicas`; a unit whose last issued
    broadcast has another generation has one due. ``land_all``: the runtime's way to land every
    due broadcast now (set by the tree's ``ShardingContext``)."""

    pending: bool = False
    by_optimizer: bool = False
    generation: int = 0
    land_all: Callable[[], None] | None = None


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


def keep_replica_place(src: torch.Tensor, alias: torch.Tensor) -> None:
    """``alias`` (a ``detach()`` / ``alias()`` of ``src``) reads the same piece: it carries the
    same place, so reading its value lands a deferred sync as reading ``src`` does."""
    place = get_replica(src)
    if place is not None:
        attach_replica(alias, place)


_STATE_ATTR = "_moo_replica_state"


def mark_replica_state(value: torch.Tensor, param: torch.Tensor) -> None:
    """Mark ``value``, an optimizer-state entry of ``param`` in a state dict, as held on
    ``param``'s step replica only (HSDP): its ``full_tensor()`` is then gathered there and
    broadcast over the replicate group, so every replica gets the whole value (torch's
    ``full_state_dict=True``). No-op for parameters every replica steps."""
    shard, place = get_matrix_shard(param), get_replica(param)
    if shard is not None and shard.step_replica is not None and place is not None and place.size > 1:
        setattr(value, _STATE_ATTR, (place, shard.step_replica))


def replica_state_source(value: torch.Tensor) -> tuple[ReplicaPlace, int] | None:
    """(this process's place, the step replica holding ``value``) for a state entry marked by
    :func:`mark_replica_state`, else None."""
    return getattr(value, _STATE_ATTR, None)


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


def held_pieces(params: Sequence[torch.Tensor]) -> list[tuple[torch.Tensor, int]]:
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
    synced = False
    for place, members in _trees(params).values():
        if only_pending and (place.sync.by_optimizer or not place.sync.pending):
            continue
        place.sync.pending = False
        issue_broadcast(place, held_pieces(members)).wait()
        synced = True
    return synced


def defer_replicas(params: Sequence[torch.Tensor]) -> None:
    """The ``"forward"`` placement: mark the trees of ``params`` as stepped, so every unit of
    them has its broadcast due before its next all-gather (see the module docstring)."""
    for place, _ in _trees(params).values():
        place.sync.pending = False
        place.sync.generation += 1


def land_deferred(param: torch.Tensor) -> None:
    """Before a read of ``param``'s value outside the runtime (``full_tensor()``): land every
    broadcast its tree has due (collective over the replicate group; a no-op when none is)."""
    place = get_replica(param)
    if place is not None and place.size > 1 and place.sync.land_all is not None:
        place.sync.land_all()


def _trees(params: Sequence[torch.Tensor]) -> dict[int, tuple[ReplicaPlace, list[torch.Tensor]]]:
    trees: dict[int, tuple[ReplicaPlace, list[torch.Tensor]]] = {}
    for p in params:
        pl = get_replica(p)
        if pl is not None and pl.size > 1:
            trees.setdefault(id(pl.sync), (pl, []))[1].append(p)
    return trees


@dataclass(eq=False)
class PendingBroadcast:
    """Broadcasts issued asynchronously over a replicate group: per (step replica, dtype) the
    flat buffer, the pieces it lands in and whether this rank sent it. :meth:`wait` completes
    them and copies what arrived into the pieces (in place)."""

    batches: list[tuple[Any, torch.Tensor, list[torch.Tensor], bool]]

    def wait(self) -> None:
        with torch.no_grad():
            for work, flat, pieces, sent in self.batches:
                if work is not None:
                    work.wait()
                if not sent:
                    sizes = [t.numel() for t in pieces]
                    views = [f.view(t.shape) for f, t in zip(flat.split(sizes), pieces, strict=True)]
                    torch._foreach_copy_(pieces, views)
        self.batches = []


def issue_broadcast(place: ReplicaPlace, pieces: list[tuple[torch.Tensor, int]]) -> PendingBroadcast:
    """Issue, asynchronously, one broadcast per (step replica, dtype) of ``pieces`` (from
    :func:`held_pieces`), in step-replica order then plan order: the same on every rank of the
    replicate group. The senders' values are read now."""
    batches: dict[tuple[int, torch.dtype], list[torch.Tensor]] = {}
    for t, r in sorted(pieces, key=lambda x: x[1]):  # stable: plan order per replica
        batches.setdefault((r, t.dtype), []).append(t)
    out = []
    with torch.no_grad():
        for (r, dtype), mine in batches.items():
            sent = place.rank == r
            if sent:
                flat = torch.cat([t.reshape(-1) for t in mine])
            else:
                flat = torch.empty(sum(t.numel() for t in mine), dtype=dtype, device=mine[0].device)
            work = comm.broadcast(flat, group_src=r, group=place.group, name="replicate_broadcast", async_op=True)
            out.append((work, flat, mine, sent))
    return PendingBroadcast(out)

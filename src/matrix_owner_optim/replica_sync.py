"""HSDP's last stage: each matrix's global owner sends the updated matrix to the other replicas,
one broadcast per (step replica, dtype) carrying the sender's step count (DESIGN.md, "HSDP: one
global owner per matrix"). Below ``sharding`` and ``optim``, above the representation.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any, Protocol

import torch
import torch.distributed as dist

from . import comm
from .agreement import check_same_step
from .planning.metadata import MatrixShard, get_matrix_shard, get_shard_rank
from .tensors import TreeLink, local_tensor, tree_link

__all__ = [
    "BROADCAST_PLACEMENTS",
    "DEFAULT_REPLICA_BROADCAST",
    "PendingBroadcast",
    "ReplicaSync",
    "ReplicaTree",
    "claim_sync",
    "held_pieces",
    "hold_on_step_replica",
    "issue_broadcast",
    "replica_groups",
    "replicas_of",
    "replicas_stepped",
    "steps_here",
]

BROADCAST_PLACEMENTS = ("step", "forward")  # OwnerRoutedOptimizer(replica_broadcast=...)
DEFAULT_REPLICA_BROADCAST = "step"  # the faster one in bench on a (2, 2) mesh (DESIGN.md)


@dataclass(eq=False)
class ReplicaSync:
    """One tree's HSDP replica state (``ShardTree.replicas``): this process's ``rank`` in the
    replicate ``group``; ``pending``: gradients of globally stepped matrices landed since the last
    sync; ``by_optimizer``: an optimizer syncs at every step; ``generation``: bumped by a deferred
    step; ``steps``: the global owners' steps, carried by every broadcast."""

    rank: int
    size: int
    group: Any
    pending: bool = False
    by_optimizer: bool = False
    generation: int = 0
    steps: int = 0


class ReplicaTree(Protocol):
    """What this module and the representation read of a tensor's tree (``sharding.tree.ShardTree``)."""

    replicas: ReplicaSync | None

    def land_replicas(self) -> None:
        """Land every broadcast the tree has due (collective over the replicate group)."""

    def replicas_stepped(self, params: Sequence[torch.Tensor], *, deferred: bool) -> None:
        """Its global owners stepped ``params``: broadcast them now, or mark them due."""


def replicas_of(t: torch.Tensor) -> ReplicaSync | None:
    """The replica record of ``t``'s tree (None: no replicas, or not a tensor of a fixed tree)."""
    tree = None if (link := tree_link(t)) is None else link.tree
    return None if tree is None else tree.replicas


def steps_here(shard: MatrixShard | None, replicas: ReplicaSync | None) -> bool:
    """Whether this rank's holder of ``shard`` steps it (not when ``MatrixShard.step_replica`` is another)."""
    if shard is None or shard.step_replica is None or replicas is None:
        return True
    return shard.step_replica == replicas.rank


def _one_replica_steps(p: torch.Tensor) -> ReplicaSync | None:
    """``p``'s replica record where one replica steps it for all (HSDP), else None."""
    shard, replicas = get_matrix_shard(p), replicas_of(p)
    if shard is None or shard.step_replica is None or replicas is None or replicas.size <= 1:
        return None
    return replicas


def claim_sync(params: Sequence[torch.Tensor]) -> None:
    """An optimizer calling :func:`replicas_stepped` at every step takes over the trees' sync."""
    for p in params:
        replicas = _one_replica_steps(p)
        if replicas is not None:
            replicas.by_optimizer = True


def replica_groups(params: Sequence[torch.Tensor]) -> list[Any]:
    """The replicate groups (of more than one rank) of the trees ``params`` belong to, each
    once, in the order of their first parameter: the groups :func:`replicas_stepped` broadcasts
    over."""
    groups: list[Any] = []
    for p in params:
        replicas = replicas_of(p)
        if replicas is not None and replicas.size > 1 and not any(g is replicas.group for g in groups):
            groups.append(replicas.group)
    return groups


def replicas_stepped(params: Sequence[torch.Tensor], placement: str) -> None:
    """The end of a step over ``params``: each tree counts it and broadcasts now or marks it due."""
    trees: dict[int, tuple[Any, list[torch.Tensor]]] = {}
    for p in params:
        replicas = replicas_of(p)
        if replicas is not None and replicas.size > 1:
            tree = tree_link(p).tree  # type: ignore[union-attr]  # replicas_of found it
            trees.setdefault(id(tree), (tree, []))[1].append(p)
    for tree, members in trees.values():
        if any(_one_replica_steps(p) is not None for p in members):
            tree.replicas.steps += 1
        tree.replicas_stepped(members, deferred=placement == "forward")


def held_pieces(params: Sequence[torch.Tensor]) -> list[tuple[torch.Tensor, int]]:
    """(this rank's piece, its step replica) of every parameter one replica steps, in order."""
    out = []
    for p in params:
        shard, rank, piece = get_matrix_shard(p), get_shard_rank(p), local_tensor(p)
        if _one_replica_steps(p) is not None and rank is not None and piece.numel():
            assert shard is not None and shard.step_replica is not None  # _one_replica_steps
            if shard.holds_rows or shard.owner == rank:
                out.append((piece, shard.step_replica))
    return out


def hold_on_step_replica(value: torch.Tensor, param: torch.Tensor) -> None:
    """Link ``value``, a state-dict entry of ``param``, to ``param``'s tree as held on its step
    replica only (HSDP), so its ``full_tensor()`` reaches every replica."""
    link = tree_link(param)
    if link is not None and _one_replica_steps(param) is not None:
        shard = get_matrix_shard(param)
        assert shard is not None
        value._tree = TreeLink.to(link.tree, shard.step_replica)  # type: ignore[attr-defined]


@dataclass(eq=False)
class PendingBroadcast:
    """Broadcasts issued asynchronously over a replicate group: per (step replica, dtype) the
    work, the flat buffer, the pieces it lands in and the sender; ``steps``: this rank's count."""

    replicas: ReplicaSync
    steps: int
    batches: list[tuple[Any, torch.Tensor, list[torch.Tensor], int]]

    def wait(self) -> None:
        """Complete them and copy what arrived; raises first when a sender was at another step."""
        batches, self.batches = self.batches, []
        for work, _, _, _ in batches:
            if work is not None:
                work.wait()
        group, me = self.replicas.group, self.replicas.rank
        received = [(f, r) for _, f, _, r in batches if r != me]
        check_same_step(
            self.steps,
            [int(f[-8 // f.element_size() :].clone().view(torch.int64)) for f, _ in received],
            who="HSDP replica broadcast",
            among=f"the replicate group (senders {sorted({dist.get_global_rank(group, r) for _, r in received})})",
            counted="optimizer steps of the global owners",
        )
        with torch.no_grad():
            for _, flat, pieces, r in batches:
                if r != me:
                    sizes = [t.numel() for t in pieces]
                    views = [f.view(t.shape) for f, t in zip(flat[: sum(sizes)].split(sizes), pieces, strict=True)]
                    torch._foreach_copy_(pieces, views)


def issue_broadcast(replicas: ReplicaSync, pieces: list[tuple[torch.Tensor, int]]) -> PendingBroadcast:
    """Issue one async broadcast per (step replica, dtype) of ``pieces`` and the step count."""
    batches: dict[tuple[int, torch.dtype], list[torch.Tensor]] = {}
    for t, r in sorted(pieces, key=lambda x: x[1]):  # stable: plan order per replica
        batches.setdefault((r, t.dtype), []).append(t)
    out = []
    with torch.no_grad():
        for (r, dtype), mine in batches.items():
            bits = torch.tensor([replicas.steps]).view(dtype).to(mine[0].device)  # int64's bytes, bit for bit
            if replicas.rank == r:
                flat = torch.cat([t.reshape(-1) for t in mine] + [bits])
            else:
                flat = torch.empty(sum(t.numel() for t in mine) + bits.numel(), dtype=dtype, device=mine[0].device)
            work = comm.broadcast(flat, group_src=r, group=replicas.group, name="replicate_broadcast", async_op=True)
            out.append((work, flat, mine, r))
    return PendingBroadcast(replicas, replicas.steps, out)

"""HSDP's last stage: each matrix's global owner sends the updated matrix to the other replicas.

Under HSDP a matrix has one holder per replica (its owner in the shard dim) but one *global
owner*, the holder in its ``step_replica`` (``planning/replicas.py``): only that rank gets the
averaged gradient, keeps the optimizer state and steps it. The other replicas' holders need the
new values for their forward gathers, so the global owners broadcast them over the replicate
group: per step replica (and dtype) one broadcast of every piece that replica stepped, in plan
order. Every rank of a replicate group is the same shard rank, so all of them list the same
pieces and issue the same broadcasts. Bytes: the all-gather half of the all-reduce the gradients
no longer take (the reduce-scatter half is the gradients' second stage).

One record holds a tree's replica state, :class:`ReplicaSync`, on its ``ShardTree``
(``sharding/tree.py``). Every tensor of the tree reaches it through its one link to the tree
(``tensors.TreeLink``); the tree's runtime (``ShardingContext``) alone issues and lands the
broadcasts. When (``OwnerRoutedOptimizer(replica_broadcast=...)``, measured in DESIGN.md):

* ``"step"``: :func:`replicas_stepped` at the end of ``step()`` asks each tree to broadcast
  now, one broadcast per (step replica, dtype) of the optimizer's pieces; the parameters are
  equal on every replica when ``step()`` returns.
* ``"forward"``: the tree is only marked (``ReplicaSync.generation``); each unit then has a
  broadcast due, issued asynchronously for every unit at the next forward pass and landed by the
  unit before its all-gather reads its pieces. Reads outside a forward land every due broadcast
  first: ``unshard()``, ``state_dict()`` / ``load_state_dict()`` and ``full_tensor()`` of a
  parameter or its ``detach()`` (``ReplicaTree.land_replicas``, through the tensor's link). A
  piece read directly (``to_local()``) before the next forward holds the previous step's values
  on the replicas that did not step it.

A plain ``torch.optim`` optimizer stepping the local pieces claims nothing: a tree whose
gradients landed since the last sync (``ReplicaSync.pending``) gets its broadcasts due at the
next forward pass or ``unshard()``. This module sits below both ``sharding`` and ``optim`` (they
never import each other), and above the representation (``owner_dtensor`` reads the link only).
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
    "replicas_of",
    "replicas_stepped",
    "steps_here",
]

BROADCAST_PLACEMENTS = ("step", "forward")  # OwnerRoutedOptimizer(replica_broadcast=...)
DEFAULT_REPLICA_BROADCAST = "step"  # the faster one in bench on a (2, 2) mesh (DESIGN.md)


@dataclass(eq=False)
class ReplicaSync:
    """One tree's HSDP replica state (``ShardTree.replicas``), the same on every rank of a
    replicate group (they land the same units and step alike).

    ``rank``, ``size``, ``group``: this process's index in the replicate group (the mesh's dim
    0), the group's size and the group. ``pending``: a backward landed gradients of matrices one
    replica steps since the last sync (cleared when the runtime makes the broadcasts due).
    ``by_optimizer``: an ``OwnerRoutedOptimizer`` steps the tree's matrices and sends (or
    defers) them at every step, so ``pending`` is never turned into broadcasts. ``generation``:
    bumped by a deferred step; a unit whose last issued broadcast has another generation has one
    due. ``steps``: the optimizer steps of the tree's global owners (:func:`replicas_stepped`
    calls with matrices one replica steps), carried by every broadcast and checked by its
    receivers."""

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
    """Whether this rank's holder of ``shard`` steps it: always, unless an HSDP plan gave the
    matrix to another replica (``MatrixShard.step_replica``)."""
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
    """An optimizer that calls :func:`replicas_stepped` at every step takes over the sync of the
    trees ``params`` belong to (the runtime's sync at the next forward is then skipped)."""
    for p in params:
        replicas = _one_replica_steps(p)
        if replicas is not None:
            replicas.by_optimizer = True


def replicas_stepped(params: Sequence[torch.Tensor], placement: str) -> None:
    """The end of an optimizer step over ``params``: each tree of them broadcasts the pieces its
    global owners stepped now (``"step"``) or marks them due before each unit's next all-gather
    (``"forward"``); see the module docstring."""
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
    """(this rank's piece, its step replica) of every parameter one replica steps for all and
    this rank holds a piece of, in the order given."""
    out = []
    for p in params:
        shard, rank = get_matrix_shard(p), get_shard_rank(p)
        if _one_replica_steps(p) is None or shard is None or shard.step_replica is None or rank is None:
            continue
        piece = local_tensor(p)
        if piece.numel() and (shard.holds_rows or shard.owner == rank):
            out.append((piece, shard.step_replica))
    return out


def hold_on_step_replica(value: torch.Tensor, param: torch.Tensor) -> None:
    """Link ``value``, an optimizer-state entry of ``param`` in a state dict, to ``param``'s
    tree as held on its step replica only (HSDP): its ``full_tensor()`` is then gathered there
    and broadcast over the replicate group, so every replica gets the whole value (torch's
    ``full_state_dict=True``). No-op for parameters every replica steps."""
    link = tree_link(param)
    if link is not None and _one_replica_steps(param) is not None:
        shard = get_matrix_shard(param)
        assert shard is not None
        value._tree = TreeLink.to(link.tree, shard.step_replica)  # type: ignore[attr-defined]


def _step_bits(step: int, dtype: torch.dtype, device: torch.device) -> torch.Tensor:
    """``step`` as an int64's 8 bytes in ``dtype`` elements: a broadcast moves them bit for bit."""
    return torch.tensor([step], dtype=torch.int64).view(dtype).to(device)


@dataclass(eq=False)
class PendingBroadcast:
    """Broadcasts issued asynchronously over a replicate group: per (step replica, dtype) the
    flat buffer (the pieces, then the sender's step count), the pieces it lands in and whether
    this rank sent it. :meth:`wait` completes them, checks that each sender was at this rank's
    step and copies what arrived into the pieces (in place)."""

    replicas: ReplicaSync
    steps: int
    batches: list[tuple[Any, torch.Tensor, list[torch.Tensor], int]]

    def wait(self) -> None:
        """Raises ``RuntimeError`` (agreement.check_same_step) before copying anything when a
        sender's step count differs from this rank's."""
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
    """Issue, asynchronously, one broadcast per (step replica, dtype) of ``pieces`` (from
    :func:`held_pieces`) and the sender's step count (8 bytes), in step-replica order then plan
    order: the same on every rank of the replicate group. The senders' values are read now."""
    batches: dict[tuple[int, torch.dtype], list[torch.Tensor]] = {}
    for t, r in sorted(pieces, key=lambda x: x[1]):  # stable: plan order per replica
        batches.setdefault((r, t.dtype), []).append(t)
    out = []
    with torch.no_grad():
        for (r, dtype), mine in batches.items():
            bits = _step_bits(replicas.steps, dtype, mine[0].device)
            if replicas.rank == r:
                flat = torch.cat([t.reshape(-1) for t in mine] + [bits])
            else:
                flat = torch.empty(sum(t.numel() for t in mine) + bits.numel(), dtype=dtype, device=mine[0].device)
            work = comm.broadcast(flat, group_src=r, group=replicas.group, name="replicate_broadcast", async_op=True)
            out.append((work, flat, mine, r))
    return PendingBroadcast(replicas, replicas.steps, out)

"""Update layouts: whether this rank updates each parameter, through which tensor (its
``proxy``), what moves around the local step, and where the state lies. :class:`LocalLayout`
serves one process and the owner layout; ``layout_of.py`` picks the layout of a tensor.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from dataclasses import dataclass
from typing import Any, ClassVar

import torch
import torch.distributed as dist
from einops import rearrange

from ..agreement import check_plan_agreement
from ..owner_dtensor import mesh_of_group
from ..pieces import placement_of
from ..planning.bands import row_band_of
from ..planning.catalog import DEFAULT_COST
from ..planning.cost import CostModel
from ..planning.metadata import Role, ShardingPlan, get_shard_group, get_shard_rank
from ..replica_sync import (
    DEFAULT_REPLICA_BROADCAST,
    claim_sync,
    replica_groups,
    replicas_of,
    replicas_stepped,
    steps_here,
)
from ..tensors import local_tensor
from .routing import RoutedParam
from .state_place import RowPieces, StatePlace

__all__ = [
    "LayoutConfig",
    "UpdateLayout",
    "LocalLayout",
    "is_multi_rank",
]


def is_multi_rank() -> bool:
    return dist.is_available() and dist.is_initialized() and dist.get_world_size() > 1


def give_grads(rps: list[RoutedParam]) -> None:
    """Give each proxy that is not its parameter the parameter's (local) gradient, in its shape."""
    for rp in rps:
        if rp.proxy is not None and rp.proxy is not rp.param:
            grad = rp.param.grad
            rp.proxy.grad = None if grad is None else local_tensor(grad).view(rp.proxy.shape)


def matrix_view(param: torch.Tensor) -> torch.Tensor:
    """The 2D ``(out, rest)`` view a matrix optimizer sees of a >2D kernel (shares storage)."""
    return rearrange(param.detach(), "o ... -> o (...)")


@dataclass(frozen=True)
class LayoutConfig:
    """What every update layout of one optimizer may need to know."""

    matrix_cost: CostModel = DEFAULT_COST
    replicated: str = "owner"
    replica_broadcast: str = DEFAULT_REPLICA_BROADCAST  # HSDP: "step" or "forward" (replica_sync.py)


class UpdateLayout(ABC):
    """Base class: one instance per layout kind per :class:`~.role_optimizer.RoleOptimizer`."""

    name: ClassVar[str] = "layout"

    def __init__(self, config: LayoutConfig | None = None) -> None:
        self.config = config or LayoutConfig()
        self.entries: list[RoutedParam] = []
        # owner plans add() made, checked across ranks by agree(): (plan, group, tp group)
        self.unagreed: list[tuple[ShardingPlan, Any, Any]] = []

    @abstractmethod
    def add(self, entries: list[RoutedParam]) -> None:
        """Take new parameters: set ``proxy`` and ``owner``. Pure: what needs other ranks waits for :meth:`agree`."""

    def agree(self) -> None:
        """Collective, the construction step after ``OwnerRoutedOptimizer._route``: check every owner
        plan :meth:`add` made across its group (and TP group); exchange what lies on other ranks."""
        remedy = (
            "Every rank must build OwnerRoutedOptimizer over the same parameters (names, global shapes, "
            "dtypes, roles) in the same order."
        )
        for plan, group, tp_group in self.unagreed:
            check_plan_agreement(plan, group, who="OwnerRoutedOptimizer", what="owner plan", remedy=remedy)
            if tp_group is not None:
                what = "owner plan across the tensor-parallel group"
                check_plan_agreement(plan, tp_group, who="OwnerRoutedOptimizer", what=what, remedy=remedy)
        self.unagreed = []

    def before_step(self) -> None:  # noqa: B027 (a hook with a no-op default)
        """Give each local proxy its gradient (collectives allowed here if the layout needs them)."""

    def after_step(self) -> None:  # noqa: B027 (a hook with a no-op default)
        """Write the proxies' new values where the layout keeps them."""

    def zero_grad(self, set_to_none: bool = True) -> None:
        """Clear the gradients the layout gave its proxies."""
        for rp in self.entries:
            if rp.proxy is not None and rp.proxy is not rp.param:
                rp.proxy.grad = None

    def bytes_per_step(self) -> int:
        """Bytes this rank sends and receives in one step (0 when the step is local)."""
        return 0

    def step_groups(self) -> list[tuple[str, Any]]:
        """The process groups (each with the name errors give it) this layout's step issues
        collectives over on this rank of an owner-layout tree, in an order every member of each
        group shares: the optimizer's step check opens the step with its step count over each,
        and the tree's forward does too (DESIGN.md, "Ranks at different steps"). A local step:
        none."""
        return []

    def extra_resident_bytes(self) -> int:
        """Working memory the layout keeps beyond parameters, gradients and optimizer state."""
        return 0

    def state_place(self, rp: RoutedParam) -> StatePlace | None:
        """Where ``rp``'s optimizer state lies (None: every rank keeps its own whole)."""
        return None


class LocalLayout(UpdateLayout):
    """Parameters this process updates without talking to anyone: every one in one process;
    after ``fully_shard``, each on its owner (``rows``: each rank's rows); under HSDP on its global
    owner, which then syncs the other replicas (``replica_sync.py``).
    """

    name = "local"

    def add(self, entries: list[RoutedParam]) -> None:
        claim_sync([rp.param for rp in entries])  # HSDP: after_step syncs the replicas
        for rp in entries:
            self.entries.append(rp)
            shard = rp.shard
            piece = local_tensor(rp.param)  # this rank's piece of an owner-layout DTensor
            if shard is not None:
                rank = get_shard_rank(rp.param)
                rp.owner = shard.owner
                if shard.holds_rows:
                    local = piece.numel() > 0
                else:
                    local = shard.owner == rank and (piece.numel() > 0 or not shard.shape)
                local = local and steps_here(shard, replicas_of(rp.param))  # HSDP: another replica's steps it
            else:
                rp.owner = 0
                local = True
            if not local:
                rp.proxy = None
            elif rp.role is Role.MATRIX and rp.param.dim() > 2:
                rp.proxy = matrix_view(piece)
            elif piece is not rp.param:  # the child optimizer steps the plain local tensor
                rp.proxy = piece.detach()
            else:
                rp.proxy = rp.param

    def before_step(self) -> None:
        give_grads(self.entries)

    def after_step(self) -> None:
        self.zero_grad(True)
        # HSDP: each matrix's global owner sends the new values to the other replicas' holders,
        # now or before each unit's next all-gather
        replicas_stepped([rp.param for rp in self.entries], self.config.replica_broadcast)

    def step_groups(self) -> list[tuple[str, Any]]:
        """HSDP with ``replica_broadcast="step"``: the replicate group of each tree whose global
        owners broadcast at the end of the step (none when they broadcast in the forward)."""
        if self.config.replica_broadcast != "step":
            return []
        return [("the replicate group", g) for g in replica_groups([rp.param for rp in self.entries])]

    def state_place(self, rp: RoutedParam) -> StatePlace | None:
        """Owner-held state is the owner's; row blocks keep this rank's rows; band keys are here."""
        shard, rank = rp.shard, get_shard_rank(rp.param)
        if shard is None or rank is None or shard.world_size <= 1:
            return None
        mesh = mesh_of_group(get_shard_group(rp.param), local_tensor(rp.param).device.type)
        rows = None
        if shard.holds_rows:
            start, stop = shard.row_range(rank)
            rows = RowPieces(mesh, placement_of(shard), int(shard.shape[0]), start, stop)
        return StatePlace(
            mesh,
            holder=None if shard.holds_rows else shard.owner,
            rows=rows,
            band=row_band_of(rp.proxy) if rp.proxy is not None else None,
            held_elsewhere=shard.is_split or (not shard.holds_rows and shard.owner is not None),
            here=False,
        )

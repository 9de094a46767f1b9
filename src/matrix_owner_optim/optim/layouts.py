"""Update layouts: how the parameters of one layout reach the rank that updates them.

An :class:`UpdateLayout` decides, for each parameter, whether this rank updates it and through which
tensor (its ``proxy``), and moves what the layout forces before and after the local step:

* :class:`LocalLayout` — one process, and owner-shaped parameters after
  :func:`matrix_owner_optim.fully_shard`: the owner holds the tensor whole, so the step is
  local and moves zero bytes.

Other layouts (stock FSDP2 DTensors, owner-layout TP / EP slices, replicated DDP parameters)
have their own modules; which one steps a parameter is one rule by what the tensor is
(``layout_of.py``).
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from dataclasses import dataclass
from typing import Any, ClassVar

import torch
import torch.distributed as dist
from einops import rearrange

from ..owner_dtensor import OwnerDTensor, as_owner_dtensor, is_owner_dtensor, mesh_of_group
from ..planning.bands import band_holds_key, row_band_of
from ..planning.catalog import DEFAULT_COST
from ..planning.cost import CostModel
from ..planning.metadata import Role, get_shard_group, get_shard_rank
from ..replica_sync import DEFAULT_REPLICA_BROADCAST, claim_sync, replicas_of, replicas_stepped, steps_here
from ..tensors import is_dtensor, local_tensor
from .routing import RoutedParam

__all__ = [
    "LayoutConfig",
    "UpdateLayout",
    "LocalLayout",
    "is_multi_rank",
    "holder_local",
    "plain_local",
    "NOT_HELD",
]


class _NotHeld:
    """What :meth:`UpdateLayout.state_local` returns for a saved state entry another rank holds
    (a block of a matrix cut into bands between owners): the loader keeps nothing of it."""

    def __repr__(self) -> str:
        return "NOT_HELD"

    def __deepcopy__(self, memo: dict[int, Any]) -> _NotHeld:
        return self


NOT_HELD = _NotHeld()


def is_multi_rank() -> bool:
    return dist.is_available() and dist.is_initialized() and dist.get_world_size() > 1


def matrix_view(param: torch.Tensor) -> torch.Tensor:
    """The 2D ``(out, rest)`` view a matrix optimizer sees of a >2D kernel (shares storage)."""
    return rearrange(param.detach(), "o ... -> o (...)")


@dataclass(frozen=True)
class LayoutConfig:
    """What every update layout of one optimizer may need to know.

    ``matrix_cost`` prices matrices for owner planning (the chosen matrix optimizer's cost
    model; by default ``planning.catalog.DEFAULT_COST``); ``replicated`` is ``"owner"`` (each
    replicated matrix updated by one owner, results shared) or ``"redundant"`` (every rank
    updates every replicated matrix, no communication). ``replica_broadcast`` is when HSDP's
    global owners send their updated matrices to the other replicas (``"step"``: at the end of
    the step; ``"forward"``: deferred into the next forward's gathers).
    """

    matrix_cost: CostModel = DEFAULT_COST
    replicated: str = "owner"
    replica_broadcast: str = DEFAULT_REPLICA_BROADCAST  # HSDP: "step" or "forward" (replica_sync.py)


class UpdateLayout(ABC):
    """Base class: one instance per layout kind per role of an optimizer
    (:class:`~.role_optimizer.RoleOptimizer` keeps them)."""

    name: ClassVar[str] = "layout"

    def __init__(self, config: LayoutConfig | None = None) -> None:
        self.config = config or LayoutConfig()
        self.entries: list[RoutedParam] = []

    @abstractmethod
    def add(self, entries: list[RoutedParam]) -> None:
        """Take new parameters: set ``proxy`` (None where another rank updates) and ``owner``."""

    def before_step(self) -> None:  # noqa: B027 (a hook with a no-op default)
        """Give each local proxy its gradient (collectives allowed here if the layout needs them)."""

    def after_step(self) -> None:  # noqa: B027 (a hook with a no-op default)
        """Write the proxies' new values where the layout keeps them."""

    def zero_grad(self, set_to_none: bool = True) -> None:  # noqa: B027 (a hook with a no-op default)
        """Clear gradients the layout made for its proxies."""

    def bytes_per_step(self) -> int:
        """Bytes this rank sends and receives in one step (0 when the step is local)."""
        return 0

    def extra_resident_bytes(self) -> int:
        """Working memory the layout keeps beyond parameters, gradients and optimizer state."""
        return 0

    # -- state dicts: how this rank's optimizer state of ``rp`` reads as a piece of a global tensor --
    def state_entry(self, rp: RoutedParam, key: str, value: Any) -> Any:
        """``value`` (state ``key`` of ``rp`` on this rank) as a state-dict entry.

        Default: the tensor itself (one process, replicated layouts). Partitioned layouts return
        DCP pieces of the global tensor (owner-layout DTensors) so that DCP reshards.
        """
        return value

    def state_holder(self, rp: RoutedParam) -> tuple[int, Any] | None:
        """(owner in the shard group, shard group) when one rank alone holds ``rp``'s state
        (the others then list its keys as empty pieces, so every rank's state dict has the same
        entries, as torch's state-dict utilities need); None where every rank holds its own."""
        return None

    def empty_state_entry(self, rp: RoutedParam, shape: tuple[int, ...], dtype: torch.dtype, device: str) -> Any:
        """The entry this rank lists for a state value of global ``shape`` that it holds none of,
        where this layout places the pieces itself (expert parallel stacks, tensor-parallel
        slices); None: an empty piece held by ``state_holder``'s owner."""
        return None

    def state_local(self, rp: RoutedParam, key: str, value: Any) -> Any:
        """This rank's value of state ``key`` of ``rp`` from a state-dict entry: a piece written
        by :meth:`state_entry` on this layout, a full tensor, or a replicated DTensor."""
        return plain_local(value, f"optimizer state {key!r} of {rp.label!r}")


def holder_local(value: OwnerDTensor, owner: int | None, what: str, *, here: bool = True) -> torch.Tensor:
    """The one holder check of a loaded entry held whole by one rank (``value.holder``): this
    rank's local tensor of it when the state dict's holder is the layout's ``owner`` (and, with
    ``here``, this rank), else the error naming both."""
    if value.holder != owner or (here and not value.is_holder):
        raise ValueError(
            f"{what}: held by rank {value.holder} in the state dict, by rank {owner} here; load a full "
            "state dict or go through DCP"
        )
    return local_tensor(value)


def plain_local(value: Any, what: str) -> Any:
    """A full tensor from a plain tensor or a replicated DTensor; other pieces are an error."""
    if is_dtensor(value):
        from torch.distributed.tensor import Replicate

        if all(isinstance(p, Replicate) for p in value.placements):
            return local_tensor(value)
        raise ValueError(
            f"{what}: the state dict holds a piece ({type(value).__name__}, placements "
            f"{tuple(value.placements)}) but this rank keeps the whole tensor; load a full state dict "
            "or go through DCP (dcp.load into get_optimizer_state_dict(model, optimizer))"
        )
    return value


class LocalLayout(UpdateLayout):
    """Parameters this process can update without talking to anyone.

    In one process every parameter is local. After owner-shaped ``fully_shard`` a parameter is
    local on its owner (matrices and tail tensors) or on every rank for its own rows
    (``rows`` role); other ranks hold an empty tensor and skip it. Under HSDP a matrix is local
    on its global owner only (the holder in its ``step_replica``), which sends the updated
    values to the other replicas' holders after the step (``replica_sync.py``).
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
        for rp in self.entries:
            if rp.proxy is not None and rp.proxy is not rp.param:
                grad = rp.param.grad
                rp.proxy.grad = None if grad is None else local_tensor(grad).view(rp.proxy.shape)

    def after_step(self) -> None:
        self.zero_grad(True)
        # HSDP: each matrix's global owner sends the new values to the other replicas' holders,
        # now or before each unit's next all-gather
        replicas_stepped([rp.param for rp in self.entries], self.config.replica_broadcast)

    def zero_grad(self, set_to_none: bool = True) -> None:
        for rp in self.entries:
            if rp.proxy is not None and rp.proxy is not rp.param:
                rp.proxy.grad = None

    @staticmethod
    def _sharded(rp: RoutedParam) -> tuple[Any, int, Any] | None:
        shard, rank = rp.shard, get_shard_rank(rp.param)
        if shard is None or rank is None or shard.world_size <= 1:
            return None
        return shard, rank, get_shard_group(rp.param)

    def state_entry(self, rp: RoutedParam, key: str, value: Any) -> Any:
        """Owner-held state: held whole by the owner, of its own shape; row-block state
        (``rows``): a ``Shard(0)`` DTensor of the parameter's global shape; scalars (``step``)
        as the plain tensors torch keeps (every rank lists the holder's value)."""
        info = self._sharded(rp)
        if info is None or not isinstance(value, torch.Tensor):
            return value
        from ..pieces import piece_of
        from ..planning.metadata import Role

        shard, rank, group = info
        if value.dim() == 0:  # a scalar (AdamW's ``step``) stays a plain tensor, as torch keeps it;
            return value  # ranks without it list the holder's value (state_dict._list_held_elsewhere)
        band = row_band_of(rp.proxy) if rp.proxy is not None else None
        if band is not None and band_holds_key(band, key) is not None:  # a block of this band
            return OwnerDTensor.owned(value, rank, mesh_of_group(group, value.device.type), tuple(value.shape))
        if band is not None and tuple(value.shape) != tuple(shard.local_shape(rank)):
            raise ValueError(
                f"optimizer state {key!r} of {rp.label!r} has shape {tuple(value.shape)}; state of a band of "
                f"rows must be per element (rows {tuple(shard.local_shape(rank))}), a scalar, or per block "
                "(keys ending in _<block row>_<block column>)"
            )
        if shard.is_split:  # this rank's experts: their state keeps the experts on dim 0
            return piece_of(value, shard, rank, group)
        if shard.role is Role.ROWS:
            if tuple(value.shape) != tuple(shard.local_shape(rank)):
                raise ValueError(
                    f"optimizer state {key!r} of {rp.label!r} has shape {tuple(value.shape)}; state of "
                    f"a row-sharded parameter must be per element (rows {tuple(shard.local_shape(rank))}) "
                    "or a scalar to be saved as a piece of a global tensor"
                )
            return piece_of(value, shard, rank, group)
        return piece_of(value, shard, rank, group, shape=tuple(value.shape))

    def state_holder(self, rp: RoutedParam) -> tuple[int, Any] | None:
        info = self._sharded(rp)
        if info is not None and info[0].is_split:  # ranks holding no expert list the others' keys
            return -1, info[2]
        if info is None or info[0].holds_rows or info[0].owner is None:
            return None
        return info[0].owner, info[2]

    def state_local(self, rp: RoutedParam, key: str, value: Any) -> Any:
        info = self._sharded(rp)
        what = f"optimizer state {key!r} of {rp.label!r}"
        value = as_owner_dtensor(value)
        band = row_band_of(rp.proxy) if rp.proxy is not None else None
        mine = band_holds_key(band, key) if band is not None else None
        if info is not None and mine is not None:  # a block's state: held whole by its band's owner
            if is_owner_dtensor(value) and value.holder is not None:
                return local_tensor(value) if value.holder == info[1] else NOT_HELD
            return plain_local(value, what) if mine else NOT_HELD
        if info is not None and is_owner_dtensor(value) and value.holder is not None:
            return holder_local(value, info[0].owner, what, here=False)
        if info is None or not isinstance(value, torch.Tensor) or value.dim() == 0:
            return plain_local(value, what) if isinstance(value, torch.Tensor) else value
        from ..pieces import local_piece

        shard, rank, _ = info
        if shard.holds_rows:
            return local_piece(value, shard, rank, what=what, like=local_tensor(rp.param))
        return plain_local(value, what)

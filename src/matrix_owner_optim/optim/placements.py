"""Placements: how parameters of one layout reach the rank that updates them.

A placement decides, for each parameter, whether this rank updates it and through which
tensor (its ``proxy``), and moves what the layout forces before and after the local step:

* :class:`LocalPlacement` — one process, and owner-shaped parameters after
  :func:`matrix_owner_optim.fully_shard`: the owner holds the tensor whole, so the step is
  local and moves zero bytes.

Other layouts (stock FSDP2 DTensors, replicated DDP parameters) register their own classes in
:data:`PLACEMENTS`; the first whose ``accepts`` says yes takes a parameter.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from dataclasses import dataclass
from typing import Any, ClassVar

import torch
import torch.distributed as dist
from einops import rearrange

from ..planning.metadata import Role, get_shard_rank
from ..tensors import is_dtensor
from .routing import RoutedParam

__all__ = ["RouterConfig", "Placement", "LocalPlacement", "PLACEMENTS", "register_placement", "placement_for", "is_multi_rank"]


def is_multi_rank() -> bool:
    return dist.is_available() and dist.is_initialized() and dist.get_world_size() > 1


def matrix_view(param: torch.Tensor) -> torch.Tensor:
    """The 2D ``(out, rest)`` view a matrix optimizer sees of a >2D kernel (shares storage)."""
    return rearrange(param.detach(), "o ... -> o (...)")


@dataclass(frozen=True)
class RouterConfig:
    """What every placement of one optimizer may need to know.

    ``matrix_factory`` prices matrices for owner planning (its ``cost_model``, else Muon's);
    ``replicated`` is ``"owner"`` (each replicated matrix updated by one owner, results shared)
    or ``"redundant"`` (every rank updates every replicated matrix, no communication).
    """

    matrix_factory: Any = None
    replicated: str = "owner"


class Placement(ABC):
    """Base class: one instance per layout per optimizer."""

    name: ClassVar[str] = "placement"

    def __init__(self, config: RouterConfig | None = None) -> None:
        self.config = config or RouterConfig()
        self.entries: list[RoutedParam] = []

    @staticmethod
    @abstractmethod
    def accepts(param: torch.Tensor) -> bool:
        """Whether this placement handles ``param``."""

    @abstractmethod
    def add(self, entries: list[RoutedParam]) -> None:
        """Take new parameters: set ``proxy`` (None where another rank updates) and ``owner``."""

    def before_step(self) -> None:
        """Give each local proxy its gradient (collectives allowed here if the layout needs them)."""

    def after_step(self) -> None:
        """Write the proxies' new values where the layout keeps them."""

    def zero_grad(self, set_to_none: bool = True) -> None:
        """Clear gradients the placement made for its proxies."""

    def bytes_per_step(self) -> int:
        """Bytes this rank sends and receives in one step (0 when the step is local)."""
        return 0

    def extra_resident_bytes(self) -> int:
        """Working memory the layout keeps beyond parameters, gradients and optimizer state."""
        return 0


class LocalPlacement(Placement):
    """Parameters this process can update without talking to anyone.

    In one process every parameter is local. After owner-shaped ``fully_shard`` a parameter is
    local on its owner (matrices and tail tensors) or on every rank for its own rows
    (``sharded`` role); other ranks hold an empty tensor and skip it.
    """

    name = "local"

    @staticmethod
    def accepts(param: torch.Tensor) -> bool:
        if is_dtensor(param):
            return False
        return get_shard_rank(param) is not None or not is_multi_rank()

    def add(self, entries: list[RoutedParam]) -> None:
        for rp in entries:
            self.entries.append(rp)
            shard = rp.shard
            if shard is not None:
                rank = get_shard_rank(rp.param)
                rp.owner = shard.owner
                if shard.role is Role.SHARDED:
                    local = rp.param.numel() > 0
                else:
                    local = shard.owner == rank and rp.param.numel() > 0
            else:
                rp.owner = 0
                local = True
            if not local:
                rp.proxy = None
            elif rp.role is Role.MATRIX and rp.param.dim() > 2:
                rp.proxy = matrix_view(rp.param)
            else:
                rp.proxy = rp.param

    def before_step(self) -> None:
        for rp in self.entries:
            if rp.proxy is not None and rp.proxy is not rp.param:
                grad = rp.param.grad
                rp.proxy.grad = None if grad is None else grad.view(rp.proxy.shape)

    def after_step(self) -> None:
        self.zero_grad(True)

    def zero_grad(self, set_to_none: bool = True) -> None:
        for rp in self.entries:
            if rp.proxy is not None and rp.proxy is not rp.param:
                rp.proxy.grad = None


PLACEMENTS: list[type[Placement]] = [LocalPlacement]


def register_placement(cls: type[Placement], *, first: bool = True) -> None:
    """Add a layout; ``first`` puts it ahead of the existing ones."""
    if cls in PLACEMENTS:
        return
    if first:
        PLACEMENTS.insert(0, cls)
    else:
        PLACEMENTS.append(cls)


def placement_for(param: torch.Tensor, label: str) -> type[Placement]:
    for cls in PLACEMENTS:
        if cls.accepts(param):
            return cls
    kind = type(param).__name__
    raise ValueError(
        f"parameter {label!r} ({kind}, shape {tuple(param.shape)}) is in a multi-rank job but "
        "is neither owner-sharded (matrix_owner_optim.fully_shard) nor a layout this optimizer "
        f"knows ({', '.join(c.name for c in PLACEMENTS)})"
    )

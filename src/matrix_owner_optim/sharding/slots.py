"""Where a unit's parameters are registered, resolved once: a swap is one loop of dict stores.

A unit swaps its parameters on every hook (the unsharded tensors in for compute, the sharded
ones back for the user and the optimizer), several times per step. Through the handles that is
a method call per parameter and an attribute walk per place; :class:`RegistrationSlots` holds
every (module, name, tensor) once for each direction, so a swap costs what FSDP2's
``_unsharded_param`` / ``_sharded_param`` swap costs: one ``module._parameters[name] = t`` per
place. It is rebuilt with the unit's unsharded tensors (``ShardedUnit.rebuild_unsharded``: at
creation and after ``nn.Module._apply``), the only points where either tensor object changes.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch
from torch import nn

from .handle import ParamHandle

__all__ = ["RegistrationSlots"]


class RegistrationSlots:
    """Every place a unit's parameters are registered, with the tensor each direction puts there."""

    unsharded: list[tuple[nn.Module, str, torch.Tensor]]
    sharded: list[tuple[nn.Module, str, torch.Tensor]]

    def __init__(self, handles: Sequence[ParamHandle]) -> None:
        self.unsharded = [(m, name, h.unsharded) for h in handles for m, name in h.locations]
        self.sharded = [(m, name, h.sharded) for h in handles for m, name in h.locations]
        self._first = self.unsharded[0] if self.unsharded else None

    def swap(self, unsharded: bool) -> None:
        """Register the unsharded tensors (compute) or the sharded ones (the user's view)."""
        for module, name, t in self.unsharded if unsharded else self.sharded:
            module._parameters[name] = t  # type: ignore[assignment]  # as FSDP2 swaps

    def unsharded_registered(self) -> bool:
        """Whether the unsharded tensors are the registered ones (read at the first place)."""
        first = self._first
        return first is not None and first[0]._parameters.get(first[1]) is first[2]

"""Parameters assigned over the sharded ones (``load_state_dict(assign=True)``, as torchtune's
``set_model_state_dict`` ends) adopted into the plan: before it is fixed as new replicated
parameters, after it copied into the planned ones (this rank's piece) and registered again.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch
from torch import nn
from torch.distributed.tensor import DTensor, Replicate

from .. import comm
from ..lazy_plan import link_lazy_plan
from ..owner_dtensor import OwnerDTensor, mesh_of_group
from .ignored import is_ignored
from .state import OwnerShardState

__all__ = ["adopt_assigned", "adoption_hook", "replica_sync_hook"]


def adoption_hook(state: OwnerShardState) -> Callable[[nn.Module, Any], None]:
    """A ``register_load_state_dict_post_hook`` hook adopting what was assigned in ``state``'s modules."""

    def hook(module: nn.Module, incompatible_keys: Any) -> None:
        adopt_assigned(state)

    return hook


def replica_sync_hook(state: OwnerShardState) -> Callable[..., None]:
    """A ``state_dict`` / ``load_state_dict`` pre hook: land every HSDP broadcast due first."""

    def hook(*args: Any, **kwargs: Any) -> None:
        state.tree.land_replicas()

    return hook


def adopt_assigned(state: OwnerShardState) -> int:
    """Adopt every parameter of ``state``'s modules not the owner layout's own; the count."""
    ctx = state.tree.context
    count = 0
    made: dict[int, nn.Parameter] = {}
    for m in state.modules:
        for mod in m.modules():
            for name, p in list(mod._parameters.items()):
                if p is None or is_ignored(p):
                    continue
                if ctx is None:
                    if isinstance(p, OwnerDTensor) and isinstance(p.placement, Replicate):
                        continue  # fully_shard's own (or an equal replicated one): the plan takes it
                    new = made.get(id(p))
                    if new is None:
                        new = made[id(p)] = _replicated(p, state)
                    mod._parameters[name] = new
                    count += 1
                    continue
                handle = ctx.handle_at(mod, name)
                if handle is None or p is handle.sharded or p is handle._unsharded:
                    continue  # unknown places are refused at the next forward (check_registrations)
                with torch.no_grad():
                    handle.sharded.copy_(_whole(p) if not isinstance(p, OwnerDTensor) else p)
                handle.sharded.requires_grad_(p.requires_grad)
                mod._parameters[name] = handle.sharded
                count += 1
    return count


def _whole(p: torch.Tensor) -> torch.Tensor:
    """The full value of a plain tensor or a DTensor (collective for a sharded DTensor)."""
    t = p.full_tensor() if isinstance(p, DTensor) else p
    return t.detach()


def _replicated(p: torch.Tensor, state: OwnerShardState) -> nn.Parameter:
    """A replicated owner-layout parameter holding ``p``'s full value, on the mesh's device."""
    device = comm.object_device(state.group)
    full = _whole(p)
    if full.device != device and full.device.type != "meta":
        full = full.to(device)
    mesh = mesh_of_group(state.group, device.type)
    new = nn.Parameter(OwnerDTensor.replicated(full, mesh), requires_grad=p.requires_grad)
    link_lazy_plan(new, state)
    return new

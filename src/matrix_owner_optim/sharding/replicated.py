"""Parameters become owner-layout DTensors at the ``fully_shard`` call, replicated.

Each rank still holds the whole tensor until the tree's plan is fixed; then the same objects
become this rank's pieces in place (``OwnerDTensor.relayout``), so the model's own init and
``load_state_dict`` run on full tensors before, and every reference taken after the call stays
valid. (``to_empty`` of parameters still on ``meta`` fixes the plan first, so that it allocates
only this rank's pieces: ``module.py``'s ``_apply``.) A tied parameter stays one object at every place it is registered; one
tied across two calls is found through the old object's link to its replacement.

The link is a plain reference from the old object to the new one, never a weak reference to the
new one: ``torch.utils.swap_tensors`` (which ``nn.Module._apply`` uses for every DTensor
parameter: ``.to(dtype)``, ``to_empty``) refuses a tensor that has a weak reference, so a weak
link would make ``model.to(...)`` fail whenever the user still holds an original parameter (a
param-group list built before ``fully_shard``). Stock FSDP2 leaves no link at all. The old
object keeps its replacement alive only as long as someone keeps the old object.
"""

from __future__ import annotations

from typing import Any

import torch
from torch import nn
from torch.distributed.tensor import DTensor

from ..owner_dtensor import OwnerDTensor
from .ignored import is_ignored

__all__ = ["as_owner_dtensors", "check_plain_parameters", "current_parameter"]

_REPLACED_BY = "_moo_replaced_by"


def current_parameter(p: torch.Tensor) -> torch.Tensor:
    """``p``, or the owner-layout DTensor ``fully_shard`` registered in its place elsewhere."""
    new = p.__dict__.get(_REPLACED_BY)
    return new if isinstance(new, torch.Tensor) else p


def check_plain_parameters(modules: list[nn.Module], ignored_params: set[nn.Parameter] | None) -> None:
    """Refuse a parameter that is already a DTensor of another kind (tensor parallel's
    ``parallelize_module``, ``distribute_tensor``) before anything is recorded: the owner layout
    holds whole tensors over one data-parallel mesh, and a TP slice inside it would fail at the
    first forward, deep in DTensor's dispatch."""
    ignored = {id(p) for p in ignored_params or ()}
    for m in modules:
        for name, p in m.named_parameters():
            if isinstance(p, OwnerDTensor) or is_ignored(p) or id(p) in ignored:
                continue
            if isinstance(p, DTensor):
                raise ValueError(
                    f"fully_shard({type(m).__name__}): parameter {name!r} is a DTensor with placements "
                    f"{tuple(p.placements)} on mesh {tuple(p.device_mesh.shape)} "
                    f"{tuple(p.device_mesh.mesh_dim_names or ())} (tensor parallel?); the owner layout "
                    "shards plain tensors over one data-parallel mesh (2D only as (replicate, shard) for "
                    "HSDP), not tensor-parallel slices. For FSDP x TP use torch.distributed.fsdp."
                    "fully_shard(block, mesh=mesh['dp']) with OwnerRoutedOptimizer, which steps "
                    "ColwiseParallel and RowwiseParallel matrices whole on their owners; or leave the "
                    "parameter out (ignored_params)"
                )


def as_owner_dtensors(module: nn.Module, mesh: Any) -> None:
    """Register every parameter of ``module`` not yet an owner-layout DTensor as one, replicated
    (each rank holds the whole tensor until the plan is fixed; then the same objects become this
    rank's pieces in place). A tied parameter stays one object at every place it is registered."""
    new: dict[int, nn.Parameter] = {}
    for _, mod in module.named_modules(remove_duplicate=False):
        for name, p in list(mod._parameters.items()):
            if p is None or isinstance(p, OwnerDTensor) or is_ignored(p):
                continue
            replaced = current_parameter(p)
            if replaced is not p:  # tied to a parameter an earlier call registered: the same object
                mod._parameters[name] = replaced  # type: ignore[assignment]
                continue
            if id(p) not in new:
                new[id(p)] = nn.Parameter(OwnerDTensor.replicated(p.detach(), mesh), requires_grad=p.requires_grad)
                # the old object may stay registered outside ``module`` (a parameter tied across
                # two fully_shard calls): the plan finds its replacement through it and refuses it
                p.__dict__[_REPLACED_BY] = new[id(p)]  # not a weakref: see the module docstring
            mod._parameters[name] = new[id(p)]

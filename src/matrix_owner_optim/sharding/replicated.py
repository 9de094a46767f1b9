"""Parameters become owner-layout DTensors at the ``fully_shard`` call, replicated, until the plan
is fixed (DESIGN.md, "Lazy sharding"). One tied across two calls is found through the old object's
plain link to its replacement (``torch.utils.swap_tensors`` refuses a weakly referenced tensor).
"""

from __future__ import annotations

from typing import Any

import torch
from torch import nn
from torch.distributed.tensor import DTensor, Replicate, Shard

from ..owner_dtensor import OwnerDTensor
from ..owner_dtensor.two_dim import TP_PLACEMENTS
from .ignored import is_ignored

__all__ = ["as_owner_dtensors", "check_plain_parameters", "current_parameter", "tp_root_mesh"]

_REPLACED_BY = "_moo_replaced_by"


def current_parameter(p: torch.Tensor) -> torch.Tensor:
    """``p``, or the owner-layout DTensor ``fully_shard`` registered in its place elsewhere."""
    new = p.__dict__.get(_REPLACED_BY)
    return new if isinstance(new, torch.Tensor) else p


def tp_root_mesh(p: DTensor, mesh: Any) -> Any:
    """The 2D (dp, tp) mesh of a tensor-parallel ``p`` sharded over the dp ``mesh`` (None: not one)."""
    from torch.distributed.device_mesh import DeviceMesh

    p_mesh = p.device_mesh
    if not isinstance(mesh, DeviceMesh) or mesh.ndim != 1 or p_mesh.ndim != 1:
        return None
    if mesh.mesh_dim_names is None or p_mesh.mesh_dim_names is None or mesh.mesh_dim_names == p_mesh.mesh_dim_names:
        return None
    placement = p.placements[0]
    if not (type(placement) is Shard or isinstance(placement, Replicate)):
        return None
    try:
        return DeviceMesh._concatenate([mesh, p_mesh])
    except RuntimeError:  # another root, or overlapping meshes
        return None


def check_plain_parameters(modules: list[nn.Module], ignored_params: set[nn.Parameter] | None, mesh: Any) -> None:
    """Refuse a DTensor parameter the owner layout does not shard (any but a TP slice)."""
    ignored = {id(p) for p in ignored_params or ()}
    for m in modules:
        for name, p in m.named_parameters():
            if isinstance(p, OwnerDTensor) or is_ignored(p) or id(p) in ignored:
                continue
            if isinstance(p, DTensor) and tp_root_mesh(p, mesh) is None:
                raise ValueError(
                    f"fully_shard({type(m).__name__}): parameter {name!r} is a DTensor with placements "
                    f"{tuple(p.placements)} on mesh {tuple(p.device_mesh.shape)} "
                    f"{tuple(p.device_mesh.mesh_dim_names or ())}, which the owner layout does not shard. "
                    "It shards plain tensors, and tensor-parallel parameters laid out by parallelize_module "
                    f"on the tp dim of a 2D (dp, tp) DeviceMesh with named dims, as {TP_PLACEMENTS} on tp, "
                    "when fully_shard gets that mesh's dp dim (mesh=mesh['dp']); not _StridedShard or Partial "
                    "placements, 3D meshes, or HSDP x TP. Alternatives: torch.distributed.fsdp.fully_shard"
                    "(block, mesh=mesh['dp']) with OwnerRoutedOptimizer, or leave the parameter out "
                    "(ignored_params)"
                )


def _replicated(p: torch.Tensor, mesh: Any, dp_mesh: Any) -> OwnerDTensor:
    """``p`` as a replicated owner-layout DTensor (a TP slice: on the 2D mesh, ``Replicate()`` on dp)."""
    if isinstance(p, DTensor):
        root = tp_root_mesh(p, dp_mesh)
        assert root is not None  # check_plain_parameters refused the rest
        local = p._local_tensor.detach()
        return OwnerDTensor.tensor_parallel(local, root, (Replicate(), p.placements[0]), p.shape)
    return OwnerDTensor.replicated(p.detach(), mesh)


def as_owner_dtensors(module: nn.Module, mesh: Any, dp_mesh: Any = None) -> None:
    """Register every parameter of ``module`` not yet an owner-layout DTensor as one, replicated."""
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
                new[id(p)] = nn.Parameter(_replicated(p, mesh, dp_mesh), requires_grad=p.requires_grad)
                p.__dict__[_REPLACED_BY] = new[id(p)]  # not a weakref: see the module docstring
            mod._parameters[name] = new[id(p)]

"""Which update layout steps a parameter: one rule, by what the tensor is.

* an owner-layout DTensor (``fully_shard`` of this package) on a 2D (dp, tp) or (efsdp, ep)
  mesh: :class:`~.owner_tp_layout.OwnerTPLayout`; on its 1D shard mesh:
  :class:`~.layouts.LocalLayout` (the owner steps it where it lies);
* any other DTensor (stock FSDP2, HSDP, FSDP2 x TP / EP): :class:`~.dtensor_layout.DTensorLayout`;
* a plain tensor in one process, or carrying a plan (``optim/simulation.py``'s stand-ins for
  another rank's parameters): :class:`~.layouts.LocalLayout`;
* a plain tensor in a multi-rank job (DDP): :class:`~.replicated_layout.ReplicatedLayout`.

Every tensor has exactly one answer, so no order of registration decides it.
"""

from __future__ import annotations

import torch

from ..owner_dtensor import is_owner_dtensor
from ..planning.metadata import get_matrix_shard
from ..tensors import is_dtensor
from .dtensor_layout import DTensorLayout
from .layouts import LocalLayout, UpdateLayout, is_multi_rank
from .owner_tp_layout import OwnerTPLayout
from .replicated_layout import ReplicatedLayout

__all__ = ["layout_of"]


def layout_of(param: torch.Tensor) -> type[UpdateLayout]:
    """The layout that steps ``param`` (see the module docstring)."""
    if is_owner_dtensor(param):
        return OwnerTPLayout if param.device_mesh.ndim == 2 else LocalLayout
    if is_dtensor(param):
        return DTensorLayout
    if get_matrix_shard(param) is not None or not is_multi_rank():
        return LocalLayout
    return ReplicatedLayout

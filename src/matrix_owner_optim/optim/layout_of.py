"""Which update layout steps a parameter: one rule by what the tensor is (owner-layout DTensor
on a 2D mesh: ``OwnerTPLayout``, on 1D: ``LocalLayout``; other DTensors: ``DTensorLayout``; plain
tensors: ``LocalLayout`` in one process or with a plan, else ``ReplicatedLayout``).
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
    """The layout that steps ``param``."""
    if is_owner_dtensor(param):
        return OwnerTPLayout if param.device_mesh.ndim == 2 else LocalLayout
    if is_dtensor(param):
        return DTensorLayout
    if get_matrix_shard(param) is not None or not is_multi_rank():
        return LocalLayout
    return ReplicatedLayout

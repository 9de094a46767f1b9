"""The optimizer layer: routing, the registry, update layouts and ``OwnerRoutedOptimizer``."""

from .dtensor_layout import DTensorLayout
from .layouts import LAYOUTS, LocalLayout, UpdateLayout, register_layout
from .owner_routed import OwnerRoutedOptimizer
from .owner_tp_layout import OwnerTPLayout
from .registry import (
    ENTRY_POINT_GROUP,
    PRECONDITIONER_ENTRY_POINT_GROUP,
    available_optimizers,
    available_preconditioners,
    register_optimizer,
    register_preconditioner,
    resolve_optimizer,
)
from .replicated_layout import ReplicatedLayout
from .role_optimizer import ChildGroup, RoleOptimizer
from .simulation import simulated_parameters

# Layouts beyond one process / owner-shaped: stock FSDP2 DTensors and replicated (DDP) tensors.
register_layout(DTensorLayout)
register_layout(ReplicatedLayout)
register_layout(OwnerTPLayout)  # ahead of LocalLayout, which takes every other owner-layout tensor

__all__ = [
    "OwnerRoutedOptimizer",
    "RoleOptimizer",
    "ChildGroup",
    "LAYOUTS",
    "LocalLayout",
    "UpdateLayout",
    "register_layout",
    "DTensorLayout",
    "ReplicatedLayout",
    "ENTRY_POINT_GROUP",
    "PRECONDITIONER_ENTRY_POINT_GROUP",
    "available_optimizers",
    "available_preconditioners",
    "register_optimizer",
    "register_preconditioner",
    "resolve_optimizer",
    "simulated_parameters",
]

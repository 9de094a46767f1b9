"""The optimizer layer: routing, the registry, update layouts and ``OwnerRoutedOptimizer``."""

from .dtensor_layout import DTensorLayout
from .layout_of import layout_of
from .layouts import LocalLayout, UpdateLayout
from .owner_routed import OwnerRoutedOptimizer
from .owner_tp_layout import OwnerTPLayout
from .registry import (
    ENTRY_POINT_GROUP,
    PRECONDITIONER_ENTRY_POINT_GROUP,
    available_optimizers,
    register_optimizer,
    register_preconditioner,
    resolve_optimizer,
)
from .replicated_layout import ReplicatedLayout
from .role_optimizer import ChildGroup, RoleOptimizer
from .simulation import simulated_parameters

__all__ = [
    "OwnerRoutedOptimizer",
    "RoleOptimizer",
    "ChildGroup",
    "LocalLayout",
    "UpdateLayout",
    "layout_of",
    "DTensorLayout",
    "OwnerTPLayout",
    "ReplicatedLayout",
    "ENTRY_POINT_GROUP",
    "PRECONDITIONER_ENTRY_POINT_GROUP",
    "available_optimizers",
    "register_optimizer",
    "register_preconditioner",
    "resolve_optimizer",
    "simulated_parameters",
]

"""The optimizer layer: routing, the registry, and ``OwnerRoutedOptimizer``."""

from .owner_routed import OwnerRoutedOptimizer
from .placements import PLACEMENTS, LocalPlacement, Placement, register_placement
from .simulation import simulated_parameters
from .registry import ENTRY_POINT_GROUP, available_preconditioners, register_preconditioner, resolve_optimizer

__all__ = [
    "OwnerRoutedOptimizer", "PLACEMENTS", "LocalPlacement", "Placement", "register_placement",
    "ENTRY_POINT_GROUP", "available_preconditioners", "register_preconditioner", "resolve_optimizer",
    "simulated_parameters",
]

"""The optimizer layer: routing, the registry, and ``OwnerRoutedOptimizer``."""

from .dtensor_placement import DTensorPlacement
from .owner_routed import OwnerRoutedOptimizer
from .placements import PLACEMENTS, LocalPlacement, Placement, register_placement
from .registry import ENTRY_POINT_GROUP, available_preconditioners, register_preconditioner, resolve_optimizer
from .replicated_placement import ReplicatedPlacement
from .simulation import simulated_parameters

# Layouts beyond one process / owner-shaped: stock FSDP2 DTensors and replicated (DDP) tensors.
register_placement(DTensorPlacement)
register_placement(ReplicatedPlacement)

__all__ = [
    "OwnerRoutedOptimizer",
    "PLACEMENTS",
    "LocalPlacement",
    "Placement",
    "register_placement",
    "DTensorPlacement",
    "ReplicatedPlacement",
    "ENTRY_POINT_GROUP",
    "available_preconditioners",
    "register_preconditioner",
    "resolve_optimizer",
    "simulated_parameters",
]

"""matrix_owner_optim: owner-shaped ZeRO-3 sharding for matrix optimizers.

Every 2D weight matrix lives whole on one data-parallel rank (its owner) and is an empty
shard elsewhere, so Muon, Shampoo or SOAP run locally and ``optimizer.step()`` moves zero
bytes. See DESIGN.md for the architecture and vocabulary.
"""

from .comm import CommCounter
from .optim import OwnerRoutedOptimizer, register_preconditioner
from .planning import MatrixShard, Role, ShardingPlan, get_matrix_shard, plan_model

__version__ = "0.1.0"

__all__ = [
    "CommCounter",
    "OwnerRoutedOptimizer",
    "register_preconditioner",
    "get_matrix_shard",
    "MatrixShard", "Role", "ShardingPlan", "plan_model", "__version__"]

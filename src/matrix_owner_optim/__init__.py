"""matrix_owner_optim: owner-shaped ZeRO-3 sharding for matrix optimizers.

Every 2D weight matrix lives whole on one data-parallel rank (its owner), so Muon, Shampoo or SOAP
run locally and ``optimizer.step()`` moves zero bytes (DESIGN.md). ``toolbox`` holds the commands.
"""

from . import checkpoint
from .comm import CommCounter
from .optim import OwnerRoutedOptimizer, register_optimizer, register_preconditioner
from .planning import MatrixShard, MeshAdvice, Role, ShardingPlan, get_matrix_shard, plan_mesh, plan_model
from .sharding import (
    MixedPrecisionPolicy,
    OwnerShardedModule,
    clip_grad_norm_,
    fully_shard,
    register_fsdp_forward_method,
)

__version__ = "0.1.0"  # the one home of the version (pyproject.toml reads it)

__all__ = [
    "CommCounter",
    "MatrixShard",
    "MeshAdvice",
    "MixedPrecisionPolicy",
    "OwnerRoutedOptimizer",
    "OwnerShardedModule",
    "Role",
    "ShardingPlan",
    "__version__",
    "checkpoint",
    "clip_grad_norm_",
    "fully_shard",
    "get_matrix_shard",
    "plan_mesh",
    "plan_model",
    "register_fsdp_forward_method",
    "register_optimizer",
    "register_preconditioner",
]

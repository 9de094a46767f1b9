"""Planning: MatrixShard metadata, the cost model and the owner planner. Pure: no processes."""

from .catalog import DEFAULT_COST, available_cost_models, register_cost_model, resolve_cost
from .cost import (
    ADAMW_COST,
    MUON_COST,
    SHAMPOO_COST,
    SOAP_COST,
    CostModel,
    FunctionCostModel,
)
from .mesh_advice import MeshAdvice, MeshCandidate, plan_mesh
from .metadata import (
    MatrixShard,
    RankLoad,
    Role,
    ShardingPlan,
    attach_matrix_shard,
    get_matrix_shard,
    get_shard_group,
    get_shard_rank,
    parse_role,
)
from .planner import plan_model, plan_tensors
from .roles import EMBEDDING_NAME_HINTS, RoleOverrides, TensorSpec, role_from_name, specs_from_module
from .views import MatrixLayout, MatrixView, declare_matrix_view, matrix_layout_of

__all__ = [
    "ADAMW_COST",
    "MUON_COST",
    "SHAMPOO_COST",
    "SOAP_COST",
    "CostModel",
    "FunctionCostModel",
    "DEFAULT_COST",
    "available_cost_models",
    "register_cost_model",
    "resolve_cost",
    "MatrixShard",
    "RankLoad",
    "attach_matrix_shard",
    "get_matrix_shard",
    "get_shard_group",
    "get_shard_rank",
    "Role",
    "ShardingPlan",
    "parse_role",
    "plan_model",
    "plan_tensors",
    "MeshAdvice",
    "MeshCandidate",
    "plan_mesh",
    "EMBEDDING_NAME_HINTS",
    "RoleOverrides",
    "TensorSpec",
    "role_from_name",
    "specs_from_module",
    "MatrixLayout",
    "MatrixView",
    "declare_matrix_view",
    "matrix_layout_of",
]

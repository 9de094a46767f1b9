"""An analytic model of matrix-optimizer step time and memory on N nodes x G GPUs.

Why: the owner layout's claim is a *systems* claim (no bytes in ``optimizer.step()``), and
the paper reports speedups on hardware this project's CI does not have. This module states a
cost model -- every constant with its value, unit and source class -- and predicts the
optimizer-step time and per-rank memory of three strategies for any model the planner can
plan, so the claims can be checked against arithmetic rather than against a feeling:

``reconstruction``
    stock FSDP2 + Muon written the explicit way: per matrix, all-gather the full gradient
    (``DTensor.full_tensor()``) on every rank, every rank runs Newton-Schulz (NS) on every
    matrix redundantly, keeps its row slice. Serial per-parameter loop, no overlap.
``reconstruction_dtensor`` (a variant of the same baseline)
    ``torch.optim.Muon`` applied directly to FSDP2's ``Shard(0)`` DTensor gradients, as traced
    with torch 2.13 (fake process group, W=8): DTensor propagates the NS matmuls shard-wise, so
    for a wide or square matrix (rows <= cols) every NS iteration all-gathers X^T and X (full
    matrix each) and the k x k Gram matrix, in bf16; for a tall matrix it all-reduces the k x k
    Gram matrix twice per iteration and runs the k^3 Gram square redundantly. The rest of the
    NS FLOPs are split 1/W.
``all_to_all``
    stock FSDP2 layout with owner routing: one bucketed all-to-all sends every rank's row
    slice of each matrix to the matrix's owner (the planner's), NS runs once on the owner,
    a second all-to-all returns the updated slices: about ``2 P / W`` bytes per rank.
``owner``
    MatrixFSDP / this package: the reduced gradient is already whole on the owner, so the
    step moves zero bytes; its time is the most loaded rank's NS compute.

Per-rank NS FLOPs of ``all_to_all`` and ``owner`` come from :func:`~matrix_owner_optim.
planning.plan_model` (max over ranks = step time; the imbalance is reported). All functions
are pure: no process group, no device, meta tensors only.

What the model cannot do, by construction: in the owner layout the step is pure compute on
the most loaded rank, so at fixed model size the model can predict speedups only from
(a) communication removed and (b) NS compute split across owners instead of repeated.
:func:`compare_with_claims` says which assumption about the baseline reproduces a claim.
"""

from __future__ import annotations

from ._units import GB, SCHEMA
from .claims import (
    BASELINES,
    CLAIMS,
    Claim,
    compare_with_claims,
)
from .estimates import (
    ESTIMATORS,
    STRATEGIES,
    StepEstimate,
    estimate_all_to_all,
    estimate_memory,
    estimate_owner,
    estimate_reconstruction,
    estimate_reconstruction_dtensor,
    estimate_strategies,
)
from .formulas import (
    FORMULAS,
    all_to_all_time,
    group_all_gather_time,
    hierarchical_all_gather_time,
    hierarchical_all_reduce_time,
    owner_routing_phase_time,
    replica_all_reduce_time,
    ring_all_gather_time,
    ring_all_reduce_time,
)
from .hardware import (
    A100,
    H100,
    PAPER_MODEL,
    PRESETS,
    Constant,
    Hardware,
    Preset,
    SimOptions,
)
from .mesh import (
    MESH_LAYOUTS,
    MeshProjection,
    StepComm,
    compare_meshes,
    mesh_sweep,
    project_mesh,
    step_comm,
)
from .plan_stats import (
    MatrixInfo,
    PlanStats,
    plan_stats,
)
from .plot import (
    plot_sweep,
)
from .sweep import (
    StatsCache,
    paper_model,
    simulate,
)

__all__ = [
    "GB",
    "SCHEMA",
    "A100",
    "Constant",
    "H100",
    "Hardware",
    "PAPER_MODEL",
    "PRESETS",
    "Preset",
    "SimOptions",
    "FORMULAS",
    "all_to_all_time",
    "group_all_gather_time",
    "hierarchical_all_gather_time",
    "hierarchical_all_reduce_time",
    "owner_routing_phase_time",
    "replica_all_reduce_time",
    "ring_all_gather_time",
    "ring_all_reduce_time",
    "MatrixInfo",
    "PlanStats",
    "plan_stats",
    "ESTIMATORS",
    "STRATEGIES",
    "StepEstimate",
    "estimate_all_to_all",
    "estimate_memory",
    "estimate_owner",
    "estimate_reconstruction",
    "estimate_reconstruction_dtensor",
    "estimate_strategies",
    "StatsCache",
    "paper_model",
    "simulate",
    "BASELINES",
    "CLAIMS",
    "Claim",
    "compare_with_claims",
    "MESH_LAYOUTS",
    "MeshProjection",
    "StepComm",
    "compare_meshes",
    "mesh_sweep",
    "project_mesh",
    "step_comm",
    "plot_sweep",
]

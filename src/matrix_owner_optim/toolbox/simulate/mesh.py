"""Projected times on the mesh :func:`~matrix_owner_optim.plan_mesh` advises, against flat layouts.

Part of :mod:`matrix_owner_optim.toolbox.simulate`; see its docstring for the model. The
library's ``plan_mesh`` picks the mesh from the plan alone (balance and memory, no hardware);
this module prices it with the stated hardware constants, so the library never needs them.

Four layouts of the same W = N x G GPUs are compared:

``stock_fsdp2_muon``
    flat stock FSDP2 over all W ranks, Muon by explicit reconstruction (and, as a variant, torch
    Muon on the ``Shard(0)`` DTensors): the paper's baseline.
``flat_owner``
    the owner layout over all W ranks (one shard dim): zero bytes in the step, but once ranks
    outnumber what the matrices fill evenly, the busiest owner sets the step time.
``owner_hsdp``
    the advised ``(replicate, shard)`` mesh: the owner layout inside each shard group of
    ``shard`` consecutive ranks, and one global owner per matrix over all W ranks (its
    ``step_replica``'s holder): the matrices' gradients are reduce-scattered across the
    replicate groups to their global owners (the tail's all-reduced), the step runs once per
    matrix, spread over all W ranks, and ends with the updated matrices' all-gather across the
    replicas (the broadcast, the other half of the bytes of the all-reduce it replaces), priced
    in the step since it cannot overlap with it.
``stock_fsdp2_hsdp``
    stock FSDP2 on the same mesh (``Shard(0)`` inside the shard dim), Muon by reconstruction
    inside the shard group: what HSDP alone, without owners, gives.

Per-step communication is what forward and backward move, priced serially (a real run overlaps
much of it with compute; the optimizer step cannot overlap): per unit two all-gathers of its
parameters (forward, and again for backward: ``reshard_after_forward``) and one reduce-scatter of
its gradients in the shard group, plus, with replicas, one all-reduce per unit across the
replicate group of the largest shard rank's gradient segment. The owner layout's uneven
all-gather-v is priced as the even ring of the same total bytes (each byte crosses each link
once either way; NCCL runs the uneven form as grouped broadcasts). Ring latencies
(``(p-1) alpha``) are pessimistic at hundreds of nodes, where NCCL switches to trees, alike for
every layout.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from torch import nn

from ...planning import MeshAdvice, ShardingPlan, plan_mesh, plan_model
from ...tensors import itemsize
from .estimates import estimate_owner, estimate_reconstruction, estimate_reconstruction_dtensor
from .formulas import group_all_gather_time, replica_all_reduce_time
from .hardware import Hardware, SimOptions
from .plan_stats import plan_stats

__all__ = [
    "MESH_LAYOUTS",
    "MeshProjection",
    "StepComm",
    "step_comm",
    "project_mesh",
    "compare_meshes",
    "mesh_sweep",
    "group_topology",
]

MESH_LAYOUTS: dict[str, str] = {
    "stock_fsdp2_muon": "flat stock FSDP2 over W ranks, Muon by reconstruction (paper baseline)",
    "flat_owner": "owner layout over W ranks (one shard dim of W)",
    "owner_hsdp": "owner layout inside the advised shard dim, one global owner per matrix over all W ranks",
    "stock_fsdp2_hsdp": "stock FSDP2 HSDP on the advised mesh, Muon by reconstruction in the shard group",
}


def group_topology(shard: int, gpus_per_node: int) -> tuple[int, int]:
    """``(nodes, gpus_per_node)`` one shard group of ``shard`` consecutive ranks spans.

    Raises when the group does not tile nodes (neither a divisor nor a multiple of G): such a
    shard group straddles node boundaries unevenly, and the two-level formulas do not apply.
    """
    G = gpus_per_node
    if shard <= G and G % shard == 0:
        return 1, shard
    if shard % G == 0:
        return shard // G, G
    raise ValueError(
        f"a shard dim of {shard} ranks straddles nodes of {G} GPUs unevenly (neither divides the "
        "other); the projection needs shard | G or G | shard"
    )


@dataclass(frozen=True)
class StepComm:
    """Forward + backward communication of one training step, seconds, priced serially."""

    shard_all_gather_s: float
    shard_reduce_scatter_s: float
    replicate_all_reduce_s: float
    replicate_bytes_per_rank: float  # the largest shard rank's segments, summed over units

    @property
    def total_s(self) -> float:
        return self.shard_all_gather_s + self.shard_reduce_scatter_s + self.replicate_all_reduce_s

    def to_json(self) -> dict[str, Any]:
        return {
            "total_ms": self.total_s * 1e3,
            "shard_all_gather_ms": self.shard_all_gather_s * 1e3,
            "shard_reduce_scatter_ms": self.shard_reduce_scatter_s * 1e3,
            "replicate_all_reduce_ms": self.replicate_all_reduce_s * 1e3,
            "replicate_bytes_per_rank": self.replicate_bytes_per_rank,
        }


def step_comm(
    plan: ShardingPlan,
    replicate: int,
    gpus_per_node: int,
    hw: Hardware,
    opts: SimOptions = SimOptions(),
    *,
    owner_segments: bool = True,
) -> StepComm:
    """Forward/backward collectives of ``plan`` (a plan for the shard dim) on a mesh of
    ``replicate`` replicas. ``owner_segments``: the replica all-reduce carries each rank's owner
    segment (the owner layout); otherwise the even ``1/shard`` slice (stock FSDP2 HSDP). A plan
    with step replicas (HSDP's global owners) reduce-scatters its matrices across the replicas
    (half an all-reduce) and all-reduces the rest."""
    S, G = plan.world_size, gpus_per_node
    units: dict[int, list[float]] = {}  # unit -> [param bytes, grad elements]
    seg: dict[int, list[float]] = {}  # unit -> gradient elements of each shard rank's segment
    once: dict[int, list[float]] = {}  # unit -> the part of each segment one replica steps
    for s in plan:
        u = units.setdefault(s.unit, [0.0, 0.0])
        row = seg.setdefault(s.unit, [0.0] * S)
        one = once.setdefault(s.unit, [0.0] * S)
        u[0] += s.numel * itemsize(s.dtype)
        if not s.requires_grad:
            continue
        u[1] += s.numel
        for r in range(S):
            n = s.local_numel(r)
            row[r] += n
            if s.step_replica is not None and owner_segments:
                one[r] += n
    ag = rs = ar = moved = 0.0
    for unit, (p_bytes, g_elems) in units.items():
        ag += 2 * group_all_gather_time(p_bytes, S, 1, G, hw)
        rs += group_all_gather_time(g_elems * opts.grad_bytes, S, 1, G, hw)
        if replicate > 1:
            segments = (
                [x * opts.grad_bytes for x in seg[unit]] if owner_segments else [g_elems / S * opts.grad_bytes] * S
            )
            stepped = [x * opts.grad_bytes for x in once[unit]]
            rest = [a - b for a, b in zip(segments, stepped, strict=True)]
            if any(rest):  # (a collective with nothing to carry is not issued)
                ar += replica_all_reduce_time(rest, replicate, G, hw)
            if any(stepped):
                ar += replica_all_reduce_time(stepped, replicate, G, hw) / 2
            moved += max(segments)
    return StepComm(ag, rs, ar, moved)


def replica_broadcast_time(plan: ShardingPlan, replicate: int, G: int, hw: Hardware) -> float:
    """HSDP's global owners send the updated matrices to the other replicas: per shard rank, the
    matrices it holds, all-gathered across the replicate group (the half of an all-reduce of
    those bytes that the gradients' reduce-scatter leaves)."""
    if replicate <= 1:
        return 0.0
    S = plan.world_size
    segments = [0.0] * S
    for s in plan:
        if s.step_replica is not None:
            for r in range(S):
                segments[r] += s.local_numel(r) * itemsize(s.dtype)
    return replica_all_reduce_time(segments, replicate, G, hw) / 2


def global_view(plan: ShardingPlan) -> ShardingPlan:
    """An HSDP plan with step replicas as a plan over all ``replicate x shard`` ranks, for pricing
    the step (``plan_stats``): each matrix on its global owner ``r * S + s`` (a split stack's rows
    on its step replica's ranks), the tail on replica 0's holders (every replica steps it alike),
    ``rows`` tensors split over all ranks; ``loads`` are the plan's per-global-rank loads."""
    R, S = plan.replicate_size, plan.world_size
    if R <= 1:
        return plan
    W = R * S
    shards = {}
    for fqn, s in plan.shards.items():
        r = s.step_replica
        if r is None:
            shards[fqn] = dataclasses.replace(s, world_size=W)
        elif s.is_split:
            ranges, cursor = [], 0
            real = {q: (a, b) for a, b, q in s.row_owners}
            for q in range(W):
                a, b = real[q % S] if q // S == r else (cursor, cursor)
                ranges.append((a, b, q))
                cursor = b
            shards[fqn] = dataclasses.replace(s, world_size=W, row_owners=tuple(ranges))
        else:
            shards[fqn] = dataclasses.replace(s, world_size=W, owner=r * S + int(s.owner))  # type: ignore[arg-type]
    return dataclasses.replace(plan, world_size=W, shards=shards, loads=list(plan.replica_loads), replicate_size=1)


@dataclass(frozen=True)
class MeshProjection:
    """One layout's projected optimizer step and per-step communication on one cluster."""

    layout: str
    replicate: int
    shard: int
    optimizer_step_s: float
    optimizer_step_comm_s: float
    comm: StepComm
    max_resident_bytes: float
    bytes_max_over_mean: float
    flops_max_over_mean: float
    variant_optimizer_step_s: float | None = None  # stock: torch Muon on DTensors
    compute_step_s: float | None = None  # HSDP owners: the step without the replica broadcast

    def to_json(self) -> dict[str, Any]:
        out = {
            "layout": self.layout,
            "mesh_shape": [self.replicate, self.shard],
            "optimizer_step_ms": self.optimizer_step_s * 1e3,
            "optimizer_step_comm_ms": self.optimizer_step_comm_s * 1e3,
            "fwd_bwd_comm": self.comm.to_json(),
            "step_overhead_ms": (self.optimizer_step_s + self.comm.total_s) * 1e3,
            "max_resident_bytes": self.max_resident_bytes,
            "bytes_max_over_mean": self.bytes_max_over_mean,
            "flops_max_over_mean": self.flops_max_over_mean,
        }
        if self.variant_optimizer_step_s is not None:
            out["optimizer_step_ms_torch_muon_dtensor"] = self.variant_optimizer_step_s * 1e3
        if self.compute_step_s is not None:  # the broadcast deferred into the next forward, hidden
            out["optimizer_step_ms_broadcast_deferred"] = self.compute_step_s * 1e3
        return out


def _owner(layout: str, plan: ShardingPlan, replicate: int, G: int, hw: Hardware, opts: SimOptions) -> MeshProjection:
    """The owner layout's step: the busiest rank's matrices (over all W ranks with HSDP's global
    owners), then, with replicas, the updated matrices' broadcast across them."""
    stepped = global_view(plan)
    nodes, g = group_topology(stepped.world_size, G)
    est = estimate_owner(plan_stats(stepped, nodes, g), hw, opts)
    bcast = replica_broadcast_time(plan, replicate, G, hw)
    imb = stepped.imbalance()
    return MeshProjection(
        layout,
        replicate,
        plan.world_size,
        est.total_s + bcast,
        bcast,
        step_comm(plan, replicate, G, hw, opts),
        max(x.resident_bytes for x in stepped.loads),
        imb["bytes_max_over_mean"],
        imb["flops_max_over_mean"],
        compute_step_s=est.total_s if replicate > 1 else None,
    )


def _stock(layout: str, plan: ShardingPlan, replicate: int, G: int, hw: Hardware, opts: SimOptions) -> MeshProjection:
    nodes, g = group_topology(plan.world_size, G)
    stats = plan_stats(plan, nodes, g)
    rec = estimate_reconstruction(stats, hw, opts)
    dt = estimate_reconstruction_dtensor(stats, hw, opts)
    even = stats.total_resident_bytes / plan.world_size
    return MeshProjection(
        layout,
        replicate,
        plan.world_size,
        rec.total_s,
        rec.comm_s,
        step_comm(plan, replicate, G, hw, opts, owner_segments=False),
        even,
        1.0,
        1.0,
        variant_optimizer_step_s=dt.total_s,
    )


def project_mesh(
    advice: MeshAdvice, gpus_per_node: int, hw: Hardware, opts: SimOptions = SimOptions()
) -> MeshProjection:
    """The advised mesh's optimizer step (the busiest owner, zero bytes) and per-step
    communication on ``hw`` with ``gpus_per_node`` GPUs per node."""
    _check_cluster(advice.world_size, gpus_per_node)
    return _owner("owner_hsdp", advice.plan, advice.replicate, gpus_per_node, hw, opts)


def _check_cluster(world_size: int, gpus_per_node: int) -> None:
    if gpus_per_node < 1 or (world_size > gpus_per_node and world_size % gpus_per_node):
        raise ValueError(
            f"{world_size} GPUs do not fill nodes of {gpus_per_node}: use a world size that is a "
            "multiple of --gpus-per-node (or at most one node)"
        )


def compare_meshes(
    model: nn.Module,
    world_size: int,
    *,
    unit_prefixes: Sequence[str] | None,
    gpus_per_node: int,
    hardware: Hardware,
    options: SimOptions = SimOptions(),
    preconditioner: str = "muon",
    roles: Mapping[str, str] | None = None,
    max_imbalance: float = 1.1,
    advice: MeshAdvice | None = None,
) -> dict[str, Any]:
    """The advice for ``world_size`` GPUs and the four layouts' projections (JSON-ready).

    ``gpus_per_node`` larger than ``world_size`` means one partly used node."""
    G = min(gpus_per_node, world_size)
    _check_cluster(world_size, G)
    if advice is None:
        advice = plan_mesh(
            model,
            world_size,
            unit_prefixes=unit_prefixes,
            roles=roles,
            preconditioner=preconditioner,
            max_imbalance=max_imbalance,
        )
    flat = plan_model(model, world_size, unit_prefixes=unit_prefixes, roles=roles, preconditioner=preconditioner)
    rows = {
        "stock_fsdp2_muon": _stock("stock_fsdp2_muon", flat, 1, G, hardware, options),
        "flat_owner": _owner("flat_owner", flat, 1, G, hardware, options),
        "owner_hsdp": _owner("owner_hsdp", advice.plan, advice.replicate, G, hardware, options),
        "stock_fsdp2_hsdp": _stock("stock_fsdp2_hsdp", advice.plan, advice.replicate, G, hardware, options),
    }
    owner = rows["owner_hsdp"]
    return {
        "world_size": world_size,
        "nodes": world_size // G,
        "gpus_per_node": G,
        "hardware": hardware.name,
        "advice": {k: v for k, v in advice.to_json().items() if k != "resident_bytes_per_rank"},
        "layouts": {k: v.to_json() for k, v in rows.items()},
        "optimizer_step_speedup_of_owner_hsdp": {
            k: v.optimizer_step_s / owner.optimizer_step_s for k, v in rows.items() if k != "owner_hsdp"
        },
    }


def mesh_sweep(
    model: nn.Module,
    *,
    unit_prefixes: Sequence[str] | None,
    world_sizes: Iterable[int],
    hardwares: Sequence[Hardware],
    gpus_per_node: int,
    options: SimOptions = SimOptions(),
    max_imbalance: float = 1.1,
) -> list[dict[str, Any]]:
    """:func:`compare_meshes` for every world size on every hardware (advice computed once per W)."""
    rows = []
    for W in world_sizes:
        advice = plan_mesh(model, W, unit_prefixes=unit_prefixes, max_imbalance=max_imbalance)
        for hw in hardwares:
            rows.append(
                compare_meshes(
                    model,
                    W,
                    unit_prefixes=unit_prefixes,
                    gpus_per_node=gpus_per_node,
                    hardware=hw,
                    options=options,
                    advice=advice,
                )
            )
    return rows

"""Optimizer-step time of each strategy, and memory per rank.

Part of :mod:`matrix_owner_optim.toolbox.simulate`; see its docstring for the model.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from .formulas import hierarchical_all_gather_time, hierarchical_all_reduce_time, owner_routing_phase_time
from .hardware import Hardware, SimOptions
from .plan_stats import MatrixInfo, PlanStats

STRATEGIES: dict[str, str] = {
    "reconstruction": (
        "stock FSDP2 + Muon, explicit reconstruction: per matrix a two-level all-gather of the "
        "full gradient (grad_bytes/elem) on every rank, then every rank runs NS on every matrix "
        "(redundant), keeps its slice; serial per-parameter loop"
    ),
    "reconstruction_dtensor": (
        "variant of the baseline: torch.optim.Muon run directly on FSDP2 Shard(0) DTensors "
        "(torch 2.13 op trace): wide/square matrices all-gather X^T, the k x k Gram and X in bf16 "
        "every NS iteration; tall matrices all-reduce the k x k Gram twice per iteration and "
        "repeat its k^3 square on every rank; the other NS FLOPs split 1/W"
    ),
    "all_to_all": (
        "stock FSDP2 layout + owner routing: bucketed all-to-all of row slices to the planner's "
        "owners, NS once on the owner, all-to-all of the updated slices back (~2 P/W bytes per "
        "rank)"
    ),
    "owner": (
        "owner layout (MatrixFSDP / this package): gradient already whole on its owner, zero "
        "bytes, NS on the owner only; time = most loaded rank"
    ),
}


@dataclass(frozen=True)
class StepEstimate:
    """Predicted optimizer-step time of one strategy (seconds) and what it is made of."""

    strategy: str
    compute_s: float  # NS matmul FLOPs at the achieved rate, on the rank that sets the step time
    launch_s: float  # kernel-launch overhead on that rank
    elementwise_s: float  # memory-bound AdamW of non-matrix tensors
    comm_s: float  # collectives inside optimizer.step()
    comm_bytes_per_rank: float  # bytes the busiest rank receives inside the step
    collectives: int  # collective calls per rank inside the step
    max_rank_flops: float  # NS FLOPs of the rank that sets the step time
    flops_imbalance: float  # max/mean of per-rank NS FLOPs (1.0 = perfect, W = all on one)

    @property
    def total_s(self) -> float:
        return self.compute_s + self.launch_s + self.elementwise_s + self.comm_s

    def to_json(self) -> dict[str, Any]:
        return {
            "total_ms": self.total_s * 1e3,
            "compute_ms": self.compute_s * 1e3,
            "launch_ms": self.launch_s * 1e3,
            "elementwise_ms": self.elementwise_s * 1e3,
            "comm_ms": self.comm_s * 1e3,
            "comm_bytes_per_rank": self.comm_bytes_per_rank,
            "collectives_per_rank": self.collectives,
            "max_rank_ns_flops": self.max_rank_flops,
            "ns_flops_imbalance": self.flops_imbalance,
        }


def _elementwise_s(elems: float, hw: Hardware, opts: SimOptions) -> float:
    return elems * opts.adamw_bytes_per_elem / hw.hbm_bw


def estimate_reconstruction(stats: PlanStats, hw: Hardware, opts: SimOptions = SimOptions()) -> StepEstimate:
    """Explicit reconstruction: gather each full gradient, NS on every matrix on every rank."""
    N, G, W = stats.nodes, stats.gpus_per_node, stats.world_size
    comm = 0.0
    bytes_moved = 0.0
    for mat in stats.matrices:
        n_bytes = mat.numel * opts.grad_bytes
        comm += hierarchical_all_gather_time(n_bytes, N, G, hw)
        bytes_moved += n_bytes * (W - 1) / W if W > 1 else 0.0
    return StepEstimate(
        "reconstruction",
        compute_s=stats.total_matrix_flops / hw.ns_flop_rate,
        launch_s=len(stats.matrices) * opts.kernels_per_matrix * hw.launch_s,
        elementwise_s=_elementwise_s(stats.elementwise_elems_even, hw, opts),
        comm_s=comm,
        comm_bytes_per_rank=bytes_moved,
        collectives=len(stats.matrices) if W > 1 else 0,
        max_rank_flops=stats.total_matrix_flops,
        flops_imbalance=float(W),
    )


def estimate_reconstruction_dtensor(stats: PlanStats, hw: Hardware, opts: SimOptions = SimOptions()) -> StepEstimate:
    """``torch.optim.Muon`` on FSDP2 ``Shard(0)`` DTensors, per the torch 2.13 op trace.

    Per matrix (k = min(m, n), l = max(m, n), s = NS iterations, b = ns_bytes):
    rows <= cols: s x [all-gather(k l b) twice + all-gather(k^2 b)], FLOPs s (4 k^2 l + 2 k^3)/W;
    rows > cols: s x 2 all-reduce(k^2 b), FLOPs s (4 k^2 l / W + 2 k^3);
    both: one scalar all-reduce for the Frobenius norm.
    """
    N, G, W = stats.nodes, stats.gpus_per_node, stats.world_size
    s, b = opts.ns_steps, opts.ns_bytes
    comm = flops = moved = 0.0
    calls = 0
    for mat in stats.matrices:
        k, l = min(mat.m, mat.n), max(mat.m, mat.n)
        extra = mat.flops - s * (4.0 * k * k * l + 2.0 * k**3)  # momentum / update terms
        if W == 1:
            flops += mat.flops
            continue
        comm += hierarchical_all_reduce_time(0.0, N, G, hw)  # norm: latency only
        calls += 1
        if mat.m <= mat.n:
            per_iter = 2 * hierarchical_all_gather_time(k * l * b, N, G, hw) + hierarchical_all_gather_time(
                k * k * b, N, G, hw
            )
            comm += s * per_iter
            moved += s * (2 * k * l + k * k) * b * (W - 1) / W
            calls += 3 * s
            flops += s * (4.0 * k * k * l + 2.0 * k**3) / W + extra / W
        else:
            comm += s * 2 * hierarchical_all_reduce_time(k * k * b, N, G, hw)
            moved += s * 2 * 2 * k * k * b * (W - 1) / W
            calls += 2 * s
            flops += s * (4.0 * k * k * l / W + 2.0 * k**3) + extra / W
    mean = stats.total_matrix_flops / W if W else 0.0
    return StepEstimate(
        "reconstruction_dtensor",
        compute_s=flops / hw.ns_flop_rate,
        launch_s=len(stats.matrices) * opts.kernels_per_matrix * hw.launch_s,
        elementwise_s=_elementwise_s(stats.elementwise_elems_even, hw, opts),
        comm_s=comm,
        comm_bytes_per_rank=moved,
        collectives=calls,
        max_rank_flops=flops,
        flops_imbalance=flops / mean if mean > 0 else 1.0,
    )


def _busiest_owner_rank(stats: PlanStats, hw: Hardware, opts: SimOptions) -> tuple[int, float, float, float]:
    """The rank whose owner-side work (NS + launches + AdamW) is longest, and its parts."""
    best = (0, 0.0, 0.0, 0.0)
    best_total = -1.0
    for r in range(stats.world_size):
        c = stats.rank_matrix_flops[r] / hw.ns_flop_rate
        ln = stats.rank_matrices[r] * opts.kernels_per_matrix * hw.launch_s
        e = _elementwise_s(stats.rank_elementwise_elems_owner[r], hw, opts)
        if c + ln + e > best_total:
            best_total, best = c + ln + e, (r, c, ln, e)
    return best


def estimate_all_to_all(stats: PlanStats, hw: Hardware, opts: SimOptions = SimOptions()) -> StepEstimate:
    """Stock layout, owner routing: slices to owners, NS once, updated slices back."""
    W, G = stats.world_size, stats.gpus_per_node
    gb = opts.grad_bytes
    phase = owner_routing_phase_time(
        [x * gb for x in stats.nvlink_send],
        [x * gb for x in stats.nvlink_recv],
        [x * gb for x in stats.nic_in],
        [x * gb for x in stats.nic_out],
        G,
        hw,
    )
    # phase 2 mirrors phase 1 (send <-> receive), same busiest link, same time
    r, c, ln, _ = _busiest_owner_rank(stats, hw, opts)
    # bytes received: phase 1 the other ranks' slices of owned matrices, phase 2 the updated
    # slices of every matrix owned elsewhere (~2 P/W on an average rank)
    total_elems = sum(m.numel for m in stats.matrices)
    per_rank = (
        [
            (stats.rank_owned_matrix_elems[q] * (W - 1) / W + (total_elems - stats.rank_owned_matrix_elems[q]) / W) * gb
            for q in range(W)
        ]
        if W > 1
        else [0.0]
    )
    return StepEstimate(
        "all_to_all",
        compute_s=c,
        launch_s=ln,
        elementwise_s=_elementwise_s(stats.elementwise_elems_even, hw, opts),
        comm_s=2.0 * phase,
        comm_bytes_per_rank=max(per_rank),
        collectives=2 if W > 1 else 0,
        max_rank_flops=stats.rank_matrix_flops[r],
        flops_imbalance=stats.flops_imbalance,
    )


def estimate_owner(stats: PlanStats, hw: Hardware, opts: SimOptions = SimOptions()) -> StepEstimate:
    """Owner layout: no collectives; the most loaded rank sets the step time."""
    r, c, ln, e = _busiest_owner_rank(stats, hw, opts)
    return StepEstimate(
        "owner",
        compute_s=c,
        launch_s=ln,
        elementwise_s=e,
        comm_s=0.0,
        comm_bytes_per_rank=0.0,
        collectives=0,
        max_rank_flops=stats.rank_matrix_flops[r],
        flops_imbalance=stats.flops_imbalance,
    )


ESTIMATORS: dict[str, Callable[[PlanStats, Hardware, SimOptions], StepEstimate]] = {
    "reconstruction": estimate_reconstruction,
    "reconstruction_dtensor": estimate_reconstruction_dtensor,
    "all_to_all": estimate_all_to_all,
    "owner": estimate_owner,
}


def estimate_strategies(stats: PlanStats, hw: Hardware, opts: SimOptions = SimOptions()) -> dict[str, StepEstimate]:
    """All strategies' estimates for one plan, keyed as :data:`STRATEGIES`."""
    return {name: fn(stats, hw, opts) for name, fn in ESTIMATORS.items()}


def _ns_workspace_bytes(m: MatrixInfo, opts: SimOptions) -> float:
    """Transient NS buffers of one matrix: X and the new X (k x l), Gram A and B (k x k), bf16."""
    k, l = min(m.m, m.n), max(m.m, m.n)
    return (2.0 * k * l + 2.0 * k * k) * opts.ns_bytes


def estimate_memory(stats: PlanStats, opts: SimOptions = SimOptions()) -> dict[str, float]:
    """Peak bytes per rank (the largest rank) during the optimizer step, per layout.

    ``owner``: the plan's resident bytes (param + grad + state, ZeRO-3-like) of the largest
    rank plus the NS workspace of its largest matrix. ``reconstruction``: even ZeRO-3 shards
    plus the largest gathered gradient and its workspace (one matrix at a time);
    ``reconstruction_gather_all``: all matrix gradients gathered at once ("gather-once"
    implementations). ``all_to_all``: even shards plus the owned full gradients the busiest
    owner receives. ``zero1_owner``: full parameters and gradients replicated on every rank,
    optimizer state on owners (ZeRO-1 owner placement).
    """
    W = stats.world_size
    even = stats.total_resident_bytes / W
    ws_all = [_ns_workspace_bytes(m, opts) for m in stats.matrices] or [0.0]
    gathered = [float(m.numel * opts.grad_bytes) for m in stats.matrices] or [0.0]
    owner_peak = 0.0
    for r in range(W):
        owned_ws = [_ns_workspace_bytes(m, opts) for m in stats.matrices if m.owner == r]
        owner_peak = max(owner_peak, stats.rank_resident_bytes[r] + max(owned_ws, default=0.0))
    recon = even + max(g + w for g, w in zip(gathered, ws_all, strict=True))
    gather_all = even + sum(gathered) + max(ws_all)
    a2a = even + max(
        stats.rank_owned_matrix_elems[r] * opts.grad_bytes
        + max((_ns_workspace_bytes(m, opts) for m in stats.matrices if m.owner == r), default=0.0)
        for r in range(W)
    )
    zero1 = stats.total_param_bytes + stats.total_grad_bytes + max(stats.rank_owned_state_bytes, default=0.0)
    return {
        "owner": owner_peak,
        "reconstruction": recon,
        "reconstruction_gather_all": gather_all,
        "all_to_all": a2a,
        "zero1_owner": zero1,
        "zero3_even_resident": even,
    }

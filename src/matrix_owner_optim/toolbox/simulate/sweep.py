"""Sweeps over cluster sizes, cached plan statistics, the paper's model.

Part of :mod:`matrix_owner_optim.toolbox.simulate`; see its docstring for the model.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from typing import Any

from torch import nn

from ...planning import plan_model
from .estimates import estimate_memory, estimate_strategies
from .hardware import PAPER_MODEL, Hardware, SimOptions
from .plan_stats import PlanStats, plan_stats


def _row(stats: PlanStats, hw: Hardware, opts: SimOptions) -> dict[str, Any]:
    est = estimate_strategies(stats, hw, opts)
    owner = est["owner"].total_s
    mem = estimate_memory(stats, opts)

    def ratio(name: str) -> float:
        return est[name].total_s / owner if owner > 0 else float("nan")

    return {
        "nodes": stats.nodes,
        "gpus_per_node": stats.gpus_per_node,
        "world_size": stats.world_size,
        "strategies": {k: v.to_json() for k, v in est.items()},
        "ratios": {
            "reconstruction_over_owner": ratio("reconstruction"),
            "reconstruction_dtensor_over_owner": ratio("reconstruction_dtensor"),
            "all_to_all_over_owner": ratio("all_to_all"),
        },
        "comm_share_of_reconstruction": est["reconstruction"].comm_s / est["reconstruction"].total_s
        if est["reconstruction"].total_s > 0
        else 0.0,
        "planner": {
            "max_rank_optimizer_flops": stats.planner_flops_max,
            "mean_rank_optimizer_flops": stats.planner_flops_mean,
            "imbalance": stats.planner_imbalance,
            "ns_flops_imbalance": stats.flops_imbalance,
            "ranks_without_matrices": sum(1 for c in stats.rank_matrices if c == 0),
        },
        "memory_bytes_per_rank": mem,
    }


class StatsCache:
    """Plans a model once per world size (planning is the only non-trivial cost)."""

    def __init__(self, model: nn.Module, unit_prefixes: Sequence[str] | None, preconditioner: str = "muon") -> None:
        self.model = model
        self.unit_prefixes = list(unit_prefixes) if unit_prefixes is not None else None
        self.preconditioner = preconditioner
        self._stats: dict[tuple[int, int], PlanStats] = {}

    def get(self, nodes: int, gpus_per_node: int) -> PlanStats:
        key = (nodes, gpus_per_node)
        if key not in self._stats:
            plan = plan_model(
                self.model, nodes * gpus_per_node, preconditioner=self.preconditioner, unit_prefixes=self.unit_prefixes
            )
            self._stats[key] = plan_stats(plan, nodes, gpus_per_node)
        return self._stats[key]


def _check_topology(nodes: int, gpus_per_node: int) -> None:
    for name, v in (("nodes", nodes), ("gpus_per_node", gpus_per_node)):
        if not isinstance(v, int) or v < 1:
            raise ValueError(f"{name} must be a positive integer, got {v!r}")


def simulate(
    model: nn.Module,
    *,
    unit_prefixes: Sequence[str] | None,
    node_counts: Iterable[int],
    gpus_per_node: int,
    hardware: Hardware,
    options: SimOptions = SimOptions(),
    cache: StatsCache | None = None,
) -> list[dict[str, Any]]:
    """One JSON-ready row per node count: per-strategy times, ratios, planner load, memory."""
    cache = cache or StatsCache(model, unit_prefixes)
    rows = []
    for n in node_counts:
        _check_topology(n, gpus_per_node)
        rows.append(_row(cache.get(n, gpus_per_node), hardware, options))
    return rows


def paper_model(**overrides: Any) -> tuple[nn.Module, list[str]]:
    """The paper/seed configuration as a meta-device GPT and its FSDP2 unit prefixes."""
    from ..models import GPT, GPTConfig

    cfg = {**PAPER_MODEL, **overrides}
    model = GPT(GPTConfig(**cfg), device="meta")
    return model, model.unit_prefixes()

"""The routing report: what reached which optimizer, so that "Muon is not running" is never silent.

A :class:`RoutingReport` of an optimizer (``opt.routing_report()``) or a plan counts tensors,
matrices and bytes per optimizer and role, and names every >2D or large 2D tensor left to the
tail. ``OwnerRoutedOptimizer`` logs it once on rank 0 at its first step, through the logger
``matrix_owner_optim.optim.report`` (DESIGN.md, "The routing report").
"""

from __future__ import annotations

import logging
import math
from collections.abc import Iterable
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Protocol

import torch.distributed as dist

from ..planning.metadata import Role, ShardingPlan
from ..planning.roles import router_fqns
from ..planning.views import MatrixView, default_matrix_view
from ..tensors import itemsize

if TYPE_CHECKING:
    from .routing import RoutedParam


class ReportsRoutes(Protocol):
    """What the report reads of an optimizer (``OwnerRoutedOptimizer`` is one)."""

    def routing_report(self, large_numel: int = ...) -> RoutingReport: ...


__all__ = [
    "RouteRow",
    "RoutingReport",
    "routing_report",
    "report_of_routes",
    "report_of_plan",
    "log_report",
    "LARGE_NUMEL",
    "logger",
]

logger = logging.getLogger(__name__)

LARGE_NUMEL = 1 << 16  # a 2D tail tensor this large is named in the report


@dataclass(frozen=True)
class RouteRow:
    """One tensor: where it went and as what."""

    name: str
    shape: tuple[int, ...]
    dtype: str
    role: str
    optimizer: str
    numel: int
    bytes: int
    matrices: int  # matrices the matrix optimizer steps it as (0 on the tail)
    view: str | None  # its MatrixView's label (matrix role only)
    owner: int | None
    reason: str | None = None  # why a named tail tensor is on the tail


@dataclass
class RoutingReport:
    """What went where (see the module docstring)."""

    rows: list[RouteRow]
    matrix_optimizer: str
    tail_optimizer: str
    large_numel: int = LARGE_NUMEL
    source: str = "optimizer"

    def summary(self) -> list[dict[str, Any]]:
        """Per (optimizer, role): tensors, matrices, elements, bytes; in a fixed order."""
        out: dict[tuple[str, str], dict[str, Any]] = {}
        for r in self.rows:
            entry = out.setdefault(
                (r.optimizer, r.role),
                {"optimizer": r.optimizer, "role": r.role, "tensors": 0, "matrices": 0, "numel": 0, "bytes": 0},
            )
            entry["tensors"] += 1
            entry["matrices"] += r.matrices
            entry["numel"] += r.numel
            entry["bytes"] += r.bytes
        order = {Role.MATRIX.value: 0, Role.TAIL.value: 1, Role.ROWS.value: 2}
        return sorted(out.values(), key=lambda e: (order.get(e["role"], 3), e["optimizer"]))

    def left_to_tail(self) -> list[RouteRow]:
        """Every >2D tensor and every large 2D ``tail`` tensor the tail optimizer updates."""
        return [
            r
            for r in self.rows
            if r.optimizer == self.tail_optimizer
            and (len(r.shape) > 2 or (len(r.shape) == 2 and r.role == Role.TAIL.value and r.numel >= self.large_numel))
        ]

    def unexpected_tail(self) -> list[RouteRow]:
        """:meth:`left_to_tail` less the routers (on the tail by design)."""
        return [r for r in self.left_to_tail() if r.reason != ROUTER_REASON]

    def stacks(self) -> list[RouteRow]:
        """The matrix-role tensors stepped as several matrices (experts, fused blocks)."""
        return [r for r in self.rows if r.matrices > 1]

    def format(self, max_named: int = 32) -> str:
        """The report as text: one line per (optimizer, role), then the named tensors."""
        lines = [
            f"routing ({self.source}): matrix optimizer {self.matrix_optimizer}, tail optimizer {self.tail_optimizer}"
        ]
        for e in self.summary():
            mats = f" as {e['matrices']} matrices" if e["role"] == Role.MATRIX.value else ""
            lines.append(
                f"  {e['optimizer']:>10} {e['role']:<8} {e['tensors']:>6} tensors{mats}, {_human(e['bytes'])}B"
            )
        stacks = self.stacks()
        if stacks:
            lines.append(f"  stepped as several matrices ({len(stacks)} tensors):")
            lines += [f"    {r.name} {r.shape}: {r.matrices} x {r.view}" for r in stacks[:max_named]]
            if len(stacks) > max_named:
                lines.append(f"    ... {len(stacks) - max_named} more")
        tail = self.left_to_tail()
        if tail:
            lines.append(
                f"  left to the tail optimizer (>2D, or 2D with >= {self.large_numel} elements) ({len(tail)} tensors):"
            )
            lines += [f"    {r.name} {r.shape} role {r.role}: {r.reason}" for r in tail[:max_named]]
            if len(tail) > max_named:
                lines.append(f"    ... {len(tail) - max_named} more")
        return "\n".join(lines)

    __str__ = format


ROUTER_REASON = "mixture-of-experts router: tail by default"


def _human(n: float) -> str:
    for unit in ("", "K", "M", "G"):
        if abs(n) < 1024:
            return f"{n:.0f} " if not unit else f"{n:.1f} {unit}"
        n /= 1024
    return f"{n:.1f} T"


def _reason(name: str, shape: tuple[int, ...], role: Role, routers: set[str]) -> str:
    if name in routers:
        return ROUTER_REASON
    if role is Role.ROWS:
        return "sharded by rows (embedding or output head)"
    if len(shape) > 2:
        view = default_matrix_view(shape, name=name)
        if view is not None and view.kind == "conv":
            return "conv kernel: tail by default (roles={...: 'matrix'} steps it as (out, rest))"
        return ">2D tensor not read as a stack of matrices (roles= / matrix_views= to change)"
    return "role tail (roles= override or by name)"


def _matrices(view: MatrixView | None, shape: tuple[int, ...], name: str) -> tuple[int, str | None]:
    view = view or default_matrix_view(shape, name=name)
    if view is None:
        return 1, None
    return view.resolve(shape, name).num_matrices, view.label


def _row(
    name: str,
    shape: tuple[int, ...],
    dtype: Any,
    role: Role,
    view: MatrixView | None,
    owner: int | None,
    optimizers: tuple[str, str],
    routers: set[str],
) -> RouteRow:
    """One tensor's row (``optimizers``: the matrix and the tail optimizer's names)."""
    numel = math.prod(int(d) for d in shape)
    is_matrix = role is Role.MATRIX
    count, label = _matrices(view, shape, name) if is_matrix else (0, None)
    return RouteRow(
        name=name,
        shape=shape,
        dtype=str(dtype).replace("torch.", ""),
        role=role.value,
        optimizer=optimizers[0] if is_matrix else optimizers[1],
        numel=numel,
        bytes=numel * itemsize(dtype),
        matrices=count,
        view=label,
        owner=owner,
        reason=None if is_matrix else _reason(name, shape, role, routers),
    )


def report_of_routes(
    routed: Iterable[RoutedParam], matrix_name: str, tail_name: str, large_numel: int = LARGE_NUMEL
) -> RoutingReport:
    """The report of an optimizer's routed parameters (every rank's, not only this rank's)."""
    routed = list(routed)
    names = [rp.fqn for rp in routed]
    routers = router_fqns(names)
    rows = [
        _row(name, rp.global_shape, rp.param.dtype, rp.role, rp.view, rp.owner, (matrix_name, tail_name), routers)
        for rp, name in zip(routed, names, strict=True)
    ]
    return RoutingReport(rows, matrix_name, tail_name, large_numel, source="optimizer")


def report_of_plan(plan: ShardingPlan, tail_name: str = "adamw", large_numel: int = LARGE_NUMEL) -> RoutingReport:
    """The report of a plan: its matrices go to ``plan.preconditioner`` (counted by the default view)."""
    shards = list(plan)
    routers = router_fqns(s.fqn for s in shards)
    names = (plan.preconditioner, tail_name)
    rows = [_row(s.fqn, tuple(int(d) for d in s.shape), s.dtype, s.role, None, s.owner, names, routers) for s in shards]
    return RoutingReport(rows, plan.preconditioner, tail_name, large_numel, source="plan")


def routing_report(source: ReportsRoutes | ShardingPlan, **kwargs: Any) -> RoutingReport:
    """The :class:`RoutingReport` of an ``OwnerRoutedOptimizer`` or a ``ShardingPlan``."""
    if isinstance(source, ShardingPlan):
        return report_of_plan(source, **kwargs)
    report = getattr(source, "routing_report", None)
    if report is None:
        raise TypeError(f"routing_report needs an OwnerRoutedOptimizer or a ShardingPlan, got {type(source).__name__}")
    return report(**kwargs)


def log_report(optimizer: ReportsRoutes) -> None:
    """Log ``optimizer``'s report on rank 0 (nothing is built when the logger drops both records)."""
    if dist.is_available() and dist.is_initialized() and dist.get_rank() != 0:
        return
    if not logger.isEnabledFor(logging.WARNING):
        return
    report = optimizer.routing_report()
    logger.info("%s", report.format())
    unexpected = report.unexpected_tail()
    if unexpected:
        logger.warning(
            "%d tensor(s) that could be matrices are updated by the tail optimizer %s, not by %s: "
            "%s. Route them with roles= / matrix_views= if that is not what you want (see the "
            "routing report: optimizer.routing_report()).",
            len(unexpected),
            report.tail_optimizer,
            report.matrix_optimizer,
            ", ".join(f"{r.name} {r.shape}" for r in unexpected[:8])
            + (f" and {len(unexpected) - 8} more" if len(unexpected) > 8 else ""),
        )

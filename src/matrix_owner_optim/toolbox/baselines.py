"""Baselines the benchmarks compare against; not for training.

``ReconstructionMuon`` is what ZeRO-3 + Muon does without an owner layout: every rank gathers
the full update matrix of every parameter (a weight-sized all-gather per step), runs
Newton-Schulz on all of them redundantly, and keeps its own rows. Its math equals Muon's
(momentum kept per shard, which is exact since momentum is coordinate-wise), so only the
cost differs. It uses the package's counted collectives, so its bytes show up in
:class:`~matrix_owner_optim.comm.CommCounter` like ours do.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch
import torch.distributed as dist

from .. import comm
from ..optim.role_optimizer import ChildGroup
from ..planning.metadata import chunk_row_range
from ..preconditioners.muon import adjust_lr, newton_schulz

__all__ = ["ReconstructionMuon", "ReconstructionOptimizer"]


class ReconstructionMuon(torch.optim.Optimizer):
    """Muon over ``Shard(0)`` DTensors by all-gathering each full update (the baseline)."""

    def __init__(
        self,
        params: Any,
        lr: float = 1e-3,
        weight_decay: float = 0.1,
        momentum: float = 0.95,
        nesterov: bool = True,
        ns_coefficients: tuple[float, float, float] = (3.4445, -4.775, 2.0315),
        eps: float = 1e-7,
        ns_steps: int = 5,
        adjust_lr_fn: str | None = None,
        ns_dtype: torch.dtype = torch.bfloat16,
    ) -> None:
        defaults = dict(
            lr=lr,
            weight_decay=weight_decay,
            momentum=momentum,
            nesterov=nesterov,
            ns_coefficients=ns_coefficients,
            eps=eps,
            ns_steps=ns_steps,
            adjust_lr_fn=adjust_lr_fn,
            ns_dtype=ns_dtype,
        )
        super().__init__(params, defaults)

    @torch.no_grad()
    def step(self, closure: Callable[[], Any] | None = None) -> Any:
        loss = None
        if closure is not None:
            with torch.enable_grad():
                loss = closure()
        with comm.comm_phase("optimizer"):
            for group in self.param_groups:
                for p in group["params"]:
                    if p.grad is None:
                        continue
                    self._update(p, group)
        return loss

    def _update(self, p: torch.Tensor, group: dict[str, Any]) -> None:
        assert p.grad is not None  # step() skips parameters without a gradient
        local_p, local_g = _local(p), _local(p.grad)
        state = self.state[p]
        if "momentum_buffer" not in state:
            state["momentum_buffer"] = torch.zeros_like(local_g)
        buf = state["momentum_buffer"]
        buf.lerp_(local_g, 1 - group["momentum"])
        update = local_g.lerp(buf, group["momentum"]) if group["nesterov"] else buf
        rows, cols = p.shape
        ortho = newton_schulz(
            _gather_rows(update, p), group["ns_coefficients"], group["ns_steps"], group["eps"], group["ns_dtype"]
        )
        start, stop = _own_rows(p)
        local_p.mul_(1 - group["lr"] * group["weight_decay"])
        lr = adjust_lr(group["lr"], group["adjust_lr_fn"], (rows, cols))
        local_p.add_(ortho[start:stop].to(local_p.dtype), alpha=-lr)


def _local(t: torch.Tensor) -> torch.Tensor:
    return t.to_local() if hasattr(t, "to_local") else t


def _group(p: torch.Tensor) -> Any:
    mesh = getattr(p, "device_mesh", None)
    if mesh is None:
        return dist.group.WORLD if dist.is_initialized() else None
    return mesh.get_group(mesh.ndim - 1)


def _rank_world(p: torch.Tensor) -> tuple[int, int]:
    group = _group(p)
    if group is None:
        return 0, 1
    return dist.get_rank(group), dist.get_world_size(group)


def _own_rows(p: torch.Tensor) -> tuple[int, int]:
    """This rank's rows of ``p`` under ``Shard(0)``."""
    rank, world = _rank_world(p)
    return chunk_row_range(p.shape[0], world, rank)


def _gather_rows(local: torch.Tensor, p: torch.Tensor) -> torch.Tensor:
    """The full matrix from every rank's rows of ``p`` (padded all-gather, counted)."""
    _, world = _rank_world(p)
    if world == 1:
        return local
    rows, cols = p.shape
    per = -(-rows // world)
    padded = torch.zeros(per, cols, dtype=local.dtype, device=local.device)
    padded[: local.shape[0]].copy_(local)
    gathered = torch.empty(per * world, cols, dtype=local.dtype, device=local.device)
    comm.all_gather_into_tensor(gathered, padded, group=_group(p), name="reconstruct_all_gather")
    return gathered[:rows]


class ReconstructionOptimizer(torch.optim.Optimizer):
    """Any matrix optimizer over ``Shard(0)`` DTensors by full reconstruction (the baseline).

    Every rank keeps a full replica of every matrix and its optimizer state, all-gathers each
    full gradient every step, runs ``inner`` on all replicas redundantly and writes its own
    rows back: the "gather" strategy for Shampoo/SOAP, whose state cannot be split by rows.
    """

    def __init__(self, params: Any, inner: Callable[..., torch.optim.Optimizer], **options: Any) -> None:
        super().__init__(params, dict(options))
        self._replicas: dict[torch.Tensor, torch.Tensor] = {}
        inner_groups = []
        for index, group in enumerate(self.param_groups):
            replicas = []
            for p in group["params"]:
                self._replicas[p] = _gather_rows(_local(p).detach(), p).clone()
                replicas.append(self._replicas[p])
            inner_groups.append(ChildGroup(self, index, replicas))  # values: this group's (lr schedulers)
        self.inner = inner(inner_groups, **options)

    @torch.no_grad()
    def step(self, closure: Callable[[], Any] | None = None) -> Any:
        loss = None
        if closure is not None:
            with torch.enable_grad():
                loss = closure()
        with comm.comm_phase("optimizer"):
            for p, replica in self._replicas.items():
                replica.grad = None if p.grad is None else _gather_rows(_local(p.grad), p)
            self.inner.step()
            for p, replica in self._replicas.items():
                start, stop = _own_rows(p)
                _local(p).copy_(replica[start:stop])
                replica.grad = None
        return loss

    def extra_resident_bytes(self) -> int:
        """Full replicas and their state: what reconstruction costs in memory."""
        total = sum(r.numel() * r.element_size() for r in self._replicas.values())
        for state in self.inner.state.values():
            total += sum(v.numel() * v.element_size() for v in state.values() if isinstance(v, torch.Tensor))
        return total

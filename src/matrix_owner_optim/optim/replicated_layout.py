"""Replicated parameters (DDP, or plain tensors in a multi-rank job): owner or redundant updates.

``replicated="owner"``: each matrix's owner (:func:`plan_owners`) alone steps it and one
``all_to_all_single`` per dtype shares the new values (state on the owners only: consolidate
before a rank-0 save, as ``ZeroRedundancyOptimizer``); ``"redundant"``: every rank steps all.
"""

from __future__ import annotations

import math
from collections.abc import Sequence

import torch
import torch.distributed as dist

from .. import comm
from ..planning import Role, ShardingPlan, TensorSpec, plan_tensors
from ..planning.cost import CostModel, itemsize
from .layouts import LayoutConfig, UpdateLayout, give_grads, matrix_view
from .routing import RoutedParam

__all__ = ["ReplicatedLayout", "plan_owners"]


def plan_owners(
    rps: Sequence[RoutedParam],
    shapes: Sequence[tuple[int, ...]],
    dtypes: Sequence[torch.dtype],
    world_size: int,
    loads: list[int],
    *,
    cost: CostModel,
) -> tuple[list[int], ShardingPlan]:
    """Owners for matrices ``rps`` and the ``planning.plan_tensors`` plan they come from (for ``agree``
    to check); updates ``loads`` (bytes per rank): a batch's heaviest rank lands on the lightest. Pure."""
    specs = [
        TensorSpec(
            fqn=rp.name if rp.name is not None else f"param{rp.index}",
            shape=tuple(shape),
            dtype=dtype,
            role=Role.MATRIX,
            unit=0,
            requires_grad=rp.param.requires_grad,
        )
        for rp, shape, dtype in zip(rps, shapes, dtypes, strict=True)
    ]
    plan = plan_tensors(specs, world_size, cost=cost, split_stacks=False)
    batch = [0] * world_size
    nbytes = [math.prod(s.shape) * itemsize(s.dtype) for s in specs]
    for s, n in zip(specs, nbytes, strict=True):
        batch[plan[s.fqn].owner] += n  # type: ignore[index]
    if any(loads):
        new_order = sorted(range(world_size), key=lambda r: (-batch[r], r))
        old_order = sorted(range(world_size), key=lambda r: (loads[r], r))
        perm = {new_order[i]: old_order[i] for i in range(world_size)}
    else:
        perm = {r: r for r in range(world_size)}
    owners = [perm[plan[s.fqn].owner] for s in specs]  # type: ignore[index]
    for o, n in zip(owners, nbytes, strict=True):
        loads[o] += n
    return owners, plan


class ReplicatedLayout(UpdateLayout):
    """Plain tensors replicated on every rank of a multi-rank job (DDP)."""

    name = "replicated"

    def __init__(self, config: LayoutConfig | None = None) -> None:
        super().__init__(config)
        self.rank = dist.get_rank()
        self.world_size = dist.get_world_size()
        self._loads = [0] * self.world_size
        # matrices with an owner, in order; views (proxies) of >2D kernels need their grads
        self._owned: list[RoutedParam] = []
        self._views: list[RoutedParam] = []

    def add(self, entries: list[RoutedParam]) -> None:
        owner_mode = self.config.replicated == "owner"
        matrices = [rp for rp in entries if rp.role is Role.MATRIX] if owner_mode else []
        if not matrices:
            owners: list[int] = []
        else:
            owners, plan = plan_owners(
                matrices,
                [tuple(rp.param.shape) for rp in matrices],
                [rp.param.dtype for rp in matrices],
                self.world_size,
                self._loads,
                cost=self.config.matrix_cost,
            )
            self.unagreed.append((plan, None, None))
        owner_of = {id(rp): o for rp, o in zip(matrices, owners, strict=True)}
        for rp in entries:
            self.entries.append(rp)
            if id(rp) in owner_of:
                rp.owner = owner_of[id(rp)]
                self._owned.append(rp)
                local = rp.owner == self.rank
            else:
                rp.owner = None  # updated on every rank
                local = True
            if not local:
                rp.proxy = None
            elif rp.role is Role.MATRIX and rp.param.dim() > 2:
                rp.proxy = matrix_view(rp.param)
                self._views.append(rp)
            else:
                rp.proxy = rp.param

    def before_step(self) -> None:
        give_grads(self._views)

    def _layout(self) -> dict[torch.dtype, list[list[RoutedParam]]]:
        """Per dtype: the owned matrices of each rank, in model order."""
        out: dict[torch.dtype, list[list[RoutedParam]]] = {}
        for rp in self._owned:
            per_rank = out.setdefault(rp.param.dtype, [[] for _ in range(self.world_size)])
            per_rank[rp.owner].append(rp)  # type: ignore[index]
        return out

    def after_step(self) -> None:
        """One all-to-all per dtype: each owner sends its updated matrices to every other rank."""
        W, me = self.world_size, self.rank
        for dtype, per_rank in self._layout().items():
            mine = per_rank[me]
            own_numel = sum(rp.param.numel() for rp in mine)
            numels = [sum(rp.param.numel() for rp in per_rank[r]) for r in range(W)]
            in_splits = [0 if r == me else own_numel for r in range(W)]
            out_splits = [0 if r == me else numels[r] for r in range(W)]
            if sum(in_splits) == 0 and sum(out_splits) == 0:
                continue
            if mine:
                flat = torch.cat([rp.param.detach().reshape(-1) for rp in mine])
                send = flat.unsqueeze(0).expand(W - 1, own_numel).reshape(-1)
            else:
                send = torch.empty(0, dtype=dtype, device=self._device())
            recv = torch.empty(sum(out_splits), dtype=dtype, device=send.device)
            comm.all_to_all_single(recv, send, out_splits, in_splits, op="replicated_owner_all_to_all")
            dsts, srcs = [], []
            for r, chunk in enumerate(recv.split(out_splits)):
                if r == me:
                    continue
                for rp, piece in zip(per_rank[r], chunk.split([p.param.numel() for p in per_rank[r]]), strict=True):
                    dsts.append(rp.param.detach())
                    srcs.append(piece.view(rp.param.shape))
            if dsts:
                torch._foreach_copy_(dsts, srcs)
        self.zero_grad(True)

    def _device(self) -> torch.device:
        return self._owned[0].param.device if self._owned else torch.device("cpu")

    @property
    def partitioned(self) -> bool:
        """Whether matrix state lives on owners only (``"owner"`` mode over several ranks)."""
        return bool(self._owned) and self.world_size > 1

    def bytes_per_step(self) -> int:
        """Bytes sent plus received by this rank in one step (0 under ``"redundant"``)."""
        total = 0
        for dtype, per_rank in self._layout().items():
            size = itemsize(dtype)
            numels = [sum(rp.param.numel() for rp in rs) for rs in per_rank]
            total += size * ((self.world_size - 1) * numels[self.rank] + sum(numels) - numels[self.rank])
        return total

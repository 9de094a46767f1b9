"""Global-norm gradient clipping that is correct on every layout.

On the owner layout each gradient lives on exactly one rank (an owner's whole gradient, or a
rank's row block of a ``sharded`` tensor), so the global ``p``-norm is the all-reduced sum of
local ``|g|^p`` partial sums (``MAX`` for the inf-norm). Parameters no plan covers are taken as
replicated and counted on rank 0 of the group only. Without any owner-sharded parameter (one
process, DDP, or stock FSDP2 DTensors) this is ``torch.nn.utils.clip_grad_norm_``.
"""

from __future__ import annotations

import math
from typing import Iterable

import torch
import torch.distributed as dist

from .. import comm
from ..tensors import is_dtensor
from ..planning.metadata import get_matrix_shard, get_shard_group

__all__ = ["clip_grad_norm_"]


def clip_grad_norm_(
    parameters: "torch.Tensor | Iterable[torch.Tensor]",
    max_norm: float,
    norm_type: float = 2.0,
    error_if_nonfinite: bool = False,
    foreach: bool | None = None,
) -> torch.Tensor:
    """Scale gradients in place so their global norm is at most ``max_norm``; return the norm.

    The norm is over all gradients of ``parameters`` across the ranks that hold them, each
    gradient counted once, exactly as ``torch.nn.utils.clip_grad_norm_`` computes it for the
    unsharded model.
    """
    if isinstance(parameters, torch.Tensor):
        parameters = [parameters]
    params: list[torch.Tensor] = []
    seen: set[int] = set()
    for p in parameters:
        if id(p) not in seen:
            seen.add(id(p))
            params.append(p)
    groups = [get_shard_group(p) for p in params if get_matrix_shard(p) is not None]
    groups = [g for g in groups if g is not None]
    if not groups or any(is_dtensor(p) for p in params) or not dist.is_initialized():
        return torch.nn.utils.clip_grad_norm_(params, max_norm, norm_type,
                                              error_if_nonfinite=error_if_nonfinite, foreach=foreach)
    group = groups[0]
    if any(g is not group for g in groups):
        raise ValueError("clip_grad_norm_: parameters are sharded over different process groups")
    rank = dist.get_rank(group)
    norm_type = float(norm_type)
    device = params[0].device
    counted = [p.grad for p in params if p.grad is not None and (get_matrix_shard(p) is not None or rank == 0)]
    all_grads = [p.grad for p in params if p.grad is not None]
    norms = [torch.linalg.vector_norm(g.detach(), norm_type).to(torch.float32) for g in counted if g.numel()]
    if math.isinf(norm_type):
        local = torch.stack(norms).max() if norms else torch.zeros((), device=device)
        local = local.to(device=device, dtype=torch.float32).reshape(1)
        comm.all_reduce(local, op=dist.ReduceOp.MAX, group=group, name="clip_grad_norm")
        total = local[0]
    else:
        local = torch.stack([n ** norm_type for n in norms]).sum() if norms else torch.zeros((), device=device)
        local = local.to(device=device, dtype=torch.float32).reshape(1)
        comm.all_reduce(local, group=group, name="clip_grad_norm")
        total = local[0] ** (1.0 / norm_type)
    if error_if_nonfinite and not torch.isfinite(total):
        raise RuntimeError(
            f"The total norm of order {norm_type} for gradients from `parameters` is non-finite, "
            "so it cannot be clipped. To disable this error and scale the gradients by the "
            "non-finite norm anyway, set `error_if_nonfinite=False`"
        )
    clip_coef = torch.clamp(max_norm / (total + 1e-6), max=1.0)
    with torch.no_grad():
        for g in all_grads:
            g.mul_(clip_coef.to(device=g.device, dtype=g.dtype))
    return total

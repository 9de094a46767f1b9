"""Global-norm gradient clipping, as ``torch.nn.utils.clip_grad_norm_`` computes it, returned whole.

torch's function is right on the owner layout's DTensors; this one returns its norm as a plain
tensor, the same on every rank. Under HSDP a matrix's gradient lives on its global owner only, so
the matrices' partial norms are summed over the replicate group too: call this one there.
"""

from __future__ import annotations

from collections.abc import Iterable

import torch
import torch.distributed as dist

from .. import comm
from ..planning.metadata import get_matrix_shard
from ..replica_sync import replicas_of
from ..tensors import is_dtensor

__all__ = ["clip_grad_norm_"]


def clip_grad_norm_(
    parameters: torch.Tensor | Iterable[torch.Tensor],
    max_norm: float,
    norm_type: float = 2.0,
    error_if_nonfinite: bool = False,
    foreach: bool | None = None,
) -> torch.Tensor:
    """Scale gradients in place so their global norm is at most ``max_norm``; return the norm
    (the unsharded model's, on every rank)."""
    if isinstance(parameters, torch.Tensor):
        parameters = [parameters]
    params = list({id(p): p for p in parameters}.values())
    stepped_once = [p for p in params if _one_replica_steps(p)]
    if not stepped_once:
        total = torch.nn.utils.clip_grad_norm_(
            params, max_norm, norm_type, error_if_nonfinite=error_if_nonfinite, foreach=foreach
        )
        return _whole(total)
    # HSDP: the matrices' norm is split over the replicas, the rest is the same on every replica
    once = {id(p) for p in stepped_once}
    rest = [p.grad for p in params if id(p) not in once and p.grad is not None]
    mats = [p.grad for p in stepped_once if p.grad is not None]
    n_rest = _whole(torch.nn.utils.get_total_norm(rest, norm_type, False, foreach))
    n_mats = _whole(torch.nn.utils.get_total_norm(mats, norm_type, False, foreach)).to(n_rest.dtype)
    place = next(pl for pl in map(replicas_of, stepped_once) if pl is not None)
    p = float(norm_type)
    if p == float("inf"):
        comm.all_reduce(n_mats, op=dist.ReduceOp.MAX, group=place.group, name="clip_grad_norm")
        total = torch.maximum(n_rest, n_mats)
    else:
        powered = n_mats.pow(p)
        comm.all_reduce(powered, group=place.group, name="clip_grad_norm")
        total = (n_rest.pow(p) + powered).pow(1.0 / p)
    if error_if_nonfinite and not bool(torch.isfinite(total)):
        raise RuntimeError(
            f"The total norm of order {norm_type} for gradients from `parameters` is non-finite, so it "
            "cannot be clipped. To disable this error and scale the gradients by the non-finite norm "
            "anyway, set `error_if_nonfinite=False`"
        )
    torch.nn.utils.clip_grads_with_norm_(params, max_norm, total, foreach)
    return total


def _whole(norm: torch.Tensor) -> torch.Tensor:
    return norm.full_tensor() if is_dtensor(norm) else norm  # type: ignore[attr-defined]


def _one_replica_steps(param: torch.Tensor) -> bool:
    """Whether an HSDP plan gives ``param`` one global owner (its gradient on one replica)."""
    shard, place = get_matrix_shard(param), replicas_of(param)
    return shard is not None and shard.step_replica is not None and place is not None and place.size > 1

"""Global-norm gradient clipping, as ``torch.nn.utils.clip_grad_norm_`` computes it, returned whole.

The owner layout's parameters and gradients are DTensors (:mod:`matrix_owner_optim.owner_dtensor`),
so ``torch.nn.utils.clip_grad_norm_`` itself is right on them: each gradient's norm is a partial
value held by the ranks that hold its pieces, and torch's sum over gradients all-reduces the
partials once. It returns that norm as a DTensor; this function returns it as a plain tensor
with the same value on every rank (one process, DDP and stock FSDP2 alike), which is what
logging and ``error_if_nonfinite`` want.
"""

from __future__ import annotations

from collections.abc import Iterable

import torch

from ..tensors import is_dtensor

__all__ = ["clip_grad_norm_"]


def clip_grad_norm_(
    parameters: torch.Tensor | Iterable[torch.Tensor],
    max_norm: float,
    norm_type: float = 2.0,
    error_if_nonfinite: bool = False,
    foreach: bool | None = None,
) -> torch.Tensor:
    """Scale gradients in place so their global norm is at most ``max_norm``; return the norm.

    ``torch.nn.utils.clip_grad_norm_`` over the parameters (each counted once), its DTensor
    result made whole: the norm of every gradient across the ranks that hold it, exactly as for
    the unsharded model.
    """
    if isinstance(parameters, torch.Tensor):
        parameters = [parameters]
    params = list({id(p): p for p in parameters}.values())
    total = torch.nn.utils.clip_grad_norm_(
        params, max_norm, norm_type, error_if_nonfinite=error_if_nonfinite, foreach=foreach
    )
    return total.full_tensor() if is_dtensor(total) else total  # type: ignore[attr-defined]

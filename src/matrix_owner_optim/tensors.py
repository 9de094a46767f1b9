"""Small facts about tensors that several layers need (no process group, no state)."""

from __future__ import annotations

from typing import Any

import torch

__all__ = ["is_dtensor", "itemsize", "local_tensor"]


def is_dtensor(t: Any) -> bool:
    """Whether ``t`` is a ``torch.distributed.tensor.DTensor`` (False where torch lacks it)."""
    try:
        from torch.distributed.tensor import DTensor
    except ImportError:  # pragma: no cover - torch built without distributed
        return False
    return isinstance(t, DTensor)


def local_tensor(t: torch.Tensor) -> torch.Tensor:
    """This rank's tensor of a ``DTensor`` (its local shard, outside autograd), or ``t`` itself.

    The one way the package reaches a DTensor's storage: optimizer and state-dict code work on
    the raw local tensor, never through ``to_local()``'s autograd view.
    """
    return t._local_tensor if is_dtensor(t) else t  # type: ignore[attr-defined]


def itemsize(dtype: torch.dtype) -> int:
    """Bytes per element of ``dtype``."""
    return torch.empty((), dtype=dtype, device="meta").element_size()

"""Small facts about tensors that several layers need (no process group, no state)."""

from __future__ import annotations

from typing import Any

__all__ = ["is_dtensor"]


def is_dtensor(t: Any) -> bool:
    """Whether ``t`` is a ``torch.distributed.tensor.DTensor`` (False where torch lacks it)."""
    try:
        from torch.distributed.tensor import DTensor
    except ImportError:  # pragma: no cover - torch built without distributed
        return False
    return isinstance(t, DTensor)

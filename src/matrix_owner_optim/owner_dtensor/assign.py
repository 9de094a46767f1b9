"""Whole-tensor assignment, ``t.data = value``, on an owner-layout tensor (DESIGN.md, "The
representation").

torch's ``Tensor.data`` setter swaps the tensor's implementation for ``value``'s, which on a
DTensor wrapper keeps the old piece and spec (``vector_to_parameters`` changed nothing). Here the
tensor takes ``value``'s whole value on every rank: its piece and spec for the same layout (the
storage shared, as torch shares it), else this rank's piece of it (a plain tensor is the whole
value; another DTensor is gathered); another shape is refused on every rank, by name.
"""

from __future__ import annotations

from typing import Any

import torch
from torch.distributed.tensor import DTensor, Partial

from .placement import same_layout, spec_for, spec_piece

__all__ = ["assign_data"]


def assign_data(cls: Any, t: Any, value: Any) -> None:
    """``t.data = value`` for an owner-layout tensor ``t`` (see the module docstring)."""
    if not isinstance(value, torch.Tensor):
        raise TypeError(f"t.data = value takes a tensor, got {type(value).__name__}")
    if tuple(value.shape) != tuple(t.shape):
        raise RuntimeError(
            f"t.data = value with value of shape {tuple(value.shape)} for an owner-layout tensor of shape "
            f"{tuple(t.shape)}: an owner-layout tensor's pieces keep the shape its placement says. Assign a "
            "value of the same shape, or shard a module built with the new shapes"
        )
    if any(isinstance(p, Partial) for p in t.placements):
        raise NotImplementedError(
            "t.data = value for a partial owner-layout value (a 0-dim result held by one rank): "
            "assign to a tensor of the layout itself"
        )
    if isinstance(value, cls) and same_layout(value, t):
        new = cls._wrap(value._local_tensor, value._spec, value._holder)
    else:
        if isinstance(value, DTensor):
            full = value.full_value() if isinstance(value, cls) else value.full_tensor()
        else:
            full = value.detach()
        piece = spec_piece(full, t)
        new = cls._wrap(piece, spec_for(t._spec, piece.dtype), t._holder)
    with torch._C.DisableTorchFunctionSubclass():  # the wrapper's own metadata (dtype) as torch sets it
        torch._C.TensorBase.data.__set__(t, new)  # type: ignore[attr-defined]
    t._local_tensor = new._local_tensor
    t._spec = new._spec
    t._holder = new._holder

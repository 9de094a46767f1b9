"""Whole-tensor assignment, ``t.data = value``, on an owner-layout tensor (DESIGN.md, "The
representation").

torch's ``Tensor.data`` setter swaps the tensor's implementation for ``value``'s; on a DTensor
wrapper that would keep the old piece and spec (its Python attributes) and silently change
nothing, so ``torch.nn.utils.vector_to_parameters`` (``param.data = vec[a:b].view_as(param)``)
left the parameters as they were. Here the tensor takes ``value``'s whole value, on every rank:

* ``value`` an owner-layout tensor of the same layout (mesh, placements, shape): its piece and
  spec, so the tensor shares ``value``'s storage, as torch's ``data =`` shares it;
* any other ``value`` of the same shape (a plain tensor: the whole value, the same on every rank,
  as every load assumes; a DTensor of another layout: gathered, every rank takes part): this
  rank's piece of it (a view of a plain ``value`` on the rank that holds rows);
* another shape: refused on every rank, by name (a piece's shape is its placement's).

``value``'s dtype is the tensor's new dtype, as with torch. ``set_`` stays refused (``ops.py``).
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

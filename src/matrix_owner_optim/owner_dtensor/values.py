"""Whole values and pieces: an argument's whole value on every rank (``full_of``), a written
tensor's piece of a new whole value (``write_piece``), and the one ``copy_`` rule of the owner
layout, for 1D and 2D meshes alike (DESIGN.md, "The representation", has the rules).
"""

from __future__ import annotations

from typing import Any

import torch
from torch.distributed.tensor import DTensor, Partial, Replicate

from .base import OwnerTensorBase
from .placement import same_layout, spec_piece

__all__ = ["copy_into", "full_of", "write_piece"]


def full_of(a: Any) -> Any:
    """The whole value of one argument on every rank (a collective for a non-replicated DTensor;
    every rank calls it for the same arguments), in the argument's own strides (see
    :func:`_in_strides_of`)."""
    if isinstance(a, DTensor):
        full = a.full_value() if isinstance(a, OwnerTensorBase) else a.full_tensor()
        return _in_strides_of(a, full)
    return a


def _dense(shape: tuple[int, ...], stride: tuple[int, ...]) -> bool:
    """Whether ``stride`` lays ``shape`` out densely with no overlap (a permutation of the
    contiguous strides; size-1 dimensions may have any stride)."""
    if 0 in shape:
        return False
    expected = 1
    for size, step in sorted(((n, st) for n, st in zip(shape, stride, strict=True) if n > 1), key=lambda x: x[1]):
        if step != expected:
            return False
        expected *= size
    return True


def _in_strides_of(a: torch.Tensor, full: torch.Tensor) -> torch.Tensor:
    """``full`` (contiguous, as gathers return it) in ``a``'s strides where ``a`` is a dense
    view in another order (a transposed matrix): a kernel given the gathered value then picks
    what it picks for the plain tensor (BLAS's transpose flags, so its summation order), and a
    gathered result rounds as the plain one does. Overlapping strides (``expand``) stay
    contiguous: no storage has them."""
    stride = tuple(a.stride())
    if stride == tuple(full.stride()) or a.dim() < 2 or not _dense(tuple(a.shape), stride):
        return full
    restrided = torch.empty_strided(tuple(a.shape), stride, dtype=full.dtype, device=full.device)
    return restrided.copy_(full)


def write_piece(dst: Any, full: torch.Tensor, func: Any = None) -> None:
    """Write this rank's piece of ``full`` (the new whole value of ``dst``) into ``dst``."""
    if tuple(full.shape) != tuple(dst.shape):
        raise RuntimeError(
            f"{func or 'an operator'} would change the shape of an owner-layout tensor it writes from "
            f"{tuple(dst.shape)} to {tuple(full.shape)} (an out= tensor of another size; a DTensor cannot be "
            "resized in place): pass an out= tensor of the result's shape"
        )
    if isinstance(dst, OwnerTensorBase):
        if isinstance(dst.placement, Partial):
            if dst.holder is None:  # a partial of every rank: now the same whole value everywhere
                dst.relayout(full.clone(), Replicate())
            elif dst.is_holder:
                dst._local_tensor.copy_(full)
            return  # a value held by another rank: this rank keeps its zero
        dst._local_tensor.copy_(dst.piece_of_full(full))
        return
    if isinstance(dst, DTensor):
        if any(isinstance(p, Partial) for p in dst.placements):
            raise NotImplementedError(
                "writing a Partial DTensor from an operator that also reads owner-layout tensors: "
                "call .full_tensor() on it first"
            )
        piece = spec_piece(full, dst)
        if dst._local_tensor.data_ptr() != piece.data_ptr() or dst._local_tensor.numel() == 0:
            dst._local_tensor.copy_(piece)
        return
    dst.copy_(full)


def copy_into(dst: Any, src: Any) -> Any:
    """``dst.copy_(src)`` for an owner-layout ``dst`` on a 1D or a 2D mesh: this rank's piece of
    ``src``'s whole value into ``dst``'s piece, cut where ``compute_local_shape_and_global_offset``
    cuts ``dst``. A source of the same layout copies piece to piece; on a 2D mesh a stock DTensor
    of ``dst``'s TP placement on the tp mesh (a TP-only model's state dict) gives the owner its
    local TP slice; a plain tensor is the whole value (the same on every rank, as every load
    assumes); any other DTensor is gathered first (every rank takes part); a number fills."""
    local = dst._local_tensor
    if isinstance(src, DTensor) and same_layout(src, dst):
        local.copy_(src._local_tensor)
        return dst
    if dst.device_mesh.ndim == 2 and isinstance(src, DTensor) and src.device_mesh.ndim == 1:
        names = dst.device_mesh.mesh_dim_names
        if (
            names is not None
            and tuple(src.shape) == tuple(dst.shape)
            and src.device_mesh == dst.device_mesh[names[1]]
            and tuple(src.placements) == (dst.placements[1],)
        ):
            if local.numel():  # the owner: its TP slice is the source's local piece
                local.copy_(src._local_tensor)
            return dst
    if isinstance(src, DTensor):
        full = src._local_tensor if all(isinstance(p, Replicate) for p in src.placements) else full_of(src)
    elif isinstance(src, torch.Tensor):
        full = src
    else:  # a Python number
        local.fill_(src)
        return dst
    if tuple(full.shape) != tuple(dst.shape):
        full = full.expand(dst.shape)  # broadcasting, as copy_ does (raises on shapes that do not)
    if dst.dim() == 0 and isinstance(dst.placement, Partial) and not dst.is_holder:
        return dst
    local.copy_(dst.piece_of_full(full))
    return dst

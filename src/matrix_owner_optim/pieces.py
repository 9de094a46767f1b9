"""Pieces of global tensors for optimizer state: the owner layout's DTensors, built from metadata.

Sharded parameters are owner-layout DTensors themselves (:mod:`matrix_owner_optim.owner_dtensor`),
so a model's ``state_dict()`` needs nothing from here. Optimizer state is kept on plain local
tensors by the child optimizers; :func:`piece_of` describes such a tensor as a piece of a global
one (``Shard(0)`` rows for ``rows`` parameters, held whole by the owner otherwise, with its own
shape for state such as Shampoo's factors), and :func:`local_piece` cuts this rank's piece out of
a loaded value (a piece, a replicated DTensor or a full tensor). Only MatrixShard metadata is read.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import torch
from torch.distributed.tensor import DTensor, Partial, Replicate, Shard

from .owner_dtensor import OwnerDTensor, OwnerShard, mesh_of_group, owned_ranges, same_placement
from .planning.metadata import MatrixShard, Role

__all__ = ["describe", "mesh_of_group", "piece_of", "local_piece", "placement_of"]


def piece_of(
    local: torch.Tensor,
    shard: MatrixShard,
    rank: int,
    group: Any,
    shape: Sequence[int] | None = None,
) -> torch.Tensor:
    """``local`` (this rank's piece of a tensor laid out like ``shard``) as a DCP piece.

    ``shape``: the global shape when it is not the parameter's (optimizer state such as
    Shampoo's factors, held whole by the owner). Row blocks of ``rows`` tensors become
    ``Shard(0)`` DTensors, owner-held tensors :meth:`OwnerDTensor.owned`.
    """
    mesh = mesh_of_group(group, local.device.type)
    if shard.is_split:  # this rank's experts; state keeps the experts on dim 0
        full = tuple(shape) if shape is not None else (shard.shape[0], *local.shape[1:])
        return OwnerDTensor.make(local, mesh, placement_of(shard), full)
    if shard.role is Role.ROWS:
        return OwnerDTensor.rows(local, mesh, shard.shape if shape is None else shape)
    assert shard.owner is not None
    full_shape = tuple(shard.shape if shape is None else shape)
    if rank != shard.owner:  # nothing of it here: an empty piece of the global shape
        local = local.new_empty((0, *full_shape[1:])) if full_shape else local.new_zeros(())
    return OwnerDTensor.owned(local, shard.owner, mesh, full_shape)


def placement_of(shard: MatrixShard, shape: Sequence[int] | None = None) -> Any:
    """The placement of a tensor laid out like ``shard`` (global ``shape``, default the
    parameter's): planned row ranges of a split stack, ``Shard(0)`` row blocks, or held whole by
    the owner (a scalar: ``Partial`` with zeros elsewhere)."""
    if shard.is_split:
        return OwnerShard(0, shard.row_ranges())
    if shard.role is Role.ROWS:
        return Shard(0)
    assert shard.owner is not None
    full_shape = tuple(shard.shape if shape is None else shape)
    if not full_shape:
        return Partial("sum")
    return OwnerShard(0, owned_ranges(int(full_shape[0]), shard.owner, shard.world_size))


def local_piece(
    value: Any, shard: MatrixShard, rank: int, *, what: str, like: torch.Tensor | None = None
) -> torch.Tensor:
    """This rank's piece of the global tensor ``value`` for a tensor laid out like ``shard``.

    ``value``: a piece in this layout (an owner-layout DTensor, e.g. read by DCP into what
    ``state_dict()`` gave), a replicated DTensor, or a full plain tensor. ``like`` gives device
    (and the empty shape of non-owners). No collective.
    """
    full_shape = tuple(shard.shape)
    if (
        shard.is_split
        and isinstance(value, torch.Tensor)
        and value.dim() > 0
        and int(value.shape[0]) == int(full_shape[0])
    ):  # experts on dim 0 (also their state)
        full_shape = (full_shape[0], *value.shape[1:])
    if isinstance(value, OwnerDTensor) and not isinstance(value.placement, Replicate):
        if tuple(value.shape) == full_shape and (
            same_placement(value.placement, placement_of(shard, full_shape))
            if full_shape
            else value.holder == shard.owner
        ):
            return value._local_tensor
        raise ValueError(
            f"{what}: the state dict holds it as {value.placement!r}, shape {tuple(value.shape)}, but "
            f"here it is {describe(shard, rank)}; load a full state dict or go through DCP (dcp.load "
            "into get_model_state_dict(model) / get_optimizer_state_dict(model, optimizer))"
        )
    if isinstance(value, DTensor):
        if all(isinstance(p, Replicate) for p in value.placements):
            value = value._local_tensor  # the full tensor
        elif (
            shard.role is Role.ROWS
            and tuple(value.shape) == full_shape
            and len(value.placements) == 1
            and value.placements[0] == Shard(0)
            and value.device_mesh.size() == shard.world_size
            and value.device_mesh.get_local_rank() == rank
        ):
            return value._local_tensor
        else:
            raise ValueError(
                f"{what}: a DTensor with placements {tuple(value.placements)} on a mesh of "
                f"{value.device_mesh.size()} ranks, but here it is {describe(shard, rank)}; load a "
                "full state dict or go through DCP"
            )
    if not isinstance(value, torch.Tensor):
        raise TypeError(f"{what}: expected a tensor, got {type(value).__name__}")
    local_shape = tuple(shard.local_shape(rank))
    if shard.is_split:
        local_shape = (local_shape[0], *full_shape[1:])
    if tuple(value.shape) == full_shape:
        if shard.holds_rows:
            start, stop = shard.row_range(rank)
            return value[start:stop]
        if shard.is_owned_by(rank):
            return value
        device = like.device if like is not None else value.device
        if not full_shape:
            return torch.zeros((), dtype=value.dtype, device=device)
        return torch.empty((0, *full_shape[1:]), dtype=value.dtype, device=device)
    if tuple(value.shape) == local_shape:
        return value
    raise ValueError(
        f"{what}: shape {tuple(value.shape)} is neither the global shape {full_shape} nor this "
        f"rank's piece {local_shape}; load a checkpoint of a model built with the same configuration"
    )


def describe(shard: MatrixShard, rank: int) -> str:
    if shard.is_split:
        return f"whole experts over {shard.world_size} ranks (rank {rank} holds {shard.row_range(rank)})"
    if shard.role is Role.ROWS:
        return f"row blocks over {shard.world_size} ranks (rank {rank} holds rows {shard.row_range(rank)})"
    return f"held whole by rank {shard.owner} of {shard.world_size}"

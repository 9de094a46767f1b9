"""How a stock-FSDP2 DTensor matrix is cut: the placements ``DTensorLayout`` accepts (``SUPPORTED``),
read once into a :class:`MatrixSharding` (a ``MeshSlice`` on 2D meshes); anything else is refused. Pure.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch.distributed.tensor import Replicate, Shard
from torch.distributed.tensor.placement_types import _StridedShard

from ..planning.metadata import chunk_row_sizes
from .mesh_slice import AxisKind, MeshSlice
from .routing import RoutedParam

__all__ = ["MatrixSharding", "matrix_sharding", "SUPPORTED"]

SUPPORTED = (
    "OwnerRoutedOptimizer supports DTensor matrices sharded by rows (Shard(0)) on one mesh dim, "
    "the others Replicate() (torch.distributed.fsdp.fully_shard, HSDP), and 2D matrices on a 2D "
    "(dp, tp) mesh as parallelize_module then fully_shard(mesh=mesh['dp']) leave them: "
    "(_StridedShard(dim=0, sf=<tp size>), Shard(dim=0)) (ColwiseParallel) or "
    "(Shard(dim=0), Shard(dim=1)) (RowwiseParallel), and stacks of matrices (the 'stack' matrix "
    "view, e.g. MoE experts [E, out, in]) split over experts on a 2D (efsdp, ep) mesh as "
    "torchtitan's expert parallel leaves them: (_StridedShard(dim=0, sf=<ep size>), Shard(dim=0))"
)


@dataclass(frozen=True)
class MatrixSharding:
    """The FSDP mesh dim a matrix's rows are split on (None: replicated) and its parallel slice."""

    dp_dim: int | None
    tp: MeshSlice | None = None


def describe(p: torch.Tensor) -> str:
    """A DTensor parameter's placements and mesh shape, for error messages."""
    return f"placements {tuple(getattr(p, 'placements', ()))} on mesh {tuple(p.device_mesh.shape)}"  # type: ignore[attr-defined]


def _refuse(rp: RoutedParam, why: str = "") -> ValueError:
    return ValueError(
        f"matrix {rp.label!r} is a DTensor with {describe(rp.param)}{why}; {SUPPORTED}. Route it to "
        f"the tail optimizer (roles={{{rp.label!r}: 'tail'}}) or shard it in one of these forms"
    )


def matrix_sharding(rp: RoutedParam) -> MatrixSharding:
    """How the DTensor matrix ``rp.param`` is cut; raises for any form not in ``SUPPORTED``."""
    p = rp.param
    placements = tuple(p.placements)  # type: ignore[attr-defined]
    mesh = p.device_mesh  # type: ignore[attr-defined]
    if all(isinstance(pl, Replicate) for pl in placements):
        return MatrixSharding(None)
    rows = [d for d, pl in enumerate(placements) if type(pl) is Shard and pl.dim == 0]
    others = [d for d, pl in enumerate(placements) if not isinstance(pl, Replicate) and d not in rows]
    if len(rows) == 1 and not others:
        return MatrixSharding(rows[0])
    if len(placements) != 2:
        raise _refuse(rp)
    dp, tp = placements
    T = mesh.size(1)
    # dim 0 split over tp, then FSDP2 over dim 0 of each tp slice
    colwise = (
        type(tp) is Shard and tp.dim == 0 and isinstance(dp, _StridedShard) and dp.dim == 0 and dp.split_factor == T
    )
    if p.dim() > 2:  # a stack of matrices split over experts (expert parallel), or refused
        if rp.view is None or rp.view.kind != "stack":
            kind = "no matrix view" if rp.view is None else f"the {rp.view.kind!r} matrix view"
            raise _refuse(rp, f" and {kind} (only a 'stack' splits into whole matrices along dim 0)")
        if not colwise:
            raise _refuse(rp)
        ep = MeshSlice(AxisKind.EP, 1, 0, mesh.get_local_rank(1), tuple(chunk_row_sizes(int(p.shape[0]), T)))
        return MatrixSharding(0, ep)
    if colwise:
        tp_dim = 0  # ColwiseParallel, then FSDP2 over the rows of each TP slice
    elif type(tp) is Shard and tp.dim == 1 and type(dp) is Shard and dp.dim == 0:
        tp_dim = 1  # RowwiseParallel, then FSDP2 over the rows of each TP slice
    else:
        raise _refuse(rp)
    tp_slice = MeshSlice(
        AxisKind.TP, 1, tp_dim, mesh.get_local_rank(1), tuple(chunk_row_sizes(int(p.shape[tp_dim]), T))
    )
    return MatrixSharding(0, tp_slice)

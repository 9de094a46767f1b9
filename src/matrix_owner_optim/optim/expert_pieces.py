"""Where the optimizer state of a stock FSDP2 x expert parallel stack lies: one
``OwnerShard(0, ranges)`` of its ``E`` rows on the flattened 2D mesh, each ep coordinate's experts
held by their efsdp owner (DESIGN.md, "FSDP2 x expert parallel on stock FSDP2").
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from .. import comm
from ..owner_dtensor.placement import OwnerShard
from .mesh_slice import MeshSlice
from .state_place import RowPieces

__all__ = ["expert_pieces"]


def _flat(mesh: Any, label: str) -> Any:
    """The 1D flattening of the 2D ``mesh`` (``DeviceMesh._flatten``, cached by the root mesh)."""
    if not mesh.mesh_dim_names:
        raise ValueError(
            f"{label!r} is a stack of matrices split over experts on a 2D mesh without dim names; "
            "OwnerRoutedOptimizer keeps its optimizer state on the flattened mesh, which torch "
            "builds only for named meshes: name the mesh dims (init_device_mesh(..., mesh_dim_names=...))"
        )
    return mesh._flatten()


def expert_pieces(
    mesh: Any, slices: Sequence[MeshSlice], owners: Sequence[int], labels: Sequence[str]
) -> list[RowPieces]:
    """Collective over ep: the state layout of each stack, split as ``slices[i]``, owned by ``owners[i]``."""
    flat = _flat(mesh, labels[0])
    per_ep = comm.all_gather_object(list(owners), group=mesh.get_group(1), name="expert_owner_plans")
    flat_ranks = [int(r) for r in flat.mesh.flatten().tolist()]
    grid = mesh.mesh.tolist()  # global rank of (efsdp coordinate, ep coordinate)
    out = []
    for i, tp in enumerate(slices):
        rows = sum(tp.sizes)
        ranges = [(rows, rows)] * len(flat_ranks)
        for t in range(tp.size):
            holder = flat_ranks.index(int(grid[per_ep[t][i]][t]))
            ranges[holder] = (tp.offset(t), tp.offset(t) + tp.sizes[t])
        start = tp.offset(tp.rank)
        out.append(RowPieces(flat, OwnerShard(0, ranges), rows, start, start + tp.sizes[tp.rank]))
    return out

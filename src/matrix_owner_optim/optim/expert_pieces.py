"""Where the optimizer state of a stock FSDP2 x expert parallel stack lies, over every ep coordinate.

Ep coordinate ``t`` holds experts ``torch.chunk`` piece ``t`` of ``E``, stepped (and their state
kept) by efsdp coordinate ``o_t``: the stack's state is one ``OwnerShard(0, ranges)`` of ``E``
rows on the flattened 2D mesh, so DCP saves one chunk per ep coordinate and reshards it like any
owner-layout tensor. The other coordinates' owners are planned in their own efsdp groups: one
``all_gather_object`` over ep tells every rank (the optimizer's construction step, ``agree``).
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
    """The 1D flattening of the 2D ``mesh`` (torch's ``DeviceMesh._flatten``, as torchtitan
    flattens its loss mesh; the root mesh caches it by name, so later calls return the same)."""
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
    """Collective over the ep group (mesh dim 1 of the 2D ``mesh``): the state layout of each
    stack ``i`` (named ``labels[i]``), split over ep as ``slices[i]`` and owned in this rank's
    efsdp group by efsdp coordinate ``owners[i]``. Every rank passes the same stacks in order."""
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

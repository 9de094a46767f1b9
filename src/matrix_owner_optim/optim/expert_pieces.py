"""Where the optimizer state of an expert parallel stack lies, as one global tensor in pieces.

Under FSDP2 x expert parallel (torchtitan's MoE parallelize: a stack of expert matrices
``[E, out, in]`` on a 2D (efsdp, ep) mesh as ``(_StridedShard(0, sf=EP), Shard(0))``), ep
coordinate ``t`` holds experts ``torch.chunk`` piece ``t`` of ``E`` and one efsdp coordinate
``o_t`` owns them: it steps them and keeps their state (Muon's momentum, ``[E_t, ...]``). The
state of the whole stack is then ``E`` rows held by ``EP`` ranks, ``(o_t, t)`` holding rows
``[offset_t, offset_t + E_t)``: one ``OwnerShard(0, ranges)`` on a 1D mesh over every rank of
the 2D mesh (its flattening), the placement the owner layout already gives experts split between
owners. DCP then saves one chunk per ep coordinate under the parameter's name, and loads and
reshards it like any owner-layout tensor; ``full_tensor()`` gathers the ``E`` rows.

Built once, at construction: the owners ``o_t`` of the other ep coordinates are planned in their
own efsdp groups, so one ``all_gather_object`` over the ep group tells every rank all of them.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

from .. import comm
from ..owner_dtensor.placement import OwnerShard
from .mesh_slice import MeshSlice

__all__ = ["ExpertPieces", "expert_pieces"]


@dataclass(frozen=True)
class ExpertPieces:
    """An expert parallel stack's state layout: ``placement`` on ``mesh`` (1D, every rank of the
    2D mesh) for ``rows`` experts in all; this rank's ep coordinate holds ``[start, stop)``."""

    mesh: Any
    placement: OwnerShard
    rows: int
    start: int
    stop: int


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
) -> list[ExpertPieces]:
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
        out.append(ExpertPieces(flat, OwnerShard(0, ranges), rows, start, start + tp.sizes[tp.rank]))
    return out

"""Owner-layout tensors built from full tensors, in every layout the dispatch must handle.

The OpInfo suite (tests/test_owner_dtensor_opinfo.py) and the fidelity scenarios put the same
full tensor ``x`` (equal on every rank) into one of these layouts over the world group's 1D CPU
mesh, run an operator, and compare with the operator on ``x`` in one process. A layout is decided
by metadata only (shapes, the world size), never by values, so every rank builds the same
global tensor and no collective is needed to build it.

A *layout* names what each tensor argument of a call becomes, by its index among the call's
tensors (:func:`assign`):

* ``held0`` / ``held_last``: held whole by rank 0 / by the last rank (``OwnerDTensor.owned``;
  a 0-dim tensor becomes the holder's ``Partial`` value);
* ``rows``: ``torch.chunk``'s row blocks (``Shard(0)``, FSDP2's form);
* ``split``: several non-empty row ranges, not ``torch.chunk``'s and not in rank order
  (``OwnerShard(0, ranges)``, as split expert stacks are);
* ``replicated``: every rank holds ``x`` (parameters before the plan);
* ``mix_owners``: tensor ``i`` held by rank ``i % W`` (operands of different owners);
* ``mix_plain``: the first tensor held by the last rank, the others plain tensors (taken as
  replicated full values);
* ``mix_rows``: the first tensor in row blocks, the others held by rank 0.

A tensor a layout cannot describe falls back to one it can, documented in :func:`placement_for`
(a 0-dim tensor is never split: it is held; a tensor of fewer than two rows cannot have several
non-empty ranges: it is held).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch
import torch.distributed as dist

from matrix_owner_optim.owner_dtensor import OwnerDTensor, OwnerShard, mesh_of_group
from matrix_owner_optim.planning.metadata import chunk_row_range

__all__ = [
    "LAYOUTS",
    "MIXES",
    "Placed",
    "applicable",
    "assign",
    "build",
    "placement_for",
    "split_ranges",
    "world_mesh",
]

SINGLE = ("held0", "held_last", "rows", "split", "replicated")
MIXES = ("mix_owners", "mix_plain", "mix_rows")
LAYOUTS = SINGLE + MIXES


@dataclass(frozen=True)
class Placed:
    """How one tensor argument is laid out: ``kind`` is ``held`` (with ``owner``), ``rows``,
    ``split``, ``replicated`` or ``plain``."""

    kind: str
    owner: int = 0

    def __str__(self) -> str:
        return f"held{self.owner}" if self.kind == "held" else self.kind


def world_mesh() -> object:
    """The 1D CPU mesh over the world group that every test tensor lives on."""
    return mesh_of_group(dist.group.WORLD, "cpu")


def split_ranges(rows: int, world_size: int) -> tuple[tuple[int, int], ...]:
    """Row ranges, per rank, that tile ``rows`` with several non-empty pieces unlike
    ``torch.chunk``'s: the last rank takes the first rows, pieces of ``rows // W`` rows with
    the remainder on the first piece (rank ``W - 1``), so sizes and order both differ from
    ``Shard(0)``. With fewer rows than ranks the first ranks' pieces are empty."""
    base, extra = divmod(rows, world_size)
    sizes = [base + (extra if i == 0 else 0) for i in range(world_size)]  # piece i -> rank W-1-i
    ranges: list[tuple[int, int]] = [(0, 0)] * world_size
    start = 0
    for i, n in enumerate(sizes):
        rank = world_size - 1 - i
        ranges[rank] = (start, start + n)
        start += n
    # empty pieces sit at the end of the tensor (an empty range still needs a valid position)
    return tuple((a, b) if b > a else (rows, rows) for a, b in ranges)


def placement_for(layout: str, index: int, x: torch.Tensor, world_size: int) -> Placed:
    """The placement of the ``index``-th tensor argument ``x`` of a call under ``layout``.

    Fallbacks: ``rows`` / ``split`` / ``mix_rows`` of a 0-dim tensor hold it on the last rank;
    ``split`` of a tensor with fewer than two rows holds it on the last rank.
    """
    last = world_size - 1
    if layout == "held0":
        return Placed("held", 0)
    if layout == "held_last":
        return Placed("held", last)
    if layout == "replicated":
        return Placed("replicated")
    if layout == "rows":
        return Placed("rows") if x.dim() > 0 else Placed("held", last)
    if layout == "split":
        return Placed("split") if x.dim() > 0 and x.shape[0] >= 2 else Placed("held", last)
    if layout == "mix_owners":
        return Placed("held", index % world_size)
    if layout == "mix_plain":
        return Placed("held", last) if index == 0 else Placed("plain")
    if layout == "mix_rows":
        if index == 0:
            return Placed("rows") if x.dim() > 0 else Placed("held", last)
        return Placed("held", 0)
    raise ValueError(f"unknown layout {layout!r}; expected one of {LAYOUTS}")


def applicable(layout: str, tensors: Sequence[torch.Tensor]) -> bool:
    """Whether ``layout`` says something of its own for a call with these tensor arguments: the
    mixes need two tensors; ``rows`` / ``split`` need a first tensor they can cut."""
    if not tensors:
        return False
    if layout in MIXES:
        return len(tensors) >= 2
    first = tensors[0]
    if layout == "rows":
        return first.dim() > 0
    if layout == "split":
        return first.dim() > 0 and first.shape[0] >= 2
    return True


def build(x: torch.Tensor, placed: Placed, mesh: object | None = None) -> torch.Tensor:
    """``x`` (the same full tensor on every rank) as an owner-layout DTensor laid out as
    ``placed`` (``plain``: ``x`` itself). The piece is a copy: the DTensor never aliases ``x``."""
    mesh = world_mesh() if mesh is None else mesh
    me, W = mesh.get_local_rank(), mesh.size()  # type: ignore[attr-defined]
    x = x.detach()
    if placed.kind == "plain":
        return x.clone()
    if placed.kind == "replicated":
        return OwnerDTensor.replicated(x.clone(), mesh)
    if placed.kind == "held":
        piece = x.clone() if me == placed.owner or x.dim() == 0 else x.new_empty((0, *x.shape[1:]))
        return OwnerDTensor.owned(piece, placed.owner, mesh, tuple(x.shape))
    if placed.kind == "rows":
        a, b = chunk_row_range(int(x.shape[0]), W, me)
        return OwnerDTensor.rows(x[a:b].clone(), mesh, tuple(x.shape))
    if placed.kind == "split":
        ranges = split_ranges(int(x.shape[0]), W)
        a, b = ranges[me]
        return OwnerDTensor.make(x[a:b].clone(), mesh, OwnerShard(0, ranges), tuple(x.shape))
    raise ValueError(f"unknown placement kind {placed.kind!r}")


def assign(layout: str, tensors: Sequence[torch.Tensor], world_size: int) -> list[Placed]:
    """The placement of every tensor argument of a call under ``layout``, in order."""
    return [placement_for(layout, i, t, world_size) for i, t in enumerate(tensors)]

"""Which slice of a matrix a rank's coordinate on a parallel mesh axis holds, and the one
assembly of a matrix from its slices: one slice type for tensor and expert parallel, named by the
role of the axis (:class:`AxisKind`), for the stock path and the owner path alike.

A TP matrix's owners are one TP group; one padded all-gather over it (:func:`assemble`, a small
header of floats in front) gives each the whole matrix. An EP slice is whole matrices: stepped
where it lies, never assembled.
"""

from __future__ import annotations

import enum
import math
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import torch

from .. import comm

__all__ = ["AxisKind", "MeshSlice", "assemble", "message_sizes"]


class AxisKind(enum.Enum):
    """The role of the parallel mesh axis a matrix is sliced on."""

    TP = "tp"  # tensor parallel: a slice of each matrix's rows or columns, assembled to step
    EP = "ep"  # expert parallel: whole experts of a stack, stepped where they lie


@dataclass(frozen=True)
class MeshSlice:
    """Which slice of a matrix this rank's coordinate on a parallel axis holds.

    ``axis``: the axis's role; ``mesh_dim`` the mesh dim it is; ``dim`` the tensor dim it splits
    (TP: 0 colwise, 1 rowwise; EP: 0, the stack dim); ``sizes`` the extent along it of every
    coordinate's slice (``torch.chunk`` sizes); ``rank`` this rank's coordinate.
    """

    axis: AxisKind
    mesh_dim: int
    dim: int
    rank: int
    sizes: tuple[int, ...]

    @property
    def whole(self) -> bool:
        """Each slice is whole matrices (expert parallel): stepped with no collective."""
        return self.axis is AxisKind.EP

    @property
    def size(self) -> int:
        return len(self.sizes)

    def offset(self, t: int) -> int:
        return sum(self.sizes[:t])

    def shape(self, global_shape: tuple[int, ...], t: int) -> tuple[int, ...]:
        """The shape of coordinate ``t``'s slice of a matrix of ``global_shape``."""
        out = list(global_shape)
        out[self.dim] = self.sizes[t]
        return tuple(out)

    def narrow(self, full: torch.Tensor, t: int) -> torch.Tensor:
        """Coordinate ``t``'s slice of the whole matrix ``full`` (a view)."""
        return full.narrow(self.dim, self.offset(t), self.sizes[t])


def message_sizes(header: int, slices: Sequence[tuple[MeshSlice, tuple[int, ...]]]) -> list[int]:
    """Elements each TP rank sends: ``header`` floats plus its slice of every matrix
    (``slices``: each matrix's :class:`MeshSlice` and global shape)."""
    if not slices:
        return []
    return [header + sum(math.prod(tp.shape(shape, t)) for tp, shape in slices) for t in range(slices[0][0].size)]


def assemble(
    group: Any,
    header: list[float],
    slices: Sequence[tuple[MeshSlice, tuple[int, ...]]],
    mine: Sequence[torch.Tensor],
    *,
    dtype: torch.dtype,
    device: torch.device,
    op: str,
) -> tuple[list[list[float]], list[torch.Tensor]]:
    """The one TP assembly: all-gather ``header`` and this rank's TP slice of every matrix over
    the TP ``group`` and join the slices. ``slices[i]`` is matrix ``i``'s :class:`MeshSlice` and
    global shape, ``mine[i]`` this rank's slice of it (any layout, of the slice's shape). Returns
    every TP rank's header and each matrix whole (new storage)."""
    if not slices:
        raise ValueError("assemble needs at least one matrix")
    sizes = message_sizes(len(header), slices)
    width = max(sizes)
    me = slices[0][0].rank
    send = torch.zeros(width, dtype=dtype, device=device)
    send[: len(header)] = torch.tensor(header, dtype=dtype)
    at = len(header)
    for (tp, shape), piece in zip(slices, mine, strict=True):
        n = piece.numel()
        if tuple(piece.shape) != tp.shape(shape, me):
            raise AssertionError(f"TP slice of shape {tuple(piece.shape)}, expected {tp.shape(shape, me)}")
        send[at : at + n].view(piece.shape).copy_(piece)
        at += n
    recv = torch.empty(len(sizes) * width, dtype=dtype, device=device)
    comm.all_gather_into_tensor(recv, send, group=group, name=op)
    rows = recv.view(len(sizes), width)
    pieces: list[list[torch.Tensor]] = [[] for _ in slices]
    for t in range(len(sizes)):
        at = len(header)
        for i, (tp, shape) in enumerate(slices):
            s = tp.shape(shape, t)
            pieces[i].append(rows[t, at : at + math.prod(s)].view(s))
            at += math.prod(s)
    whole = [torch.cat(ps, dim=tp.dim) for ps, (tp, _) in zip(pieces, slices, strict=True)]
    return rows[:, : len(header)].tolist(), whole

"""Which slice of a matrix a rank's coordinate on a parallel mesh axis holds (one type for tensor
and expert parallel, named by the axis's :class:`AxisKind`), and the one TP assembly
(:func:`assemble`: a padded all-gather with a header of floats in front).
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
    """Which slice (tensor dim ``dim`` in ``torch.chunk`` ``sizes``) this rank's coordinate holds."""

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
    """Elements each TP rank sends: ``header`` floats plus its slice of every matrix."""
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
    """The one TP assembly: all-gather ``header`` and this rank's slice ``mine[i]`` of every matrix
    (``slices[i]``: its slice and global shape) over ``group``; returns every rank's header and
    each matrix whole."""
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

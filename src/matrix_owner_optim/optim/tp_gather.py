"""One all-gather over the tensor-parallel group: the owners of a matrix's TP slices assemble it.

Under FSDP2 x tensor parallel on a (dp, tp) mesh, every matrix has one owner per TP coordinate,
all at the same dp coordinate ``o``: ranks ``(o, 0) .. (o, T-1)``, which is exactly the TP group
of dp coordinate ``o``. Every member of that group therefore owns the same matrices, and one
all-gather over it gives each of them every other TP slice: the whole matrix, with no dp
traffic. A small header (floats) travels in front of each rank's slices. Slices are cut by
``torch.chunk`` and may differ in size between TP ranks; the all-gather is padded to the
largest rank's message (at most one row or column per matrix).
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import torch

from .. import comm
from .dtensor_sharding import TPSlice

__all__ = ["message_sizes", "all_gather_slices"]


def message_sizes(header: int, slices: Sequence[tuple[TPSlice, tuple[int, ...]]]) -> list[int]:
    """Elements each TP rank sends: ``header`` floats plus its slice of every matrix
    (``slices``: each matrix's :class:`TPSlice` and global shape)."""
    if not slices:
        return []
    T = slices[0][0].size
    sizes = []
    for t in range(T):
        n = header
        for tp, shape in slices:
            k = 1
            for d in tp.shape(shape, t):
                k *= int(d)
            n += k
        sizes.append(n)
    return sizes


def all_gather_slices(
    group: Any,
    header: list[float],
    slices: Sequence[tuple[TPSlice, tuple[int, ...]]],
    mine: Sequence[torch.Tensor],
    *,
    dtype: torch.dtype,
    device: torch.device,
    op: str,
) -> tuple[list[list[float]], list[list[torch.Tensor]]]:
    """All-gather ``header`` and this rank's TP slice of every matrix over the TP ``group``.

    ``slices[i]`` is matrix ``i``'s :class:`TPSlice` and global shape, ``mine[i]`` this rank's
    slice of it (any layout, of the slice's shape). Returns every TP rank's header and, per
    matrix, every TP rank's slice (views of one receive buffer, shaped as the slices).
    """
    if not slices:
        raise ValueError("all_gather_slices needs at least one matrix")
    sizes = message_sizes(len(header), slices)
    T = len(sizes)
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
    recv = torch.empty(T * width, dtype=dtype, device=device)
    comm.all_gather_into_tensor(recv, send, group=group, name=op)
    rows = recv.view(T, width)
    headers = rows[:, : len(header)].tolist()
    pieces: list[list[torch.Tensor]] = [[] for _ in slices]
    for t in range(T):
        at = len(header)
        for i, (tp, shape) in enumerate(slices):
            s = tp.shape(shape, t)
            n = 1
            for d in s:
                n *= int(d)
            pieces[i].append(rows[t, at : at + n].view(s))
            at += n
    return headers, pieces

"""The placements of the owner layout: ``OwnerShard``, a ``Shard(0)`` with explicit row ranges
(DESIGN.md, "The representation"), and the layout comparisons and gathers built on them.
"""

from __future__ import annotations

import collections
import operator
from collections.abc import Sequence
from itertools import chain
from operator import itemgetter
from typing import Any

import torch
import torch.distributed as dist
from torch.distributed.tensor import Shard

from .. import comm

__all__ = [
    "MeshTable",
    "interned",
    "OwnerShard",
    "as_bytes",
    "contiguous_stride",
    "gather_ranges",
    "owned_ranges",
    "placement_key",
    "same_layout",
    "same_placement",
    "spec_for",
    "spec_piece",
]


def contiguous_stride(shape: Sequence[int]) -> tuple[int, ...]:
    stride, acc = [], 1
    for s in reversed(tuple(shape)):
        stride.append(acc)
        acc *= max(int(s), 1)
    return tuple(reversed(stride))


def owned_ranges(rows: int, owner: int, world_size: int) -> tuple[tuple[int, int], ...]:
    """Row ranges of a tensor of ``rows`` rows held whole by ``owner``."""
    ranges = [(rows, rows)] * world_size  # one list multiply, not a Python loop over ranks
    ranges[owner] = (0, rows)
    return tuple(ranges)


class OwnerShard(Shard):
    """``Shard(dim)`` whose piece on mesh rank ``r`` is rows ``ranges[r]`` (``[start, stop)``).

    Pieces are contiguous row ranges that tile the dimension; they need not follow rank order
    nor ``torch.chunk``'s sizes. The tensor held whole by one owner is the common case.
    """

    ranges: tuple[tuple[int, int], ...]

    def __init__(self, dim: int, ranges: Sequence[tuple[int, int]]) -> None:
        super().__init__(dim)
        pairs = tuple(ranges)
        # (int, int) pairs as given are kept (checked in C loops: W ranges per tensor); others
        # are converted
        if (
            set(map(type, pairs)) - {tuple}
            or set(map(len, pairs)) - {2}
            or set(map(type, chain.from_iterable(pairs))) - {int}
        ):
            pairs = tuple((int(a), int(b)) for a, b in pairs)
        object.__setattr__(self, "ranges", pairs)

    @property
    def holder(self) -> int | None:
        """The one rank holding every row, or None when rows are split over several ranks."""
        starts = list(map(itemgetter(0), self.ranges))
        full = list(map(operator.lt, starts, map(itemgetter(1), self.ranges)))
        held = full.count(True)
        if held == 1:
            return full.index(True)
        if not held:  # zero rows: the owner is recorded as the rank whose range starts at 0
            return starts.index(0) if 0 in starts else 0
        return None

    def __eq__(self, other: object) -> bool:
        """Two owner placements are equal when their pieces are (ranges included). Against a
        plain ``Shard`` equality stays Shard's, by dim: DTensorSpec verifies its shard order
        with ``placements[d] != Shard(dim)``."""
        if isinstance(other, OwnerShard):
            return self.dim == other.dim and self.ranges == other.ranges
        return bool(super().__eq__(other))

    def __hash__(self) -> int:
        """By dim and ranges, never a ``Shard``'s hash: DTensor's sharding-propagation caches
        key on specs, and a cached answer for one placement must not be handed to a call on
        another (rows held by rank 1 are not rows held by rank 0, nor FSDP2's even rows)."""
        return hash((OwnerShard, self.dim, self.ranges))

    def __repr__(self) -> str:
        return f"OwnerShard(dim={self.dim}, ranges={self.ranges})"

    def __str__(self) -> str:
        h = self.holder
        return f"O({h})" if h is not None else f"OS({self.dim})"

    def __reduce__(self) -> Any:
        return (OwnerShard, (self.dim, self.ranges))

    def _local_shard_size_and_offset(self, curr_local_size: int, num_chunks: int, rank: Any) -> tuple[int, int]:
        a, b = self.ranges[int(rank)]
        return b - a, a

    def _split_tensor(
        self, tensor: torch.Tensor, num_chunks: int, *, with_padding: bool = True, contiguous: bool = True
    ) -> tuple[list[torch.Tensor], list[int]]:
        if with_padding:
            raise NotImplementedError(
                "OwnerShard pieces are uneven by design: wrap this rank's rows (OwnerShard.ranges) with "
                "OwnerDTensor.make instead of distribute_tensor / scatter"
            )
        pieces = [tensor.narrow(self.dim, a, b - a) for a, b in self.ranges]
        return [p.contiguous() if contiguous else p for p in pieces], [0] * len(pieces)

    def _replicate_to_shard(
        self, local_tensor: torch.Tensor, mesh: Any, mesh_dim: int, shard_index: Any
    ) -> torch.Tensor:
        a, b = self.ranges[int(shard_index)]
        return local_tensor.narrow(self.dim, a, b - a).clone()

    def _to_replicate_tensor(
        self,
        local_tensor: torch.Tensor,
        mesh: Any,
        mesh_dim: int,
        current_logical_shape: Sequence[int],  # type: ignore[override]
    ) -> torch.Tensor:
        return gather_ranges(local_tensor, self, tuple(current_logical_shape), mesh.get_group(mesh_dim))


def same_placement(a: Any, b: Any) -> bool:
    """Whether two placements describe the same pieces (ranges included)."""
    if type(a) is not type(b):
        return False
    if isinstance(a, OwnerShard):
        return a.dim == b.dim and a.ranges == b.ranges
    return bool(a == b)


def same_layout(a: Any, b: Any, holders: bool = True) -> bool:
    """Whether two DTensors are pieces of one layout: mesh, shape, placements (ranges included:
    an ``OwnerShard`` compares equal to a ``Shard`` of its dim for DTensorSpec's sake, but
    ``torch.chunk``'s rows are another layout) and (``holders``) the holder of a held value."""
    return (
        a.device_mesh == b.device_mesh
        and tuple(a.shape) == tuple(b.shape)
        and len(a.placements) == len(b.placements)
        and all(same_placement(x, y) for x, y in zip(a.placements, b.placements, strict=True))
        and (not holders or getattr(a, "_holder", None) == getattr(b, "_holder", None))
    )


class MeshTable(dict):
    """A table a mesh keeps in its own ``__dict__`` (recorded decisions, interned specs); a mesh
    pickled or deep-copied takes an empty OrderedDict from the standard library instead (the
    entries are this process's; ``weights_only`` loads accept it)."""

    def __reduce__(self) -> Any:
        return (collections.OrderedDict, ())


_SPECS = "_owner_layout_specs"  # the attribute a mesh keeps its interned specs in
_SPEC_LIMIT = 4096  # distinct specs per mesh before the table starts over (shapes in a model are few)


def interned(spec: Any) -> Any:
    """The one object of ``spec``'s value on its mesh: tensors of one layout share their spec,
    so a recorded decision's key matches by identity (``DTensorSpec.__eq__`` is Python and
    compares mesh, placements and metadata: microseconds per lookup otherwise)."""
    table = spec.mesh.__dict__.get(_SPECS)
    if table is None or len(table) >= _SPEC_LIMIT:
        table = spec.mesh.__dict__[_SPECS] = MeshTable()
    return table.setdefault(spec, spec)


def spec_for(spec: Any, dtype: torch.dtype) -> Any:
    """``spec`` (contiguous) for a piece of ``dtype``: the spec itself (specs are immutable) where
    the dtype is its own and its strides are contiguous, else a new one with contiguous strides."""
    from torch.distributed.tensor._dtensor_spec import DTensorSpec, TensorMeta

    meta = spec.tensor_meta
    if meta.dtype == dtype and tuple(meta.stride) == contiguous_stride(meta.shape):
        return spec
    return interned(
        DTensorSpec(
            spec.mesh, spec.placements, tensor_meta=TensorMeta(meta.shape, contiguous_stride(meta.shape), dtype)
        )
    )


def placement_key(p: Any) -> Any:
    return (
        type(p),
        getattr(p, "dim", None),
        getattr(p, "ranges", None),
        getattr(p, "reduce_op", None),
        getattr(p, "norm_type", None),
    )


def as_bytes(t: torch.Tensor) -> torch.Tensor:
    """``t``'s storage as a flat ``uint8`` tensor: gloo has no int16, uint16-64 or complex, so the
    layout's gathers move bytes, whatever the dtype (no copy when ``t`` is contiguous)."""
    if t.numel() == 0:
        return torch.empty(0, dtype=torch.uint8, device=t.device)
    flat = torch.as_strided(t.contiguous(), (t.numel(),), (1,))  # size-1 dims may keep any stride
    return flat.view(torch.uint8)


def gather_ranges(local: torch.Tensor, placement: OwnerShard, shape: tuple[int, ...], group: Any) -> torch.Tensor:
    """The full tensor, in new storage, from every rank's row range (one broadcast when one rank
    holds it all); moved as bytes, so every dtype travels."""
    holder = placement.holder
    rank = dist.get_rank(group)
    full = torch.empty(shape, dtype=local.dtype, device=local.device)
    if holder is not None:
        if rank == holder:  # new storage on the holder too: the result never aliases the piece
            full.copy_(local)
        comm.broadcast(as_bytes(full), group_src=holder, group=group, name="owner_full_tensor")
        return full
    row = local.element_size()
    for s in shape[1:]:
        row *= int(s)
    sizes = [(b - a) * row for a, b in placement.ranges]
    recv = torch.empty(sum(sizes), dtype=torch.uint8, device=local.device)
    send = as_bytes(local)
    world = len(sizes)
    comm.all_to_all_single(
        recv,
        send.repeat(world) if send.numel() else send,
        output_split_sizes=sizes,
        input_split_sizes=[send.numel()] * world,
        group=group,
        op="owner_full_tensor",
    )
    flat = as_bytes(full)
    offset = 0
    for (a, b), n in zip(placement.ranges, sizes, strict=True):
        flat[a * row : b * row].copy_(recv[offset : offset + n])
        offset += n
    return full


def spec_piece(full: torch.Tensor, t: Any) -> torch.Tensor:
    """This rank's piece of ``full`` (the whole value of DTensor ``t``), cut where
    ``compute_local_shape_and_global_offset`` cuts ``t`` (DCP's view: ranges of an
    ``OwnerShard`` included, the TP slice of a 2D owner-layout tensor); a view, no copy."""
    from torch.distributed.tensor._utils import compute_local_shape_and_global_offset

    shape, offset = compute_local_shape_and_global_offset(t.shape, t.device_mesh, t.placements)
    return full[tuple(slice(o, o + n) for o, n in zip(offset, shape, strict=True))]

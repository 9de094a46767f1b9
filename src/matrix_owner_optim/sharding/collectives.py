"""Owner-segment collectives: one all-gather-v and one reduce-scatter-v per unit, unpadded
(uneven-list NCCL collectives, else one ``all_to_all_single``; DESIGN.md, "Collectives and bytes").
"""

from __future__ import annotations

import math
import operator
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from itertools import repeat
from operator import itemgetter
from typing import Any, overload

import torch
import torch.distributed as dist

from .. import comm
from ..planning.metadata import MatrixShard

__all__ = [
    "SegmentEntry",
    "SegmentLayout",
    "PendingGather",
    "all_gather_v",
    "gradient_divide_factors",
    "others_first_offsets",
    "PendingReduce",
    "reduce_scatter_v",
    "uses_nccl",
]


@dataclass(frozen=True)
class SegmentEntry:
    """One tensor (or row block) inside one rank's segment."""

    index: int  # position of the parameter in its unit
    offset: int  # element offset inside the rank's segment
    length: int  # elements
    rows: tuple[int, int] | None = None  # row range for ``rows`` tensors; None: whole tensor


class _RankEntries(Sequence[tuple[SegmentEntry, ...]]):
    """Every rank's entries of a :class:`SegmentLayout`, each rank's built when first read."""

    def __init__(self, owned: list[list[tuple[int, int]]], rows: list[tuple[int, list[tuple[int, int]], int]]) -> None:
        self._owned = owned  # per rank: (index, elements) of the tensors it owns, model order
        self._rows = rows  # per rows tensor: (index, every rank's row range, elements per row)
        self._built: dict[int, tuple[SegmentEntry, ...]] = {}

    def __len__(self) -> int:
        return len(self._owned)

    @overload
    def __getitem__(self, rank: int) -> tuple[SegmentEntry, ...]: ...

    @overload
    def __getitem__(self, rank: slice) -> list[tuple[SegmentEntry, ...]]: ...

    def __getitem__(self, rank: int | slice) -> tuple[SegmentEntry, ...] | list[tuple[SegmentEntry, ...]]:
        if isinstance(rank, slice):
            return [self[r] for r in range(len(self))[rank]]
        r = range(len(self))[rank]  # negative ranks as a tuple reads them; IndexError outside
        built = self._built.get(r)
        if built is None:
            out, at = [], 0
            for index, n in self._owned[r]:
                out.append(SegmentEntry(index, at, n))
                at += n
            for index, ranges, per_row in self._rows:
                start, stop = ranges[r]
                n = (stop - start) * per_row
                out.append(SegmentEntry(index, at, n, (start, stop)))
                at += n
            built = self._built[r] = tuple(out)
        return built


@dataclass(frozen=True)
class SegmentLayout:
    """Where every rank's segment of a unit puts each tensor (the same on every rank)."""

    world_size: int
    entries: Sequence[tuple[SegmentEntry, ...]]  # per rank
    sizes: tuple[int, ...]  # elements per rank

    @property
    def total(self) -> int:
        return sum(self.sizes)

    @classmethod
    def build(
        cls, shards: Sequence[MatrixShard], world_size: int, include: Callable[[MatrixShard], bool] = lambda s: True
    ) -> SegmentLayout:
        """Owned tensors first (model order), then row blocks of ``rows`` tensors; linear in the tensors."""
        owned: list[list[tuple[int, int]]] = [[] for _ in range(world_size)]
        cursor = [0] * world_size
        for i, s in enumerate(shards):
            if include(s) and not s.holds_rows:
                if s.owner is None or not 0 <= s.owner < world_size:
                    raise ValueError(f"parameter {s.fqn!r} has owner {s.owner!r} outside world size {world_size}")
                owned[s.owner].append((i, s.numel))
                cursor[s.owner] += s.numel
        rows: list[tuple[int, list[tuple[int, int]], int]] = []
        for i, s in enumerate(shards):
            if include(s) and s.holds_rows:
                per_row = math.prod(int(d) for d in s.shape[1:])  # elements of one row
                ranges = s.row_ranges()
                rows.append((i, ranges, per_row))
                lengths = map(operator.sub, map(itemgetter(1), ranges), map(itemgetter(0), ranges))
                cursor = list(map(operator.add, cursor, map(operator.mul, lengths, repeat(per_row))))
        return cls(world_size, _RankEntries(owned, rows), tuple(cursor))


def uses_nccl(group: Any, device: torch.device) -> bool:
    """True when the uneven-list NCCL collectives apply (CUDA tensors, NCCL backend)."""
    if device.type != "cuda":
        return False
    return "nccl" in str(dist.get_backend(group)).lower()


class PendingGather:
    """An issued all-gather-v: :meth:`wait` returns one 1D tensor per rank."""

    def __init__(self, work: Any, parts: list[torch.Tensor], keep: tuple = ()) -> None:
        self._work = work
        self._parts = parts
        self._keep = keep  # send buffers must outlive the collective

    def wait(self) -> list[torch.Tensor]:
        if self._work is not None:
            self._work.wait()
            self._work = None
            self._keep = ()
        return self._parts


def all_gather_v(
    send: torch.Tensor, sizes: Sequence[int], rank: int, group: Any, async_op: bool = False
) -> list[torch.Tensor] | PendingGather:
    """Gather every rank's segment (one 1D tensor per rank), or a :class:`PendingGather`."""
    W = len(sizes)
    if send.numel() != sizes[rank]:
        raise RuntimeError(f"segment of rank {rank} has {send.numel()} elements, layout says {sizes[rank]}")
    if W == 1 or sum(sizes) == 0:
        parts = [send if r == rank else send.new_empty(0) for r in range(W)]
        return PendingGather(None, parts) if async_op else parts
    if uses_nccl(group, send.device):
        flat = torch.empty(sum(sizes), dtype=send.dtype, device=send.device)
        outs = list(flat.split(list(sizes)))
        work = comm.all_gather(outs, send, group=group, name="all_gather_v", async_op=async_op)
        parts = list(outs)
        parts[rank] = send
        return PendingGather(work, parts, (send, outs)) if async_op else parts
    in_splits = [0 if r == rank else sizes[rank] for r in range(W)]
    out_splits = [0 if r == rank else sizes[r] for r in range(W)]
    inp = send.repeat(W - 1) if sizes[rank] else send
    out = torch.empty(sum(out_splits), dtype=send.dtype, device=send.device)
    work = comm.all_to_all_single(
        out,
        inp,
        output_split_sizes=out_splits,
        input_split_sizes=in_splits,
        group=group,
        op="all_gather_v",
        async_op=async_op,
    )
    parts = list(out.split(out_splits))
    parts[rank] = send
    return PendingGather(work, parts, (inp, out)) if async_op else parts


def others_first_offsets(sizes: Sequence[int], rank: int) -> list[int]:
    """Where each rank's segment starts in a reduce buffer laid out *others first* (own last)."""
    offsets, cursor = [0] * len(sizes), 0
    for r, n in enumerate(sizes):
        if r != rank:
            offsets[r] = cursor
            cursor += n
    offsets[rank] = cursor
    return offsets


def gradient_divide_factors(
    reduce_dtype: torch.dtype, data_parallel_size: int, factor: float | None = None
) -> tuple[float, float]:
    """``(pre, post)`` divisors around the sum over ranks, whose product is ``factor`` (FSDP2's
    rule; DESIGN.md, "The lifecycle of a unit")."""
    if factor is None:
        factor = float(data_parallel_size)
    if factor <= 0 or not math.isfinite(factor):
        raise ValueError(f"gradient divide factor must be a positive finite number, got {factor}")
    if not reduce_dtype.is_floating_point or torch.finfo(reduce_dtype).max >= torch.finfo(torch.bfloat16).max:
        return 1.0, float(factor)
    pre = 1
    while factor % pre == 0 and factor / pre > pre:
        pre *= 2
    return float(pre), factor / pre


class PendingReduce:
    """An issued reduce-scatter-v: :meth:`wait` returns this rank's summed segment."""

    def __init__(
        self, work: Any, flat: torch.Tensor, out: torch.Tensor, finish: Callable[[torch.Tensor], torch.Tensor]
    ) -> None:
        self._work = work
        self._flat: torch.Tensor | None = flat
        self._out = out
        self._finish = finish

    def wait(self) -> torch.Tensor:
        if self._work is not None:
            self._work.wait()
            self._work = None
        self._flat = None
        return self._finish(self._out)


def reduce_scatter_v(
    flat: torch.Tensor,
    sizes: Sequence[int],
    rank: int,
    group: Any,
    async_op: bool = False,
    op: str = "reduce_scatter_v",
) -> torch.Tensor | PendingReduce:
    """This rank's segment summed over ranks in rank order (``flat`` laid out
    :func:`others_first_offsets`), or with ``async_op=True`` a :class:`PendingReduce`."""
    W = len(sizes)
    own_n = sizes[rank]
    others_n = flat.numel() - own_n
    own = flat[others_n:]
    pending: PendingReduce
    if W == 1 or flat.numel() == 0:
        pending = PendingReduce(None, flat, own, lambda out: out)
    elif uses_nccl(group, flat.device):
        offsets = others_first_offsets(sizes, rank)
        chunks = [flat[offsets[r] : offsets[r] + sizes[r]] for r in range(W)]
        out = torch.empty_like(own)
        work = comm.reduce_scatter(out, chunks, op=dist.ReduceOp.SUM, group=group, name=op, async_op=async_op)
        pending = PendingReduce(work, flat, out, lambda out: out)
    else:
        in_splits = [0 if r == rank else sizes[r] for r in range(W)]
        out_splits = [0 if r == rank else own_n for r in range(W)]
        out = flat.new_empty(sum(out_splits))
        work = comm.all_to_all_single(
            out,
            flat[:others_n],
            output_split_sizes=out_splits,
            input_split_sizes=in_splits,
            group=group,
            op=op,
            async_op=async_op,
        )

        def rank_order_sum(out: torch.Tensor) -> torch.Tensor:
            received = out.split(out_splits)
            parts = [own if r == rank else received[r] for r in range(W)]
            total = parts[0].clone()
            for part in parts[1:]:  # rank order: the same summation order whoever owns the segment
                total += part
            return total

        pending = PendingReduce(work, flat, out, rank_order_sum)
    return pending if async_op else pending.wait()

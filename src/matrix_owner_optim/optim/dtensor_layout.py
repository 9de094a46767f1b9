"""Stock FSDP2 / HSDP parameters (DTensor ``Shard(0)``): each matrix updated whole by its owner.

One ``all_to_all_single`` per (shard group, dtype) sends gradient rows to each matrix's owner,
which steps its full copy (the *proxy*), and one sends the updated rows back; tail tensors step
shard-locally. Under TP, :func:`.mesh_slice.assemble` joins the slices (DESIGN.md, "FSDP2 x
tensor parallel on stock FSDP2").
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Any, cast

import torch
from torch.distributed.tensor import DTensor

from .. import comm
from ..agreement import STEP_DIGITS, check_header_steps, step_digits
from ..owner_dtensor import mesh_of_group
from ..planning import Role
from ..planning.cost import itemsize
from ..planning.metadata import chunk_row_sizes
from ..tensors import local_tensor
from .dtensor_sharding import matrix_sharding
from .expert_pieces import expert_pieces
from .layouts import LayoutConfig, UpdateLayout
from .mesh_slice import MeshSlice, assemble, message_sizes
from .replicated_layout import plan_owners
from .routing import RoutedParam
from .state_place import RowPieces, StatePlace

__all__ = ["DTensorLayout"]


def _alias(t: torch.Tensor) -> torch.Tensor:
    """A new leaf tensor object sharing ``t``'s storage (re-pointable with ``set_``)."""
    return torch.empty(0, dtype=t.dtype, device=t.device).set_(
        t.untyped_storage(), t.storage_offset(), t.size(), t.stride()
    )


def _same_view(a: torch.Tensor, b: torch.Tensor) -> bool:
    return (
        a.untyped_storage().data_ptr() == b.untyped_storage().data_ptr()
        and a.storage_offset() == b.storage_offset()
        and a.size() == b.size()
        and a.stride() == b.stride()
        and a.dtype == b.dtype
    )


def _key(p: torch.Tensor) -> tuple[int, int, tuple[int, ...], int, int]:
    """What identifies a DTensor's local shard content as of our last write: storage, offset,
    shape, and the version counters of the local tensor and of the DTensor (in-place ops on the
    DTensor, e.g. ``model.load_state_dict``, leave the local one alone)."""
    t = local_tensor(p)
    return (
        t.untyped_storage().data_ptr(),
        int(t.storage_offset()),
        tuple(int(n) for n in t.shape),
        t._version,
        p._version,
    )


def _local_grad(rp: RoutedParam) -> torch.Tensor | None:
    g = rp.param.grad
    if g is None:
        return None
    if isinstance(g, DTensor):
        expected = tuple(rp.param.placements)  # type: ignore[attr-defined]
        if tuple(g.placements) != expected:
            raise ValueError(
                f"gradient of {rp.label!r} has placements {tuple(g.placements)} but the parameter "
                f"has {expected}; expected FSDP2's reduced Shard(0) gradient"
            )
        return local_tensor(g)
    raise ValueError(f"gradient of DTensor parameter {rp.label!r} is a plain tensor; expected a DTensor")


@dataclass(eq=False)
class _Matrix:
    rp: RoutedParam
    rows: list[int]  # rows of this rank's slice (the whole matrix without TP) held by each rank of the shard group
    row_numel: int
    owner: int
    tp: MeshSlice | None = None  # the TP slice this rank's shard group splits by rows (tensor parallel)
    full: torch.Tensor | None = None  # the owner's full copy (global shape)
    key: tuple | None = None  # _key of the local shard after our last write

    @property
    def local(self) -> torch.Tensor:
        return local_tensor(self.rp.param)  # read fresh: FSDP2 may re-point it (lazy init, _apply)

    @property
    def shape(self) -> tuple[int, ...]:
        return tuple(int(n) for n in self.rp.param.shape)

    def numel_of(self, rank: int) -> int:
        return self.rows[rank] * self.row_numel

    def owner_slice(self) -> torch.Tensor:
        """The owner's copy of what its shard group splits by rows: the matrix, or its TP slice."""
        assert self.full is not None
        if self.tp is None:
            return self.full
        return self.tp.narrow(self.full, self.tp.rank).contiguous()


def _stepped_shape(rp: RoutedParam) -> tuple[int, ...]:
    """The shape an owner steps: the global shape, or an expert parallel slice (``rp.step_shape``)."""
    return rp.step_shape if rp.step_shape is not None else tuple(int(n) for n in rp.param.shape)


def _tp_slices(mats: list[_Matrix]) -> list[tuple[MeshSlice, tuple[int, ...]]]:
    """Each TP matrix's slice and global shape (what :func:`~.mesh_slice.assemble` takes)."""
    return [(cast(MeshSlice, m.tp), m.shape) for m in mats]


@dataclass(eq=False)
class _Bucket:
    """The matrices of one shard group and dtype: two all-to-alls per step."""

    group: Any
    rank: int
    world_size: int
    dtype: torch.dtype
    device: torch.device
    mats: list[_Matrix] = field(default_factory=list)
    loads: list[int] = field(default_factory=list)
    tp_group: Any = None  # tensor parallel: the TP group, whose members own the same matrices

    def rebuild(self) -> None:
        W, me = self.world_size, self.rank
        self.by_owner = [[m for m in self.mats if m.owner == d] for d in range(W)]
        self.mine = self.by_owner[me]
        # gradient all-to-all: header [dirty, has_grad per destination's matrix] + row blocks
        self.grad_send = [1 + len(self.by_owner[d]) + sum(m.numel_of(me) for m in self.by_owner[d]) for d in range(W)]
        self.grad_recv = [1 + len(self.mine) + sum(m.numel_of(s) for m in self.mine) for s in range(W)]
        # parameter resync and write-back: row blocks only
        self.param_send = [sum(m.numel_of(me) for m in self.by_owner[d]) for d in range(W)]
        self.param_recv = [sum(m.numel_of(s) for m in self.mine) for s in range(W)]


class DTensorLayout(UpdateLayout):
    """DTensor parameters (stock FSDP2, HSDP): owner-routed matrices, shard-local tail."""

    name = "dtensor"

    def __init__(self, config: LayoutConfig | None = None) -> None:
        super().__init__(config)
        self._buckets: dict[tuple[Any, int, int | None, torch.dtype], _Bucket] = {}
        self._tails: list[RoutedParam] = []  # updated shard-locally (proxy aliases the local shard)
        self.resyncs = 0  # how many times owner copies were (re)built from the shards
        self.steps = 0  # before_step calls: the TP assembly checks every owner is at the same one
        self._group_of: dict[int, Any] = {}  # id(matrix RoutedParam) -> its shard group
        self._experts: dict[int, RowPieces] = {}  # id(expert parallel stack) -> its state's pieces
        self._unplaced: list[tuple[Any, list[tuple[RoutedParam, MeshSlice, int]]]] = []  # stacks for agree()

    # -- construction ----------------------------------------------------------------------
    def add(self, entries: list[RoutedParam]) -> None:
        new: dict[tuple[Any, int, int | None, torch.dtype], list[RoutedParam]] = {}
        tp_of: dict[int, MeshSlice | None] = {}
        ep_of: dict[int, MeshSlice] = {}  # expert parallel stacks: their split over ep
        for rp in entries:
            self.entries.append(rp)
            p = rp.param
            sharding = matrix_sharding(rp) if rp.role is Role.MATRIX else None
            if sharding is None or sharding.dp_dim is None:
                # shard-local (elementwise tail optimizer) or a fully replicated matrix
                rp.owner = None
                local = local_tensor(p)
                rp.proxy = _alias(local) if local.numel() > 0 else None
                if rp.proxy is not None and rp.role is Role.MATRIX and rp.proxy.dim() > 2:
                    raise ValueError(f"replicated DTensor matrix {rp.label!r} must be 2D, got {tuple(p.shape)}")
                self._tails.append(rp)
                continue
            # expert parallel: this rank's experts are a stack of their own, no tp stage
            tp_of[id(rp)] = None if sharding.tp is None or sharding.tp.whole else sharding.tp
            if sharding.tp is not None and sharding.tp.whole:
                rp.step_shape = sharding.tp.shape(tuple(int(n) for n in p.shape), sharding.tp.rank)
                ep_of[id(rp)] = sharding.tp
            tp_dim = None if sharding.tp is None or sharding.tp.whole else sharding.tp.mesh_dim
            key = (p.device_mesh, sharding.dp_dim, tp_dim, p.dtype)  # type: ignore[attr-defined]
            new.setdefault(key, []).append(rp)
        for key, rps in new.items():
            mesh, mesh_dim, tp_dim, dtype = key
            bucket = self._buckets.get(key)
            if bucket is None:
                W = mesh.size(mesh_dim)
                bucket = _Bucket(
                    mesh.get_group(mesh_dim),
                    mesh.get_local_rank(mesh_dim),
                    W,
                    dtype,
                    rps[0].param.device,
                    loads=[0] * W,
                    tp_group=None if tp_dim is None else mesh.get_group(tp_dim),
                )
                self._buckets[key] = bucket
            W, me = bucket.world_size, bucket.rank
            # owners are dp coordinates, planned on global shapes: every TP rank plans the same
            # list, so the owners of one matrix's TP slices share a dp coordinate (one TP group)
            shapes = [_stepped_shape(rp) for rp in rps]
            owners, plan = plan_owners(rps, shapes, [dtype] * len(rps), W, bucket.loads, cost=self.config.matrix_cost)
            self.unagreed.append((plan, bucket.group, bucket.tp_group))
            for rp, owner, shape in zip(rps, owners, shapes, strict=True):
                tp = tp_of[id(rp)]
                piece = shape if tp is None else tp.shape(shape, tp.rank)  # what the shard group splits
                rows = chunk_row_sizes(piece[0], W)
                local = local_tensor(rp.param)
                if local.shape[0] != rows[me] or tuple(local.shape[1:]) != piece[1:]:
                    what = "" if tp is None else f" of the TP slice {piece}"
                    raise ValueError(
                        f"matrix {rp.label!r}: local shard has shape {tuple(local.shape)}, expected "
                        f"{(rows[me], *piece[1:])} (torch.chunk rows{what} of {shape} over {W} ranks)"
                    )
                m = _Matrix(rp, rows, math.prod(piece[1:]), owner, tp)
                rp.owner = owner
                self._group_of[id(rp)] = bucket.group
                if owner == me:
                    m.full = torch.zeros(shape, dtype=dtype, device=local.device)
                    rp.proxy = m.full if len(shape) == 2 else m.full.view(shape[0], -1)
                else:
                    rp.proxy = None
                bucket.mats.append(m)
            bucket.rebuild()
            stacks = [(rp, ep_of[id(rp)], owner) for rp, owner in zip(rps, owners, strict=True) if id(rp) in ep_of]
            if stacks:  # where their state lies over every ep coordinate: exchanged in agree()
                self._unplaced.append((mesh, stacks))

    def agree(self) -> None:
        """The base's check, then where each expert parallel stack's state lies (collective over ep)."""
        super().agree()
        for mesh, stacks in self._unplaced:
            places = expert_pieces(
                mesh, [s for _, s, _ in stacks], [o for *_, o in stacks], [rp.label for rp, *_ in stacks]
            )
            for (rp, *_), where in zip(stacks, places, strict=True):
                self._experts[id(rp)] = where
        self._unplaced = []

    # -- the step ----------------------------------------------------------------------------------
    def before_step(self) -> None:
        self.steps += 1
        for rp in self._tails:
            if rp.proxy is None:
                continue
            local = local_tensor(rp.param)
            if not _same_view(rp.proxy, local):  # FSDP2 re-pointed the shard (lazy init, _apply)
                rp.proxy.set_(local.untyped_storage(), local.storage_offset(), local.size(), local.stride())
            g = _local_grad(rp)
            rp.proxy.grad = None if g is None else g
        for bucket in self._buckets.values():
            if bucket.mats:
                self._gather_grads(bucket)

    def _gather_grads(self, b: _Bucket) -> None:
        W = b.world_size
        dirty = any(m.key != _key(m.rp.param) for m in b.mats)
        parts: list[torch.Tensor] = []
        for d in range(W):
            ms = b.by_owner[d]
            grads = [_local_grad(m.rp) for m in ms]
            parts.append(
                torch.tensor([float(dirty)] + [float(g is not None) for g in grads], dtype=b.dtype, device=b.device)
            )
            for m, g in zip(ms, grads, strict=True):
                if g is None:
                    parts.append(torch.zeros(m.numel_of(b.rank), dtype=b.dtype, device=b.device))
                else:
                    parts.append(g.reshape(-1).to(b.dtype))
        send = torch.cat(parts)
        recv = torch.empty(sum(b.grad_recv), dtype=b.dtype, device=b.device)
        comm.all_to_all_single(recv, send, b.grad_recv, b.grad_send, group=b.group, op="owner_grad_all_to_all")
        chunks = recv.split(b.grad_recv)
        hlen = 1 + len(b.mine)
        headers = torch.stack([c[:hlen] for c in chunks]).tolist()
        any_dirty = any(h[0] != 0 for h in headers)
        blocks = [c[hlen:].split([m.numel_of(s) for m in b.mine]) for s, c in enumerate(chunks)]
        whole: list[torch.Tensor | None] = [
            torch.cat([blocks[s][i] for s in range(W)]) if any(h[1 + i] != 0 for h in headers) else None
            for i in range(len(b.mine))
        ]
        tp_dirty = False
        if b.tp_group is not None and b.mine:
            whole, tp_dirty = self._assemble_tp_grads(b, whole, any_dirty)
        for m, g in zip(b.mine, whole, strict=True):
            assert m.rp.proxy is not None
            m.rp.proxy.grad = None if g is None else g.view(m.rp.proxy.shape)
        if any_dirty or tp_dirty:
            self._resync(b, dp=any_dirty, tp=tp_dirty)

    def _assemble_tp_grads(
        self, b: _Bucket, grads: list[torch.Tensor | None], dirty: bool
    ) -> tuple[list[torch.Tensor | None], bool]:
        """Tensor parallel: one all-gather over the TP group gives each owner the whole gradient."""
        slices = _tp_slices(b.mine)
        mine = []
        for m, g in zip(b.mine, grads, strict=True):
            assert m.tp is not None
            shape = m.tp.shape(m.shape, m.tp.rank)
            mine.append(torch.zeros(shape, dtype=b.dtype, device=b.device) if g is None else g.view(shape))
        header = [float(dirty)] + [float(g is not None) for g in grads] + step_digits(self.steps)
        headers, full = assemble(
            b.tp_group, header, slices, mine, dtype=b.dtype, device=b.device, op="owner_grad_tp_all_gather"
        )
        check_header_steps(self.steps, headers, who="TP gradient assembly", among="the TP group")
        whole = [g if any(h[1 + i] != 0 for h in headers) else None for i, g in enumerate(full)]
        return whole, any(h[0] != 0 for h in headers)

    def _resync(self, b: _Bucket, *, dp: bool = True, tp: bool = False) -> None:
        """Rebuild the owners' full copies from the shards (over ``dp``, then ``tp``)."""
        W = b.world_size
        if dp:
            send_parts = [m.local.reshape(-1) for d in range(W) for m in b.by_owner[d]]
            send = torch.cat(send_parts) if send_parts else torch.empty(0, dtype=b.dtype, device=b.device)
            recv = torch.empty(sum(b.param_recv), dtype=b.dtype, device=b.device)
            comm.all_to_all_single(
                recv, send, b.param_recv, b.param_send, group=b.group, op="owner_param_resync_all_to_all"
            )
            blocks = [c.split([m.numel_of(s) for m in b.mine]) for s, c in enumerate(recv.split(b.param_recv))]
            for i, m in enumerate(b.mine):
                assert m.full is not None
                parts = [blocks[s][i] for s in range(W)]
                if m.tp is None:
                    torch.cat(parts, out=m.full.view(-1))
                else:
                    own = m.tp.narrow(m.full, m.tp.rank)
                    own.copy_(torch.cat(parts).view(own.shape))
        if tp and b.mine:
            views = [m.tp.narrow(m.full, m.tp.rank) for m in b.mine]  # type: ignore[union-attr,arg-type]
            op = "owner_param_resync_tp_all_gather"
            _, full = assemble(b.tp_group, [], _tp_slices(b.mine), views, dtype=b.dtype, device=b.device, op=op)
            for m, whole in zip(b.mine, full, strict=True):
                assert m.full is not None
                m.full.copy_(whole)
        for m in b.mats:
            m.key = _key(m.rp.param)
        self.resyncs += 1

    def after_step(self) -> None:
        for bucket in self._buckets.values():
            if bucket.mats:
                self._scatter_updates(bucket)
        self.zero_grad(True)

    def _scatter_updates(self, b: _Bucket) -> None:
        W, me = b.world_size, b.rank
        parts = []
        flat = [m.owner_slice().view(-1) for m in b.mine]  # under TP: this rank's TP slice
        for s in range(W):
            for m, f in zip(b.mine, flat, strict=True):
                start = sum(m.rows[:s]) * m.row_numel
                parts.append(f[start : start + m.numel_of(s)])
        send = torch.cat(parts) if parts else torch.empty(0, dtype=b.dtype, device=b.device)
        recv = torch.empty(sum(b.param_send), dtype=b.dtype, device=b.device)
        comm.all_to_all_single(recv, send, b.param_send, b.param_recv, group=b.group, op="owner_update_all_to_all")
        dsts, srcs = [], []
        for d, chunk in enumerate(recv.split(b.param_send)):
            for m, piece in zip(b.by_owner[d], chunk.split([m.numel_of(me) for m in b.by_owner[d]]), strict=True):
                local = m.local
                if local.numel():
                    dsts.append(local)
                    srcs.append(piece.view(local.shape))
        if dsts:
            torch._foreach_copy_(dsts, srcs)
        for m in b.mats:
            m.key = _key(m.rp.param)

    # -- state dicts ---------------------------------------------------------------------------
    def state_place(self, rp: RoutedParam) -> StatePlace | None:
        """A matrix's state is its owner's; shard-local state is a piece of the parameter's layout."""
        group = self._group_of.get(id(rp))
        if rp.owner is None or group is None:
            return StatePlace(None, like=rp.param)
        mesh = mesh_of_group(group, local_tensor(rp.param).device.type)
        return StatePlace(mesh, holder=rp.owner, rows=self._experts.get(id(rp)), held_elsewhere=True)

    # -- introspection -------------------------------------------------------------------------
    def bytes_per_step(self) -> int:
        """Bytes this rank sends plus receives in a steady-state step (no resync)."""
        total = 0
        for b in self._buckets.values():
            if not b.mats:
                continue
            moved = sum(sum(n) - n[b.rank] for n in (b.grad_send, b.grad_recv, b.param_send, b.param_recv))
            if b.tp_group is not None and b.mine:  # the whole gradients over TP (padded, header in front)
                T = b.mine[0].tp.size  # type: ignore[union-attr]
                width = max(message_sizes(1 + len(b.mine) + STEP_DIGITS, _tp_slices(b.mine)))
                moved += 2 * (T - 1) * width
            total += moved * itemsize(b.dtype)
        return total

    def extra_resident_bytes(self) -> int:
        """The owner's full working copies of its matrices."""
        return self.owner_copy_bytes()

    def owner_copy_bytes(self) -> int:
        """Bytes of full matrix copies this rank keeps as owner."""
        return sum(
            m.full.numel() * m.full.element_size() for b in self._buckets.values() for m in b.mine if m.full is not None
        )

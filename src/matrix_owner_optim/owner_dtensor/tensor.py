"""``OwnerDTensor``: the DTensor subclass every owner-layout tensor is, and its operators.

See the package docstring for the layout and the operator rules.
"""

from __future__ import annotations

import weakref
from collections.abc import Sequence
from typing import Any, TypeGuard

import torch
import torch.distributed as dist
from torch.distributed.tensor import DTensor, Partial, Replicate, Shard
from torch.distributed.tensor._dtensor_spec import DTensorSpec, TensorMeta
from torch.distributed.tensor._ops._math_ops import _NormPartial
from torch.utils._pytree import tree_flatten, tree_map, tree_unflatten

from .. import comm
from ..planning.metadata import chunk_row_range
from .dcp import DcpChunks
from .ops import JOINS, NORMS, is_elementwise, is_inplace, norm_partial
from .placement import (
    OwnerShard,
    contiguous_stride,
    gather_ranges,
    owned_ranges,
    placement_key,
    same_placement,
)

aten = torch.ops.aten

__all__ = ["OwnerDTensor", "as_owner_dtensor", "is_owner_dtensor", "like_layout", "mesh_of_group"]


def is_owner_dtensor(t: Any) -> TypeGuard[OwnerDTensor]:
    return isinstance(t, OwnerDTensor)


def as_owner_dtensor(value: Any) -> Any:
    """``value`` as an owner-layout DTensor when it is a plain ``DTensor`` carrying an owner
    placement (torch's state-dict utilities rebuild pieces with ``DTensor.from_local``);
    anything else as it is."""
    if (
        isinstance(value, DTensor)
        and not isinstance(value, OwnerDTensor)
        and len(value.placements) == 1
        and isinstance(value.placements[0], OwnerShard)
    ):
        return OwnerDTensor.make(
            value._local_tensor, value.device_mesh, value.placements[0], value.shape, value.stride()
        )
    return value


def like_layout(t: OwnerDTensor, local: torch.Tensor) -> OwnerDTensor:
    """``local`` (this rank's piece of a tensor laid out as ``t``) as an owner-layout DTensor."""
    return OwnerDTensor.make(local, t.device_mesh, t.placement, t.shape, holder=t._holder)


# (id(group), device type) -> mesh, held weakly: a DeviceMesh keeps its process group alive, and
# a process-lifetime cache would keep gloo's worker threads running into interpreter teardown.
_MESHES: weakref.WeakValueDictionary[tuple[int, str], Any] = weakref.WeakValueDictionary()


def mesh_of_group(group: Any, device_type: str) -> Any:
    """The 1D ``DeviceMesh`` over ``group`` (no collective) owner-layout tensors live on."""
    from torch.distributed.device_mesh import DeviceMesh

    group = group if group is not None else dist.group.WORLD
    key = (id(group), device_type)
    mesh = _MESHES.get(key)
    if mesh is None or mesh.get_group() is not group:
        mesh = DeviceMesh.from_group(group, device_type)
        _MESHES[key] = mesh
    return mesh


class OwnerDTensor(DcpChunks, DTensor):
    """A DTensor of the owner layout (see the module docstring).

    Built with :meth:`make` (no copy). The placement is ``OwnerShard``, ``Shard(0)`` or
    ``Replicate()``; 0-dim values held by one rank carry a ``Partial`` placement and their
    holder in ``_holder``.
    """

    _holder: int | None

    # -- construction -------------------------------------------------------------------------
    @staticmethod
    def make(
        local: torch.Tensor,
        mesh: Any,
        placement: Any,
        shape: Sequence[int],
        stride: Sequence[int] | None = None,
        *,
        requires_grad: bool = False,
        holder: int | None = None,
    ) -> OwnerDTensor:
        """Wrap ``local`` (this rank's piece) with ``placement`` for a global ``shape``; no copy."""
        shape = torch.Size(tuple(int(s) for s in shape))
        stride = tuple(stride) if stride is not None else contiguous_stride(shape)
        spec = DTensorSpec(mesh, (placement,), tensor_meta=TensorMeta(shape, stride, local.dtype))
        r = DTensor.__new__(OwnerDTensor, local, spec, requires_grad=requires_grad)  # type: ignore[call-arg]
        assert isinstance(r, OwnerDTensor)
        r._holder = holder if holder is not None else (placement.holder if isinstance(placement, OwnerShard) else None)
        return r

    @staticmethod
    def owned(local: torch.Tensor, owner: int, mesh: Any, shape: Sequence[int]) -> OwnerDTensor:
        """A tensor held whole by ``owner``: ``local`` is the whole tensor there, empty elsewhere."""
        shape = tuple(int(s) for s in shape)
        me = mesh.get_local_rank()
        if len(shape) == 0:  # a scalar: the owner's value, a zero placeholder elsewhere (Partial sum)
            value = local.reshape(()) if me == owner else torch.zeros((), dtype=local.dtype, device=local.device)
            return OwnerDTensor.make(value, mesh, Partial("sum"), shape, holder=owner)
        if me == owner and tuple(local.shape) != shape:
            raise ValueError(f"the owner's piece has shape {tuple(local.shape)}, expected {shape}")
        if me != owner and local.numel() != 0:
            raise ValueError(f"a non-owner's piece must be empty, got shape {tuple(local.shape)}")
        if me != owner:
            local = local.reshape((0, *shape[1:]))
        return OwnerDTensor.make(local, mesh, OwnerShard(0, owned_ranges(shape[0], owner, mesh.size())), shape)

    @staticmethod
    def rows(local: torch.Tensor, mesh: Any, shape: Sequence[int]) -> OwnerDTensor:
        """``local`` rows of a tensor split as ``torch.chunk`` splits it (``Shard(0)``)."""
        return OwnerDTensor.make(local, mesh, Shard(0), shape)

    @staticmethod
    def replicated(full: torch.Tensor, mesh: Any) -> OwnerDTensor:
        """Every rank holds ``full`` (a module's parameters until the plan is fixed)."""
        return OwnerDTensor.make(full, mesh, Replicate(), full.shape, full.stride())

    # -- layout -----------------------------------------------------------------------------------
    @property
    def placement(self) -> Any:
        return self._spec.placements[0]

    @property
    def holder(self) -> int | None:
        """The rank holding the whole value, or None (split rows, or replicated)."""
        return self._holder

    @property
    def is_holder(self) -> bool:
        return self._holder is not None and self.device_mesh.get_local_rank() == self._holder

    def relayout(self, local: torch.Tensor, placement: Any, *, holder: int | None = None) -> None:
        """Replace this object's piece and placement in place (the plan was fixed: the object a
        module and an optimizer hold stays the same, as FSDP2 re-points ``_local_tensor``)."""
        meta = self._spec.tensor_meta
        assert meta is not None
        self._spec = DTensorSpec(
            self.device_mesh, (placement,), tensor_meta=TensorMeta(meta.shape, meta.stride, local.dtype)
        )
        self._local_tensor = local
        self._holder = (
            holder if holder is not None else (placement.holder if isinstance(placement, OwnerShard) else None)
        )

    def local_rows(self) -> tuple[int, int] | None:
        """This rank's rows ``[start, stop)`` of dim 0 (None for a replicated or 0-dim tensor)."""
        p = self.placement
        if self.dim() == 0 or isinstance(p, (Replicate, Partial)):
            return None
        me = self.device_mesh.get_local_rank()
        if isinstance(p, OwnerShard):
            return p.ranges[me]
        return chunk_row_range(int(self.shape[0]), self.device_mesh.size(), me)

    def piece_of_full(self, full: torch.Tensor) -> torch.Tensor:
        """This rank's piece of a full tensor of this tensor's global shape (a view, no copy)."""
        if isinstance(self.placement, Replicate):
            return full
        if self.dim() == 0:
            return full if self.is_holder else torch.zeros_like(full)
        rows = self.local_rows()
        assert rows is not None
        return full[rows[0] : rows[1]]

    def __repr__(self) -> str:  # type: ignore[override]
        return (
            f"OwnerDTensor(shape={tuple(self.shape)}, dtype={self.dtype}, placement={self.placement!r}, "
            f"local={tuple(self._local_tensor.shape)})"
        )

    # -- gathering ----------------------------------------------------------------------------
    def _as_stock(self) -> DTensor:
        """The same local tensor and spec as a plain DTensor (for DTensor's own rules)."""
        return DTensor.__new__(
            DTensor,
            self._local_tensor,
            self._spec,  # type: ignore[call-arg]
            requires_grad=False,
        )

    def full_value(self) -> torch.Tensor:
        """The whole tensor on every rank (collective unless replicated)."""
        p, local = self.placement, self._local_tensor
        group = self.device_mesh.get_group()
        if isinstance(p, Replicate) or self.device_mesh.size() == 1:
            return local
        if isinstance(p, OwnerShard):
            return gather_ranges(local, p, tuple(self.shape), group)
        if isinstance(p, Partial) and self._holder is not None:
            full = local.clone() if self.is_holder else torch.empty((), dtype=local.dtype, device=local.device)
            comm.broadcast(full, group_src=self._holder, group=group, name="owner_full_tensor")
            return full
        if type(p) is Shard:  # torch.chunk's rows, gathered as explicit ranges
            n, W = int(self.shape[0]), self.device_mesh.size()
            ranges = [chunk_row_range(n, W, r) for r in range(W)]
            return gather_ranges(local, OwnerShard(0, ranges), tuple(self.shape), group)
        raise NotImplementedError(f"full_tensor() of an owner-layout tensor with placement {p!r}")

    def redistribute(
        self, device_mesh: Any = None, placements: Sequence[Any] | None = None, *, async_op: bool = False, **kwargs: Any
    ) -> DTensor:  # type: ignore[override]
        """To ``Replicate`` on its own mesh (what ``full_tensor()`` and state-dict gathering ask)."""
        mesh = device_mesh if device_mesh is not None else self.device_mesh
        if mesh is not self.device_mesh or placements is None or not all(isinstance(p, Replicate) for p in placements):
            raise NotImplementedError(
                f"an owner-layout tensor redistributes only to Replicate() on its own mesh (full_tensor()); "
                f"got {placements}. Gather with full_tensor() and distribute the result"
            )
        full = self.full_value()
        return DTensor.from_local(
            full, self.device_mesh, [Replicate()], run_check=False, shape=self.shape, stride=self.stride()
        )

    def full_tensor(self, *, grad_placements: Any = None) -> torch.Tensor:  # type: ignore[override]
        return self.full_value()

    # -- operators --------------------------------------------------------------------------------
    @classmethod
    def __torch_dispatch__(cls, func, types, args=(), kwargs=None):  # type: ignore[override]
        kwargs = kwargs or {}
        flat, spec = tree_flatten((args, kwargs))
        mine = [a for a in flat if isinstance(a, OwnerDTensor)]
        if func is aten.copy_.default and isinstance(args[0], OwnerDTensor):
            return _copy_into(args[0], args[1])
        if func.name().startswith("aten::_foreach_"):
            out = _foreach(func, args, kwargs)
            if out is not NotImplemented:
                return out
        mesh = mine[0].device_mesh
        holders = {m._holder for m in mine}
        if func in JOINS and (len(holders) > 1 or len(mine) < len([a for a in flat if isinstance(a, DTensor)])):
            joined = _join_partials(func, args, kwargs)
            if joined is not None:
                return joined
        placements = {placement_key(m.placement) for m in mine}
        others = [a for a in flat if isinstance(a, DTensor) and not isinstance(a, OwnerDTensor)]
        stock_replicated = all(all(isinstance(p, Replicate) for p in o.placements) for o in others)
        # 1. replicated (parameters before the plan): every rank computes, as on plain tensors
        if all(isinstance(m.placement, Replicate) for m in mine) and stock_replicated:
            return _run_replicated(func, flat, spec, mesh)
        # 2. one holder: the holder alone computes
        if (
            len(holders) == 1
            and None not in holders
            and stock_replicated
            and all(isinstance(m.placement, (OwnerShard, Partial)) or isinstance(m.placement, Replicate) for m in mine)
        ):
            return _run_on_holder(func, flat, spec, mesh, holders.pop(), args, kwargs)
        # 3. one layout, elementwise: local pieces
        shapes = {tuple(m.shape) for m in mine}
        if len(placements) == 1 and len(shapes) == 1 and is_elementwise(func) and stock_replicated:
            local = _local_args(flat, spec, mine[0])
            if local is not None:
                out = func(*local[0], **local[1])
                return _wrap_like(func, out, mine[0], args)
        # 4. row blocks: DTensor's own rules
        if all(type(m.placement) is Shard for m in mine) and all(len(o.placements) == 1 for o in others):
            stock = [a._as_stock() if isinstance(a, OwnerDTensor) else a for a in flat]
            sargs, skwargs = tree_unflatten(stock, spec)
            out = func(*sargs, **skwargs)
            if is_inplace(func):
                return args[0]
            return out
        # 5. anything else: gather, compute, keep this rank's piece of an in-place result
        return _run_gathered(func, flat, spec, args)


def _plain_like_replicated(a: Any) -> Any:
    if isinstance(a, OwnerDTensor):
        return a._local_tensor
    if isinstance(a, DTensor):
        return a._local_tensor
    return a


def _run_replicated(func: Any, flat: list, spec: Any, mesh: Any) -> Any:
    local = [_plain_like_replicated(a) for a in flat]
    largs, lkwargs = tree_unflatten(local, spec)
    out = func(*largs, **lkwargs)
    originals = {id(a._local_tensor): a for a in flat if isinstance(a, OwnerDTensor)}

    def wrap(t: Any) -> Any:
        if isinstance(t, torch.Tensor):
            if id(t) in originals:
                return originals[id(t)]
            return OwnerDTensor.make(t, mesh, Replicate(), t.shape, t.stride())
        return t

    return tree_map(wrap, out)


def _meta(a: Any) -> Any:
    if isinstance(a, OwnerDTensor):
        return torch.empty_strided(a.shape, a.stride(), dtype=a.dtype, device="meta")
    if isinstance(a, DTensor):
        return a._local_tensor.to("meta")
    if isinstance(a, torch.Tensor):
        return a.to("meta")
    return a


def _returns_value(func: Any) -> bool:
    """Whether ``func`` returns a Python value (``equal``, ``_local_scalar_dense``), not tensors."""
    returns = func._schema.returns
    return len(returns) == 1 and str(returns[0].type) in ("bool", "int", "float", "Scalar", "SymInt", "SymBool")


def _value_from_holder(func: Any, flat: list, spec: Any, mesh: Any, holder: int) -> Any:
    """A Python value (``item()``, ``torch.equal``) of tensors one rank holds: that rank reads
    it locally (no collective, so an owner alone may ask); any other rank holds nothing to read
    and is told how to get the value everywhere, instead of getting a value of its own."""
    if mesh.get_local_rank() != holder:
        raise RuntimeError(
            f"{func.name()} of an owner-layout tensor held whole by rank {holder}: this rank holds no "
            "piece of it. Read it on its holder (tensor.holder), or call .full_tensor() on every rank "
            "first for the value everywhere"
        )
    largs, lkwargs = tree_unflatten([_plain_like_replicated(a) for a in flat], spec)
    return func(*largs, **lkwargs)


def _join_partials(func: Any, args: tuple, kwargs: dict) -> Any:
    """``stack`` / ``cat`` of 0-dim partial values of several holders (``clip_grad_norm_``'s
    per-gradient norms): the local values side by side, still partial of the same kind (zeros
    where a rank holds nothing), as DTensor joins FSDP2's partial norms. None when not that."""
    tensors = args[0] if args and isinstance(args[0], (list, tuple)) else None
    if not tensors or not all(isinstance(t, DTensor) and t.dim() == 0 for t in tensors):
        return None
    places = [t._spec.placements for t in tensors]
    if not all(len(p) == 1 and isinstance(p[0], Partial) for p in places):
        return None
    if len({placement_key(p[0]) for p in places}) != 1:
        return None
    mesh = tensors[0].device_mesh
    if any(t.device_mesh != mesh for t in tensors):
        return None
    out = func([t._local_tensor for t in tensors], *args[1:], **kwargs)
    return DTensor.from_local(out, mesh, [places[0][0]], run_check=False)


def _run_on_holder(func: Any, flat: list, spec: Any, mesh: Any, holder: int, args: tuple, kwargs: dict) -> Any:
    me = mesh.get_local_rank()
    inplace = is_inplace(func)
    if _returns_value(func):
        return _value_from_holder(func, flat, spec, mesh, holder)
    if me == holder:
        local = [_plain_like_replicated(a) for a in flat]
        largs, lkwargs = tree_unflatten(local, spec)
        out = func(*largs, **lkwargs)
    else:
        if inplace:  # the holder's piece changes; this rank holds nothing of it
            return args[0]
        margs, mkwargs = tree_unflatten([_meta(a) for a in flat], spec)
        out = func(*margs, **mkwargs)
    if inplace:
        return args[0]
    device = next(a._local_tensor.device for a in flat if isinstance(a, OwnerDTensor))
    norm = func in NORMS

    def wrap(t: Any) -> Any:
        if not isinstance(t, torch.Tensor):
            return t
        shape = tuple(t.shape)
        if t.dim() == 0:
            placement = (norm_partial(func, args, kwargs) if norm else Partial("sum")) or Partial("sum")
            local = t if me == holder else torch.zeros((), dtype=t.dtype, device=device)
            return OwnerDTensor.make(local, mesh, placement, shape, holder=holder)
        local = t if me == holder else torch.empty((0, *shape[1:]), dtype=t.dtype, device=device)
        placement = OwnerShard(0, owned_ranges(shape[0], holder, mesh.size()))
        return OwnerDTensor.make(local, mesh, placement, shape, t.stride() if me == holder else None)

    return tree_map(wrap, out)


def _local_args(flat: list, spec: Any, like: OwnerDTensor) -> tuple[tuple, dict] | None:
    """Arguments as local pieces for an elementwise operator of ``like``'s layout, or None when a
    plain tensor cannot be cut to this rank's piece."""
    out = []
    for a in flat:
        if isinstance(a, OwnerDTensor):
            out.append(a._local_tensor)
        elif isinstance(a, DTensor):
            if a.dim() != 0:
                return None
            out.append(a._local_tensor)
        elif isinstance(a, torch.Tensor) and a.dim() > 0:
            if tuple(a.shape) != tuple(like.shape):
                return None
            out.append(like.piece_of_full(a))
        else:
            out.append(a)
    largs, lkwargs = tree_unflatten(out, spec)
    return largs, lkwargs


def _wrap_like(func: Any, out: Any, like: OwnerDTensor, args: tuple) -> Any:
    if is_inplace(func):
        return args[0]

    def wrap(t: Any) -> Any:
        if isinstance(t, torch.Tensor):
            return OwnerDTensor.make(
                t,
                like.device_mesh,
                like.placement,
                like.shape,
                like.stride() if t.is_contiguous() else None,
                holder=like._holder,
            )
        return t

    return tree_map(wrap, out)


def _copy_into(dst: OwnerDTensor, src: Any) -> OwnerDTensor:
    """``dst.copy_(src)``: this rank's piece of ``src`` into ``dst``'s piece."""
    if (
        isinstance(src, OwnerDTensor)
        and same_placement(src.placement, dst.placement)
        and tuple(src.shape) == tuple(dst.shape)
        and src.device_mesh is dst.device_mesh
    ):
        dst._local_tensor.copy_(src._local_tensor)
        return dst
    if isinstance(src, DTensor):
        if not isinstance(src, OwnerDTensor) and all(isinstance(p, Replicate) for p in src.placements):
            full = src._local_tensor
        else:
            full = src.full_tensor()
    elif isinstance(src, torch.Tensor):
        full = src
    else:
        dst._local_tensor.fill_(src)
        return dst
    if tuple(full.shape) != tuple(dst.shape):
        full = full.expand(dst.shape)
    piece = dst.piece_of_full(full)
    if dst.dim() == 0 and not isinstance(dst.placement, Replicate) and not dst.is_holder:
        return dst
    dst._local_tensor.copy_(piece)
    return dst


def _run_gathered(func: Any, flat: list, spec: Any, args: tuple) -> Any:
    full = [
        a.full_value() if isinstance(a, OwnerDTensor) else (a.full_tensor() if isinstance(a, DTensor) else a)
        for a in flat
    ]
    fargs, fkwargs = tree_unflatten(full, spec)
    out = func(*fargs, **fkwargs)
    if is_inplace(func) and isinstance(args[0], OwnerDTensor):
        dst = args[0]
        if not (dst.dim() == 0 and not dst.is_holder and not isinstance(dst.placement, Replicate)):
            dst._local_tensor.copy_(dst.piece_of_full(fargs[0]))
        return dst
    mesh = next(a.device_mesh for a in flat if isinstance(a, OwnerDTensor))
    return tree_map(
        lambda t: OwnerDTensor.make(t, mesh, Replicate(), t.shape, t.stride()) if isinstance(t, torch.Tensor) else t,
        out,
    )


def _foreach(func: Any, args: tuple, kwargs: dict) -> Any:
    """Foreach operators element by element: every element's tensors share one layout (a
    parameter, its gradient and its state), so the operator runs once over the local pieces and
    each result takes its element's layout. NotImplemented when an element mixes layouts."""
    lists = [
        i
        for i, a in enumerate(args)
        if isinstance(a, (list, tuple)) and a and all(isinstance(t, torch.Tensor) for t in a)
    ]
    if not lists:
        return NotImplemented
    n = len(args[lists[0]])
    likes: list[Any] = []
    for j in range(n):
        elems = [args[i][j] for i in lists]
        ref = next((t for t in elems if isinstance(t, DTensor)), None)
        for t in elems:
            if isinstance(t, DTensor) and (
                type(t) is not type(ref)
                or t.shape != ref.shape
                or not all(same_placement(a, b) for a, b in zip(t._spec.placements, ref._spec.placements, strict=True))
            ):
                return NotImplemented
            if not isinstance(t, DTensor) and ref is not None:
                return NotImplemented
        likes.append(ref)
    scalars_ok = all(not isinstance(a, DTensor) or a.dim() == 0 for i, a in enumerate(args) if i not in lists)
    if not scalars_ok:
        return NotImplemented

    def unwrap(a: Any) -> Any:
        if isinstance(a, DTensor):
            if a.dim() == 0 and not all(isinstance(p, Replicate) for p in a.placements):
                a = a.redistribute(a.device_mesh, [Replicate()] * a.device_mesh.ndim)
            return a._local_tensor
        return a

    norm = "norm" in func.name()

    def unwrap_elem(t: Any) -> Any:
        t = unwrap(t)
        if norm and t.numel() == 0:  # nothing held here: the norm's identity, 0 (the inf-norm of
            return t.new_zeros(1)  # an empty tensor is an error, not 0)
        return t

    largs = [[unwrap_elem(t) for t in a] if i in lists else unwrap(a) for i, a in enumerate(args)]
    out = func(*largs, **{k: unwrap(v) for k, v in kwargs.items()})
    if out is None or is_inplace(func) or func.name().endswith("_"):
        return None if out is None else args[lists[0]]
    wrapped = []
    for like, t in zip(likes, out, strict=True):
        if like is None:
            wrapped.append(t)
        elif norm:
            p = args[1] if len(args) > 1 and isinstance(args[1], (int, float)) else kwargs.get("ord", 2)
            placement = norm_partial(aten.linalg_vector_norm.default, (None, p), {}) or Partial("sum")
            if isinstance(like, OwnerDTensor) and isinstance(like.placement, Replicate):
                wrapped.append(OwnerDTensor.make(t, like.device_mesh, Replicate(), ()))
            elif isinstance(like, OwnerDTensor) and like._holder is not None:
                local = t if like.is_holder else torch.zeros_like(t)
                wrapped.append(OwnerDTensor.make(local, like.device_mesh, placement, (), holder=like._holder))
            else:
                wrapped.append(DTensor.from_local(t, like.device_mesh, [placement], run_check=False))
        elif isinstance(like, OwnerDTensor):
            wrapped.append(OwnerDTensor.make(t, like.device_mesh, like.placement, like.shape, holder=like._holder))
        else:
            wrapped.append(
                DTensor.from_local(
                    t, like.device_mesh, like.placements, run_check=False, shape=like.shape, stride=like.stride()
                )
            )
    return wrapped


torch.serialization.add_safe_globals([OwnerDTensor, OwnerShard, _NormPartial])

"""Owner-layout tensors on a 2D (dp, tp) mesh: a tensor-parallel slice held whole by its dp owner.

The package's ``fully_shard(block, mesh=mesh["dp"])`` on tensor-parallel blocks leaves each
parameter with placements ``(OwnerShard(0, ranges), <TP placement>)`` over the *global* rows:
rank ``(o, t)`` holds TP slice ``t`` whole, every other dp coordinate an empty piece of the
slice's trailing shape (``compute_local_shape_and_global_offset`` cuts it dp first). DESIGN.md,
"The representation", has the rule table; this module holds the 2D mesh's local rules (one
spec's pointwise operators, whole-tensor norms as the partial values stock DTensor gives); what
they cannot place takes the rules every mesh shares (``dispatch.py``: gathered and written back).
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import torch
from torch.distributed.tensor import DTensor, Replicate, Shard
from torch.distributed.tensor._dtensor_spec import DTensorSpec, TensorMeta
from torch.utils._pytree import tree_flatten, tree_map

from .. import comm
from .ops import ELEMENTWISE, NORMS, OperatorInfo, norm_partial
from .placement import as_bytes, contiguous_stride, interned, same_layout, spec_for

aten = torch.ops.aten

__all__ = [
    "NOT_LOCAL",
    "TP_PLACEMENTS",
    "full_value_2d",
    "is_2d",
    "local_2d",
    "local_shape_at",
    "norm_2d",
    "same_spec_2d",
    "spec_2d",
    "tp_mesh_of",
    "tp_placement_of",
    "wrap_2d",
]

TP_PLACEMENTS = "Shard(0) (ColwiseParallel), Shard(1) (RowwiseParallel) or Replicate() (SequenceParallel, biases)"
NOT_LOCAL: Any = object()  # a 2D call no local rule places: the shared rules run


def same_spec_2d(a: DTensor, b: DTensor) -> bool:
    """Whether two 2D tensors are pieces of one layout (``placement.same_layout``)."""
    return same_layout(a, b, holders=False)


def is_2d(t: Any) -> bool:
    """Whether ``t`` is a DTensor whose spec is on a 2D mesh."""
    return isinstance(t, DTensor) and t.device_mesh.ndim == 2


def spec_2d(mesh: Any, placements: Sequence[Any], shape: Sequence[int], dtype: torch.dtype) -> DTensorSpec:
    """The spec of an owner-layout tensor on the 2D (dp, tp) ``mesh`` of global ``shape``."""
    shape = torch.Size(tuple(int(s) for s in shape))
    return interned(
        DTensorSpec(mesh, tuple(placements), tensor_meta=TensorMeta(shape, contiguous_stride(shape), dtype))
    )


def tp_mesh_of(t: Any) -> Any:
    """The tp sub-mesh (dim 1) of a 2D owner-layout tensor's mesh."""
    names = t.device_mesh.mesh_dim_names
    assert names is not None, "a 2D owner-layout mesh has named dims (fully_shard checks it)"
    return t.device_mesh[names[1]]


def tp_placement_of(t: DTensor) -> Any:
    return t.placements[1]


def _replicated_scalar(a: Any) -> bool:
    """A value every rank holds whole: a plain 0-dim tensor or a fully replicated 0-dim DTensor."""
    if isinstance(a, DTensor):
        return a.dim() == 0 and all(isinstance(p, Replicate) for p in a.placements)
    return isinstance(a, torch.Tensor) and a.dim() == 0


def _local(a: Any) -> Any:
    return a._local_tensor if isinstance(a, DTensor) else a


def wrap_2d(cls: Any, local: torch.Tensor, ref: Any) -> Any:
    """``local`` as a piece of ``ref``'s 2D layout (its spec; a new one only for another dtype)."""
    return cls._wrap(local, spec_for(ref._spec, local.dtype), ref._holder)


def norm_2d(value: torch.Tensor, t: DTensor, partial: Any) -> DTensor:
    """The norm ``value`` of ``t``'s local piece as the partial value it is: zero where the piece
    is empty, ``partial`` on dp and on tp where TP splits ``t`` (``Replicate()`` where it does
    not): what stock DTensor gives for a ``(Shard, Shard)`` tensor, so its own rules reduce it."""
    if t._local_tensor.numel() == 0:
        value = torch.zeros_like(value)
    tp = Replicate() if isinstance(tp_placement_of(t), Replicate) else partial
    return DTensor.from_local(value, t.device_mesh, [partial, tp], run_check=False)


def _whole_norm(func: Any, args: tuple, kwargs: dict) -> Any:
    """The partial form of a whole-tensor ``linalg.vector_norm``, or None (another norm)."""
    dims = args[2] if len(args) > 2 else kwargs.get("dim")
    keepdim = args[3] if len(args) > 3 else kwargs.get("keepdim", False)
    if dims not in (None, [], ()) or keepdim or func is not aten.linalg_vector_norm.default:
        return None
    return norm_partial(func, args, kwargs)


def local_2d(cls: Any, func: Any, args: tuple, kwargs: dict, info: OperatorInfo) -> Any:
    """A call with a 2D owner-layout argument on the local pieces, or :data:`NOT_LOCAL`: a
    whole-tensor norm of one tensor (a partial value), or a pointwise operator whose owner-layout
    arguments are one 2D spec and whose other tensors are 0-dim values every rank holds
    (``clip_grad_norm_``'s coefficient, a fused optimizer's steps): the result in that spec."""
    flat, _ = tree_flatten((args, kwargs))
    owners = [a for a in flat if isinstance(a, cls) and (is_2d(a) or not _replicated_scalar(a))]
    if func in NORMS:
        partial = _whole_norm(func, args, kwargs)
        if partial is None or len(owners) != 1 or args[0] is not owners[0]:
            return NOT_LOCAL
        return norm_2d(func(_local(args[0]), *args[1:], **kwargs), args[0], partial)
    ref = owners[0]
    if not (info.pointwise or func in ELEMENTWISE) or not all(is_2d(o) and same_spec_2d(o, ref) for o in owners):
        return NOT_LOCAL
    others = [a for a in flat if isinstance(a, torch.Tensor) and not any(a is o for o in owners)]
    if not all(_replicated_scalar(a) for a in others) or (info.inplace and args[0] is not ref):
        return NOT_LOCAL
    local_args, local_kwargs = tree_map(_local, (args, kwargs))
    out = func(*local_args, **local_kwargs)
    if info.inplace:
        return args[0]
    return tree_map(lambda r: wrap_2d(cls, r, ref) if isinstance(r, torch.Tensor) else r, out)


def full_value_2d(t: Any) -> torch.Tensor:
    """The whole tensor on every rank, in new storage: the TP slice broadcast over dp from its
    owner (every dp rank holds it before the plan), then TP's own ``full_tensor()`` over tp."""
    mesh, local, holder = t.device_mesh, t._local_tensor, t._holder
    piece = local
    if not isinstance(t.placements[0], Replicate):
        coordinate = mesh.get_coordinate()
        assert coordinate is not None and holder is not None
        slice_shape = local_shape_at(t.shape, mesh, t.placements, [holder, coordinate[1]])
        own = coordinate[0] == holder
        piece = local.clone(memory_format=torch.contiguous_format) if own else local.new_empty(slice_shape)
        comm.broadcast(as_bytes(piece), group_src=holder, group=mesh.get_group(0), name="owner_full_tensor")
    tp = DTensor.from_local(
        piece, tp_mesh_of(t), [tp_placement_of(t)], run_check=False, shape=t.shape, stride=t.stride()
    )
    full = tp.full_tensor()
    return full.clone() if full.untyped_storage().data_ptr() == local.untyped_storage().data_ptr() else full


def local_shape_at(shape: Any, mesh: Any, placements: Any, coordinate: list[int]) -> tuple[int, ...]:
    """The local shape the rank at mesh ``coordinate`` holds of a tensor of global ``shape``
    (the TP slice on the owner), as ``compute_local_shape_and_global_offset`` cuts it there."""
    dims = list(shape)
    for mesh_dim, p in enumerate(placements):
        if isinstance(p, Shard):
            size, _ = p._local_shard_size_and_offset(dims[p.dim], mesh.size(mesh_dim), coordinate[mesh_dim])
            dims[p.dim] = size
    return tuple(dims)

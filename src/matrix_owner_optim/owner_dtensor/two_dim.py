"""Owner-layout tensors on a 2D (dp, tp) mesh: a tensor-parallel slice held whole by its dp owner.

The package's ``fully_shard(block, mesh=mesh["dp"])`` on blocks that torch's
``parallelize_module`` made tensor parallel leaves each parameter an :class:`OwnerDTensor` whose
spec is on the 2D (dp, tp) mesh with placements ``(OwnerShard(0, ranges), <TP placement>)``:
the ranges are over the *global* rows (``[0, N)`` on the owner's dp coordinate, empty
elsewhere), the TP placement is the one ``parallelize_module`` left (``Shard(0)``, ``Shard(1)``
or ``Replicate()``). Rank ``(o, t)`` holds TP slice ``t`` whole; every other dp coordinate an
empty piece of the slice's trailing shape. ``compute_local_shape_and_global_offset`` reads it
dp first (the owner gets all ``N`` rows, then TP's placement splits them), so DCP offsets and
torch's state-dict utilities see the right pieces.

DTensor's own op rules treat ``OwnerShard`` as ``Shard(0)`` (the ranges would be lost), so the
1D rules of ``dispatch.py`` are not used here; instead a short list of explicit rules, every
one chosen from metadata only (the same on every rank), none issuing a collective except
``full_tensor()``:

* **same spec, pointwise** (and the element-wise ops of ``ops.ELEMENTWISE``: ``detach``,
  ``clone``, ``zero_``, ...): every owner-layout argument of one spec, other tensors plain
  0-dim values or replicated 0-dim DTensors (``clip_grad_norm_``'s coefficient): local pieces,
  the result in the same spec. The optimizer's math and the clipping multiply.
* **norms** (``linalg_vector_norm`` of the whole tensor, ``clip_grad_norm_``'s per-tensor
  norm): the local piece's norm (zero on an empty piece) as a *stock* 0-dim DTensor on the 2D
  mesh, ``_NormPartial`` on dp and on tp where TP splits the tensor (``Replicate()`` where it
  does not): exactly what stock DTensor gives for ``(Shard, Shard)``, so torch's ``stack`` of the
  norms and the total norm follow DTensor's own rules, and the result is the global norm.
* **copy_** into a 2D tensor (the load path: ``load_state_dict`` of full tensors, DSD's
  ``set_model_state_dict(full_state_dict=True)``, ``_foreach_copy_``): this rank's piece of the
  source, cut where ``compute_local_shape_and_global_offset`` says (the TP slice on the owner,
  nothing elsewhere). A source of the same spec copies piece to piece, a stock DTensor of the
  same TP placement on the tp mesh (a TP-only model's state dict) gives the owner its local TP
  slice, a plain tensor is read as the whole value (the same on every rank, as every load
  assumes), any other DTensor is gathered first (``full_tensor()``: every rank takes part).
* **lists** (``_foreach_*``, ``_fused_*``, ``_amp_*``: ``lists.py``): an element whose tensors
  are one 2D spec (and plain 0-dim values: a fused optimizer's steps) runs on local pieces, a
  ``_foreach_norm`` element is a partial norm as above, ``_foreach_copy_`` is the ``copy_``
  rule; GradScaler's ``found_inf`` is agreed over both mesh dims. Other 2D elements refused.
* everything else: refused on every rank, naming the operator (``full_tensor()`` first).

``full_tensor()`` / ``redistribute(Replicate())``: the TP slice broadcast over dp from the owner,
then TP's own gather over tp; new storage on every rank.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import torch
from torch.distributed.tensor import DTensor, Replicate, Shard
from torch.distributed.tensor._dtensor_spec import DTensorSpec, TensorMeta
from torch.utils._pytree import tree_flatten, tree_map

from .. import comm
from .dispatch import OwnerDTensorType
from .ops import ELEMENTWISE, NORMS, OperatorInfo, norm_partial
from .placement import as_bytes, contiguous_stride, same_placement
from .values import copy_into

aten = torch.ops.aten

__all__ = [
    "TP_PLACEMENTS",
    "dispatch_2d",
    "full_value_2d",
    "is_2d",
    "local_shape_at",
    "norm_2d",
    "refuse_2d",
    "same_spec_2d",
    "spec_2d",
    "wrap_2d",
    "tp_mesh_of",
    "tp_placement_of",
]

TP_PLACEMENTS = "Shard(0) (ColwiseParallel), Shard(1) (RowwiseParallel) or Replicate() (SequenceParallel, biases)"


def is_2d(t: Any) -> bool:
    """Whether ``t`` is a DTensor whose spec is on a 2D mesh."""
    return isinstance(t, DTensor) and t.device_mesh.ndim == 2


def spec_2d(mesh: Any, placements: Sequence[Any], shape: Sequence[int], dtype: torch.dtype) -> DTensorSpec:
    """The spec of an owner-layout tensor on the 2D (dp, tp) ``mesh`` of global ``shape``."""
    shape = torch.Size(tuple(int(s) for s in shape))
    return DTensorSpec(mesh, tuple(placements), tensor_meta=TensorMeta(shape, contiguous_stride(shape), dtype))


def tp_mesh_of(t: Any) -> Any:
    """The tp sub-mesh (dim 1) of a 2D owner-layout tensor's mesh."""
    mesh = t.device_mesh
    names = mesh.mesh_dim_names
    assert names is not None, "a 2D owner-layout mesh has named dims (fully_shard checks it)"
    return mesh[names[1]]


def tp_placement_of(t: DTensor) -> Any:
    return t.placements[1]


def same_spec_2d(a: DTensor, b: DTensor) -> bool:
    """Whether two 2D tensors are pieces of one layout: mesh, shape, and placements of one type
    each (an ``OwnerShard`` compares equal to a plain ``Shard`` of its dim, for DTensorSpec's
    sake, but torch's ``distribute_tensor`` cuts a ``Shard`` in even chunks: another layout)."""
    return (
        a.device_mesh == b.device_mesh
        and tuple(a.shape) == tuple(b.shape)
        and len(a.placements) == len(b.placements)
        and all(same_placement(x, y) for x, y in zip(a.placements, b.placements, strict=True))
    )


def _replicated_scalar(a: Any) -> bool:
    """A value every rank holds whole: a plain 0-dim tensor or a fully replicated 0-dim DTensor."""
    if isinstance(a, DTensor):
        return a.dim() == 0 and all(isinstance(p, Replicate) for p in a.placements)
    return isinstance(a, torch.Tensor) and a.dim() == 0


def refuse_2d(func: Any, why: str) -> Any:
    """Raise, on every rank (the reasons are read off metadata), naming ``func`` and what runs."""
    raise NotImplementedError(
        f"{func} on an owner-layout tensor on a 2D (dp, tp) mesh (a tensor-parallel slice held by its "
        f"dp owner): {why}. This layout runs pointwise operators of one layout, whole-tensor norms and "
        "_foreach_* lists of one layout per element; gather with full_tensor() first for anything else"
    )


def _local(a: Any) -> Any:
    return a._local_tensor if isinstance(a, DTensor) else a


def wrap_2d(cls: OwnerDTensorType, local: torch.Tensor, ref: Any) -> Any:
    """``local`` as a piece of ``ref``'s 2D layout (its spec; a new one only for another dtype)."""
    spec = ref._spec
    if spec.tensor_meta is None or spec.tensor_meta.dtype != local.dtype:
        spec = spec_2d(ref.device_mesh, tuple(ref.placements), ref.shape, local.dtype)
    return cls._wrap(local, spec, ref._holder)


def _norm(cls: OwnerDTensorType, func: Any, args: tuple, kwargs: dict) -> Any:
    t = args[0]
    dims = args[2] if len(args) > 2 else kwargs.get("dim")
    keepdim = args[3] if len(args) > 3 else kwargs.get("keepdim", False)
    if dims not in (None, [], ()) or keepdim or func is not aten.linalg_vector_norm.default:
        refuse_2d(func, "only the norm of the whole tensor (linalg.vector_norm, no dim) is a partial value here")
    partial = norm_partial(func, args, kwargs)
    if partial is None:
        refuse_2d(func, "a norm of order 0 or -inf has no partial form")
    local = _local(t)
    return norm_2d(func(local, *args[1:], **kwargs), t, partial)


def norm_2d(value: torch.Tensor, t: DTensor, partial: Any) -> DTensor:
    """The norm ``value`` of ``t``'s local piece as the partial value it is: zero where the piece
    is empty, ``partial`` on dp and on tp where TP splits ``t`` (``Replicate()`` where it does
    not): what stock DTensor gives for a ``(Shard, Shard)`` tensor, so its own rules reduce it."""
    if t._local_tensor.numel() == 0:
        value = torch.zeros_like(value)
    tp = Replicate() if isinstance(tp_placement_of(t), Replicate) else partial
    return DTensor.from_local(value, t.device_mesh, [partial, tp], run_check=False)


def dispatch_2d(cls: OwnerDTensorType, func: Any, args: tuple, kwargs: dict, info: OperatorInfo) -> Any:
    """One call with a 2D owner-layout argument (see the module docstring for the rules)."""
    if func is aten.copy_.default and isinstance(args[0], cls) and is_2d(args[0]):
        return copy_into(args[0], args[1])  # the layout's one copy_ rule (values.py)
    flat, _ = tree_flatten((args, kwargs))
    # a 0-dim value every rank holds (clip_grad_norm_'s coefficient, replicated on the dense 1D
    # mesh of the tensors outside tensor/expert parallel) is a scalar, whatever its layout
    owners = [a for a in flat if isinstance(a, cls) and (is_2d(a) or not _replicated_scalar(a))]
    if func in NORMS:
        if len(owners) != 1 or args[0] is not owners[0]:
            refuse_2d(func, "a norm of one owner-layout tensor")
        return _norm(cls, func, args, kwargs)
    ref = owners[0]
    if not all(is_2d(o) and same_spec_2d(o, ref) for o in owners):
        refuse_2d(func, "its owner-layout arguments are not of one layout (mesh, placements and shape)")
    others = [a for a in flat if isinstance(a, torch.Tensor) and not any(a is o for o in owners)]
    if not (info.pointwise or func in ELEMENTWISE):
        refuse_2d(func, "it is not pointwise")
    if not all(_replicated_scalar(a) for a in others):
        refuse_2d(func, "its other tensor arguments are not 0-dim values every rank holds whole")
    if info.inplace and args[0] is not ref:
        refuse_2d(func, "it writes a tensor that is not of the 2D layout")
    local_args, local_kwargs = tree_map(_local, (args, kwargs))
    out = func(*local_args, **local_kwargs)
    if info.inplace:
        return args[0]
    return tree_map(lambda r: wrap_2d(cls, r, ref) if isinstance(r, torch.Tensor) else r, out)


def full_value_2d(t: DTensor, holder: int) -> torch.Tensor:
    """The whole tensor on every rank, in new storage: the TP slice broadcast over dp from the
    owner coordinate ``holder``, then TP's own ``full_tensor()`` over tp."""
    mesh = t.device_mesh
    local = t._local_tensor
    coordinate = mesh.get_coordinate()
    assert coordinate is not None
    owner_coordinate = [holder, coordinate[1]]
    slice_shape = local_shape_at(t.shape, mesh, t.placements, owner_coordinate)
    piece = torch.empty(slice_shape, dtype=local.dtype, device=local.device)
    if coordinate[0] == holder:
        piece.copy_(local)
    comm.broadcast(as_bytes(piece), group_src=holder, group=mesh.get_group(0), name="owner_full_tensor")
    tp = DTensor.from_local(
        piece, tp_mesh_of(t), [tp_placement_of(t)], run_check=False, shape=t.shape, stride=t.stride()
    )
    return tp.full_tensor()


def local_shape_at(shape: Any, mesh: Any, placements: Any, coordinate: list[int]) -> tuple[int, ...]:
    """The local shape the rank at mesh ``coordinate`` holds of a tensor of global ``shape``
    (the TP slice on the owner), as ``compute_local_shape_and_global_offset`` cuts it there."""
    dims = list(shape)
    for mesh_dim, p in enumerate(placements):
        if isinstance(p, Shard):
            size, _ = p._local_shard_size_and_offset(dims[p.dim], mesh.size(mesh_dim), coordinate[mesh_dim])
            dims[p.dim] = size
    return tuple(dims)

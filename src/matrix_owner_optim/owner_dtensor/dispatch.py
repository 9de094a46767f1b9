"""The owner layout's operator rules: one rule per call, chosen from metadata only, on 1D and 2D
meshes alike (DESIGN.md, "The representation", has the rule table, its order and the reasons).

``OwnerDTensor.__torch_dispatch__`` hands every call that no recorded decision (``decisions.py``)
and no 2D local rule (``two_dim.py``) took here. The rule is picked from the operator's class
(``ops.py``) and the arguments' placements, shapes and meshes, never from a value or a piece's
size, so every rank picks the same rule and issues the same collectives. What no rule places is
gathered: whole values, the operator, every written argument's piece back (both mesh ranks).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import torch
from torch.distributed.tensor import DTensor, Partial, Replicate, Shard
from torch.distributed.tensor._dtensor_spec import DTensorSpec, TensorMeta
from torch.utils._pytree import tree_flatten, tree_map, tree_unflatten

from ..planning.metadata import chunk_row_range
from .base import OwnerTensorBase
from .holder_agreement import agree
from .ops import NEW_FACTORIES, OpClass, OperatorInfo, mutated_arguments, norm_partial
from .placement import OwnerShard, interned, owned_ranges, placement_key, same_placement, spec_for
from .values import copy_into, full_of, write_piece

# The class arrives as ``cls`` (``__torch_dispatch__`` passes itself); this module reads it through
# its base class (tensor.py imports this module).
OwnerDTensorType = type[OwnerTensorBase]

aten = torch.ops.aten

__all__ = ["Call", "adopt", "full_of", "lay_out_like", "replicated", "run_rules", "write_piece"]


@dataclass
class Call:
    """One operator call: its arguments flattened, and which of them are owner-layout tensors,
    other DTensors, or written by the operator."""

    cls: OwnerDTensorType
    func: Any
    args: tuple
    kwargs: dict
    info: OperatorInfo
    flat: list = field(init=False)
    spec: Any = field(init=False)
    owners: list = field(init=False)
    stocks: list = field(init=False)
    written: set[int] = field(init=False)  # ids of the argument tensors the operator writes
    two_d: bool = field(init=False)  # an owner-layout argument is on a 2D (dp, tp) mesh

    def __post_init__(self) -> None:
        self.flat, self.spec = tree_flatten((self.args, self.kwargs))
        self.owners = [a for a in self.flat if isinstance(a, self.cls)]
        self.stocks = [a for a in self.flat if isinstance(a, DTensor) and not isinstance(a, self.cls)]
        self.written = {id(t) for t in mutated_arguments(self.info, self.args, self.kwargs)}
        self.two_d = any(o.device_mesh.ndim == 2 for o in self.owners)

    @property
    def mesh(self) -> Any:
        """The call's mesh: the first owner-layout argument's (a 2D one's where there is one)."""
        return next((o.device_mesh for o in self.owners if o.device_mesh.ndim == 2), self.owners[0].device_mesh)

    def one_mesh(self) -> bool:
        mesh = self.mesh
        return all(_same_mesh(o.device_mesh, mesh) for o in self.owners) and all(
            _same_mesh(s.device_mesh, mesh) for s in self.stocks
        )

    def run(self, converted: list) -> Any:
        args, kwargs = tree_unflatten(converted, self.spec)
        return self.func(*args, **kwargs)

    def returns(self, out: Any, converted: list, wrap: Any) -> Any:
        """``out`` with every written argument's converted value replaced by the argument itself
        (in-place and ``out=`` results are the objects the caller passed) and every other tensor
        passed through ``wrap``."""
        back = {id(c): a for a, c in zip(self.flat, converted, strict=True) if id(a) in self.written}

        def one(t: Any) -> Any:
            if isinstance(t, torch.Tensor):
                original = back.get(id(t))
                return original if original is not None else wrap(t)
            return t

        return tree_map(one, out)


def _same_mesh(a: Any, b: Any) -> bool:
    return a is b or a == b


def local_rank(mesh: Any) -> int:
    """This rank's index on a 1D mesh (its cached coordinate: no process-group query)."""
    coordinate = mesh.get_coordinate()
    return int(coordinate[0]) if coordinate is not None else mesh.get_local_rank()


def _replicated(t: Any) -> bool:
    return all(isinstance(p, Replicate) for p in t._spec.placements)


def _all_replicated(call: Call) -> bool:
    return all(_replicated(o) for o in call.owners) and all(_replicated(s) for s in call.stocks)


def replicated(cls: OwnerDTensorType, t: torch.Tensor, mesh: Any) -> Any:
    """``t`` (the same whole value on every rank) as a replicated owner-layout tensor on ``mesh``."""
    spec = interned(DTensorSpec(mesh, (Replicate(),) * mesh.ndim, tensor_meta=TensorMeta(t.shape, t.stride(), t.dtype)))
    return cls._wrap(t, spec, None)


def lay_out_like(cls: OwnerDTensorType, like: Any, full: torch.Tensor) -> Any:
    """A new result ``full`` (the same on every rank) laid out as ``like``: this rank's piece
    copied out of it (so the whole tensor is not kept alive), or replicated when shapes differ."""
    if tuple(full.shape) != tuple(like.shape) or not isinstance(like, cls) or _replicated(like):
        return replicated(cls, full, like.device_mesh)
    piece = like.piece_of_full(full).clone(memory_format=torch.contiguous_format)
    return cls._wrap(piece, spec_for(like._spec, piece.dtype), like._holder)


# -- the rules --------------------------------------------------------------------------------------


def _refuse(call: Call, info: OperatorInfo) -> Any:
    if info.collective and any(
        isinstance(a, torch.Tensor) and not isinstance(a, DTensor) and a.numel() != 1 for a in call.flat
    ):  # plain non-scalar tensors beside a DTensor: stock DTensor's error for this mix
        raise RuntimeError(
            f"{call.func}: got mixed torch.Tensor and DTensor, need to convert all torch.Tensor to DTensor "
            f"before calling distributed operators! ({info.why_refused})"
        )
    raise NotImplementedError(f"{call.func} on owner-layout tensors is refused: {info.why_refused}")


SHAPE_VIEWS = frozenset({aten.view.default, aten._unsafe_view.default, aten.expand.default, aten.alias.default})


def _keeps_shape_view(call: Call) -> bool:
    """Whether a view asks for the shape its owner-layout input has (a view of the same piece)."""
    a = call.args[0]
    if not isinstance(a, call.cls) or isinstance(a.placement, Partial):
        return False
    if call.func is aten.alias.default:
        return True
    shape = [int(s) for s in call.args[1]]
    if shape.count(-1) == 1 and a.numel() > 0:
        known = 1
        for s in shape:
            known *= s if s != -1 else 1
        shape[shape.index(-1)] = a.numel() // known
    return tuple(shape) == tuple(a.shape)


def _keeps_shape(call: Call) -> bool:
    """Whether a ``resize_`` / ``resize_as_`` asks for the shape the tensor has (a no-op)."""
    target = call.args[1]
    shape = tuple(target.shape) if isinstance(target, torch.Tensor) else tuple(int(s) for s in target)
    return shape == tuple(call.args[0].shape)


def _value(call: Call) -> Any:
    """A Python value: metadata answered from global shapes; otherwise every rank reads the
    whole tensors (a collective unless replicated) and gets the same value."""
    if call.func is aten.is_same_size.default:
        return tuple(call.args[0].shape) == tuple(call.args[1].shape)
    if _all_replicated(call):
        return call.run([a._local_tensor if isinstance(a, DTensor) else a for a in call.flat])
    return call.run([full_of(a) for a in call.flat])


def _random(call: Call, info: OperatorInfo) -> Any:
    """Every rank draws the whole result with its own generator and keeps its piece: under one
    seed the values one process draws, whatever the layout."""
    self_arg = call.args[0] if call.args else None
    converted = []
    for a in call.flat:
        if info.overwrites and a is self_arg and isinstance(a, call.cls):
            converted.append(torch.empty(a.shape, dtype=a.dtype, device=a._local_tensor.device))
        else:
            converted.append(full_of(a))
    out = call.run(converted)
    for a, c in zip(call.flat, converted, strict=True):
        if id(a) in call.written and isinstance(a, DTensor):
            write_piece(a, c, call.func)
    like = next((o for o in call.owners if o.dim() > 0), call.owners[0])
    return call.returns(out, converted, lambda t: lay_out_like(call.cls, like, t))


def _replicated_rule(call: Call) -> Any:
    converted = [a._local_tensor if isinstance(a, DTensor) else a for a in call.flat]
    out = call.run(converted)
    mesh = call.mesh
    return call.returns(out, converted, lambda t: replicated(call.cls, t, mesh))


def _join_partials(call: Call) -> Any:
    """``stack`` / ``cat`` of 0-dim partial values of several holders (``clip_grad_norm_``'s
    per-gradient norms): the local values side by side, still partial of the same kind (zeros
    where a rank holds nothing), as DTensor joins FSDP2's partial norms. None when not that."""
    tensors = call.args[0] if call.args and isinstance(call.args[0], (list, tuple)) else None
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
    out = call.func([t._local_tensor for t in tensors], *call.args[1:], **call.kwargs)
    return DTensor.from_local(out, mesh, [places[0][0]], run_check=False)


def _single_holder(call: Call) -> int | None:
    """The one rank holding every non-replicated tensor of the call, or None."""
    if not call.one_mesh() or not all(_replicated(s) for s in call.stocks):
        return None
    holders = set()
    for o in call.owners:
        if _replicated(o):
            continue
        if o.holder is None or not isinstance(o.placement, (OwnerShard, Partial)):
            return None
        holders.add(o.holder)
    return holders.pop() if len(holders) == 1 else None


def _holder_local(call: Call, holder: int, info: OperatorInfo) -> Any:
    """The holder computes; the others compute shapes on ``meta`` and hold an empty piece; an
    operator whose meta kernel is not exact by construction then agrees (``holder_agreement.py``).
    None: gather."""
    for a in call.flat:  # every written tensor must be held by the holder: nothing else changes
        if id(a) in call.written and not (isinstance(a, call.cls) and a.holder == holder and not _replicated(a)):
            return None
    mesh = call.mesh
    me = local_rank(mesh)
    metas = None
    if not info.meta_trusted:  # every rank, the holder too, checks the shapes compute on meta
        try:
            metas = [_meta(a) for a in call.flat]
            meta_out = call.run(metas)
        except Exception:  # no meta kernel, or a shape read from data: every rank gathers instead
            return None
    error: BaseException | None = None
    written_shapes: list[tuple[torch.Tensor, torch.Size, tuple[int, ...]]] = []
    if me == holder:
        converted = [a._local_tensor if isinstance(a, DTensor) else a for a in call.flat]
        written_shapes = [
            (c, c.shape, c.stride()) for a, c in zip(call.flat, converted, strict=True) if id(a) in call.written
        ]
        try:
            out = call.run(converted)
        except Exception as exc:  # raised below, on every rank (after the agreement)
            error, out = exc, None
    elif metas is not None:
        converted, out = metas, meta_out
    else:
        converted = [_meta(a) for a in call.flat]
        out = call.run(converted)
    if mesh.size() > 1 and not info.meta_exact:
        agreed = agree(call.mesh, call.func, call.flat, call.written, holder, error, out, converted)
        if not agreed:  # the kernel's metadata is not meta's: every rank gathers instead
            if info.inplace:
                raise NotImplementedError(
                    f"{call.func}: its kernel gave a result of other metadata than its meta kernel; the "
                    "holder's tensor was written: compute on full_tensor() values instead"
                )
            for t, shape, stride in written_shapes:  # out= tensors the kernel resized: as they were
                if t.shape != shape:
                    t.resize_(shape).as_strided_(shape, stride)
            return None
    elif error is not None:
        raise error
    # where the holder's result lives (the others computed on meta): a factory's device= if given
    device = torch.device(call.kwargs["device"]) if call.kwargs.get("device") is not None else None
    device = device or call.owners[0]._local_tensor.device

    def wrap(t: torch.Tensor) -> Any:
        shape = tuple(t.shape)
        if t.dim() == 0:
            placement = (norm_partial(call.func, call.args, call.kwargs) if info.norm else None) or Partial("sum")
            local = t if me == holder else _placeholder(t, torch.zeros((), dtype=t.dtype, device=device))
            return call.cls.make(local, mesh, placement, shape, holder=holder)
        local = t if me == holder else _placeholder(t, torch.empty((0, *shape[1:]), dtype=t.dtype, device=device))
        placement = OwnerShard(0, owned_ranges(shape[0], holder, mesh.size()))
        return call.cls.make(local, mesh, placement, shape, t.stride(), holder=holder)

    return call.returns(out, converted, wrap)


def _placeholder(like: torch.Tensor, empty: torch.Tensor) -> torch.Tensor:
    """A non-holder's piece ``empty`` with the conjugate and negative bits of the result ``like``
    (a wrapper takes them from its piece; torch's composites branch on ``is_conj()``)."""
    if like.is_conj():
        empty = empty.conj()
    if like.is_neg():
        empty = empty._neg_view()
    return empty


def _meta(a: Any) -> Any:
    """An argument as ``meta``, to compute the result's shape with no data (a ``device=`` too:
    a factory asked for ``cpu`` would otherwise try to copy data out of ``meta``)."""
    if isinstance(a, torch.device):
        return torch.device("meta")
    if isinstance(a, DTensor):
        return torch.empty_strided(a.shape, a.stride(), dtype=a.dtype, device="meta")
    if isinstance(a, torch.Tensor):
        return a.to("meta")
    return a


def _same_layout(call: Call) -> Any:
    """A pointwise operator on tensors of one placement and shape: the local pieces. None when
    the call is not that."""
    big = [o for o in call.owners if o.dim() > 0]
    if not big or not call.one_mesh():
        return None
    like = big[0]
    if isinstance(like.placement, (Replicate, Partial)):
        return None
    for o in big[1:]:
        if not same_placement(o.placement, like.placement) or tuple(o.shape) != tuple(like.shape):
            return None
    for s in call.stocks:
        if s.dim() > 0:
            return None
    tensor_shapes = [tuple(a.shape) for a in call.flat if isinstance(a, torch.Tensor)]
    try:
        if tuple(torch.broadcast_shapes(*tensor_shapes)) != tuple(like.shape):
            return None
    except RuntimeError:
        return None
    converted = []
    for a in call.flat:
        if isinstance(a, call.cls) and a.dim() > 0:
            converted.append(a._local_tensor)
        elif isinstance(a, DTensor):  # 0-dim: its whole value, the same everywhere
            if id(a) in call.written:
                return None
            converted.append(full_of(a))
        elif isinstance(a, torch.Tensor) and a.dim() > 0:
            if id(a) in call.written:
                return None
            if a.dim() == like.dim() and a.shape[0] == like.shape[0] and like.shape[0] != 1:
                converted.append(like.piece_of_full(a))
            else:
                converted.append(a)  # broadcast along the rows: the same for every piece
        else:
            if isinstance(a, torch.Tensor) and id(a) in call.written:
                return None
            converted.append(a)
    out = call.run(converted)
    mesh, placement, shape = like.device_mesh, like.placement, like.shape
    return call.returns(out, converted, lambda t: call.cls.make(t, mesh, placement, shape, holder=like.holder))


def _row_blocks(call: Call) -> Any:
    """A reduction of ``Shard(0)`` row blocks (FSDP2's form; a gradient norm, a sum) with
    replicated values: DTensor's own rule on the same local tensors and specs, a partial result
    and no gather. Only where every rank holds rows: DTensor's rules run the operator on every
    local piece, and reducing an empty piece can raise on that rank alone. None otherwise."""
    if not call.one_mesh() or call.mesh.ndim != 1:
        return None
    if call.info.norm:
        partial = norm_partial(call.func, call.args, call.kwargs)
        if partial is None or partial.reduce_op in ("max", "min"):
            return None  # an infinite order is a partial max (NaN lost in the combine): gathered
    W = call.mesh.size()
    for o in call.owners:
        if _replicated(o):
            continue
        if type(o.placement) is not Shard or o.dim() == 0:
            return None
        n = int(o.shape[0])
        if any(b <= a for a, b in (chunk_row_range(n, W, r) for r in range(W))):
            return None
    mesh = call.mesh
    converted: list[Any] = []
    for a in call.flat:
        if isinstance(a, call.cls):
            converted.append(a._as_stock())
        elif isinstance(a, torch.Tensor) and not isinstance(a, DTensor):
            converted.append(DTensor.from_local(a, mesh, [Replicate()], run_check=False))
        else:
            converted.append(a)
    out = call.run(converted)
    for a, c in zip(call.flat, converted, strict=True):
        if id(a) in call.written and isinstance(a, call.cls) and tuple(c.placements) != tuple(a._spec.placements):
            raise NotImplementedError(
                f"{call.func} would change the placement of an owner-layout tensor it writes in place "
                f"({a.placement} -> {c.placements[0]}); compute out of place, or on full_tensor()"
            )
    return call.returns(out, converted, lambda t: adopt(call.cls, t))


def adopt(cls: OwnerDTensorType, t: Any) -> Any:
    """A DTensor result of DTensor's own rules as an owner-layout tensor when its placement is
    one of the layout's (``Shard(0)``, ``Replicate()``, a ``Partial``), so that what is computed
    from it next (``item()`` of a partial sum included) follows these rules too; other
    placements (``Shard(1)`` of a transposed row block) stay DTensor's."""
    if not isinstance(t, DTensor) or isinstance(t, cls) or t.device_mesh.ndim != 1:
        return t
    p = t.placements[0]
    if type(p) is Shard and p.dim != 0:
        return t
    return cls.make(t._local_tensor, t.device_mesh, p, t.shape, t.stride())


def _gathered(call: Call) -> Any:
    """Whole values on every rank, the operator on them, every written argument's piece back. A
    view computed this way views the gathered copy, not the tensor: it is marked, and writing it
    is refused (the write could not reach the tensor)."""
    converted = [full_of(a) for a in call.flat]
    out = call.run(converted)
    for a, c in zip(call.flat, converted, strict=True):
        if id(a) in call.written and isinstance(a, DTensor):
            write_piece(a, c, call.func)
    mesh = call.mesh
    is_view = any(r.alias_info is not None and not r.alias_info.is_write for r in call.func._schema.returns)

    def wrap(t: torch.Tensor) -> Any:
        r = replicated(call.cls, t, mesh)
        if is_view:
            r._gathered_view = True
        return r

    return call.returns(out, converted, wrap)


def run_rules(
    cls: OwnerDTensorType, func: Any, args: tuple, kwargs: dict, info: OperatorInfo
) -> tuple[str, int | None, Any]:
    """Run ``func`` (not a list operator: ``lists.py``) on arguments of which at least one is an
    owner-layout tensor; the rule it took and its holder too (``decisions.py`` records the local
    rules' decisions)."""
    call = Call(cls, func, args, kwargs or {}, info)
    if func in (aten.resize_.default, aten.resize_as_.default) and _keeps_shape(call):
        return "no-op", None, call.args[0]  # out= kernels resize their out tensor to the shape it already has
    if info.cls is OpClass.REFUSED:
        return "refused", None, _refuse(call, info)
    for a in call.flat:
        if id(a) in call.written and getattr(a, "_gathered_view", False):
            raise NotImplementedError(
                f"{func} writes a view that was computed on a gathered copy of an owner-layout tensor (a view "
                "the layout cannot keep in place): the write would not reach the tensor. Write the tensor "
                "itself (or its full_tensor() and copy_ it back)"
            )
    if func in SHAPE_VIEWS and _keeps_shape_view(call):
        like = call.args[0]  # the same piece under the same spec
        return "view", None, cls._wrap(like._local_tensor.view(like._local_tensor.shape), like._spec, like._holder)
    if func in NEW_FACTORIES:  # only self's dtype and device are read: a plain (replicated) tensor
        return "factory", None, func(args[0]._local_tensor, *args[1:], **(kwargs or {}))
    if func is aten.copy_.default and isinstance(args[0], cls):
        return "copy_", None, copy_into(args[0], args[1])
    if info.cls is OpClass.VALUE:
        return "value", None, _value(call)
    if info.cls is OpClass.RANDOM and not _all_replicated(call):
        return "random", None, _random(call, info)
    if call.two_d:  # the 2D mesh's local rules ran first (two_dim.local_2d)
        return "gathered", None, _gathered(call)
    if _all_replicated(call):
        return "replicated", None, _replicated_rule(call)
    if info.join:
        joined = _join_partials(call)
        if joined is not None:
            return "partial join", None, joined
    holder = _single_holder(call)
    if holder is not None and info.meta:
        out = _holder_local(call, holder, info)
        if out is not None:
            return "holder-local", holder, out
    if info.pointwise:
        out = _same_layout(call)
        if out is not None:
            return "same layout", None, out
    if info.row_blocks:
        out = _row_blocks(call)
        if out is not None:
            return "row blocks", None, out
    return "gathered", None, _gathered(call)

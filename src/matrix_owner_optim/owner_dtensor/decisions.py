"""Cached decisions: a call whose rule was decided from metadata once runs that rule again with
no pytree, no re-decision and no new ``DTensorSpec``, as DTensor's ``_sharding_prop`` caches
output shardings (DESIGN.md, "The representation", says which rules are recorded and why).

A key is the operator, every argument's spec and holder, and the kinds (or, where they can
matter, the values) of the other arguments. A Python ``float`` enters by its kind only for the
pointwise operators of ``_FLOAT_BY_KIND`` (type promotion reads a scalar's kind, never its
value: a learning-rate schedule must not grow the cache). A mesh keeps its table in its own
``__dict__``: the entries hold specs, which hold the mesh, so a process-wide table would keep
the mesh's process group alive (``tensor.py: _MESHES``); a pickled or copied mesh takes an
empty table.
"""

from __future__ import annotations

from typing import Any

import torch
from torch.distributed.tensor import DTensor, Partial, Replicate
from torch.distributed.tensor._dtensor_spec import DTensorSpec, TensorMeta

from .dispatch import OwnerDTensorType, local_rank
from .ops import OpClass, OperatorInfo, operator_info
from .placement import MeshTable, OwnerShard, contiguous_stride, owned_ranges, same_layout

aten = torch.ops.aten

__all__ = ["MISS", "LEARNABLE_RULES", "fast_call", "learn", "learn_list"]

MISS: Any = object()  # no recorded decision: the general rules run
_TABLE = "_owner_layout_decisions"  # the attribute a mesh keeps its table in
_LIMIT = 4096  # entries per mesh before its table starts over (shapes in a model are few)

# The rules whose decision can be recorded (``dispatch.py`` names the rule every call took).
LEARNABLE_RULES = frozenset({"holder-local", "same layout", "replicated", "copy_", "row blocks", "partial join"})

_PLAIN_SCALARS = (int, bool, str, type(None), torch.dtype, torch.device, torch.memory_format, torch.layout)
_FLOAT = object()  # the key of a float whose value does not enter the decision


def _sig(a: Any, cls: OwnerDTensorType) -> Any:
    """A non-owner, non-float argument's part of the key, or None when it cannot be keyed."""
    t = type(a)
    if t in _PLAIN_SCALARS:
        return (t, a)
    if t is torch.Tensor:
        return ("T", a.shape, a.stride(), a.dtype, a.device, a.is_conj(), a.is_neg())
    if t is list or t is tuple:
        return (t, tuple(a)) if all(type(v) is int for v in a) else None
    if isinstance(a, DTensor) and not isinstance(a, cls):  # a 0-dim value every rank holds
        if a.dim() == 0 and all(isinstance(p, Replicate) for p in a._spec.placements):
            return ("D", a._spec)
    return None


def _key(func: Any, args: tuple, kwargs: dict, cls: OwnerDTensorType) -> tuple[Any, tuple] | None:
    """(the first owner-layout tensor, the call's key), or None. A list of owner-layout tensors
    (list operators, ``stack``) is keyed element by element. One pass, no pytree: this runs on
    every call an owner-layout tensor takes part in."""
    parts: list[Any] = [id(func)]  # operators live as long as the process
    first = None
    by_kind = None  # whether the operator's floats enter by kind (read at the first float)
    for a in args:
        t = type(a)
        if t is cls:
            if a._gathered_view:
                return None
            if first is None:
                first = a
            parts.append(a._spec)
            parts.append(a._holder)
        elif t is float:
            if by_kind is None:
                by_kind = operator_info(func).float_by_kind
            parts.append(_FLOAT if by_kind else (float, a))
        elif (t is list or t is tuple) and a and type(a[0]) is cls:
            sigs = []
            for e in a:
                if type(e) is not cls or e._gathered_view:
                    return None
                sigs.append(e._spec)
                sigs.append(e._holder)
            if first is None:
                first = a[0]
            parts.append(tuple(sigs))
        else:
            s = _sig(a, cls)
            if s is None:
                return None
            parts.append(s)
    if first is None:
        return None
    for name, v in kwargs.items():
        if type(v) is float:
            if by_kind is None:
                by_kind = operator_info(func).float_by_kind
            s = _FLOAT if by_kind else (float, v)
        elif isinstance(v, torch.Tensor) or (s := _sig(v, cls)) is None:
            return None
        parts.append(name)
        parts.append(s)
    parts.append(first._local_tensor.device)  # a meta-initialised piece is not a materialised one
    return first, tuple(parts)


def fast_call(cls: OwnerDTensorType, func: Any, args: tuple, kwargs: dict) -> Any:
    """The recorded decision for this call run on its arguments, or :data:`MISS`."""
    keyed = _key(func, args, kwargs, cls)
    if keyed is None:
        return MISS
    table = keyed[0]._spec.mesh.__dict__.get(_TABLE)  # the first owner-layout argument's mesh
    decision = None if table is None else table.get(keyed[1])
    return MISS if decision is None else decision.run(func, args, kwargs)


def _locals(args: tuple) -> list:
    return [a._local_tensor if isinstance(a, DTensor) else a for a in args]


def _meta_of(spec: DTensorSpec) -> TensorMeta:
    meta = spec.tensor_meta
    assert meta is not None
    return meta


def _matches(t: torch.Tensor, meta: TensorMeta) -> bool:
    return t.shape == meta.shape and t.stride() == meta.stride and t.dtype == meta.dtype


class _InPlace:
    """An in-place call: the rank runs the kernel on its pieces when it holds any; the tensor back."""

    __slots__ = ("runs",)

    def __init__(self, runs: bool) -> None:
        self.runs = runs

    def run(self, func: Any, args: tuple, kwargs: dict) -> Any:
        if self.runs:
            func._op(*_locals(args), **kwargs)
        return args[0]


class _HolderOut:
    """Holder-local, out of place: the holder's result under the recorded spec (a new spec only
    where the kernel gave other metadata, as the general rule would wrap it)."""

    __slots__ = ("cls", "spec", "holder")

    def __init__(self, cls: Any, spec: DTensorSpec, holder: int) -> None:
        self.cls, self.spec, self.holder = cls, spec, holder

    def run(self, func: Any, args: tuple, kwargs: dict) -> Any:
        t = func._op(*_locals(args), **kwargs)
        if _matches(t, _meta_of(self.spec)):
            return self.cls._wrap(t, self.spec, self.holder)
        mesh, placement = self.spec.mesh, self.spec.placements[0]
        if t.dim() > 0:
            placement = OwnerShard(0, owned_ranges(int(t.shape[0]), self.holder, mesh.size()))
        return self.cls.make(t, mesh, placement, t.shape, t.stride(), holder=self.holder)


class _Placeholder:
    """Holder-local on a rank that holds nothing: an empty piece (a zero for a 0-dim result)
    under the recorded spec; no kernel, no ``meta``."""

    __slots__ = ("cls", "spec", "holder", "shape", "dtype", "device", "zeros")

    def __init__(self, cls: Any, spec: DTensorSpec, holder: int | None, piece: torch.Tensor) -> None:
        self.cls, self.spec, self.holder = cls, spec, holder
        self.shape, self.dtype, self.device = tuple(piece.shape), piece.dtype, piece.device
        self.zeros = piece.dim() == 0

    def piece(self) -> torch.Tensor:
        return (torch.zeros if self.zeros else torch.empty)(self.shape, dtype=self.dtype, device=self.device)

    def run(self, func: Any, args: tuple, kwargs: dict) -> Any:
        return self.cls._wrap(self.piece(), self.spec, self.holder)


class _LocalOut:
    """Same layout, replicated or a row-block norm, out of place: the local result under the
    recorded spec when its dtype (same layout and norms: the global shape is the recorded one)
    or its metadata (replicated) match."""

    __slots__ = ("cls", "spec", "holder", "replicated")

    def __init__(self, cls: Any, spec: DTensorSpec, holder: int | None, replicated: bool) -> None:
        self.cls, self.spec, self.holder, self.replicated = cls, spec, holder, replicated

    def run(self, func: Any, args: tuple, kwargs: dict) -> Any:
        t = func._op(*_locals(args), **kwargs)
        meta = _meta_of(self.spec)
        if _matches(t, meta) if self.replicated else t.dtype == meta.dtype:
            return self.cls._wrap(t, self.spec, self.holder)
        if self.replicated:
            return self.cls.make(t, self.spec.mesh, Replicate(), t.shape, t.stride())
        return self.cls.make(t, self.spec.mesh, self.spec.placements[0], meta.shape, holder=self.holder)


class _CopyLocal:
    """``dst.copy_(src)`` of one layout: piece to piece."""

    __slots__ = ()

    def run(self, func: Any, args: tuple, kwargs: dict) -> Any:
        dst = args[0]
        dst._local_tensor.copy_(args[1]._local_tensor, *args[2:], **kwargs)
        return dst


class _Join:
    """``stack`` / ``cat`` of 0-dim partial values: the local values side by side, as the
    recorded (stock DTensor) partial."""

    __slots__ = ("spec",)

    def __init__(self, spec: DTensorSpec) -> None:
        self.spec = spec

    def run(self, func: Any, args: tuple, kwargs: dict) -> Any:
        local = func([t._local_tensor for t in args[0]], *args[1:], **kwargs)
        if not _matches(local, _meta_of(self.spec)):
            return DTensor.from_local(local, self.spec.mesh, self.spec.placements, run_check=False)
        return DTensor.__new__(DTensor, local, self.spec, requires_grad=False)  # type: ignore[call-arg]


def _decision(cls: Any, rule: str, holder: int | None, me: int, info: OperatorInfo, args: tuple, out: Any) -> Any:
    """The decision to record for a call the general rules ran as ``rule``, or None."""
    if rule == "partial join":
        return _Join(out._spec) if type(out) is DTensor and len(args) <= 2 else None
    if any(type(a) in (list, tuple) and any(isinstance(e, torch.Tensor) for e in a) for a in args):
        return None  # the other decisions run on ``_locals``, which does not look into lists
    if rule == "copy_":
        src = args[1]
        if type(src) is cls and src._local_tensor.numel() == args[0]._local_tensor.numel():
            return _CopyLocal() if out is args[0] and same_layout(args[0], src) else None
        return None
    if info.inplace:
        if out is not args[0] or info.written != ((0, "self", False),) or rule == "row blocks":
            return None
        return _InPlace(runs=rule != "holder-local" or me == holder)
    if type(out) is not cls or out._local_tensor.is_conj() or out._local_tensor.is_neg():
        return None
    spec = out._spec
    if rule == "holder-local":
        assert holder is not None
        return _Placeholder(cls, spec, holder, out._local_tensor) if me != holder else _HolderOut(cls, spec, holder)
    if rule == "row blocks":  # a whole-tensor norm of one Shard(0) tensor: the local norm, partial
        tensors = [a for a in args if isinstance(a, torch.Tensor)]
        if not info.norm or out.dim() != 0 or len(tensors) != 1 or not isinstance(spec.placements[0], Partial):
            return None
        return _LocalOut(cls, spec, None, replicated=False)
    if rule == "same layout":
        if not _pieces_as_given(cls, args):
            return None
        meta = _meta_of(spec)
        if tuple(meta.stride) != contiguous_stride(meta.shape) or isinstance(spec.placements[0], (Replicate, Partial)):
            return None
        return _LocalOut(cls, spec, out._holder, replicated=False)
    if rule == "replicated":
        return _LocalOut(cls, spec, out._holder, replicated=True)
    return None


def _pieces_as_given(cls: Any, args: tuple) -> bool:
    """Whether the same-layout rule passed every argument's local piece or the argument itself
    (what :func:`_locals` passes): not a plain tensor of rows (cut to this rank's rows) nor a
    0-dim value held by one rank (read whole); those calls take the general rule every time."""
    for a in args:
        if isinstance(a, cls):
            if a.dim() == 0 and not isinstance(a._spec.placements[0], Replicate):
                return False
        elif isinstance(a, torch.Tensor) and not isinstance(a, DTensor) and a.dim() > 0:
            return False
    return True


def learn(
    cls: Any, func: Any, args: tuple, kwargs: dict, info: OperatorInfo, rule: str, holder: int | None, out: Any
) -> None:
    """Record the decision of a call the general rules just ran as ``rule``; nothing for the
    rules whose work depends on more than the key."""
    if rule not in LEARNABLE_RULES or info.cls is not OpClass.GENERAL:
        return
    if rule == "holder-local" and not (info.meta_trusted and info.meta_exact):
        return  # the general rule checks on meta first, or agrees over the mesh: every call
    keyed = _key(func, args, kwargs, cls)
    if keyed is None or keyed[0]._spec.mesh.ndim != 1:
        return
    mesh = keyed[0]._spec.mesh
    decision = _decision(cls, rule, holder, local_rank(mesh), info, args, out)
    if decision is not None:
        _store(mesh, keyed[1], decision)


class _ListLocal:
    """A list call every element of which ran on its local pieces: the kernel on the elements this
    rank holds rows of (one call), the recorded spec around each result, and the recorded empty
    piece (a zero for a norm: the general rule's norm of nothing held) for the others."""

    __slots__ = ("cls", "held", "results")

    def __init__(self, cls: Any, held: tuple[int, ...], results: tuple | None) -> None:
        self.cls, self.held, self.results = cls, held, results

    def run(self, func: Any, args: tuple, kwargs: dict) -> Any:
        held = self.held
        out: Any = ()
        if held:
            largs = [
                [a[j]._local_tensor for j in held]
                if type(a) in (list, tuple)
                else (a._local_tensor if isinstance(a, DTensor) else a)
                for a in args
            ]
            out = func(*largs, **kwargs)
        if self.results is None:
            return None
        results: list[Any] = []
        it = iter(out)
        cls = self.cls
        for spec, holder, empty in self.results:
            if empty is not None:
                results.append(cls._wrap(empty.piece(), spec, holder))
                continue
            t = next(it)  # held: the kernel's result
            meta = spec.tensor_meta
            if t.dtype == meta.dtype and (t.dim() == 0 or t.shape[1:] == meta.shape[1:]):
                results.append(cls._wrap(t, spec, holder))
            else:
                results.append(cls.make(t, spec.mesh, spec.placements[0], meta.shape, holder=holder))
        return results


def learn_list(cls: Any, func: Any, args: tuple, kwargs: dict, out: Any) -> None:
    """Record a list call whose every element ran on its local pieces (``lists.py``). Non-list
    owner-layout arguments (a value one rank holds) are read whole by the list rule: not keyed."""
    if any(type(a) is cls for a in args):
        return
    keyed = _key(func, args, kwargs, cls)
    if keyed is None or keyed[0]._spec.mesh.ndim != 1:
        return
    lists = [a for a in args if type(a) in (list, tuple) and a and type(a[0]) is cls]
    n = len(lists[0])
    held = tuple(j for j in range(n) if lists[0][j]._local_tensor.numel() > 0)
    results: tuple | None = None
    if out is not None:
        if not isinstance(out, list) or len(out) != n or not all(type(t) is cls for t in out):
            return
        recorded = []
        for j, t in enumerate(out):
            local = t._local_tensor
            if local.is_conj() or local.is_neg() or t._spec.mesh.ndim != 1:
                return
            empty = None if j in held else _Placeholder(cls, t._spec, t._holder, local)
            if empty is not None and (local.numel() != 0 if local.dim() else bool(local.item() != 0)):
                return  # not the empty piece (or zero) a rank holding nothing has
            recorded.append((t._spec, t._holder, empty))
        results = tuple(recorded)
    _store(keyed[0]._spec.mesh, keyed[1], _ListLocal(cls, held, results))


def _store(mesh: Any, key: Any, decision: Any) -> None:
    table = mesh.__dict__.get(_TABLE)
    if table is None or len(table) >= _LIMIT:
        table = MeshTable()
        mesh.__dict__[_TABLE] = table
    table[key] = decision

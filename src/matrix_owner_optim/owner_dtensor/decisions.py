"""Cached decisions: a call whose rule was decided from metadata once runs that rule again with
no pytree, no re-decision and no new ``DTensorSpec`` (DESIGN.md, "The representation").

The rules (``dispatch.py``) choose from metadata only: the operator, the arguments' specs (mesh,
placements, shape, stride, dtype), their holders, the kinds and, where they can matter, the
values of the non-tensor arguments. So the rule and the result's metadata are a function of a
key built from exactly that, and a second call with the same key may reuse both, as DTensor's
``_sharding_prop`` caches output shardings. The first call with a key runs the general rules;
when the rule it took is one of the local rules below, its result is recorded; later calls with
that key take the recorded decision:

* **holder-local** (one holder, an operator whose meta result is exact and trusted, so the
  general rule issues no collective): the holder runs the kernel on its pieces and wraps the
  result with the recorded spec; a non-holder runs nothing (no ``meta`` kernel) and returns an
  empty piece under the recorded spec; an in-place call returns its tensor.
* **same layout** (a pointwise operator on tensors of one placement and shape): local pieces.
* **replicated** (every tensor whole on every rank): local values.
* **copy_** between two tensors of one layout: piece to piece.

The holder runs the kernel every time, so an error the kernel raises on values still raises
there (as under the general rule); only what the general rule computed from metadata is reused.
Below autograd (``__torch_dispatch__``) ``requires_grad`` and grad mode do not enter a rule, so
they are not in the key. A key records a Python ``float`` by its kind only for the pointwise
operators of ``_FLOAT_BY_KIND`` (type promotion reads a scalar's kind, never its value: a
learning-rate schedule must not grow the cache); every other scalar is recorded by value.

The table of a mesh lives on the mesh object itself: its entries hold specs, which hold the
mesh, so a table kept by a process-wide cache would keep the mesh's process group alive
(``tensor.py: _MESHES`` says why that aborts at exit); on the mesh it is a cycle the garbage
collector frees with the mesh. A pickled or copied mesh takes an empty table.
"""

from __future__ import annotations

import collections
from typing import Any

import torch
from torch.distributed.tensor import DTensor, Partial, Replicate
from torch.distributed.tensor._dtensor_spec import DTensorSpec, TensorMeta

from .dispatch import OwnerDTensorType, local_rank
from .ops import OpClass, OperatorInfo
from .placement import OwnerShard, contiguous_stride, owned_ranges

aten = torch.ops.aten

__all__ = ["MISS", "LEARNABLE_RULES", "fast_call", "learn", "learn_list"]

MISS: Any = object()  # no recorded decision: the general rules run
_TABLE = "_owner_layout_decisions"  # the attribute a mesh keeps its table in
_LIMIT = 4096  # entries per mesh before its table starts over (shapes in a model are few)

# The rules whose decision can be recorded (``dispatch.py`` names the rule every call took).
LEARNABLE_RULES = frozenset({"holder-local", "same layout", "replicated", "copy_"})

# Pointwise operators whose float scalars matter to the result's metadata by kind only.
_FLOAT_BY_KIND = frozenset(
    {
        "add",
        "sub",
        "mul",
        "div",
        "lerp",
        "addcmul",
        "addcdiv",
        "fill",
        "clamp",
        "clamp_min",
        "clamp_max",
        "pow",
        "rsub",
        "maximum",
        "minimum",
        "where",
        "sqrt",
        "neg",
        "abs",
    }
)
_PLAIN_SCALARS = (int, bool, str, type(None), torch.dtype, torch.device, torch.memory_format, torch.layout)


class _Float:
    """The key of a float whose value does not enter the decision (one per operator call)."""


_FLOAT = _Float()


def _owner_sig(a: Any) -> Any:
    if a._gathered_view:
        return None
    return (a._spec, a._holder)


def _sig(a: Any, owner_cls: OwnerDTensorType, float_by_kind: bool) -> Any:
    """One argument's part of the key, or None when the argument cannot be keyed."""
    t = type(a)
    if t is owner_cls:
        return _owner_sig(a)
    if t is float:
        return _FLOAT if float_by_kind else (float, a)
    if t in _PLAIN_SCALARS:
        return (t, a)
    if t is torch.Tensor:
        return ("T", a.shape, a.stride(), a.dtype, a.device, a.is_conj(), a.is_neg())
    if t is list or t is tuple:
        if all(type(v) is int for v in a):
            return (t, tuple(a))
        return None
    if isinstance(a, DTensor) and not isinstance(a, owner_cls):  # a 0-dim value every rank holds
        if a.dim() == 0 and all(isinstance(p, Replicate) for p in a._spec.placements):
            return ("D", a._spec)
    return None


def _key(func: Any, args: tuple, kwargs: dict, owner_cls: OwnerDTensorType, first: Any) -> Any:
    float_by_kind = _packet_name(func) in _FLOAT_BY_KIND
    parts: list[Any] = [id(func), first._local_tensor.device]  # operators live as long as the process
    for a in args:
        if type(a) is owner_cls:  # the common case, inline
            if a._gathered_view:
                return None
            parts.append(a._spec)
            parts.append(a._holder)
            continue
        s = _sig(a, owner_cls, float_by_kind)
        if s is None:
            return None
        parts.append(s)
    if kwargs:
        for name, v in kwargs.items():
            s = _sig(v, owner_cls, float_by_kind)
            if s is None or isinstance(v, torch.Tensor):
                return None
            parts.append((name, s))
    return tuple(parts)


def _packet_name(func: Any) -> str:
    return str(func._overloadpacket.__name__).rstrip("_")


def _first_owner(args: tuple, owner_cls: OwnerDTensorType) -> Any:
    for a in args:
        if type(a) is owner_cls:
            return a
    return None


def fast_call(owner_cls: OwnerDTensorType, func: Any, args: tuple, kwargs: dict) -> Any:
    """The recorded decision for this call run on its arguments, or :data:`MISS`."""
    if args and type(args[0]) in (list, tuple):
        return _fast_list(owner_cls, func, args, kwargs)
    first = _first_owner(args, owner_cls)
    if first is None:
        return MISS
    table = first._spec.mesh.__dict__.get(_TABLE)
    if not table:
        return MISS
    key = _key(func, args, kwargs, owner_cls, first)
    if key is None:
        return MISS
    decision = table.get(key)
    if decision is None:
        return MISS
    return decision.run(func, args, kwargs)


def _locals(args: tuple) -> list:
    return [a._local_tensor if isinstance(a, DTensor) else a for a in args]


def _meta_of(spec: DTensorSpec) -> TensorMeta:
    meta = spec.tensor_meta
    assert meta is not None
    return meta


class _InPlace:
    """An in-place call: the rank runs the kernel on its pieces when it holds any; the tensor back."""

    __slots__ = ("runs",)

    def __init__(self, runs: bool) -> None:
        self.runs = runs

    def run(self, func: Any, args: tuple, kwargs: dict) -> Any:
        if self.runs:
            func(*_locals(args), **kwargs)
        return args[0]


class _HolderOut:
    """Holder-local, out of place: the holder's result under the recorded spec (a new spec only
    where the kernel gave other metadata, as the general rule would wrap it)."""

    __slots__ = ("cls", "spec", "holder")

    def __init__(self, cls: Any, spec: DTensorSpec, holder: int) -> None:
        self.cls, self.spec, self.holder = cls, spec, holder

    def run(self, func: Any, args: tuple, kwargs: dict) -> Any:
        t = func(*_locals(args), **kwargs)
        meta = _meta_of(self.spec)
        if t.shape == meta.shape and t.stride() == meta.stride and t.dtype == meta.dtype:
            return self.cls._wrap(t, self.spec, self.holder)
        mesh, placement = self.spec.mesh, self.spec.placements[0]
        if t.dim() > 0:
            placement = OwnerShard(0, owned_ranges(int(t.shape[0]), self.holder, mesh.size()))
        return self.cls.make(t, mesh, placement, t.shape, t.stride(), holder=self.holder)


class _Placeholder:
    """Holder-local on a rank that holds nothing: an empty piece under the recorded spec."""

    __slots__ = ("cls", "spec", "holder", "shape", "dtype", "device", "zeros")

    def __init__(self, cls: Any, spec: DTensorSpec, holder: int, piece: torch.Tensor) -> None:
        self.cls, self.spec, self.holder = cls, spec, holder
        self.shape, self.dtype, self.device = tuple(piece.shape), piece.dtype, piece.device
        self.zeros = piece.dim() == 0

    def run(self, func: Any, args: tuple, kwargs: dict) -> Any:
        make = torch.zeros if self.zeros else torch.empty
        return self.cls._wrap(make(self.shape, dtype=self.dtype, device=self.device), self.spec, self.holder)


class _LocalOut:
    """Same layout or replicated, out of place: the local result under the recorded spec when its
    dtype (same layout: the global shape is the input's) or its metadata (replicated) match."""

    __slots__ = ("cls", "spec", "holder", "replicated")

    def __init__(self, cls: Any, spec: DTensorSpec, holder: int | None, replicated: bool) -> None:
        self.cls, self.spec, self.holder, self.replicated = cls, spec, holder, replicated

    def run(self, func: Any, args: tuple, kwargs: dict) -> Any:
        t = func(*_locals(args), **kwargs)
        meta = _meta_of(self.spec)
        mesh = self.spec.mesh
        if self.replicated:
            if t.shape == meta.shape and t.stride() == meta.stride and t.dtype == meta.dtype:
                return self.cls._wrap(t, self.spec, self.holder)
            return self.cls.make(t, mesh, Replicate(), t.shape, t.stride())
        if t.dtype == meta.dtype:
            return self.cls._wrap(t, self.spec, self.holder)
        return self.cls.make(t, mesh, self.spec.placements[0], meta.shape, holder=self.holder)


class _CopyLocal:
    """``dst.copy_(src)`` of one layout: piece to piece."""

    __slots__ = ()

    def run(self, func: Any, args: tuple, kwargs: dict) -> Any:
        dst = args[0]
        dst._local_tensor.copy_(args[1]._local_tensor, *args[2:], **kwargs)
        return dst


def _decision(cls: Any, rule: str, holder: int | None, me: int, info: OperatorInfo, args: tuple, out: Any) -> Any:
    """The decision to record for a call the general rules ran as ``rule``, or None."""
    if rule == "copy_":
        src = args[1]
        if type(src) is cls and src._local_tensor.numel() == args[0]._local_tensor.numel():
            return _CopyLocal() if out is args[0] and _copied_piece_to_piece(args[0], src) else None
        return None
    if info.inplace:
        if out is not args[0] or info.written != ((0, "self", False),):
            return None
        return _InPlace(runs=rule != "holder-local" or me == holder)
    if type(out) is not cls or out._local_tensor.is_conj() or out._local_tensor.is_neg():
        return None
    spec = out._spec
    if rule == "holder-local":
        assert holder is not None
        if me != holder:
            return _Placeholder(cls, spec, holder, out._local_tensor)
        return _HolderOut(cls, spec, holder)
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
    (what :func:`_locals` passes): owner-layout tensors of rows or replicated, 0-dim plain
    tensors. A plain tensor of rows is cut to this rank's rows, a 0-dim value held by one rank is
    read whole: those calls take the general rule every time."""
    for a in args:
        if isinstance(a, cls):
            if a.dim() == 0 and not isinstance(a._spec.placements[0], Replicate):
                return False
        elif isinstance(a, torch.Tensor) and not isinstance(a, DTensor) and a.dim() > 0:
            return False
    return True


def _copied_piece_to_piece(dst: Any, src: Any) -> bool:
    """Whether ``copy_``'s rule took its piece-to-piece branch (its first test, repeated)."""
    from .placement import same_placement

    return (
        same_placement(src.placement, dst.placement)
        and src.holder == dst.holder
        and tuple(src.shape) == tuple(dst.shape)
        and src.device_mesh == dst.device_mesh
    )


def learn(
    cls: Any, func: Any, args: tuple, kwargs: dict, info: OperatorInfo, rule: str, holder: int | None, out: Any
) -> None:
    """Record the decision of a call the general rules just ran as ``rule`` (see the module
    docstring); nothing for the rules whose work depends on more than the key."""
    if rule not in LEARNABLE_RULES or info.cls is not OpClass.GENERAL:
        return
    if rule == "holder-local" and not (info.meta_trusted and info.meta_exact):
        return  # the general rule checks on meta first, or agrees over the mesh: every call
    first = _first_owner(args, cls)
    if first is None or first._spec.mesh.ndim != 1:
        return
    key = _key(func, args, kwargs, cls, first)
    if key is None:
        return
    mesh = first._spec.mesh
    decision = _decision(cls, rule, holder, local_rank(mesh), info, args, out)
    if decision is not None:
        _store(mesh, key, decision)


# -- list operators (``lists.py``): every element on its local pieces ------------------------------


def _list_key(func: Any, args: tuple, kwargs: dict, owner_cls: OwnerDTensorType) -> Any:
    """The key of a list call whose list arguments hold owner-layout tensors only (1D meshes),
    or None. Floats by kind except ``_foreach_norm``'s order (which picks the partial norm)."""
    float_by_kind = func not in _NORM_LISTS
    parts: list[Any] = [id(func)]
    first = None
    for a in args:
        t = type(a)
        if t is list or t is tuple:
            sigs = []
            for e in a:
                if type(e) is not owner_cls or e._gathered_view:
                    return None
                sigs.append((e._spec, e._holder))
            if first is None and a:
                first = a[0]
            parts.append(tuple(sigs))
        else:
            s = _sig(a, owner_cls, float_by_kind)
            if s is None or isinstance(a, owner_cls):
                return None
            parts.append(s)
    for name, v in kwargs.items():
        s = _sig(v, owner_cls, float_by_kind)
        if s is None or isinstance(v, torch.Tensor):
            return None
        parts.append((name, s))
    if first is None or first._spec.mesh.ndim != 1:
        return None
    return first, tuple(parts)


_NORM_LISTS = frozenset({aten._foreach_norm.Scalar})


def _fast_list(owner_cls: OwnerDTensorType, func: Any, args: tuple, kwargs: dict) -> Any:
    first = next((l[0] for l in args if type(l) in (list, tuple) and l and type(l[0]) is owner_cls), None)
    if first is None:
        return MISS
    table = first._spec.mesh.__dict__.get(_TABLE)
    if not table:
        return MISS
    keyed = _list_key(func, args, kwargs, owner_cls)
    if keyed is None:
        return MISS
    decision = table.get(keyed[1])
    if decision is None:
        return MISS
    return decision.run(func, args, kwargs)


class _ListLocal:
    """A list call every element of which ran on its local pieces: the kernel on the elements
    this rank holds rows of (one call), the recorded spec around each result, and the recorded
    empty piece (a zero for a norm) for the others, which the kernel would only compute on
    empty pieces (the general rule's norm of nothing held: 0)."""

    __slots__ = ("cls", "held", "results")

    def __init__(self, cls: Any, held: tuple[int, ...], results: tuple | None) -> None:
        self.cls, self.held, self.results = cls, held, results

    def run(self, func: Any, args: tuple, kwargs: dict) -> Any:
        held = self.held
        out = None
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
        it = iter(out) if out is not None else iter(())
        cls = self.cls
        for spec, holder, piece in self.results:
            if piece is None:  # held: the kernel's result
                t = next(it)
                meta = spec.tensor_meta
                if t.dtype == meta.dtype and (t.dim() == 0 or t.shape[1:] == meta.shape[1:]):
                    results.append(cls._wrap(t, spec, holder))
                else:
                    results.append(cls.make(t, spec.mesh, spec.placements[0], meta.shape, holder=holder))
            else:
                shape, dtype, device = piece
                make = torch.zeros if not shape else torch.empty
                results.append(cls._wrap(make(shape, dtype=dtype, device=device), spec, holder))
        return results


def learn_list(cls: Any, func: Any, args: tuple, kwargs: dict, out: Any) -> None:
    """Record a list call whose every element ran on its local pieces (``lists.py``)."""
    keyed = _list_key(func, args, kwargs, cls)
    if keyed is None:
        return
    first, key = keyed
    lists = [a for a in args if type(a) in (list, tuple)]
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
            piece = None if j in held else (tuple(local.shape), local.dtype, local.device)
            if piece is not None and (local.numel() != 0 if local.dim() else bool(local.item() != 0)):
                return  # not the empty piece (or zero) a rank holding nothing has
            recorded.append((t._spec, t._holder, piece))
        results = tuple(recorded)
    _store(first._spec.mesh, key, _ListLocal(cls, held, results))


class _Table(dict):
    """A mesh's recorded decisions. A mesh pickled or deep-copied (``torch.save`` of a state
    dict, ``copy.deepcopy`` of a model) takes an empty OrderedDict from the standard library
    instead: decisions are this process's, and ``torch.load(weights_only=True)`` (or a process
    without this package) accepts that type."""

    def __reduce__(self) -> Any:
        return (collections.OrderedDict, ())


def _store(mesh: Any, key: Any, decision: Any) -> None:
    table = mesh.__dict__.get(_TABLE)
    if table is None or len(table) >= _LIMIT:
        table = _Table()
        mesh.__dict__[_TABLE] = table
    table[key] = decision

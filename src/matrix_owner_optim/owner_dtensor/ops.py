"""Operator classes: what the owner layout's dispatch must know of an aten operator, read once.

Pure classification from the operator's schema, tags and registrations, no tensors:
``dispatch.py`` decides each call's rule from this and the arguments' placements. Every field is
a property of the operator alone (never of a value), so every rank classifies a call the same
way and takes the same rule: the basis of "exact on every rank, or refused on every rank".
"""

from __future__ import annotations

import enum
import functools
import math
from dataclasses import dataclass
from typing import Any

import torch
from torch.distributed.tensor import DTensor, Partial
from torch.distributed.tensor._ops._math_ops import _NormPartial

aten = torch.ops.aten

__all__ = [
    "JOINS",
    "NEW_FACTORIES",
    "NORMS",
    "ROW_BLOCK_REDUCTIONS",
    "OpClass",
    "OperatorInfo",
    "mutated_arguments",
    "norm_partial",
    "operator_info",
]


class OpClass(enum.Enum):
    """Which family of rules an operator takes (``dispatch.py`` has one rule set per class)."""

    REFUSED = "refused"  # collectives and storage surgery: refused on every rank
    LIST = "list"  # _foreach_*, _fused_*, _amp_foreach_*: per element of its tensor lists
    VALUE = "value"  # returns a Python value (item(), bool(), equal): a collective read
    RANDOM = "random"  # draws from the generator: every rank draws the whole tensor
    GENERAL = "general"  # everything else: replicated / holder-local / same-layout / rows / gathered


def _overloads(names: str) -> frozenset[Any]:
    """The aten overloads named ``op.overload`` in ``names`` (whitespace-separated)."""
    return frozenset(getattr(getattr(aten, n.split(".")[0]), n.split(".")[1]) for n in names.split())


# Operators whose result is their first argument's shape element by element, beyond those aten
# tags ``pointwise`` (views and factories of the same shape, in-place fills and copies).
ELEMENTWISE = _overloads(
    "detach.default alias.default clone.default _to_copy.default zeros_like.default ones_like.default "
    "empty_like.default full_like.default fill_.Scalar fill_.Tensor zero_.default lerp_.Scalar lerp_.Tensor "
    "lerp.Scalar lerp.Tensor"
)
NORMS = _overloads("linalg_vector_norm.default norm.Scalar norm.ScalarOpt_dim")
# Reductions of Shard(0) row blocks that DTensor's own rules compute exactly as a partial sum
# (or a finite-order partial norm): a gradient norm, a sum, a mean. Not the max / min family: a
# partial max is combined by the backend's MAX, which drops NaN (gloo's max(nan, x) is x), and
# DTensor's argmax / argmin of row blocks fail on some shapes; those are gathered.
ROW_BLOCK_REDUCTIONS = NORMS | _overloads("sum.default sum.dim_IntList mean.default mean.dim")
JOINS = _overloads("stack.default cat.default")
# Random in-place operators whose result does not read the values they overwrite: the whole
# tensor is drawn into fresh storage, no gather needed.
OVERWRITING_RANDOM = _overloads(
    "uniform_.default normal_.default random_.default random_.from random_.to exponential_.default "
    "geometric_.default log_normal_.default cauchy_.default bernoulli_.float"
)
# Factories that read only their first argument's dtype and device: the result has no relation to
# the layout, so it is a plain tensor (the same on every rank: replicated by the layout's rule).
NEW_FACTORIES = _overloads(
    "new_empty.default new_empty_strided.default new_zeros.default new_ones.default new_full.default"
)
# Storage surgery that would make a piece disagree with its placement.
STORAGE_SURGERY = _overloads(
    "set_.source_Storage set_.source_Storage_storage_offset set_.source_Tensor set_.source_Tensor_storage_offset "
    "set_.default resize_.default resize_as_.default"
)

# Pointwise operators whose float scalars matter to the result's metadata by kind only (type
# promotion reads a scalar's kind), and every list operator but ``_foreach_norm`` (its order picks
# the partial norm): a learning-rate schedule must not grow the cache of decisions.
_FLOAT_BY_KIND = frozenset(
    "add sub mul div lerp addcmul addcdiv fill clamp clamp_min clamp_max pow rsub maximum minimum where sqrt neg "
    "abs".split()
)
_LISTS = ("_foreach_", "_fused_", "_amp_foreach_")
_COLLECTIVE_NAMESPACES = ("c10d", "_c10d_functional", "_c10d_functional_autograd", "_dtensor")
_VALUE_TYPES = ("bool", "int", "float", "Scalar", "SymInt", "SymBool", "complex")


@dataclass(frozen=True)
class OperatorInfo:
    """What the dispatch reads of one operator overload (see the module docstring)."""

    cls: OpClass
    pointwise: bool  # result element i reads only element i of each argument of its shape
    inplace: bool  # writes its first argument and returns it
    mutates: bool  # writes any argument (in place, ``out=``, lists)
    overwrites: bool  # random in-place that never reads the values it overwrites
    meta: bool  # has a meta kernel and a data-independent result shape
    meta_trusted: bool  # pointwise, or DTensor has a rule for it: its meta kernel is exercised
    meta_exact: bool  # its result's metadata on meta is the kernel's by construction (see _meta_exact)
    stock_rule: bool  # DTensor has a sharding rule for it (row blocks follow DTensor's own rules)
    norm: bool
    join: bool
    collective: bool  # a torch.distributed collective (refused with stock DTensor's errors)
    reduction: bool  # aten tags it a reduction (sum, mean, norms, amax, ...)
    row_blocks: bool  # a reduction DTensor's rule computes exactly on Shard(0) rows (ROW_BLOCK_REDUCTIONS)
    float_by_kind: bool = False  # its float scalars enter its result's metadata by kind only (decisions.py)
    written: tuple[tuple[int, str, bool], ...] = ()  # (position, name, keyword-only) of written arguments
    why_refused: str = ""


def _returns_value(schema: Any) -> bool:
    returns = schema.returns
    return len(returns) == 1 and str(returns[0].type) in _VALUE_TYPES


def _writes(schema: Any) -> list[bool]:
    return [a.alias_info is not None and a.alias_info.is_write for a in schema.arguments]


def _has_meta(func: Any) -> bool:
    """Whether ``func`` runs on ``meta`` tensors with a data-independent result shape."""
    if torch.Tag.dynamic_output_shape in func.tags or torch.Tag.data_dependent_output in func.tags:
        return False
    keys = (
        torch._C.DispatchKey.Meta,
        torch._C.DispatchKey.CompositeImplicitAutograd,
        torch._C.DispatchKey.CompositeExplicitAutograd,
        torch._C.DispatchKey.CompositeExplicitAutogradNonFunctional,
    )
    return any(func.has_kernel_for_dispatch_key(k) or k in func.py_kernels for k in keys)


def _meta_exact(func: Any, pointwise: bool) -> bool:
    """Whether ``func``'s result on ``meta`` has, by construction, the shapes, strides and dtypes
    its kernel gives: a pointwise operator; a structured kernel (its CPU and CUDA kernels run the
    same generated meta function that ``meta`` runs: ``RegisterMeta`` in its registrations); or
    no CPU / CUDA kernel of its own (a device-generic composite: the same code on every device).
    Otherwise a hand-written meta kernel stands beside a device kernel and may disagree with it
    (``native_batch_norm`` in eval mode: ``(C,)`` statistics on meta, empty ones on CPU). An
    operator that reads indices from data (an ``index`` / ``indices`` tensor argument: ``gather``,
    ``scatter``, ``index``) is not exact either: it fails on its values, on the holder only."""
    if pointwise:
        return True
    if any(a.name in ("index", "indices") and "Tensor" in str(a.type) for a in func._schema.arguments):
        return False  # (an int index, select's, is metadata: checked on meta too)
    overload = func._overloadname
    name = func._schema.name if overload == "default" else f"{func._schema.name}.{overload}"
    if "RegisterMeta" in torch._C._dispatch_dump(name):
        return True
    keys = (torch._C.DispatchKey.CPU, torch._C.DispatchKey.CUDA)
    return not any(func.has_kernel_for_dispatch_key(k) for k in keys)


def _stock_rule(func: Any) -> bool:
    prop = DTensor._op_dispatcher.sharding_propagator
    tables = (prop.op_strategy_funcs, prop.op_single_dim_strategy_funcs, prop.op_to_rules)
    return any(func in t for t in tables) or func in DTensor._op_dispatcher._custom_op_handlers


@functools.cache
def operator_info(func: Any) -> OperatorInfo:
    """The class and properties of ``func`` (cached: operators are process-lifetime objects)."""
    schema = func._schema
    name = func._schema.name  # "namespace::op", no overload
    namespace = name.split("::")[0]
    writes = _writes(schema)
    inplace = bool(writes) and writes[0] and not schema.arguments[0].kwarg_only
    base = name.split("::")[-1]
    pointwise = func in ELEMENTWISE or torch.Tag.pointwise in func.tags
    info = dict(
        pointwise=pointwise,
        inplace=inplace,
        mutates=any(writes),
        overwrites=func in OVERWRITING_RANDOM,
        meta=_has_meta(func),
        meta_trusted=pointwise or _stock_rule(func),
        meta_exact=_meta_exact(func, pointwise),
        stock_rule=_stock_rule(func),
        norm=func in NORMS,
        join=func in JOINS,
        collective=namespace in _COLLECTIVE_NAMESPACES,
        reduction=torch.Tag.reduction in func.tags,
        row_blocks=func in ROW_BLOCK_REDUCTIONS and _stock_rule(func),
        written=tuple((i, a.name, a.kwarg_only) for i, a in enumerate(schema.arguments) if writes[i]),
        float_by_kind=base.rstrip("_") in _FLOAT_BY_KIND or (base.startswith(_LISTS) and base != "_foreach_norm"),
    )
    if info["collective"]:
        why = (
            "a collective given an owner-layout DTensor (as for any DTensor, torch.distributed's "
            "collectives take plain tensors): pass t.to_local() for this rank's piece, or "
            "t.full_tensor() for the whole value on every rank"
        )
        return OperatorInfo(OpClass.REFUSED, why_refused=why, **info)  # type: ignore[arg-type]
    if func in STORAGE_SURGERY:
        why = (
            "it replaces or resizes the storage of an owner-layout tensor, whose piece must keep the "
            "shape its placement says: build a new tensor instead (full_tensor() gives the whole value)"
        )
        return OperatorInfo(OpClass.REFUSED, why_refused=why, **info)  # type: ignore[arg-type]
    if torch.Tag.inplace_view in func.tags:
        why = (
            "an in-place view (t_, transpose_, squeeze_, unsqueeze_, as_strided_) changes a tensor's shape in "
            "place, which no DTensor can (stock DTensor refuses it too): use the out-of-place view (t(), "
            "transpose(), ...); for an init that needs one (nn.init.orthogonal_), initialise before "
            "fully_shard, or on full_tensor() and copy_ the result back"
        )
        return OperatorInfo(OpClass.REFUSED, why_refused=why, **info)  # type: ignore[arg-type]
    if "sparse" in base or base.startswith("_to_dense"):
        why = "sparse layouts of owner-layout tensors are not supported: call full_tensor() first"
        return OperatorInfo(OpClass.REFUSED, why_refused=why, **info)  # type: ignore[arg-type]
    if base.startswith(("_foreach_", "_fused_", "_amp_foreach_")):
        return OperatorInfo(OpClass.LIST, **info)  # type: ignore[arg-type]
    if _returns_value(schema):
        return OperatorInfo(OpClass.VALUE, **info)  # type: ignore[arg-type]
    if torch.Tag.nondeterministic_seeded in func.tags:
        return OperatorInfo(OpClass.RANDOM, **info)  # type: ignore[arg-type]
    return OperatorInfo(OpClass.GENERAL, **info)  # type: ignore[arg-type]


def mutated_arguments(info: OperatorInfo, args: tuple, kwargs: dict) -> list[Any]:
    """The argument values an operator writes (in place, ``out=``, written lists), in schema order."""
    out: list[Any] = []
    for i, name, kwarg_only in info.written:
        value = args[i] if i < len(args) and not kwarg_only else kwargs.get(name)
        if isinstance(value, (list, tuple)):
            out.extend(v for v in value if isinstance(v, torch.Tensor))
        elif isinstance(value, torch.Tensor):
            out.append(value)
    return out


def norm_partial(func: Any, args: tuple, kwargs: dict) -> Any:
    """The Partial a 0-dim norm result of one holder has (zeros on the other ranks)."""
    p = kwargs.get("ord", kwargs.get("p", args[1] if len(args) > 1 and isinstance(args[1], (int, float)) else 2))
    p = 2.0 if p is None else float(p)
    if math.isinf(p):
        return Partial("max") if p > 0 else None
    if p == 0:
        return Partial("sum")
    if p < 0:
        return None
    return _NormPartial(p)

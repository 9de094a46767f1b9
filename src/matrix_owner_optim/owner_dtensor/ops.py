"""Which aten operators the owner layout runs piecewise: elementwise, in place, norms, joins.

Pure classification, no tensors: ``tensor.py``'s ``__torch_dispatch__`` reads it.
"""

from __future__ import annotations

import math
from typing import Any

import torch
from torch.distributed.tensor import Partial
from torch.distributed.tensor._ops._math_ops import _NormPartial

aten = torch.ops.aten

__all__ = ["ELEMENTWISE", "JOINS", "NORMS", "is_elementwise", "is_inplace", "norm_partial"]

# Operators that produce a tensor of their first argument's shape, element by element (with the
# pointwise tag, aten marks the rest).
ELEMENTWISE = {
    aten.detach.default,
    aten.alias.default,
    aten.clone.default,
    aten._to_copy.default,
    aten.zeros_like.default,
    aten.ones_like.default,
    aten.empty_like.default,
    aten.full_like.default,
    aten.rand_like.default,
    aten.randn_like.default,
    aten.fill_.Scalar,
    aten.fill_.Tensor,
    aten.zero_.default,
    aten.copy_.default,
    aten.lerp_.Scalar,
    aten.lerp_.Tensor,
    aten.lerp.Scalar,
    aten.lerp.Tensor,
    aten.uniform_.default,
    aten.normal_.default,
    aten.bernoulli_.float,
}
NORMS = {aten.linalg_vector_norm.default, aten.norm.Scalar, aten.norm.ScalarOpt_dim}


def is_elementwise(func: Any) -> bool:
    return func in ELEMENTWISE or torch.Tag.pointwise in func.tags


def is_inplace(func: Any) -> bool:
    schema = func._schema
    return (
        bool(schema.arguments)
        and schema.arguments[0].alias_info is not None
        and schema.arguments[0].alias_info.is_write
    )


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


JOINS = {aten.stack.default, aten.cat.default}

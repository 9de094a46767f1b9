"""Per-tensor cost model: resident bytes and optimizer FLOPs on the rank that updates a tensor.

The planner balances what these report; each preconditioner states its own (``Muon.cost_model``
and so on point at the objects below), a third-party optimizer brings its own through the
registry (:mod:`.catalog`, whose ``resolve_cost`` picks it). Estimates for balancing, not
measurements.
"""

from __future__ import annotations

import functools
import math
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Protocol, runtime_checkable

import torch

from ..tensors import itemsize
from .views import CONV, MatrixView, default_matrix_view

__all__ = [
    "CostModel",
    "FunctionCostModel",
    "MUON_COST",
    "SHAMPOO_COST",
    "SOAP_COST",
    "shampoo_cost",
    "BlockedCostModel",
    "row_block_of",
    "soap_cost",
    "shampoo_sides",
    "soap_working_shape",
    "block_sizes",
    "ADAMW_COST",
    "SGD_COST",
    "as_matrix_shape",
    "matrix_shapes",
    "matrix_state_bytes",
    "matrix_flops",
    "itemsize",
]

Shape = Sequence[int]


def numel(shape: Shape) -> int:
    return math.prod(int(s) for s in shape) if len(shape) else 1


def as_matrix_shape(shape: Shape) -> tuple[int, int]:
    """The 2D view a matrix optimizer sees: ``(out, rest)`` for >2D kernels."""
    if len(shape) < 2:
        raise ValueError(f"a matrix needs at least 2 dims, got shape {tuple(shape)}")
    return int(shape[0]), numel(shape[1:])


def matrix_shapes(shape: Shape, view: MatrixView | None = None) -> list[tuple[int, int, int]]:
    """``(count, rows, cols)`` of the matrices a tensor of ``shape`` is stepped as (see
    :mod:`.views`): a stack of ``E`` experts is ``E`` matrices, a fused ``wqkv`` split into q, k,
    v three. ``view`` None: the default reading (a >3D tensor of unknown origin as a conv kernel,
    the ``(out, rest)`` convention)."""
    view = view or default_matrix_view(shape) or CONV
    return view.resolve(shape).matrix_shapes()


def matrix_state_bytes(cost: CostModel, shape: Shape, dtype: torch.dtype, view: MatrixView | None = None) -> int:
    """Optimizer state of a matrix-role tensor: the sum over the matrices it is stepped as."""
    return sum(count * cost.state_bytes((m, n), dtype) for count, m, n in matrix_shapes(shape, view))


def matrix_flops(cost: CostModel, shape: Shape, view: MatrixView | None = None) -> float:
    """Optimizer FLOPs of a matrix-role tensor: the sum over the matrices it is stepped as."""
    return sum(count * cost.flops((m, n)) for count, m, n in matrix_shapes(shape, view))


@runtime_checkable
class CostModel(Protocol):
    """What a preconditioner costs on the rank that updates one matrix of ``shape``.

    The planner asks per matrix (a stack or a fused tensor is priced as the sum over its
    matrices, :func:`matrix_flops`); a >2D ``shape`` reads as ``(out, rest)``."""

    @property
    def name(self) -> str:
        """The preconditioner's name, as reported in plans."""

    def state_bytes(self, shape: Shape, dtype: torch.dtype) -> int:
        """Bytes of optimizer state kept between steps."""

    def flops(self, shape: Shape) -> float:
        """Floating-point operations of one optimizer step (amortized over refreshes)."""


@dataclass(frozen=True)
class FunctionCostModel:
    """A :class:`CostModel` built from two functions."""

    name: str
    state_bytes_fn: Callable[[Shape, torch.dtype], int]
    flops_fn: Callable[[Shape], float]

    def state_bytes(self, shape: Shape, dtype: torch.dtype) -> int:
        return int(self.state_bytes_fn(shape, dtype))

    def flops(self, shape: Shape) -> float:
        return float(self.flops_fn(shape))


# --- Muon: momentum buffer; Newton-Schulz on the short side ---------------------------------
MUON_NS_STEPS = 5


def _muon_flops(shape: Shape) -> float:
    m, n = as_matrix_shape(shape)
    k, l = min(m, n), max(m, n)
    # per iteration: A = X X^T (2k^2 l), B = bA + cA^2 (2k^3), X = aX + B X (2k^2 l)
    per_step = 4.0 * k * k * l + 2.0 * k**3
    return MUON_NS_STEPS * per_step + 8.0 * m * n  # + momentum, normalisation, update


MUON_COST = FunctionCostModel("muon", lambda shape, dtype: numel(shape) * itemsize(dtype), _muon_flops)

# --- Shampoo: blocked Kronecker factors and their inverse roots -----------------------------
SHAMPOO_PRECONDITION_FREQUENCY = 1  # Shampoo's default: roots recomputed every step
SHAMPOO_MAX_PRECONDITIONER_DIM = 1024  # Shampoo's (and Distributed Shampoo's) default block size
SOAP_PRECONDITION_FREQUENCY = 10  # SOAP's default basis refresh interval
SOAP_MAX_PRECOND_DIM = 10000  # SOAP's default cap (the reference implementation's)
EIGH_FLOPS_PER_N3 = 9.0  # symmetric eigendecomposition, order-of-magnitude constant


def block_sizes(dim: int, block: int) -> list[int]:
    """``dim`` split into chunks of ``block`` (the last one smaller): Shampoo's blocking."""
    if block < 1:
        raise ValueError(f"block size must be >= 1, got {block}")
    return [min(block, dim - start) for start in range(0, dim, block)] or [0]


def _state_itemsize(dtype: torch.dtype) -> int:
    # matrix optimizers keep state in float64 for float64 parameters, else float32
    return 8 if dtype == torch.float64 else 4


def shampoo_sides(rows: int, cols: int, max_aspect_ratio: float | None) -> tuple[bool, bool]:
    """Which Kronecker factors Shampoo keeps for a block: ``(left, right)``.

    Both, unless ``max_aspect_ratio`` is set and the block's ``max/min`` side ratio exceeds it;
    then only the small side's (one-sided Shampoo).
    """
    ratio = max(rows, cols) / max(min(rows, cols), 1)
    if max_aspect_ratio is not None and ratio > max_aspect_ratio:
        return (rows < cols, rows >= cols)
    return (True, True)


@dataclass(frozen=True)
class BlockedCostModel(FunctionCostModel):
    """A :class:`FunctionCostModel` of an optimizer that steps bands of ``row_block`` rows of a
    matrix independently (blocked Shampoo: every block keeps its own factors, roots and graft
    norm), so a planner may give the bands of one matrix to different owners, cut at
    multiples of ``row_block`` (:func:`row_block_of`)."""

    row_block: int = 0


def row_block_of(cost: object) -> int | None:
    """The rows of the bands a cost model's optimizer steps independently (a
    :class:`BlockedCostModel`'s ``row_block``, or any model's ``row_block`` attribute), or None
    when a matrix must stay whole."""
    block = getattr(cost, "row_block", None)
    return block if isinstance(block, int) and block >= 1 else None


def shampoo_cost(
    *,
    max_preconditioner_dim: int = SHAMPOO_MAX_PRECONDITIONER_DIM,
    precondition_frequency: int = SHAMPOO_PRECONDITION_FREQUENCY,
    max_aspect_ratio: float | None = None,
    filtered_grad: bool = True,
    momentum: bool = False,
    grafting_state: bool = False,
) -> FunctionCostModel:
    """The cost of :class:`~matrix_owner_optim.preconditioners.Shampoo` configured like this:
    one object per configuration (a cache), so a configuration is one cost model, identical
    wherever it is asked for (``SHAMPOO_COST`` is the default one).

    Blocks of at most ``max_preconditioner_dim`` per side each keep their factors and roots
    (``2 (r^2 + c^2)`` elements for an ``r x c`` block, one side only when one-sided), and pay
    ``G G^T``, ``G^T G``, the preconditioning products and, every ``precondition_frequency``
    steps, two eigendecompositions. Per-element state: the filtered gradient (``beta1 > 0``),
    the momentum buffer and the grafting accumulator, as configured.

    Blocks are independent, so the model is a :class:`BlockedCostModel` with ``row_block =
    max_preconditioner_dim``: the planner may split a heavy matrix between owners into bands of
    whole blocks, and a band costs exactly the sum over its blocks.
    """
    return _shampoo_cost(
        int(max_preconditioner_dim),
        int(precondition_frequency),
        max_aspect_ratio,
        bool(filtered_grad),
        bool(momentum),
        bool(grafting_state),
    )


@functools.cache
def _shampoo_cost(
    max_preconditioner_dim: int,
    precondition_frequency: int,
    max_aspect_ratio: float | None,
    filtered_grad: bool,
    momentum: bool,
    grafting_state: bool,
) -> BlockedCostModel:
    def blocks(shape: Shape) -> list[tuple[int, int]]:
        m, n = as_matrix_shape(shape)
        return [(r, c) for r in block_sizes(m, max_preconditioner_dim) for c in block_sizes(n, max_preconditioner_dim)]

    def state_bytes(shape: Shape, dtype: torch.dtype) -> int:
        elements = 0
        for r, c in blocks(shape):
            left, right = shampoo_sides(r, c, max_aspect_ratio)
            elements += 2 * (r * r * left + c * c * right)
        per_element = int(filtered_grad) + int(momentum) + int(grafting_state)
        return (elements + per_element * numel(shape)) * _state_itemsize(dtype)

    def flops(shape: Shape) -> float:
        total = 0.0
        for r, c in blocks(shape):
            left, right = shampoo_sides(r, c, max_aspect_ratio)
            outer = 2.0 * r * r * c * left + 2.0 * r * c * c * right  # G G^T, G^T G
            precondition = outer  # L^-1/4 G R^-1/4
            roots = (EIGH_FLOPS_PER_N3 + 4.0) * (r**3 * left + c**3 * right)
            total += outer + precondition + roots / precondition_frequency
        return total + 10.0 * numel(shape)

    return BlockedCostModel("shampoo", state_bytes, flops, row_block=max_preconditioner_dim)


SHAMPOO_COST = shampoo_cost()


def _whole_matrix_shampoo() -> FunctionCostModel:
    """torch_optimizer's Shampoo: one preconditioner per side of the whole matrix (no blocks), so
    a matrix must stay whole on one owner (a plain, not a blocked, cost model)."""
    whole = shampoo_cost(max_preconditioner_dim=1 << 62)
    return FunctionCostModel("torch_optimizer_shampoo", whole.state_bytes_fn, whole.flops_fn)


TORCH_OPTIMIZER_SHAMPOO_COST = _whole_matrix_shampoo()

# --- SOAP: factors, their eigenbases, Adam moments in the rotated space ---------------------


def soap_working_shape(rows: int, cols: int, max_precond_dim: int, merge_dims: bool) -> tuple[int, ...]:
    """The shape SOAP preconditions a ``rows x cols`` matrix as.

    Without ``merge_dims`` the matrix itself. With it, adjacent dimensions are merged while their
    product stays within ``max_precond_dim`` (the reference implementation's rule): a small
    matrix becomes one vector of ``rows * cols`` elements.
    """
    if not merge_dims:
        return (rows, cols)
    merged: list[int] = []
    current = 1
    for size in (rows, cols):
        if current * size > max_precond_dim:
            if current > 1:
                merged.append(current)
                current = size
            else:
                merged.append(size)
                current = 1
        else:
            current *= size
    if current > 1 or not merged:
        merged.append(current)
    return tuple(merged)


def soap_cost(
    *,
    max_precond_dim: int = SOAP_MAX_PRECOND_DIM,
    merge_dims: bool = False,
    precondition_frequency: int = SOAP_PRECONDITION_FREQUENCY,
) -> FunctionCostModel:
    """The cost of :class:`~matrix_owner_optim.preconditioners.SOAP` configured like this (one object
    per configuration, as :func:`shampoo_cost`).

    Each dimension of the working shape (see :func:`soap_working_shape`) of at most
    ``max_precond_dim`` keeps a factor and its eigenbasis (``2 d^2`` elements) and pays its
    rotations and, every ``precondition_frequency`` steps, a power-iteration refresh; a larger
    dimension keeps nothing and is left unrotated. Adam's two moments are per element.
    """
    return _soap_cost(int(max_precond_dim), bool(merge_dims), int(precondition_frequency))


@functools.cache
def _soap_cost(max_precond_dim: int, merge_dims: bool, precondition_frequency: int) -> FunctionCostModel:
    def dims(shape: Shape) -> tuple[int, list[int]]:
        m, n = as_matrix_shape(shape)
        work = soap_working_shape(m, n, max_precond_dim, merge_dims)
        return m * n, [d for d in work if d <= max_precond_dim]

    def state_bytes(shape: Shape, dtype: torch.dtype) -> int:
        size, kept = dims(shape)
        return (sum(2 * d * d for d in kept) + 2 * size) * _state_itemsize(dtype)

    def flops(shape: Shape) -> float:
        size, kept = dims(shape)
        rotate = sum(2.0 * d * size for d in kept)  # one projection into (or out of) the basis
        factors = rotate  # G G^T and G^T G
        refresh = sum((EIGH_FLOPS_PER_N3 + 4.0) * d**3 for d in kept) / precondition_frequency
        return factors + 3.0 * rotate + refresh + 12.0 * size

    return FunctionCostModel("soap", state_bytes, flops)


SOAP_COST = soap_cost()

# --- coordinate-wise optimizers -------------------------------------------------------------
ADAMW_COST = FunctionCostModel(
    "adamw", lambda shape, dtype: 2 * numel(shape) * itemsize(dtype), lambda s: 12.0 * numel(s)
)
SGD_COST = FunctionCostModel("sgd", lambda shape, dtype: numel(shape) * itemsize(dtype), lambda s: 3.0 * numel(s))

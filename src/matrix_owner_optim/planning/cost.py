"""Per-tensor cost model: resident bytes and optimizer FLOPs on the rank that updates a tensor.

The planner balances what these functions report. Each preconditioner states its own cost
(``Muon.cost_model`` and so on point at the objects below), and a third-party optimizer can
bring its own by registering a :class:`CostModel` under its name with
:func:`register_cost_model` (``register_preconditioner`` does this when the factory carries a
``cost_model`` attribute). Costs are estimates for balancing, not measurements.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Callable, Protocol, Sequence, runtime_checkable

import torch

__all__ = [
    "CostModel",
    "FunctionCostModel",
    "MUON_COST",
    "SHAMPOO_COST",
    "SOAP_COST",
    "ADAMW_COST",
    "SGD_COST",
    "register_cost_model",
    "get_cost_model",
    "available_cost_models",
    "as_matrix_shape",
    "itemsize",
]

Shape = Sequence[int]


def itemsize(dtype: torch.dtype) -> int:
    """Bytes per element of ``dtype``."""
    return torch.empty((), dtype=dtype, device="meta").element_size()


def numel(shape: Shape) -> int:
    return math.prod(int(s) for s in shape) if len(shape) else 1


def as_matrix_shape(shape: Shape) -> tuple[int, int]:
    """The 2D view a matrix optimizer sees: ``(out, rest)`` for >2D kernels."""
    if len(shape) < 2:
        raise ValueError(f"a matrix needs at least 2 dims, got shape {tuple(shape)}")
    return int(shape[0]), numel(shape[1:])


@runtime_checkable
class CostModel(Protocol):
    """What a preconditioner costs on the rank that updates one tensor of ``shape``."""

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


MUON_COST = FunctionCostModel(
    "muon", lambda shape, dtype: numel(shape) * itemsize(dtype), _muon_flops
)

# --- Shampoo: two Kronecker factors and their inverse roots, float32 ------------------------
SHAMPOO_PRECONDITION_FREQUENCY = 1  # Shampoo's default: roots recomputed every step
SOAP_PRECONDITION_FREQUENCY = 10  # SOAP's default basis refresh interval
EIGH_FLOPS_PER_N3 = 9.0  # symmetric eigendecomposition, order-of-magnitude constant


def _shampoo_state(shape: Shape, dtype: torch.dtype) -> int:
    m, n = as_matrix_shape(shape)
    return 2 * (m * m + n * n) * 4  # L, R and their inverse roots in float32


def _shampoo_flops(shape: Shape) -> float:
    m, n = as_matrix_shape(shape)
    factors = 2.0 * m * m * n + 2.0 * m * n * n  # G G^T and G^T G
    precondition = 2.0 * m * m * n + 2.0 * m * n * n  # L^-1/4 G R^-1/4
    roots = (EIGH_FLOPS_PER_N3 + 4.0) * (m**3 + n**3) / SHAMPOO_PRECONDITION_FREQUENCY
    return factors + precondition + roots + 6.0 * m * n


SHAMPOO_COST = FunctionCostModel("shampoo", _shampoo_state, _shampoo_flops)

# --- SOAP: factors, their eigenbases, Adam moments in the rotated space ---------------------


def _soap_state(shape: Shape, dtype: torch.dtype) -> int:
    m, n = as_matrix_shape(shape)
    return (2 * (m * m + n * n) + 2 * m * n) * 4


def _soap_flops(shape: Shape) -> float:
    m, n = as_matrix_shape(shape)
    rotate = 2.0 * m * m * n + 2.0 * m * n * n  # one projection into (or out of) the basis
    factors = rotate  # G G^T and G^T G
    refresh = (EIGH_FLOPS_PER_N3 + 4.0) * (m**3 + n**3) / SOAP_PRECONDITION_FREQUENCY
    return factors + 3.0 * rotate + refresh + 12.0 * m * n


SOAP_COST = FunctionCostModel("soap", _soap_state, _soap_flops)

# --- coordinate-wise optimizers -------------------------------------------------------------
ADAMW_COST = FunctionCostModel(
    "adamw", lambda shape, dtype: 2 * numel(shape) * itemsize(dtype), lambda s: 12.0 * numel(s)
)
SGD_COST = FunctionCostModel(
    "sgd", lambda shape, dtype: numel(shape) * itemsize(dtype), lambda s: 3.0 * numel(s)
)

_COST_MODELS: dict[str, CostModel] = {
    "muon": MUON_COST,
    "torch_muon": MUON_COST,
    "shampoo": SHAMPOO_COST,
    "torch_optimizer_shampoo": SHAMPOO_COST,
    "soap": SOAP_COST,
    "adamw": ADAMW_COST,
    "adam": ADAMW_COST,
    "sgd": SGD_COST,
}


def register_cost_model(name: str, model: CostModel) -> None:
    """Make ``plan_model(..., preconditioner=name)`` use ``model``."""
    if not isinstance(model, CostModel):
        raise TypeError(
            f"cost model for {name!r} must have name, state_bytes(shape, dtype) and flops(shape)"
        )
    _COST_MODELS[name.lower()] = model


def available_cost_models() -> list[str]:
    return sorted(_COST_MODELS)


def get_cost_model(preconditioner: "str | CostModel | type | None") -> CostModel:
    """Resolve a name, a :class:`CostModel`, or an optimizer class carrying ``cost_model``.

    An optimizer class without a stated cost is charged like Muon (one state buffer of the
    parameter's size plus an orthogonalisation): a conservative estimate, never zero.
    """
    if preconditioner is None:
        return MUON_COST
    if isinstance(preconditioner, str):
        try:
            return _COST_MODELS[preconditioner.lower()]
        except KeyError:
            raise ValueError(
                f"no cost model for preconditioner {preconditioner!r}; known: "
                f"{', '.join(available_cost_models())}. Register one with "
                "matrix_owner_optim.register_preconditioner (factory.cost_model) or "
                "planning.register_cost_model."
            ) from None
    if isinstance(preconditioner, CostModel):
        return preconditioner
    stated = getattr(preconditioner, "cost_model", None)
    if isinstance(stated, CostModel):
        return stated
    return MUON_COST

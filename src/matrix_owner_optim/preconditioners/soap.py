"""SOAP (Vyas et al., 2024, "SOAP: Improving and Stabilizing Shampoo using Adam") for 2D tensors.

SOAP runs Adam in the eigenbasis of Shampoo's Kronecker factors. For a gradient ``G`` of shape
``(m, n)`` it keeps ``L`` (m x m) and ``R`` (n x n) as EMAs of ``G G^T`` and ``G^T G`` with
``shampoo_beta``, their eigenbases ``QL``, ``QR``, Adam's first moment ``exp_avg`` in the
*original* space (projected every step, as the reference implementation did) and Adam's
second moment ``exp_avg_sq`` in the *rotated* space.

Step order (following the official code, github.com/nikhilvyas/SOAP, for 2D tensors):

1. First call for a parameter: ``L, R <- lerp(0, G G^T / G^T G, 1 - shampoo_beta)``, bases
   from ``eigh`` (eigenvectors sorted by eigenvalue, descending), and **no parameter update**
   (the reference skips it "so that we never use the current gradients in the projection";
   weight decay is skipped too). The Adam step counter stays 0.
2. Every later call, with ``t`` the Adam step (1, 2, ...)::

       G'  = QL^T G QR
       m   = beta1 m + (1 - beta1) G               (original space)
       v   = beta2 v + (1 - beta2) G'^2            (rotated space)
       N'  = (QL^T m QR) / (sqrt(v) + eps)
       p  <- p - lr * sqrt(1 - beta2^t) / (1 - beta1^t) * QL N' QR^T
       p  <- p * (1 - lr * weight_decay)           (decoupled, after the update, as the reference)
       L, R <- lerp(L, G G^T, 1 - shampoo_beta), lerp(R, G^T G, 1 - shampoo_beta)
       if t % precondition_frequency == 0: refresh the bases

3. Refresh (one power-iteration step + QR per side): sort ``Q``'s columns by the eigenvalue
   estimates ``diag(Q^T F Q)``, descending (permuting ``v`` alike), then ``Q <- qr(F Q)``.
   Sorting first ties the basis order to the eigenvalue order, so Adam-in-the-eigenbasis does
   not depend on eigh/QR ordering conventions (column signs cancel), and with distinct
   eigenvalues the update is equivariant to rotations ``G -> U G V^T``.

The reference's options, with its defaults: ``max_precond_dim`` (10000; a larger dimension
keeps no factor and stays unrotated, so a vocabulary-sized side never gets a ``V x V`` factor),
``merge_dims`` (False; adjacent dimensions merged while their product stays within
``max_precond_dim``, :func:`~..planning.cost.soap_working_shape`), ``precondition_1d`` (False;
a factor for 1D parameters, which this class accepts only then) and ``normalize_grads`` (False;
the update divided by its RMS, ``+1e-30``).

State per parameter (float32, or float64 for float64 parameters): ``step`` (int64 scalar),
``exp_avg``, ``exp_avg_sq`` (the parameter's shape), per rotated side ``L``/``QL`` and
``R``/``QR`` (what :func:`~..planning.cost.soap_cost` prices); a stack or fused tensor keeps
them per matrix, stacked per run (``L`` of shape ``(E, m, m)``), each matrix stepped as alone.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import torch
from torch import Tensor

from ..planning.cost import SOAP_COST, FunctionCostModel, soap_cost, soap_working_shape
from ..planning.views import MatrixLayout, matrix_layout_of
from ._common import (
    MatrixOptimizer,
    MatrixState,
    as_float,
    check_nonnegative,
    eigh_with_retry,
    matrix_positions,
    state_dtype_for,
)

__all__ = ["SOAP", "soap", "soap_layout"]

# the group's entries soap() takes as they are (lr, shampoo_beta and the flags are read apart)
_HYPERPARAMETERS = (
    "betas",
    "eps",
    "weight_decay",
    "precondition_frequency",
    "correct_bias",
    "max_precond_dim",
    "normalize_grads",
)
# The reference adds 1e-30 * I before eigh (numerical guard only; eigenvectors are unchanged).
_EIGH_EPS = 1e-30


def _project(x: Tensor, ql: Tensor | None, qr: Tensor | None) -> Tensor:
    """Rotate ``x`` into the eigenbases: ``QL^T x QR`` (a missing side is the identity)."""
    x = ql.T @ x if ql is not None else x
    return x @ qr if qr is not None else x


def _project_back(x: Tensor, ql: Tensor | None, qr: Tensor | None) -> Tensor:
    """Rotate ``x`` back to the original space: ``QL x QR^T``."""
    x = ql @ x if ql is not None else x
    return x @ qr.T if qr is not None else x


def _eigh_basis(mat: Tensor) -> Tensor:
    """Eigenvectors of a symmetric ``mat``, columns ordered by eigenvalue, descending (a float32
    convergence failure retried in float64, as the reference)."""
    eye = torch.eye(mat.shape[0], dtype=mat.dtype, device=mat.device)
    return torch.flip(eigh_with_retry(mat + _EIGH_EPS * eye)[1], [1])


def _refresh_basis(factor: Tensor, basis: Tensor, exp_avg_sq: Tensor, dim: int) -> tuple[Tensor, Tensor]:
    """One power-iteration step + QR; returns ``(new_basis, exp_avg_sq permuted along dim)``.

    Q alone, from ``geqrf``'s reflectors (``linalg.qr``'s own two steps, bitwise its Q): ``R``,
    which ``linalg.qr`` also forms and the step drops, cost ~15% of each QR (1024 x 1024)."""
    fq = factor @ basis
    est_eig = (basis * fq).sum(0)  # diag(Q^T F Q)
    order = torch.argsort(est_eig, descending=True)
    new_basis = torch.linalg.householder_product(*torch.geqrf(fq[:, order]))
    return new_basis, exp_avg_sq.index_select(dim, order)


class SOAP(MatrixOptimizer):
    """SOAP: Adam in Shampoo's eigenbasis, over whole 2D tensors (the module docstring's step).

    Defaults are the reference's: lr 3e-3 (a float or a one-element tensor), betas (0.95, 0.95)
    (Adam's), shampoo_beta None (= ``betas[1]``, the factors' EMA), eps 1e-8, weight_decay 0.01
    (decoupled, after the update), precondition_frequency 10 (Adam steps between basis
    refreshes), correct_bias True; ``max_precond_dim``, ``merge_dims``, ``precondition_1d`` and
    ``normalize_grads`` as the module docstring says.

    Raises:
        ValueError: for a non-2D parameter or gradient (naming its shape) and for invalid
            hyperparameters.
    """

    _NAME = "SOAP"
    cost_model: FunctionCostModel = SOAP_COST

    def __init__(
        self,
        params: Any,
        lr: float | Tensor = 3e-3,
        betas: tuple[float, float] = (0.95, 0.95),
        shampoo_beta: float | None = None,
        eps: float = 1e-8,
        weight_decay: float = 0.01,
        precondition_frequency: int = 10,
        correct_bias: bool = True,
        max_precond_dim: int = 10000,
        merge_dims: bool = False,
        precondition_1d: bool = False,
        normalize_grads: bool = False,
    ) -> None:
        check_nonnegative(lr, eps=eps, weight_decay=weight_decay)
        if len(betas) != 2 or not all(0.0 <= b < 1.0 for b in betas):
            raise ValueError(f"betas must be two values in [0, 1), got {betas}")
        if shampoo_beta is not None and not 0.0 <= shampoo_beta < 1.0:
            raise ValueError(f"shampoo_beta must be None or in [0, 1), got {shampoo_beta}")
        if int(precondition_frequency) < 1:
            raise ValueError(f"precondition_frequency must be >= 1, got {precondition_frequency}")
        if not (isinstance(max_precond_dim, int) and max_precond_dim >= 1):
            raise ValueError(f"max_precond_dim must be an int >= 1, got {max_precond_dim!r}")
        defaults = {
            "lr": lr,
            "betas": tuple(betas),
            "shampoo_beta": shampoo_beta,
            "eps": eps,
            "weight_decay": weight_decay,
            "precondition_frequency": int(precondition_frequency),
            "correct_bias": correct_bias,
            "max_precond_dim": max_precond_dim,
            "merge_dims": merge_dims,
            "precondition_1d": precondition_1d,
            "normalize_grads": normalize_grads,
        }
        super().__init__(params, defaults)
        # This instance's own price (cap, merged shape, refresh interval), for planners.
        self.cost_model = soap_cost(
            max_precond_dim=max_precond_dim,
            merge_dims=merge_dims,
            precondition_frequency=int(precondition_frequency),
        )

    def _check_shape(self, tensor: Tensor, group: Mapping[str, Any], name: str | None, what: str) -> None:
        if tensor.ndim == 1 and group.get("precondition_1d", False):
            return
        super()._check_shape(tensor, group, name, what)

    def _layout_of(self, p: Tensor) -> MatrixLayout | None:
        """``p``'s matrix layout (None for a 1D parameter)."""
        return None if p.ndim == 1 else self.matrix_layout(p)

    def _init_state(self, p: Tensor, grad: Tensor, group: dict[str, Any], shampoo_beta: float) -> None:
        """First step: build the factors and bases from this gradient (no update)."""
        state = self.state[p]
        dtype, device = state_dtype_for(p), p.device
        layout = self._layout_of(p)
        state["step"] = torch.tensor(0, dtype=torch.int64)
        state["exp_avg"] = torch.zeros(p.shape, dtype=dtype, device=device)
        state["exp_avg_sq"] = torch.zeros(p.shape, dtype=dtype, device=device)
        for (shape, run, index), gm in zip(_matrices(p, layout), _views(layout, grad), strict=True):
            flags = bool(group["merge_dims"]), bool(group["precondition_1d"])
            (a, b), left, right = soap_layout(shape, group["max_precond_dim"], *flags)
            g = gm.to(dtype).reshape(a, b)
            ms = MatrixState(state, layout, run, index)
            count = 1 if ms.single else layout.matrix_shapes()[run][0]  # type: ignore[union-attr]
            lead = () if ms.single else (count,)
            for side, size, has in (("L", a, left), ("R", b, right)):
                if not has:
                    continue
                outer = g @ g.T if side == "L" else g.T @ g
                if not ms.has(side):
                    state[ms.key(side)] = torch.zeros(*lead, size, size, dtype=dtype, device=device)
                    if not ms.single:  # column-major per matrix, as LAPACK returns one
                        # basis (eigh, qr): each matrix's products then match its own bit for bit
                        state[ms.key(f"Q{side}")] = torch.zeros(count, size, size, dtype=dtype, device=device).mT
                ms.get(side).lerp_(outer, 1 - shampoo_beta)
                ms.set(f"Q{side}", _eigh_basis(ms.get(side)))

    # -- the step: gather, then the pure function -------------------------------------------------
    def _step_group(self, group: dict[str, Any]) -> None:
        shampoo_beta = group["shampoo_beta"]
        if shampoo_beta is None:
            shampoo_beta = group["betas"][1]
        params: list[Tensor] = []
        grads: list[Tensor] = []
        states: list[dict[str, Any]] = []
        layouts: list[MatrixLayout | None] = []
        for p, grad in self._grads(group):
            if "exp_avg" not in self.state[p]:
                # First step: build the factors and bases from this gradient, do not update.
                self._init_state(p, grad, group, shampoo_beta)
                continue
            params.append(p)
            grads.append(grad)
            states.append(self.state[p])
            layouts.append(self._layout_of(p))
        hyper: dict[str, Any] = {k: group[k] for k in _HYPERPARAMETERS}
        hyper |= {k: bool(group[k]) for k in ("merge_dims", "precondition_1d")}
        soap(params, grads, states, **hyper, lr=as_float(group["lr"]), shampoo_beta=shampoo_beta, layouts=layouts)


def soap_layout(
    shape: torch.Size | tuple[int, ...], max_precond_dim: int, merge_dims: bool, precondition_1d: bool
) -> tuple[tuple[int, int], bool, bool]:
    """``((a, b), left, right)``: the 2D shape SOAP works in and which sides it rotates.

    ``(a, b)`` is the matrix itself, or ``(k, 1)`` for a vector (a 1D parameter, or a matrix
    that ``merge_dims`` merged into one vector); a side is rotated when it has at most
    ``max_precond_dim`` elements (and, for a 1D parameter, ``precondition_1d``).
    """
    cap = max_precond_dim
    if len(shape) == 1:
        k = int(shape[0])
        return (k, 1), precondition_1d and k <= cap, False
    m, n = int(shape[0]), int(shape[1])
    work = soap_working_shape(m, n, cap, merge_dims)
    if len(work) == 1:
        return (m * n, 1), work[0] <= cap, False
    return (m, n), m <= cap, n <= cap


def _matrices(p: Tensor, layout: MatrixLayout | None) -> list[tuple[tuple[int, ...], int, int]]:
    """Per matrix of ``p``: its shape, run and index within the run (``layout`` None: ``p``
    itself, a 1D parameter)."""
    if layout is None:
        return [(tuple(p.shape), 0, 0)]
    shapes = [(m, n) for count, m, n in layout.matrix_shapes() for _ in range(count)]
    return [(shape, run, i) for shape, (run, i) in zip(shapes, matrix_positions(layout), strict=True)]


def _views(layout: MatrixLayout | None, tensor: Tensor) -> list[Tensor]:
    return [tensor] if layout is None else layout.matrices(tensor)


def soap(
    params: list[Tensor],
    grads: list[Tensor],
    states: list[dict[str, Any]],
    *,
    lr: float,
    betas: tuple[float, float],
    shampoo_beta: float,
    eps: float,
    weight_decay: float,
    precondition_frequency: int,
    correct_bias: bool,
    max_precond_dim: int,
    merge_dims: bool,
    precondition_1d: bool,
    normalize_grads: bool,
    layouts: list[MatrixLayout | None] | None = None,
) -> None:
    """One SOAP step (step 2 of the module docstring) of ``params`` in place (the package
    docstring's pure function; ``shampoo_beta`` resolved). ``states[k]``: parameter ``k``'s
    state, initialised by a first call (:class:`SOAP` does that and updates nothing then).
    ``layouts``: each :class:`~..planning.views.MatrixLayout`, None for a 1D parameter."""
    if not len(params) == len(grads) == len(states):
        raise ValueError("soap: params, grads and states must have the same length")
    if layouts is None:
        layouts = [None if p.ndim == 1 else matrix_layout_of(p) for p in params]
    beta1, beta2 = betas
    for p, grad, state, layout in zip(params, grads, states, layouts, strict=True):
        exp_avg: Tensor = state["exp_avg"]
        state["step"] += 1
        step = int(state["step"])
        exp_avg.mul_(beta1).add_(grad.to(exp_avg.dtype), alpha=1 - beta1)
        step_size = lr
        if correct_bias:
            bias_correction1 = 1.0 - beta1**step
            bias_correction2 = 1.0 - beta2**step
            step_size = lr * (bias_correction2**0.5) / bias_correction1
        direction = torch.empty_like(exp_avg)
        refresh = step % precondition_frequency == 0
        for (shape, run, index), gm, mm, sq_m, dm in zip(
            _matrices(p, layout),
            _views(layout, grad),
            _views(layout, exp_avg),
            _views(layout, state["exp_avg_sq"]),
            _views(layout, direction),
            strict=True,
        ):
            (a, b), _, _ = soap_layout(shape, max_precond_dim, merge_dims, precondition_1d)
            ms = MatrixState(state, layout, run, index)
            ql: Tensor | None = ms.get("QL") if ms.has("QL") else None
            qr: Tensor | None = ms.get("QR") if ms.has("QR") else None
            g = gm.to(exp_avg.dtype).reshape(a, b)

            g_rot = _project(g, ql, qr)
            exp_avg_sq = sq_m.view(a, b)
            exp_avg_sq.mul_(beta2).add_(g_rot.square(), alpha=1 - beta2)
            denom = exp_avg_sq.sqrt().add_(eps)
            m_rot = _project(mm.view(a, b), ql, qr)
            d = _project_back(m_rot / denom, ql, qr)
            if normalize_grads:
                d = d / (1e-30 + d.square().mean().sqrt())
            dm.copy_(d.view(dm.shape))

            # Update the factors after the step, so the current gradient never shapes its
            # own projection; refresh the bases every precondition_frequency Adam steps.
            if ql is not None:
                ms.get("L").lerp_(g @ g.T, 1 - shampoo_beta)
            if qr is not None:
                ms.get("R").lerp_(g.T @ g, 1 - shampoo_beta)
            if refresh:
                if ql is not None:
                    new_ql, exp_avg_sq = _refresh_basis(ms.get("L"), ql, exp_avg_sq, 0)
                    ms.set("QL", new_ql)
                if qr is not None:
                    new_qr, exp_avg_sq = _refresh_basis(ms.get("R"), qr, exp_avg_sq, 1)
                    ms.set("QR", new_qr)
                sq_m.copy_(exp_avg_sq.view(sq_m.shape))
        p.add_(direction.to(p.dtype), alpha=-step_size)
        if weight_decay > 0.0:
            p.mul_(1 - lr * weight_decay)

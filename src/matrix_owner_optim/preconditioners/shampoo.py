"""Shampoo (Gupta, Koren & Singer, 2018) for whole 2D tensors.

For a gradient ``G`` of shape ``(m, n)`` Shampoo keeps two Kronecker factors::

    L <- L + G G^T      (m x m)         or, with beta2 < 1, L <- beta2 L + (1 - beta2) G G^T
    R <- R + G^T G      (n x n)

and updates ``p <- p - lr * L^{-1/4} G R^{-1/4}``. The inverse roots are computed with
``torch.linalg.eigh`` in ``root_dtype`` (float64 by default) on ``L + eps*||L||_F*I``
(see :func:`~._common.matrix_inverse_root`: a *relative*, isotropic damping -- the update
stays invariant to the gradient's scale and equivariant to orthogonal rotations,
``update(U G V^T) = U update(G) V^T``). Roots are recomputed every ``precondition_frequency``
steps starting at ``start_preconditioning_step``; in between the stored roots are reused while
the factors keep accumulating every step.

Options:

* one-sided mode: when ``max_aspect_ratio`` is set and ``max(m, n) / min(m, n)`` exceeds it,
  only the small side's factor is kept and the update is ``L^{-1/2} G`` (``m < n``) or
  ``G R^{-1/2}`` (``m >= n``). This saves the big ``max(m,n)^2`` factor and its eigh.
* grafting (``"sgd"`` or ``"adagrad"``): the Shampoo direction ``D`` is rescaled to the
  Frobenius norm of the graft's direction (``G`` for SGD, ``G / (sqrt(sum G^2) + grafting_eps)``
  for AdaGrad); before ``start_preconditioning_step`` the graft's direction is used as is
  (without grafting, plain ``G``, i.e. SGD).
* momentum: heavy-ball on the final (preconditioned, grafted) direction,
  ``buf <- momentum * buf + D; p <- p - lr * buf`` (as Meta's Distributed Shampoo applies it to
  the search direction). The factors always see the raw gradient.
* weight decay: decoupled, ``p <- p * (1 - lr * weight_decay)`` before the update.

State per parameter (float32, or float64 for float64 parameters): ``step`` (int64 scalar),
``L``/``R`` and their roots ``L_root``/``R_root`` (one side only in one-sided mode), plus
``momentum_buffer`` when ``momentum > 0`` and ``graft_sum`` for AdaGrad grafting.
"""

from __future__ import annotations

from typing import Any

import torch
from torch import Tensor

from ..planning.cost import SHAMPOO_COST, FunctionCostModel
from ._common import MatrixOptimizer, as_float, matrix_inverse_root, state_dtype_for

__all__ = ["Shampoo"]

_GRAFTING = (None, "sgd", "adagrad")


class Shampoo(MatrixOptimizer):
    """Two-sided (or optionally one-sided) Shampoo over whole 2D tensors.

    Args:
        params: 2D parameters or parameter groups (named parameters work too).
        lr: learning rate (default 1e-3). A float or a one-element tensor.
        beta2: factor EMA; 1.0 accumulates ``L += G G^T`` (default 1.0). For ``beta2 < 1``:
            ``L = beta2 L + (1 - beta2) G G^T``.
        eps: relative damping: ``eps * ||L||_F`` is added to the diagonal before the root
            (default 1e-12).
        momentum: heavy-ball momentum on the preconditioned direction; 0 disables it and
            keeps no buffer (default 0.0).
        weight_decay: decoupled weight decay (default 0.0).
        precondition_frequency: recompute the inverse roots every this many steps (default 1).
        start_preconditioning_step: first step (1-based) that uses the preconditioner; earlier
            steps use the graft's direction, or the raw gradient (default 1).
        max_aspect_ratio: above this ``max(m,n)/min(m,n)`` use only the small side's factor
            with exponent -1/2 (default None: always two-sided).
        grafting: None, ``"sgd"`` or ``"adagrad"`` (default None).
        grafting_eps: AdaGrad graft's denominator epsilon (default 1e-10).
        root_dtype: precision of the eigendecomposition, float32 or float64 (default float64).

    Raises:
        ValueError: for a non-2D parameter or gradient (naming its shape) and for invalid
            hyperparameters.
    """

    _NAME = "Shampoo"
    cost_model: FunctionCostModel = SHAMPOO_COST

    def __init__(
        self,
        params: Any,
        lr: float | Tensor = 1e-3,
        beta2: float = 1.0,
        eps: float = 1e-12,
        momentum: float = 0.0,
        weight_decay: float = 0.0,
        precondition_frequency: int = 1,
        start_preconditioning_step: int = 1,
        max_aspect_ratio: float | None = None,
        grafting: str | None = None,
        grafting_eps: float = 1e-10,
        root_dtype: torch.dtype = torch.float64,
    ) -> None:
        if not 0.0 <= lr:
            raise ValueError(f"Learning rate should be >= 0 but is: {lr}")
        if not 0.0 < beta2 <= 1.0:
            raise ValueError(f"beta2 must be in (0, 1], got {beta2}")
        if not 0.0 <= eps:
            raise ValueError(f"eps must be >= 0, got {eps}")
        if not 0.0 <= momentum < 1.0:
            raise ValueError(f"momentum must be in [0, 1), got {momentum}")
        if not 0.0 <= weight_decay:
            raise ValueError(f"weight_decay must be >= 0, got {weight_decay}")
        if int(precondition_frequency) < 1:
            raise ValueError(f"precondition_frequency must be >= 1, got {precondition_frequency}")
        if int(start_preconditioning_step) < 1:
            raise ValueError(
                f"start_preconditioning_step must be >= 1, got {start_preconditioning_step}"
            )
        if max_aspect_ratio is not None and not max_aspect_ratio >= 1.0:
            raise ValueError(f"max_aspect_ratio must be None or >= 1, got {max_aspect_ratio}")
        if grafting not in _GRAFTING:
            raise ValueError(f"grafting must be one of {_GRAFTING}, got {grafting!r}")
        if root_dtype not in (torch.float32, torch.float64):
            raise ValueError(f"root_dtype must be torch.float32 or torch.float64, got {root_dtype}")
        defaults = {
            "lr": lr,
            "beta2": beta2,
            "eps": eps,
            "momentum": momentum,
            "weight_decay": weight_decay,
            "precondition_frequency": int(precondition_frequency),
            "start_preconditioning_step": int(start_preconditioning_step),
            "max_aspect_ratio": max_aspect_ratio,
            "grafting": grafting,
            "grafting_eps": grafting_eps,
            "root_dtype": root_dtype,
        }
        super().__init__(params, defaults)

    @staticmethod
    def _sides(shape: torch.Size, max_aspect_ratio: float | None) -> tuple[bool, bool]:
        """Which factors to keep: ``(use_left, use_right)``."""
        m, n = int(shape[0]), int(shape[1])
        if max_aspect_ratio is not None and max(m, n) / min(m, n) > max_aspect_ratio:
            return (m < n, m >= n)
        return (True, True)

    def _init_state(self, p: Tensor, group: dict[str, Any]) -> dict[str, Any]:
        state = self.state[p]
        dtype = state_dtype_for(p)
        m, n = p.shape
        use_left, use_right = self._sides(p.shape, group["max_aspect_ratio"])
        state["step"] = torch.tensor(0, dtype=torch.int64)
        if use_left:
            state["L"] = torch.zeros(m, m, dtype=dtype, device=p.device)
            state["L_root"] = torch.eye(m, dtype=dtype, device=p.device)
        if use_right:
            state["R"] = torch.zeros(n, n, dtype=dtype, device=p.device)
            state["R_root"] = torch.eye(n, dtype=dtype, device=p.device)
        if group["momentum"] > 0:
            state["momentum_buffer"] = torch.zeros(m, n, dtype=dtype, device=p.device)
        if group["grafting"] == "adagrad":
            state["graft_sum"] = torch.zeros(m, n, dtype=dtype, device=p.device)
        return state

    def _step_group(self, group: dict[str, Any]) -> None:
        lr = as_float(group["lr"])
        beta2 = group["beta2"]
        grafting = group["grafting"]
        for p, grad in self._grads(group):
            state = self.state[p]
            if "step" not in state:
                state = self._init_state(p, group)
            state["step"] += 1
            step = int(state["step"])
            has_left, has_right = "L" in state, "R" in state
            ref = state["L"] if has_left else state["R"]
            g = grad.to(ref.dtype)

            # 1. Kronecker factors see the raw gradient every step.
            if has_left:
                outer = g @ g.T
                if beta2 == 1.0:
                    state["L"].add_(outer)
                else:
                    state["L"].mul_(beta2).add_(outer, alpha=1 - beta2)
            if has_right:
                outer = g.T @ g
                if beta2 == 1.0:
                    state["R"].add_(outer)
                else:
                    state["R"].mul_(beta2).add_(outer, alpha=1 - beta2)

            # 2. The graft's direction (if any).
            graft: Tensor | None = None
            if grafting == "sgd":
                graft = g
            elif grafting == "adagrad":
                if "graft_sum" not in state:
                    state["graft_sum"] = torch.zeros_like(g)
                state["graft_sum"].addcmul_(g, g)
                graft = g / (state["graft_sum"].sqrt() + group["grafting_eps"])

            # 3. Preconditioned direction.
            start = group["start_preconditioning_step"]
            if step >= start:
                if (step - start) % group["precondition_frequency"] == 0:
                    exponent = 4.0 if (has_left and has_right) else 2.0
                    for side in ("L", "R"):
                        if side in state:
                            state[f"{side}_root"] = matrix_inverse_root(
                                state[side], exponent, group["eps"], root_dtype=group["root_dtype"]
                            )
                direction = g
                if has_left:
                    direction = state["L_root"] @ direction
                if has_right:
                    direction = direction @ state["R_root"]
                if graft is not None:
                    d_norm = torch.linalg.matrix_norm(direction)
                    g_norm = torch.linalg.matrix_norm(graft)
                    direction = direction * (g_norm / d_norm.clamp_min(torch.finfo(g.dtype).tiny))
            else:
                direction = graft if graft is not None else g

            # 4. Momentum on the search direction, decoupled weight decay, update.
            if group["momentum"] > 0:
                if "momentum_buffer" not in state:
                    state["momentum_buffer"] = torch.zeros_like(g)
                buf = state["momentum_buffer"]
                buf.mul_(group["momentum"]).add_(direction)
                direction = buf
            if group["weight_decay"] != 0:
                p.mul_(1 - lr * group["weight_decay"])
            p.add_(direction.to(p.dtype), alpha=-lr)

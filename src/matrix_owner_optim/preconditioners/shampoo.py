"""Shampoo (Gupta, Koren & Singer, 2018) over whole 2D tensors, with Distributed Shampoo's options.

Semantics follow Meta's Distributed Shampoo (Shi et al. 2023, arXiv:2309.06497) for a matrix
parameter ``W`` (``m x n``) with gradient ``G``, per step ``t = 1, 2, ...``:

1. **Blocking.** ``W`` is cut into blocks of at most ``max_preconditioner_dim`` rows and columns
   (the last block of each side smaller). Every block has its own Kronecker factors, roots and
   graft norm, so a plan may give bands of whole block rows to different owners: a band
   (:mod:`~..planning.bands`) steps exactly as those rows of the whole matrix, its state keyed
   by the whole matrix's block indices.
2. **Factors** (raw gradient, every step), per block ``B``::

       L_B <- L_B + B B^T                                   beta2 == 1 (AdaGrad-style sum)
       L_B <- beta2 L_B + (1 - beta2) B B^T                 beta2 <  1 (EMA)

   and likewise ``R_B`` with ``B^T B``.
3. **Grafting state** (raw gradient, per element): AdaGrad ``v += G^2``; RMSprop and Adam
   ``v = b v + (1 - b) G^2`` with ``b = grafting_beta2``.
4. **Filtering** (``beta1 > 0``): ``F = lerp(F, G, 1 - beta1)``; the search uses
   ``Gf = F / (1 - beta1^t)`` (bias-corrected when ``use_bias_correction``), else ``Gf = G``.
5. **Roots**, recomputed at step ``t`` when ``t == start`` or ``t > start and t % frequency ==
   0`` (Distributed Shampoo's schedule), otherwise reused::

       L_root = (L_B / (1 - beta2^t) + eps ||.||_F I)^(-1/4)      (the bias correction only
                                                                  when beta2 < 1)

   The root runs in ``root_dtype`` (float32 by default); an eigendecomposition that fails to
   converge is retried in float64 (Distributed Shampoo's protected eigh).
6. **Direction.** For ``t < start``: the graft's direction (below), or ``Gf`` without grafting.
   From ``start`` on, per block, ``D_B = L_root Gf_B R_root`` rescaled by grafting to
   ``||graft_B|| / (||D_B|| + 1e-16)``. The graft's direction is ``Gf`` (SGD) or
   ``Gf / (sqrt(v / c) + grafting_eps)`` with ``c = 1 - grafting_beta2^t`` for Adam and ``1``
   for AdaGrad/RMSprop.
7. **Weight decay** (decoupled, as Distributed Shampoo's default): ``D += weight_decay * W``.
8. **Momentum**: ``M = momentum M + D``; ``D = D + momentum M`` (Nesterov) or ``D = M``.
9. ``W <- W - lr D``.

Defaults, ours against Distributed Shampoo's (``DistributedShampoo.__init__``):

=========================== ==================== =======================================
option                      here                 Distributed Shampoo
=========================== ==================== =======================================
lr                          1e-3                 1e-2
betas                       (0.9, 1.0)           (0.9, 1.0)
eps                         1e-6, *relative*     1e-12, absolute (added to the factor)
momentum / nesterov         0.0 / False          0.0 / False
weight_decay                0.0 (decoupled)      0.0 (decoupled)
max_preconditioner_dim      1024                 1024
precondition_frequency      1                    1
start_preconditioning_step  -1 (= frequency)     -1 (= frequency)
use_bias_correction         True                 True
grafting                    None                 None (grafting_config)
grafting_eps                1e-10 AdaGrad,       AdaGrad 1e-10, RMSprop 1e-8, Adam 1e-8
                            1e-8 RMSprop/Adam
grafting_beta2              0.99 RMSprop,        RMSprop 0.99, Adam 0.999
                            0.999 Adam
root_dtype                  float32 (+ float64   float32 (+ float64 retry, use_protected_eigh)
                            retry)
=========================== ==================== =======================================

Deliberate differences: ``eps`` is relative (``eps * ||L||_F`` on the diagonal), so the update
is invariant to the gradient's scale, and 1e-6 because a relative damping below float32's
resolution (1e-12) gives 3-5% root errors on rank-deficient gradients. No ``use_merge_dims``
(a matrix is always preconditioned as a matrix), no coupled weight decay, ``beta3``,
``dampening``, ``exponent_multiplier`` or ``inv_root_override``. ``max_aspect_ratio`` (ours)
makes a block whose long/short ratio exceeds it one-sided: the small side's factor, exponent
``-1/2``. No host synchronisation inside :meth:`step` (the step count is a Python int, the
zero-factor guard a tensor operation); a tensor ``lr`` is applied as a tensor.

State per parameter (float32, or float64 for float64 parameters): ``step`` (a Python int), per
block ``L``/``R``/``L_root``/``R_root`` (keys suffixed ``_i_j`` for block ``(i, j)`` of a
several-block matrix; one side when one-sided), per element ``filtered_grad`` (``beta1 > 0``),
``momentum_buffer`` (``momentum > 0``) and ``graft_state`` (AdaGrad/RMSprop/Adam grafting):
what :func:`~..planning.cost.shampoo_cost` prices.
Stacks and fused blocks: every matrix of a :class:`~..planning.views.MatrixLayout` keeps its own
factors and roots, stacked per run (``L`` of shape ``(E, r, r)``, keys suffixed ``_m<run>`` for
several runs), and is preconditioned exactly as alone (DESIGN.md, "Matrix views").
"""

from __future__ import annotations

from typing import Any

import torch
from torch import Tensor

from ..planning.bands import RowBand, row_band_of
from ..planning.cost import (
    SHAMPOO_COST,
    FunctionCostModel,
    block_sizes,
    shampoo_cost,
    shampoo_sides,
)
from ..planning.views import MatrixLayout, matrix_layout_of
from ._common import (
    MatrixOptimizer,
    MatrixState,
    check_nonnegative,
    matrix_inverse_root,
    matrix_positions,
    state_dtype_for,
)

__all__ = ["Shampoo", "shampoo", "shampoo_blocks", "GRAFTING_TYPES"]

GRAFTING_TYPES = (None, "sgd", "adagrad", "rmsprop", "adam")
_GRAFTING_EPS = {"sgd": 0.0, "adagrad": 1e-10, "rmsprop": 1e-8, "adam": 1e-8}
_GRAFTING_BETA2 = {"sgd": 1.0, "adagrad": 1.0, "rmsprop": 0.99, "adam": 0.999}
# Distributed Shampoo adds this to the Shampoo direction's norm before grafting.
_GRAFT_NORM_EPS = 1e-16
# the group's entries shampoo() takes, as the constructor validated them
_HYPERPARAMETERS = tuple(
    "lr betas eps momentum nesterov weight_decay max_preconditioner_dim precondition_frequency "
    "start_preconditioning_step max_aspect_ratio grafting grafting_beta2 grafting_eps use_bias_correction root_dtype".split()
)


def _block_slices(dim: int, block: int) -> list[slice]:
    starts = range(0, dim, block)
    return [slice(s, s + size) for s, size in zip(starts, block_sizes(dim, block), strict=True)]


class Shampoo(MatrixOptimizer):
    """Blocked Shampoo with Distributed Shampoo's options over whole 2D tensors: the step and the
    defaults are the module docstring's (its table's "here" column is the arguments' defaults).
    ``lr`` may be a one-element tensor; ``start_preconditioning_step=-1`` means
    ``precondition_frequency``; ``grafting_beta2``/``grafting_eps`` default per grafting type;
    ``beta2``, when given, overrides ``betas[1]``; ``max_aspect_ratio`` None keeps every block
    two-sided.

    Raises:
        ValueError: for a non-2D parameter or gradient (naming its shape) and for invalid
            hyperparameters.
    """

    _NAME = "Shampoo"
    cost_model: FunctionCostModel = SHAMPOO_COST
    accepts_row_bands = True  # blocks are independent: a band of whole blocks steps as in the matrix

    def __init__(
        self,
        params: Any,
        lr: float | Tensor = 1e-3,
        betas: tuple[float, float] = (0.9, 1.0),
        eps: float = 1e-6,
        momentum: float = 0.0,
        nesterov: bool = False,
        weight_decay: float = 0.0,
        max_preconditioner_dim: int = 1024,
        precondition_frequency: int = 1,
        start_preconditioning_step: int = -1,
        max_aspect_ratio: float | None = None,
        grafting: str | None = None,
        grafting_beta2: float | None = None,
        grafting_eps: float | None = None,
        use_bias_correction: bool = True,
        root_dtype: torch.dtype = torch.float32,
        beta2: float | None = None,
    ) -> None:
        check_nonnegative(lr, eps=eps, weight_decay=weight_decay)
        if len(betas) != 2:
            raise ValueError(f"betas must be (beta1, beta2), got {betas}")
        beta1, factor_beta2 = betas[0], betas[1] if beta2 is None else beta2
        if not 0.0 <= beta1 < 1.0:
            raise ValueError(f"beta1 (betas[0]) must be in [0, 1), got {beta1}")
        if not 0.0 < factor_beta2 <= 1.0:
            raise ValueError(f"beta2 must be in (0, 1], got {factor_beta2}")
        if not 0.0 <= momentum < 1.0:
            raise ValueError(f"momentum must be in [0, 1), got {momentum}")
        if not (isinstance(max_preconditioner_dim, int) and max_preconditioner_dim >= 1):
            raise ValueError(f"max_preconditioner_dim must be an int >= 1, got {max_preconditioner_dim!r}")
        if not (isinstance(precondition_frequency, int) and precondition_frequency >= 1):
            raise ValueError(f"precondition_frequency must be an int >= 1, got {precondition_frequency!r}")
        if start_preconditioning_step == -1:
            start_preconditioning_step = precondition_frequency
        if not (isinstance(start_preconditioning_step, int) and start_preconditioning_step >= 1):
            raise ValueError(
                "start_preconditioning_step must be -1 (= precondition_frequency) or an int >= 1, "
                f"got {start_preconditioning_step!r}"
            )
        if max_aspect_ratio is not None and not max_aspect_ratio >= 1.0:
            raise ValueError(f"max_aspect_ratio must be None or >= 1, got {max_aspect_ratio}")
        if grafting not in GRAFTING_TYPES:
            raise ValueError(f"grafting must be one of {GRAFTING_TYPES}, got {grafting!r}")
        if grafting_beta2 is None:
            grafting_beta2 = _GRAFTING_BETA2.get(grafting or "sgd", 1.0)
        if grafting_eps is None:
            grafting_eps = _GRAFTING_EPS.get(grafting or "sgd", 0.0)
        if not 0.0 < grafting_beta2 <= 1.0:
            raise ValueError(f"grafting_beta2 must be in (0, 1], got {grafting_beta2}")
        if grafting in ("rmsprop", "adam") and grafting_beta2 == 1.0:
            raise ValueError(f"grafting={grafting!r} needs grafting_beta2 < 1; use 'adagrad'")
        if not 0.0 <= grafting_eps:
            raise ValueError(f"grafting_eps must be >= 0, got {grafting_eps}")
        if root_dtype not in (torch.float32, torch.float64):
            raise ValueError(f"root_dtype must be torch.float32 or torch.float64, got {root_dtype}")
        defaults = {
            "lr": lr,
            "betas": (beta1, factor_beta2),
            "eps": eps,
            "momentum": momentum,
            "nesterov": nesterov,
            "weight_decay": weight_decay,
            "max_preconditioner_dim": max_preconditioner_dim,
            "precondition_frequency": precondition_frequency,
            "start_preconditioning_step": start_preconditioning_step,
            "max_aspect_ratio": max_aspect_ratio,
            "grafting": grafting,
            "grafting_beta2": grafting_beta2,
            "grafting_eps": grafting_eps,
            "use_bias_correction": use_bias_correction,
            "root_dtype": root_dtype,
        }
        super().__init__(params, defaults)
        for group in self.param_groups:
            for p in group["params"]:
                self._band(p, group)
        # This instance's own price (blocks, caps, frequency), for planners given the instance.
        self.cost_model = shampoo_cost(
            max_preconditioner_dim=max_preconditioner_dim,
            precondition_frequency=precondition_frequency,
            max_aspect_ratio=max_aspect_ratio,
            filtered_grad=beta1 > 0,
            momentum=momentum > 0,
            grafting_state=grafting not in (None, "sgd"),
        )

    def _band(self, p: Tensor, group: dict[str, Any]) -> RowBand | None:
        """``p``'s band, checked against the group's block size (recorded on the band)."""
        band = row_band_of(p)
        if band is not None:
            if not self.matrix_layout(p).single:
                raise ValueError(f"Shampoo: a band of rows must be one plain matrix, got {self.matrix_layout(p)}")
            band.check_block(group["max_preconditioner_dim"], "Shampoo")
            band.block = group["max_preconditioner_dim"]
        return band

    def _init_state(self, p: Tensor, group: dict[str, Any], layout: MatrixLayout) -> dict[str, Any]:
        state = self.state[p]
        dtype, device = state_dtype_for(p), p.device
        state["step"] = 0
        for run, (count, m, n) in enumerate(layout.matrix_shapes()):
            lead = () if layout.single else (count,)  # a stack keeps one factor per matrix
            band = row_band_of(p)  # a band's blocks keep the whole matrix's block rows
            first, rows = (band.start, band.rows) if band is not None else (0, None)
            cap, ratio = group["max_preconditioner_dim"], group["max_aspect_ratio"]
            for suffix, rs, cs, left, right in shampoo_blocks((m, n), cap, ratio, first_row=first, total_rows=rows):
                r, c = rs.stop - rs.start, cs.stop - cs.start
                for side, size, has in (("L", r, left), ("R", c, right)):
                    if not has:
                        continue
                    eye = torch.eye(size, dtype=dtype, device=device)
                    state[layout.state_key(f"{side}{suffix}", run)] = torch.zeros(
                        *lead, size, size, dtype=dtype, device=device
                    )
                    state[layout.state_key(f"{side}_root{suffix}", run)] = eye.repeat(*lead, 1, 1) if lead else eye
        if group["betas"][0] > 0:
            state["filtered_grad"] = torch.zeros(p.shape, dtype=dtype, device=device)
        if group["momentum"] > 0:
            state["momentum_buffer"] = torch.zeros(p.shape, dtype=dtype, device=device)
        if group["grafting"] not in (None, "sgd"):
            state["graft_state"] = torch.zeros(p.shape, dtype=dtype, device=device)
        return state

    # -- the step: gather, then the pure function -------------------------------------------------
    def _step_group(self, group: dict[str, Any]) -> None:
        params: list[Tensor] = []
        grads: list[Tensor] = []
        states: list[dict[str, Any]] = []
        layouts: list[MatrixLayout] = []
        bands: list[tuple[int, int] | None] = []
        for p, grad in self._grads(group):
            layout = self.matrix_layout(p)
            band = self._band(p, group)
            state = self.state[p]
            if "step" not in state:
                state = self._init_state(p, group, layout)
            params.append(p)
            grads.append(grad)
            states.append(state)
            layouts.append(layout)
            bands.append(None if band is None else (band.start, band.rows))
        hyper = {k: group[k] for k in _HYPERPARAMETERS}
        shampoo(params, grads, states, **hyper, layouts=layouts, bands=bands)


# (key suffix, row slice, column slice, has left factor, has right factor)
Block = tuple[str, slice, slice, bool, bool]


def shampoo_blocks(
    shape: torch.Size | tuple[int, ...],
    max_preconditioner_dim: int,
    max_aspect_ratio: float | None,
    *,
    first_row: int = 0,
    total_rows: int | None = None,
) -> list[Block]:
    """The blocks of an ``m x n`` matrix: ``(key suffix, row slice, column slice, has left, has
    right)`` per block, row-major.

    Blocks have at most ``max_preconditioner_dim`` rows and columns (the last of each side
    smaller); a block whose side ratio exceeds ``max_aspect_ratio`` keeps only its small side's
    factor. The suffix is ``""`` for a single block (state keys ``L``, ``R``, ...) and
    ``"_i_j"`` for block ``(i, j)`` otherwise. ``first_row``/``total_rows``: the tensor is rows
    ``[first_row, first_row + m)`` of a ``total_rows``-row matrix (a band, cut at a multiple of
    the block size): the slices are the band's, the suffixes the whole matrix's.
    """
    m, n = int(shape[0]), int(shape[1])
    size = max_preconditioner_dim
    total = m if total_rows is None else int(total_rows)
    if first_row % size or (first_row + m != total and m % size):
        raise ValueError(f"rows [{first_row}, {first_row + m}) of {total} are not whole blocks of {size} rows")
    rows, cols = _block_slices(m, size), _block_slices(n, size)
    single = total <= size and len(cols) == 1
    out = []
    for i, rs in enumerate(rows, start=first_row // size):
        for j, cs in enumerate(cols):
            left, right = shampoo_sides(rs.stop - rs.start, cs.stop - cs.start, max_aspect_ratio)
            out.append(("" if single else f"_{i}_{j}", rs, cs, left, right))
    return out


def shampoo(
    params: list[Tensor],
    grads: list[Tensor],
    states: list[dict[str, Any]],
    *,
    lr: float | Tensor,
    betas: tuple[float, float],
    eps: float,
    momentum: float,
    nesterov: bool,
    weight_decay: float,
    max_preconditioner_dim: int,
    precondition_frequency: int,
    start_preconditioning_step: int,
    max_aspect_ratio: float | None,
    grafting: str | None,
    grafting_beta2: float,
    grafting_eps: float,
    use_bias_correction: bool,
    root_dtype: torch.dtype,
    layouts: list[MatrixLayout] | None = None,
    bands: list[tuple[int, int] | None] | None = None,
) -> None:
    """One Shampoo step of ``params`` in place (the package docstring's pure function).
    ``states[k]``: parameter ``k``'s state as :class:`Shampoo` initialises it, updated in place.
    ``layouts``: each parameter's :class:`~..planning.views.MatrixLayout` (default: declared, else by shape).
    ``bands``: per parameter None, or ``(first row, rows of the whole matrix)`` for a band cut at
    block boundaries (DESIGN.md, "Experts as ownable units"): its blocks keep the whole matrix's
    indices and step exactly as there, since blocks share nothing.
    """
    if not len(params) == len(grads) == len(states):
        raise ValueError("shampoo: params, grads and states must have the same length")
    if layouts is None:
        layouts = [matrix_layout_of(p) for p in params]
    if bands is None:
        bands = [None] * len(params)
    beta1, beta2 = betas
    for p, grad, state, layout, band in zip(params, grads, states, layouts, bands, strict=True):
        first, total = band if band is not None else (0, None)
        state["step"] += 1
        t: int = state["step"]
        dtype = state_dtype_for(p)
        g = grad.to(dtype)
        # Every matrix of the layout: its gradient view, its factors and its blocks.
        mats = [
            (
                gm,
                MatrixState(state, layout, run, index),
                shampoo_blocks(gm.shape, max_preconditioner_dim, max_aspect_ratio, first_row=first, total_rows=total),
            )
            for gm, (run, index) in zip(layout.matrices(g), matrix_positions(layout), strict=True)
        ]

        # 1. Factors (raw gradient, every step), per matrix.
        for gm, ms, blocks in mats:
            _update_factors(gm, ms, blocks, beta2)

        # 2. Grafting state (raw gradient, per element).
        if grafting == "adagrad":
            state["graft_state"].addcmul_(g, g)
        elif grafting in ("rmsprop", "adam"):
            state["graft_state"].mul_(grafting_beta2).addcmul_(g, g, value=1 - grafting_beta2)

        # 3. Filtered gradient.
        if beta1 > 0:
            filtered: Tensor = state["filtered_grad"]
            filtered.lerp_(g, 1 - beta1)
            gf = filtered / (1 - beta1**t) if use_bias_correction else filtered
        else:
            gf = g

        # 4. The graft's direction.
        graft: Tensor | None = None
        if grafting == "sgd":
            graft = gf
        elif grafting is not None:
            v = state["graft_state"]
            if grafting == "adam" and use_bias_correction:
                v = v / (1 - grafting_beta2**t)
            graft = gf / (v.sqrt() + grafting_eps)

        # 5. Roots (Distributed Shampoo's schedule) and the search direction, per matrix.
        if t < start_preconditioning_step:
            direction = graft if graft is not None else gf
        else:
            direction = torch.empty_like(gf)
            grafts = layout.matrices(graft) if graft is not None else [None] * len(mats)
            for (_, ms, blocks), gfm, graft_m, dm in zip(
                mats, layout.matrices(gf), grafts, layout.matrices(direction), strict=True
            ):
                if t == start_preconditioning_step or t % precondition_frequency == 0:
                    correction = 1.0 - beta2**t if use_bias_correction and beta2 < 1.0 else 1.0
                    _compute_roots(ms, blocks, correction, eps, root_dtype)
                _precondition(gfm, graft_m, dm, ms, blocks)

        # 6. Decoupled weight decay, momentum, update.
        if weight_decay != 0:
            direction = direction + weight_decay * p.to(dtype)
        if momentum > 0:
            buf: Tensor = state["momentum_buffer"]
            buf.mul_(momentum).add_(direction)
            direction = direction + momentum * buf if nesterov else buf
        if isinstance(lr, Tensor):
            p.sub_((direction * lr.to(direction.device)).to(p.dtype))
        else:
            p.add_(direction.to(p.dtype), alpha=-lr)


def _update_factors(gm: Tensor, ms: MatrixState, blocks: list[Block], beta2: float) -> None:
    """``L += B B^T`` and ``R += B^T B`` per block (an EMA with ``beta2 < 1``)."""
    for suffix, rs, cs, left, right in blocks:
        gb = gm[rs, cs]
        outers = []
        if left:
            outers.append((ms.get(f"L{suffix}"), gb @ gb.T))
        if right:
            outers.append((ms.get(f"R{suffix}"), gb.T @ gb))
        for factor, outer in outers:
            if beta2 == 1.0:
                factor.add_(outer)
            else:
                factor.mul_(beta2).add_(outer, alpha=1 - beta2)


def _precondition(gfm: Tensor, graft_m: Tensor | None, dm: Tensor, ms: MatrixState, blocks: list[Block]) -> None:
    """``L_root Gf R_root`` per block of one matrix, grafted per block, written into ``dm``."""
    for suffix, rs, cs, left, right in blocks:
        d = gfm[rs, cs]
        if left:
            d = ms.get(f"L_root{suffix}") @ d
        if right:
            d = d @ ms.get(f"R_root{suffix}")
        if graft_m is not None:
            scale = torch.linalg.matrix_norm(graft_m[rs, cs]) / (torch.linalg.matrix_norm(d) + _GRAFT_NORM_EPS)
            d = d * scale
        dm[rs, cs] = d


def _compute_roots(
    ms: MatrixState, blocks: list[Block], correction: float, eps: float, root_dtype: torch.dtype
) -> None:
    """Every block's inverse roots from its (bias-corrected by ``correction``) factors."""
    for suffix, _, _, left, right in blocks:
        exponent = 4.0 if (left and right) else 2.0
        for side, has in (("L", left), ("R", right)):
            if not has:
                continue
            factor = ms.get(f"{side}{suffix}")
            if correction != 1.0:
                factor = factor / correction
            ms.set(f"{side}_root{suffix}", matrix_inverse_root(factor, exponent, eps, root_dtype=root_dtype))

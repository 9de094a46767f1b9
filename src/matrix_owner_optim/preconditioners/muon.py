"""Muon: momentum followed by Newton-Schulz orthogonalisation, one whole 2D tensor at a time.

``torch.optim.Muon`` (torch 2.13): configured the same (default ``ns_dtype=torch.bfloat16``),
its updates bitwise per matrix, within bfloat16's noise batched (below). The one addition is
``ns_dtype``, the iteration's precision (``torch.float32``: an essentially exact
orthogonalisation on CPU, what exactness tests use). Per step, for each parameter ``p`` with gradient ``g`` (hyperparameters
read from the group every step, so lr schedulers work)::

    B <- lerp(B, g, 1 - momentum)
    U <- lerp(g, B, momentum) if nesterov else B
    O <- NS_{a,b,c}^{ns_steps}(U / max(||U||_F, eps))  on the short side (transposed if tall)
    p <- p * (1 - lr * weight_decay)
    p <- p - adjusted_lr * O                       # O cast back to p's dtype

``adjusted_lr``: ``"original"``/None: ``lr * sqrt(max(1, A/B))``; ``"match_rms_adamw"``:
``lr * 0.2 * sqrt(max(A, B))`` for a parameter of shape ``(A, B)``.

``batched=True`` (the default): a group's matrices of one shape, dtype and device go through one
stacked Newton-Schulz, each Nesterov update written once into its slice of the stack in
``ns_dtype``, every matrix (a lone one too) in the fast form (DESIGN.md, "Newton-Schulz
forms"): torch's form except for bfloat16 on a CPU without bfloat16 matmuls, where it is
~7x faster and rounds otherwise, within bfloat16's noise. Each matrix rounds as alone, so the
stacks a rank forms do not change its result. ``batched=False`` is torch's loop, each matrix's
momentum, Newton-Schulz and update in turn, bitwise ``torch.optim.Muon``. Every matrix of a
tensor's :class:`~..planning.views.MatrixLayout` (experts, a declared fused ``wqkv``) is
orthogonalised alone with its own shape's ``adjusted_lr`` (DESIGN.md, "Matrix views"). The
ns_floor benchmark times both paths against ``torch.optim.Muon`` and the matmul floor.

State per parameter: ``momentum_buffer`` (the parameter's shape and dtype), what
``planning.cost.MUON_COST`` prices. The group keeps ``ns_dtype`` as its name (``"bfloat16"``):
torch's state-dict utilities (``full_state_dict``, ``cpu_offload``) refuse a ``torch.dtype`` in
param groups; the constructor and the group accept either form.
"""

from __future__ import annotations

import math
from typing import Any

import torch
from torch import Tensor

from ..planning.cost import MUON_COST, FunctionCostModel
from ..planning.views import MatrixLayout, matrix_layout_of
from ._common import MatrixOptimizer, as_float, check_nonnegative
from .newton_schulz import DEFAULT_NS_COEFFICIENTS, check_ns_args, newton_schulz_

__all__ = ["Muon", "muon", "newton_schulz", "newton_schulz_batched", "adjust_lr", "ns_dtype_name", "resolve_ns_dtype"]

_ADJUST_LR_FNS = (None, "original", "match_rms_adamw")
# the group's entries muon() takes as they are (lr and batched are read apart)
_HYPERPARAMETERS = (
    "weight_decay",
    "momentum",
    "nesterov",
    "ns_coefficients",
    "ns_steps",
    "eps",
    "adjust_lr_fn",
    "ns_dtype",
)


def resolve_ns_dtype(value: torch.dtype | str) -> torch.dtype:
    """The floating ``torch.dtype`` that ``value`` names (a ``torch.dtype``, or its name such as
    ``"bfloat16"`` or ``"torch.float32"``); ``ValueError`` naming the value otherwise."""
    dtype: Any = value
    if isinstance(value, str):
        dtype = getattr(torch, value.removeprefix("torch."), None)
    if not isinstance(dtype, torch.dtype) or not dtype.is_floating_point:
        raise ValueError(
            f"ns_dtype must be a floating torch.dtype or its name (torch.float32, 'bfloat16'), got {value!r}"
        )
    return dtype


def ns_dtype_name(value: torch.dtype | str) -> str:
    """The name a param group keeps for ``ns_dtype`` (``torch.bfloat16`` -> ``"bfloat16"``)."""
    return str(resolve_ns_dtype(value)).removeprefix("torch.")


def newton_schulz(
    grad: Tensor,
    ns_coefficients: tuple[float, float, float] = DEFAULT_NS_COEFFICIENTS,
    ns_steps: int = 5,
    eps: float = 1e-7,
    ns_dtype: torch.dtype | str = torch.bfloat16,
) -> Tensor:
    """Approximately orthogonalise a 2D ``grad`` (``U V^T``), or every matrix of a ``(batch, m,
    n)`` stack (each by its own norm, batched matmuls): torch's ``_zeropower_via_newtonschulz``
    (cast to ``ns_dtype``, transpose when tall, divide by the Frobenius norm clamped at ``eps``,
    ``ns_steps`` quintic iterations). Returns a new tensor of ``grad``'s shape in ``ns_dtype``;
    ``grad`` is not modified."""
    check_ns_args(ns_coefficients, ns_steps)
    if grad.ndim not in (2, 3):
        raise ValueError(f"Newton-Schulz needs a 2D matrix or a (batch, m, n) stack, got shape {tuple(grad.shape)}")
    layout = torch.contiguous_format if grad.ndim == 3 else torch.preserve_format  # a 2D one read as torch reads it
    x = grad.to(resolve_ns_dtype(ns_dtype), memory_format=layout, copy=True)  # never scale the caller's in place
    return newton_schulz_(x, ns_coefficients, ns_steps, eps)


def newton_schulz_batched(
    grads: Tensor,
    ns_coefficients: tuple[float, float, float] = DEFAULT_NS_COEFFICIENTS,
    ns_steps: int = 5,
    eps: float = 1e-7,
    ns_dtype: torch.dtype | str = torch.bfloat16,
) -> Tensor:
    """:func:`newton_schulz` of a ``(batch, m, n)`` stack (``ValueError`` for any other shape)."""
    if grads.ndim != 3:
        raise ValueError(f"expected a (batch, m, n) stack, got shape {tuple(grads.shape)}")
    return newton_schulz(grads, ns_coefficients, ns_steps, eps, ns_dtype)


def adjust_lr(lr: float, adjust_lr_fn: str | None, shape: torch.Size | tuple[int, ...]) -> float:
    """Muon's shape-dependent learning-rate scale (see the module docstring)."""
    rows, cols = shape[:2]
    if adjust_lr_fn is None or adjust_lr_fn == "original":
        ratio = math.sqrt(max(1, rows / cols))
    elif adjust_lr_fn == "match_rms_adamw":
        ratio = 0.2 * math.sqrt(max(rows, cols))
    else:
        ratio = 1.0
    return lr * ratio


class Muon(MatrixOptimizer):
    """Muon over whole 2D tensors (and stacks of them); ``torch.optim.Muon`` with the default
    ``ns_dtype``. Arguments and defaults are torch's (lr 1e-3, weight_decay 0.1, momentum 0.95,
    nesterov, ns_coefficients ``(3.4445, -4.775, 2.0315)``, eps 1e-7, ns_steps 5, adjust_lr_fn
    None = ``"original"``), plus ``ns_dtype`` (the iteration's precision, a dtype or its name,
    default ``torch.bfloat16``; the result is cast back to the parameter's dtype) and
    ``batched`` (module docstring). ``lr`` may be a one-element tensor.

    Raises:
        ValueError: for a parameter (at construction) or gradient (at step) that does not read
            as matrices (<2D, or >3D with no declared view), naming the shape; for invalid
            hyperparameters.
    """

    _NAME = "Muon"
    cost_model: FunctionCostModel = MUON_COST

    def __init__(
        self,
        params: Any,
        lr: float | Tensor = 1e-3,
        weight_decay: float = 0.1,
        momentum: float = 0.95,
        nesterov: bool = True,
        ns_coefficients: tuple[float, float, float] = DEFAULT_NS_COEFFICIENTS,
        eps: float = 1e-7,
        ns_steps: int = 5,
        adjust_lr_fn: str | None = None,
        ns_dtype: torch.dtype | str = torch.bfloat16,
        batched: bool = True,
    ) -> None:
        check_nonnegative(lr, momentum=momentum, weight_decay=weight_decay)
        if adjust_lr_fn not in _ADJUST_LR_FNS:
            raise ValueError(f"Adjust learning rate function {adjust_lr_fn} is not supported")
        check_ns_args(ns_coefficients, ns_steps)
        defaults = {
            "lr": lr,
            "weight_decay": weight_decay,
            "momentum": momentum,
            "nesterov": nesterov,
            "ns_coefficients": tuple(ns_coefficients),
            "eps": eps,
            "ns_steps": ns_steps,
            "adjust_lr_fn": adjust_lr_fn,
            "ns_dtype": ns_dtype_name(ns_dtype),  # a name: state-dict utilities refuse torch.dtype
            "batched": batched,
        }
        super().__init__(params, defaults)

    def _step_group(self, group: dict[str, Any]) -> None:
        params: list[Tensor] = []
        grads: list[Tensor] = []
        momentum_buffers: list[Tensor] = []
        layouts: list[MatrixLayout] = []
        for p, grad in self._grads(group):
            state = self.state[p]
            if "momentum_buffer" not in state:
                state["momentum_buffer"] = torch.zeros_like(grad, memory_format=torch.preserve_format)
            params.append(p)
            grads.append(grad)
            momentum_buffers.append(state["momentum_buffer"])
            layouts.append(self.matrix_layout(p))
        hyper = {k: group[k] for k in _HYPERPARAMETERS}
        muon(
            params,
            grads,
            momentum_buffers,
            **hyper,
            lr=as_float(group["lr"]),
            batched=bool(group.get("batched", False)),
            layouts=layouts,
        )


def muon(
    params: list[Tensor],
    grads: list[Tensor],
    momentum_buffers: list[Tensor],
    *,
    lr: float,
    weight_decay: float,
    momentum: float,
    nesterov: bool,
    ns_coefficients: tuple[float, float, float],
    ns_steps: int,
    eps: float,
    adjust_lr_fn: str | None,
    ns_dtype: torch.dtype | str,
    batched: bool,
    layouts: list[MatrixLayout] | None = None,
) -> None:
    """One Muon step of ``params`` in place, updating ``momentum_buffers`` (zeros at the first
    step): the package docstring's pure function (``lr`` a float). ``layouts``: each
    parameter's :class:`~..planning.views.MatrixLayout` (default: declared, else by shape)."""
    if not len(params) == len(grads) == len(momentum_buffers):
        raise ValueError("muon: params, grads and momentum_buffers must have the same length")
    if layouts is None:
        layouts = [matrix_layout_of(p) for p in params]
    step = _MuonStep(
        params,
        grads,
        momentum_buffers,
        layouts,
        lr=lr,
        weight_decay=weight_decay,
        momentum=momentum,
        nesterov=nesterov,
        adjust_lr_fn=adjust_lr_fn,
        ns_args=(ns_coefficients, ns_steps, eps),
        ns_dtype=resolve_ns_dtype(ns_dtype),
        torch_forms=not batched,
    )
    if batched:
        step.run_batched()
    else:
        step.run_per_matrix()


# One matrix run of one tensor: (tensor index, run, matrices in the run).
# A CPU stack's Newton-Schulz working set at most (Muon.batches): about a core's L2 and a share of L3.
_CPU_STACK_BYTES = 2 << 20
_Piece = tuple[int, int, int]


class _MuonStep:
    """One Muon step over lists of tensors: the two paths :func:`muon` chooses between.

    Every tensor's momentum is updated once, right before the first of its runs is
    orthogonalised (while its gradient is in cache), and its weight decay is applied right
    before the first update lands on it.
    """

    def __init__(
        self,
        params: list[Tensor],
        grads: list[Tensor],
        bufs: list[Tensor],
        layouts: list[MatrixLayout],
        *,
        lr: float,
        weight_decay: float,
        momentum: float,
        nesterov: bool,
        adjust_lr_fn: str | None,
        ns_args: tuple[tuple[float, float, float], int, float],
        ns_dtype: torch.dtype,
        torch_forms: bool = True,
    ) -> None:
        self.params, self.grads, self.bufs, self.layouts = params, grads, bufs, layouts
        self.torch_forms = torch_forms  # Newton-Schulz in torch's calls (else the fast form)
        self.lr, self.weight_decay, self.momentum, self.nesterov = lr, weight_decay, momentum, nesterov
        self.adjust_lr_fn, self.ns_args, self.ns_dtype = adjust_lr_fn, ns_args, ns_dtype
        self.moved = [False] * len(params)  # momentum updated this step
        self.decayed = [False] * len(params)

    def pieces(self, i: int) -> list[_Piece]:
        layout = self.layouts[i]
        if layout.single:
            return [(i, 0, 1)]
        return [(i, run, count) for run, (count, _, _) in enumerate(layout.matrix_shapes())]

    def shape(self, piece: _Piece) -> tuple[int, int]:
        layout = self.layouts[piece[0]]
        return layout.rows if layout.single else layout.runs[piece[1]][2], layout.cols

    def run_view(self, tensor: Tensor, piece: _Piece) -> Tensor:
        """``tensor`` (a parameter, gradient or buffer of ``piece``'s tensor) as the run's
        ``(batch, blocks, rows, cols)`` view (``(1, 1, rows, cols)`` for a plain matrix)."""
        i, run, _ = piece
        layout = self.layouts[i]
        if layout.single:
            return tensor.view(1, 1, layout.rows, layout.cols)
        return layout.run_views(tensor)[run]

    def move(self, i: int) -> None:
        """Momentum of tensor ``i`` (once per step): ``B <- lerp(B, g, 1 - momentum)``."""
        if not self.moved[i]:
            self.moved[i] = True
            self.bufs[i].lerp_(self.grads[i], 1 - self.momentum)

    def apply(self, piece: _Piece, ortho: Tensor) -> None:
        """Land ``piece``'s orthogonalised update ``(matrices, rows, cols)`` on its parameter."""
        i = piece[0]
        target = self.params[i] if self.plain(i) else self.run_view(self.params[i], piece)
        self.land(i, target, ortho.view(target.shape), self.shape(piece))

    def land(self, i: int, target: Tensor, update: Tensor, shape: tuple[int, ...]) -> None:
        """``target`` (tensor ``i`` or a view of it) ``-= adjusted_lr * update``, after tensor
        ``i``'s decoupled weight decay (once per tensor)."""
        p = self.params[i]
        if not self.decayed[i]:
            self.decayed[i] = True
            p.mul_(1 - self.lr * self.weight_decay)
        if torch.promote_types(update.dtype, p.dtype) != p.dtype:  # a wider ns_dtype: round first
            update = update.to(p.dtype)  # (else add_ widens it exactly, as torch's Muon relies on)
        target.add_(update, alpha=-adjust_lr(self.lr, self.adjust_lr_fn, shape))

    def orthogonalise_alone(self, piece: _Piece) -> Tensor:
        """``piece``'s update, one Newton-Schulz per matrix, ``(matrices, rows, cols)``."""
        i = piece[0]
        self.move(i)
        grad, buf = self.run_view(self.grads[i], piece), self.run_view(self.bufs[i], piece)
        update = grad.lerp(buf, self.momentum) if self.nesterov else buf
        each = [self.newton_schulz_alone(u, fresh=self.nesterov) for u in update.flatten(0, 1).unbind(0)]
        return each[0].unsqueeze(0) if len(each) == 1 else torch.stack(each)

    def step_plain(self, i: int) -> None:
        """Tensor ``i``, one plain 2D matrix, in ``torch.optim.Muon``'s own operations on the 2D
        tensors themselves (no views: each costs a few microseconds and the step is torch's)."""
        p, grad, buf = self.params[i], self.grads[i], self.bufs[i]
        buf.lerp_(grad, 1 - self.momentum)
        self.moved[i] = True
        update = grad.lerp(buf, self.momentum) if self.nesterov else buf
        # rebound, as torch does: the float32 update is freed before the parameter's update, so
        # the allocator hands its memory on (keeping it alive costs ~10%: fresh pages to touch)
        update = self.newton_schulz_alone(update, fresh=self.nesterov)
        self.land(i, p, update, p.shape)

    def newton_schulz_alone(self, update: Tensor, fresh: bool) -> Tensor:
        """The Newton-Schulz of one 2D ``update``, in the step's form; ``fresh``: a tensor of
        ours, which may be scaled in place when already in ``ns_dtype`` (else cast or copied)."""
        x = update.to(self.ns_dtype) if fresh else update.to(self.ns_dtype, copy=True)
        return newton_schulz_(x, *self.ns_args, torch_forms=self.torch_forms)

    def plain(self, i: int) -> bool:
        """Whether tensor ``i`` is one plain 2D matrix: its layout single and the tensor that
        matrix as stored (a declared view may read a 2D tensor as another shape: then the views)."""
        layout, p, g = self.layouts[i], self.params[i], self.grads[i]
        shape = (layout.rows, layout.cols)
        return layout.single and tuple(p.shape) == shape and tuple(g.shape) == shape

    def step_alone(self, piece: _Piece) -> None:
        """``piece`` without a stack: a plain matrix in torch's own operations, else its views."""
        if self.plain(piece[0]):
            self.step_plain(piece[0])
        else:
            self.apply(piece, self.orthogonalise_alone(piece))

    def run_per_matrix(self) -> None:
        """torch's loop: each tensor's momentum, Newton-Schulz per matrix and update in turn."""
        for i in range(len(self.params)):
            for piece in self.pieces(i):
                self.step_alone(piece)

    def run_batched(self) -> None:
        """One stacked Newton-Schulz per same-shape bucket (a lone matrix: no stack).

        Tensor subclasses (owner-layout DTensors handed over directly) step per matrix in
        torch's calls: the stack is written with ``out=`` calls their rules do not take."""
        if any(type(t) not in (Tensor, torch.nn.Parameter) for t in (*self.params, *self.grads, *self.bufs)):
            self.run_per_matrix()
            return
        buckets: dict[tuple[Any, ...], list[_Piece]] = {}
        for i, grad in enumerate(self.grads):
            for piece in self.pieces(i):
                buckets.setdefault((self.shape(piece), grad.dtype, grad.device), []).append(piece)
        for (shape, _, device), pieces in buckets.items():
            for bucket in self.batches(pieces, shape, device):
                self.run_stack(bucket, shape, device)

    def batches(self, pieces: list[_Piece], shape: tuple[int, int], device: torch.device) -> list[list[_Piece]]:
        """``pieces`` (one shape's) in stacks. On a CPU each stack's Newton-Schulz working set
        (two iterates, the Gram matrix and its update) stays within ``_CPU_STACK_BYTES``: a
        stack that outgrows the cache makes every batched call stream it, and the calls it
        saves cost microseconds against milliseconds of matmul (float32 at 256 x 1024: 16%
        slower than matrix by matrix). A run of a stacked tensor is never cut; each matrix
        rounds as alone, so the stacks do not change the result."""
        if device.type != "cpu":
            return [pieces]
        s, long = sorted(shape)
        cap = max(1, _CPU_STACK_BYTES // ((2 * s * long + 2 * s * s) * self.ns_dtype.itemsize))
        stacks: list[list[_Piece]] = [[]]
        for piece in pieces:
            if stacks[-1] and sum(count for *_, count in stacks[-1]) + piece[2] > cap:
                stacks.append([])
            stacks[-1].append(piece)
        return stacks

    def run_stack(self, bucket: list[_Piece], shape: tuple[int, int], device: torch.device) -> None:
        """One stacked Newton-Schulz of ``bucket``'s matrices (a lone matrix: no stack)."""
        total = sum(count for *_, count in bucket)
        if total == 1:
            self.step_alone(bucket[0])
            return
        stack = torch.empty((total, *shape), dtype=self.ns_dtype, device=device)
        start = 0
        for piece in bucket:  # each update written once, into its slice, in ns_dtype
            i, _, count = piece
            self.move(i)
            grad, buf = self.run_view(self.grads[i], piece), self.run_view(self.bufs[i], piece)
            dst = stack[start : start + count].view(grad.shape)
            if self.nesterov:
                torch.lerp(grad, buf, self.momentum, out=dst)
            else:
                dst.copy_(buf)
            start += count
        orthos = newton_schulz_(stack, *self.ns_args, torch_forms=self.torch_forms)
        start = 0
        for piece in bucket:
            self.apply(piece, orthos[start : start + piece[2]])
            start += piece[2]

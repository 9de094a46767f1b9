"""Newton-Schulz kernels: the iteration on a matrix, or a same-shape stack, the caller hands over.

:func:`newton_schulz_` runs in one of two forms (DESIGN.md, "Newton-Schulz forms"):

* torch's (``torch_forms=True``): ``torch.optim.Muon``'s ``_zeropower_via_newtonschulz``
  operation for operation (bitwise equal) on a 2D tensor, the same calls batched on a stack;
* the fast form (``torch_forms=False``), where :func:`transposed_forms_pay` says so: every
  product with its left operand column-major and its right one row-major, the layout torch's
  CPU BLAS fallback runs bfloat16 through a vectorised dot (measured 10-20x torch's
  row-major ``A @ A`` and ``B @ X``); the Gram and its update are symmetric, so ``A^T`` stands
  in for ``A``, and one ``s x l`` transpose copy per iteration keeps ``X`` in both layouts.
  Elsewhere (float32 MKL, float16, GPUs, CPUs whose oneDNN runs bfloat16 matmuls) it is
  torch's form.

On this package's CPUs either form rounds each matrix of a stack exactly as alone
(tests/test_preconditioners.py), so a rank stepping a lone matrix agrees bitwise with a
reference that batches it in the same form.
The input is scaled in place and the iterates live in buffers reused across iterations.
:func:`~.muon.newton_schulz` and :func:`~.muon.newton_schulz_batched` copy first.
"""

from __future__ import annotations

import torch
from torch import Tensor

__all__ = ["DEFAULT_NS_COEFFICIENTS", "check_ns_args", "newton_schulz_", "transposed_forms_pay"]

DEFAULT_NS_COEFFICIENTS: tuple[float, float, float] = (3.4445, -4.775, 2.0315)


def check_ns_args(ns_coefficients: tuple[float, float, float], ns_steps: int) -> None:
    """``ValueError`` for an iteration count of 100 or more (torch's check) or below 0, or not
    three coefficients (torch's)."""
    if ns_steps < 0:
        raise ValueError(f"ns_steps must be >= 0, got {ns_steps}")
    if ns_steps >= 100:
        raise ValueError("Number of steps must be less than 100 for computational efficiency")
    if len(ns_coefficients) != 3:
        raise ValueError("Coefficients must be a tuple of exactly 3 values")


def transposed_forms_pay(device: torch.device, dtype: torch.dtype) -> bool:
    """Whether the fast form differs from torch's on ``device`` for ``dtype``: on a CPU, for
    bfloat16 when oneDNN does not multiply it there (torch's own check), torch's BLAS fallback
    runs a row-major ``A @ B`` as a scalar loop and ``A.mT @ B`` as vectorised dots
    (docs/performance.md, Muon's step against the matmul floor). MKL float32 runs every layout
    within ~10% and rounds them alike, GPU BLAS takes every layout at its rate, and float16's
    fastest layout on that fallback is another one (``A @ B.mT``): there the fast form is
    torch's calls."""
    return device.type == "cpu" and dtype == torch.bfloat16 and not torch.ops.mkldnn._is_mkldnn_bf16_supported()


def newton_schulz_(
    x: Tensor,
    ns_coefficients: tuple[float, float, float] = DEFAULT_NS_COEFFICIENTS,
    ns_steps: int = 5,
    eps: float = 1e-7,
    *,
    torch_forms: bool = True,
) -> Tensor:
    """:func:`~.muon.newton_schulz` of a 2D ``x``, or of every matrix of a contiguous ``(k, m, n)``
    stack (each by its own norm), already in the iteration's dtype, consuming ``x`` (scaled in
    place, then scratch): for a caller whose ``x`` is its own (Muon's Nesterov update, the stack
    its batched step wrote), to which a copy would be one more pass for nothing. Returns ``x``'s
    shape (a transposed view when tall), in one of the iteration's buffers. ``torch_forms``:
    torch's calls (bitwise ``torch.optim.Muon``), else the fast form (module docstring).
    """
    check_ns_args(ns_coefficients, ns_steps)
    if x.ndim not in (2, 3):
        raise ValueError(f"Newton-Schulz needs a 2D matrix or a (k, m, n) stack, got shape {tuple(x.shape)}")
    stacked = x.ndim == 3
    if stacked and not x.is_contiguous():
        raise ValueError(f"expected a contiguous (batch, m, n) stack, got strides {x.stride()}")
    tall = x.size(-2) > x.size(-1)
    if tall:
        x = x.mT
    # each matrix by its own Frobenius norm (a stack's through one reduction over its last dims)
    x.div_((x.norm(dim=(-2, -1), keepdim=True) if stacked else x.norm()).clamp(min=eps))
    if ns_steps:
        fast = not torch_forms and type(x) is Tensor and transposed_forms_pay(x.device, x.dtype)
        x = _iterate(x, ns_coefficients, ns_steps, stacked, fast)
    return x.mT if tall else x


def _iterate(x: Tensor, coefficients: tuple[float, float, float], steps: int, stacked: bool, fast: bool) -> Tensor:
    """``steps`` times ``A = X X^T; B = b A + c A A; X = a X + B X`` (``mm``/``addmm`` on a
    matrix, ``bmm``/``baddbmm`` on a stack) into buffers reused across iterations (``out=``
    changes where a result goes, not how it is summed). Torch's calls read ``x`` in its own
    layout at the first iteration (a tall matrix's transposed view, as torch reads it). ``fast``:
    the fast form, ``A = (X^T)^T X^T`` from a column-major copy of ``X``, ``B = b A + c A^T A``
    and ``X = a X + B^T X`` (``A`` and ``B`` symmetric), every left operand column-major and
    every right one row-major."""
    a, b, c = coefficients
    if type(x) is not Tensor:  # a tensor subclass (an owner-layout DTensor): its own ops' rules
        for _ in range(steps):  # know these calls, not out= ones
            gram = x @ x.mT
            gram_update = (torch.baddbmm if stacked else torch.addmm)(gram, gram, gram, beta=b, alpha=c)
            x = (torch.baddbmm if stacked else torch.addmm)(x, gram_update, x, beta=a)
        return x
    mm, addmm = (torch.bmm, torch.baddbmm) if stacked else (torch.mm, torch.addmm)
    *lead, short, long = x.shape
    buffers = (x.new_empty((*lead, short, long)), x.new_empty((*lead, short, long)))
    gram, gram_update = x.new_empty((*lead, short, short)), x.new_empty((*lead, short, short))
    columns = x.new_empty((*lead, long, short)) if fast else None  # X column-major (X^T row-major)
    if fast and not x.is_contiguous():  # a tall matrix's transposed view: row-major once, for B^T X
        x = buffers[1].copy_(x)
    for i in range(steps):
        if columns is not None:
            columns.copy_(x.mT)  # an s x l copy, cheap against the s^2 l products
            mm(columns.mT, columns, out=gram)
        else:
            mm(x, x.mT, out=gram)
        addmm(gram, gram.mT if fast else gram, gram, beta=b, alpha=c, out=gram_update)
        out = buffers[i % 2]
        addmm(x, gram_update.mT if fast else gram_update, x, beta=a, out=out)
        x = out
    return x

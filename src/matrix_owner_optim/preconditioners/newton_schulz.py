"""Newton-Schulz kernels: the iteration on a matrix, or a same-shape stack, the caller hands over.

:func:`newton_schulz_` is ``torch.optim.Muon``'s ``_zeropower_via_newtonschulz`` operation for
operation (bitwise equal) on a 2D tensor already in the iteration's dtype, and the same steps
with batched matmuls on a ``(k, m, n)`` stack; on this package's CPUs (oneDNN bfloat16, MKL
float32) each matrix of a stack rounds exactly as alone (tests/test_preconditioners.py), so a
rank stepping a lone matrix agrees bitwise with a reference that batches it. Each iteration is
torch's fused forms (``addmm``/``baddbmm`` with alpha and beta), a tall matrix through its
transpose (a view); the input is scaled in place and the iterates live in buffers reused across
iterations. :func:`~.muon.newton_schulz` and :func:`~.muon.newton_schulz_batched` copy first.
"""

from __future__ import annotations

import torch
from torch import Tensor

__all__ = ["DEFAULT_NS_COEFFICIENTS", "check_ns_args", "newton_schulz_"]

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


def newton_schulz_(
    x: Tensor,
    ns_coefficients: tuple[float, float, float] = DEFAULT_NS_COEFFICIENTS,
    ns_steps: int = 5,
    eps: float = 1e-7,
) -> Tensor:
    """:func:`~.muon.newton_schulz` of a 2D ``x``, or of every matrix of a contiguous ``(k, m, n)``
    stack (each by its own norm), already in the iteration's dtype, consuming ``x`` (scaled in
    place, then scratch): for a caller whose ``x`` is its own (Muon's Nesterov update, the stack
    its batched step wrote), to which a copy would be one more pass for nothing. Returns ``x``'s
    shape (a transposed view when tall), in one of :func:`_iterate`'s buffers.
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
        x = _iterate(x, ns_coefficients, ns_steps, stacked)
    return x.mT if tall else x


def _iterate(x: Tensor, coefficients: tuple[float, float, float], steps: int, stacked: bool) -> Tensor:
    """``steps`` times ``A = X X^T; B = b A + c A A; X = a X + B X`` in torch's calls (``mm``/
    ``addmm`` on a matrix, ``bmm``/``baddbmm`` on a stack) into buffers reused across iterations
    (``out=`` changes where a result goes, not how it is summed). ``x`` is read in its own layout
    at the first iteration (a tall matrix's transposed view, as torch reads it)."""
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
    for i in range(steps):
        mm(x, x.mT, out=gram)
        addmm(gram, gram, gram, beta=b, alpha=c, out=gram_update)
        out = buffers[i % 2]
        addmm(x, gram_update, x, beta=a, out=out)
        x = out
    return x
